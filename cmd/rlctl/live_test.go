package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/agent"
	"github.com/apportion/apportion/sync/agentd"
)

// fakeAgent serves the sync agent's endpoint with fixed answers, encoded
// from the agent's own types so that rlctl's mirror stays in step.
func fakeAgent(t *testing.T, region string, code int, keys []agent.RuleShareKey) *httptest.Server {
	t.Helper()
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if r.URL.Path != agent.SharesPath {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		rule := r.URL.Query().Get("rule")
		limit, err := strconv.Atoi(r.URL.Query().Get("limit"))
		if err != nil || limit < 1 || limit > agent.MaxSharesLimit {
			w.WriteHeader(http.StatusBadRequest)
			json.NewEncoder(w).Encode(map[string]string{"error": "bad limit"})
			return
		}
		if code != http.StatusOK {
			w.WriteHeader(code)
			json.NewEncoder(w).Encode(map[string]string{"error": "rule " + rule + " not here", "region": region})
			return
		}
		ks := keys[:min(limit, len(keys))]
		json.NewEncoder(w).Encode(agent.RuleShares{Region: region, Rule: rule, Incarnation: 7, Units: 1_000_000,
			Floor: 50_000, TotalKeys: len(keys), Keys: ks})
	}))
	t.Cleanup(srv.Close)
	return srv
}

// deadURL returns the URL of a server that no longer listens.
func deadURL(t *testing.T) string {
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL
	srv.Close()
	return u
}

func TestLimitsShowLive(t *testing.T) {
	f := newFixture(t)
	rule, err := rules.ParseRule([]byte(ordersRule))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.store.Put(context.Background(), rule, 0); err != nil {
		t.Fatal(err)
	}
	// orders-free: 10/s burst 20; us-east's keys at 60%, 50%, 10% of the limit.
	us := fakeAgent(t, "us-east", http.StatusOK, []agent.RuleShareKey{
		{Key: "rl:{user:1}:orders", Units: 600_000, Rate: 6, Burst: 12},
		{Key: "rl:{user:2}:orders", Units: 500_000, Rate: 5, Burst: 10},
		{Key: "rl:{user:3}:orders", Units: 100_000, Rate: 1, Burst: 2},
	})
	ap := fakeAgent(t, "ap-south", http.StatusNotFound, nil)
	dead := deadURL(t)
	base := []string{"--etcd-endpoints", f.endpoints, "limits", "show", "orders-free"}
	agents := "us-east=" + us.URL + "," + strings.TrimPrefix(ap.URL, "http://") + ",eu-west=" + dead

	res := rlctl(t, append(base, "--agents", agents, "--top", "2")...).must(t, exitOK, "live shares", "top 2 keys")
	out := res.stdout
	t.Logf("limits show --agents ... --top 2:\n%s", out)
	for _, row := range [][]string{
		{"us-east", "2", "5", "10", "0.5"}, // the static table is unchanged
		{"us-east", "ok", "7", "no", "3", "12", "24", us.URL},
		{"eu-west", "unreachable", "-", "-", "-", "-", "-", dead},
		{"ap-south", "not-coordinated", "-", "-", "-", "-", "-", ap.URL},
		{"us-east", "rl:{user:1}:orders", "600000", "60%", "6", "12"},
		{"us-east", "rl:{user:2}:orders", "500000", "50%", "5", "10"},
	} {
		if !hasRow(out, row...) {
			t.Errorf("no row %q in:\n%s", row, out)
		}
	}
	if strings.Contains(out, "rl:{user:3}") {
		t.Errorf("--top 2 listed a third key:\n%s", out)
	}
	if !strings.Contains(res.stderr, dead) || !strings.Contains(res.stderr, "unreachable") {
		t.Errorf("stderr does not name the unreachable agent:\n%s", res.stderr)
	}

	// JSON, agents from the environment.
	t.Setenv("APPORTION_AGENTS", agents)
	var v limitsView
	js := rlctl(t, append(base, "-o", "json")...).must(t, exitOK).stdout
	if err := json.Unmarshal([]byte(js), &v); err != nil {
		t.Fatalf("%v\n%s", err, js)
	}
	live := map[string]*liveShare{}
	for _, r := range v.Regions {
		live[r.Region] = r.Live
	}
	if l := live["us-east"]; l == nil || l.Status != liveOK || l.Rate != 12 || l.Burst != 24 || l.Keys != 3 ||
		l.TotalKeys != 3 || l.Incarnation != 7 || l.Units != 1_000_000 || len(l.Top) != 0 {
		t.Errorf("us-east: %+v", l)
	}
	if l := live["eu-west"]; l == nil || l.Status != liveUnreachable || l.Error == "" {
		t.Errorf("eu-west: %+v", l)
	}
	if l := live["ap-south"]; l == nil || l.Status != liveNotCoordinated {
		t.Errorf("ap-south: %+v", l)
	}
	if rate := v.Regions[2].StaticRate; rate == nil || *rate != 5 {
		t.Errorf("static rate of us-east: %v", rate)
	}

	// Every agent fails: exit 1, the output still printed.
	t.Setenv("APPORTION_AGENTS", "eu-west="+dead+","+dead)
	res = rlctl(t, base...).must(t, exitFailure, "no sync agent answered")
	if !hasRow(res.stdout, "eu-west", "unreachable", "-", "-", "-", "-", "-", dead) || !hasRow(res.stdout, "?", "unreachable", "-", "-", "-", "-", "-", dead) {
		t.Errorf("all unreachable:\n%s", res.stdout)
	}
	rlctl(t, append(base, "-o", "json")...).must(t, exitFailure, `"status": "unreachable"`)
	os.Unsetenv("APPORTION_AGENTS")

	// An agent of another region than the one named: an error, not its numbers.
	res = rlctl(t, append(base, "--agents", "eu-west="+us.URL)...).must(t, exitFailure, "serves region us-east, not eu-west")
	if !hasRow(res.stdout, "eu-west", "error", "-", "-", "-", "-", "-", us.URL) {
		t.Errorf("mismatch:\n%s", res.stdout)
	}

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"top without agents", []string{"--top", "3"}, "--top needs --agents"},
		{"negative top", []string{"--agents", us.URL, "--top", "-1"}, "--top"},
		{"bad agent URL", []string{"--agents", "ftp://x"}, "--agents"},
		{"empty agents", []string{"--agents", ","}, "--agents"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rlctl(t, append(base, tc.args...)...).must(t, exitUsage, tc.want)
		})
	}

	// A regional rule: no agent is asked.
	rlctl(t, "--etcd-endpoints", f.endpoints, "rules", "put", "-f", f.file(t, "l.yaml", listYAML)).must(t, exitOK)
	rlctl(t, "--etcd-endpoints", f.endpoints, "limits", "show", "search", "--agents", dead).must(t, exitOK, "regional rule")
}

func TestParseAgents(t *testing.T) {
	got, err := parseAgents(" us-east=http://10.0.0.1:9091/ , 10.0.0.2:9091,eu=https://h/x ")
	if err != nil {
		t.Fatal(err)
	}
	want := []agentRef{{"us-east", "http://10.0.0.1:9091"}, {"", "http://10.0.0.2:9091"}, {"eu", "https://h/x"}}
	if len(got) != len(want) {
		t.Fatalf("%+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

// TestLimitsShowRealAgent runs a real sync agent (Redis, NATS, etcd) for a
// global rule of one region and reads its live share with rlctl.
func TestLimitsShowRealAgent(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	f := newFixture(t)
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	ctx, cancel := context.WithCancel(context.Background())
	out := &testutil.SyncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- agentd.RunCommand(ctx, []string{"--region", "solo", "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(),
			"--etcd-endpoints", f.endpoints, "--http-addr", "127.0.0.1:0", "--interval", "50ms",
			"--insecure-unsigned-reports"}, out, io.Discard) // one region: no peers to verify
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("agent: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("agent did not stop")
		}
	})
	ready := regexp.MustCompile(`ready region=solo http=(\S+)`)
	testutil.WaitFor(t, 20*time.Second, "the agent's ready line", func() bool { return ready.MatchString(out.String()) })
	addr := ready.FindStringSubmatch(out.String())[1]

	rule := rules.Rule{ID: "solo-orders", Key: []string{"client_key"}, Algorithm: rules.TokenBucket, Capacity: 30,
		RefillPerSecond: 12.5, Scope: rules.Global, Regions: map[string]float64{"solo": 1}, MinShare: 0.2}
	if _, err := f.store.Put(context.Background(), rule, 0); err != nil {
		t.Fatal(err)
	}
	nc := ns.Connect(t)
	args := []string{"--etcd-endpoints", f.endpoints, "limits", "show", "solo-orders", "--agents", addr, "--top", "1"}
	var res result
	seq := uint64(0)
	testutil.WaitFor(t, 20*time.Second, "the agent's live share", func() bool {
		seq++
		b, _ := usage.Encode(usage.Batch{Region: "solo", Enforcer: "test", Seq: seq,
			Deltas: []usage.Delta{{Rule: "solo-orders", Key: "rl:{user:9}:orders", Admitted: 3}}})
		nc.Publish(usage.Subject("solo"), b)
		res = rlctl(t, args...)
		return res.code == exitOK && strings.Contains(res.stdout, "rl:{user:9}:orders")
	})
	// One region holds the whole limit for the key.
	if !hasRow(res.stdout, "solo", "ok", "1", "no", "1", "12.5", "30", "http://"+addr) ||
		!hasRow(res.stdout, "solo", "rl:{user:9}:orders", "1000000", "100%", "12.5", "30") {
		t.Fatalf("live share of the real agent:\n%s\nstderr:\n%s", res.stdout, res.stderr)
	}
}
