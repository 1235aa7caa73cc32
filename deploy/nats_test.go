package deploy

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/agent"
	"github.com/apportion/apportion/sync/agentd"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// ---------------------------------------------------------------------------
// NATS.

// natsKeys runs "syncagent keys" for every region into dir/keys, as the
// compose one-shot keys-init does, and returns each region's public key.
func natsKeys(t testing.TB, dir string) map[string]string {
	t.Helper()
	var out bytes.Buffer
	if err := agentd.RunCommand(context.Background(), append([]string{"keys", filepath.Join(dir, "keys")}, regions...), &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	pubs := map[string]string{}
	for _, line := range strings.Fields(out.String()) {
		r, pub, _ := strings.Cut(line, "=")
		pubs[r] = pub
	}
	return pubs
}

// regionNATSConfig parses deploy/nats/<region>.conf as the compose stack
// runs it: next to the keys directory that keys-init fills.
func regionNATSConfig(t testing.TB, dir, region string) (*natsserver.Options, error) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("nats", region+".conf"))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, region+".conf")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return natsserver.ProcessConfigFile(path)
}

func TestNATSConfigs(t *testing.T) {
	dir := t.TempDir()
	natsKeys(t, dir)
	check := func(path, region string) {
		var o *natsserver.Options
		var err error
		if strings.HasPrefix(path, "nats") {
			o, err = regionNATSConfig(t, dir, region)
		} else {
			o, err = natsserver.ProcessConfigFile(path)
		}
		if err != nil {
			t.Errorf("%s: %v", path, err)
			return
		}
		if o.Port != 4222 || o.Cluster.Port != 6222 || o.Gateway.Port != 7222 || o.HTTPPort != 8222 {
			t.Errorf("%s: ports client %d cluster %d gateway %d monitoring %d, want 4222 6222 7222 8222",
				path, o.Port, o.Cluster.Port, o.Gateway.Port, o.HTTPPort)
		}
		if o.Cluster.Name != region || o.Gateway.Name != region {
			t.Errorf("%s: cluster %q gateway %q, want both %q", path, o.Cluster.Name, o.Gateway.Name, region)
		}
		var gws []string
		for _, g := range o.Gateway.Gateways {
			gws = append(gws, g.Name)
			if len(g.URLs) == 0 {
				t.Errorf("%s: gateway %s has no URL", path, g.Name)
			}
		}
		for _, r := range regions {
			if !slices.Contains(gws, r) {
				t.Errorf("%s: no gateway to %s (gateways %v)", path, r, gws)
			}
		}
	}
	for _, r := range regions {
		check(filepath.Join("nats", r+".conf"), r)
	}
	t.Setenv("POD_NAME", "nats-0")
	t.Setenv("NATS_GATEWAY_NAME", "eu-west")
	check(filepath.Join("k8s", "base", "nats.conf"), "eu-west")
}

// subjectMatches reports whether NATS subject pattern p (with * and >)
// matches subject x.
func subjectMatches(p, x string) bool {
	pt, xt := strings.Split(p, "."), strings.Split(x, ".")
	for i, tok := range pt {
		if tok == ">" {
			return len(xt) > i
		}
		if i >= len(xt) || tok != "*" && tok != xt[i] {
			return false
		}
	}
	return len(pt) == len(xt)
}

// TestNATSPermissions: in every region's NATS configuration only that
// region's sync agent (its NKey, made by keys-init) may publish the
// region's reports, nobody may publish another region's, and clients
// without credentials are the enforcers, who may publish usage only. Then
// the same configuration runs (on free ports, without gateways) and a
// client of each kind tries.
func TestNATSPermissions(t *testing.T) {
	dir := t.TempDir()
	pubs := natsKeys(t, dir)
	for _, r := range regions {
		o, err := regionNATSConfig(t, dir, r)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		type who struct {
			name  string
			perms *natsserver.Permissions
		}
		var all []who
		for _, u := range o.Users {
			all = append(all, who{"user " + u.Username, u.Permissions})
		}
		for _, u := range o.Nkeys {
			all = append(all, who{"nkey " + u.Nkey, u.Permissions})
		}
		if o.NoAuthUser != "ratelimitd" || len(o.Nkeys) != 1 || o.Nkeys[0].Nkey != pubs[r] {
			t.Errorf("%s: no_auth_user %q, nkeys %d (want ratelimitd, and one: the agent's %s)", r, o.NoAuthUser, len(o.Nkeys), pubs[r])
		}
		for _, w := range all {
			if w.perms == nil || w.perms.Publish == nil || len(w.perms.Publish.Allow) == 0 {
				t.Errorf("%s: %s may publish anything", r, w.name)
				continue
			}
			for _, other := range append(slices.Clone(regions), "zz") {
				for _, p := range w.perms.Publish.Allow {
					may := subjectMatches(p, agent.ReportSubject(other))
					if may && (other != r || w.name != "nkey "+pubs[r]) {
						t.Errorf("%s: %s may publish %s (%q)", r, w.name, agent.ReportSubject(other), p)
					}
				}
			}
		}

		// Live: the same options on free ports, alone.
		o.Port, o.HTTPPort, o.Cluster.Port, o.Gateway.Port, o.Gateway.Gateways, o.Gateway.Name = -1, 0, 0, 0, nil, ""
		o.Cluster.Name, o.NoLog, o.NoSigs = "", true, true
		ns, err := natsserver.NewServer(o)
		if err != nil {
			t.Fatalf("%s: %v", r, err)
		}
		go ns.Start()
		if !ns.ReadyForConnections(10 * time.Second) {
			t.Fatalf("%s: NATS not ready", r)
		}
		errs := make(chan error, 16)
		connect := func(opts ...nats.Option) (*nats.Conn, error) {
			return nats.Connect(ns.ClientURL(), append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))...)
		}
		nkey := func(region string) nats.Option {
			opt, err := nats.NkeyOptionFromSeed(filepath.Join(dir, "keys", region+".nk"))
			if err != nil {
				t.Fatal(err)
			}
			return opt
		}
		agentNC, err := connect(nkey(r))
		if err != nil {
			t.Fatalf("%s: the agent's NKey is refused: %v", r, err)
		}
		anon, err := connect()
		if err != nil {
			t.Fatalf("%s: a client without credentials is refused: %v", r, err)
		}
		other := regions[0]
		if other == r {
			other = regions[1]
		}
		if nc, err := connect(nkey(other)); err == nil {
			nc.Close()
			t.Errorf("%s: %s's agent key is accepted", r, other)
		}
		got := make(chan string, 16)
		for _, subj := range []string{agent.ReportPrefix + "*", usage.Subject(r)} {
			if _, err := agentNC.Subscribe(subj, func(m *nats.Msg) { got <- m.Subject }); err != nil {
				t.Fatal(err)
			}
		}
		agentNC.Flush()
		// Refused publications: each gets a permissions error, no delivery.
		for _, tc := range []struct {
			nc   *nats.Conn
			subj string
		}{{anon, agent.ReportSubject(r)}, {anon, agent.ReportSubject(other)}, {agentNC, agent.ReportSubject(other)}} {
			tc.nc.Publish(tc.subj, []byte("x"))
			tc.nc.Flush()
			select {
			case err := <-errs:
				if !strings.Contains(strings.ToLower(err.Error()), "permissions violation") {
					t.Errorf("%s: publish %s: %v", r, tc.subj, err)
				}
			case <-time.After(5 * time.Second):
				t.Errorf("%s: publish on %s was not refused", r, tc.subj)
			}
		}
		// Allowed ones arrive, and nothing refused arrived before them.
		anon.Publish(usage.Subject(r), []byte("x"))
		anon.Flush()
		agentNC.Publish(agent.ReportSubject(r), []byte("x"))
		agentNC.Flush()
		want := map[string]bool{usage.Subject(r): true, agent.ReportSubject(r): true} // two connections: any order
		for range 2 {
			select {
			case s := <-got:
				if !want[s] {
					t.Errorf("%s: got a message on %s, want one of %v", r, s, want)
				}
				delete(want, s)
			case <-time.After(5 * time.Second):
				t.Errorf("%s: nothing arrived on %v", r, want)
			}
		}
		anon.Close()
		agentNC.Close()
		ns.Shutdown()
	}
}
