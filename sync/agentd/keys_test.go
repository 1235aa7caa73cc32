package agentd

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apportion/apportion/sync/wire"
)

func TestRunCommandKeys(t *testing.T) {
	dir := t.TempDir()
	_, otherPub, err := wire.GenerateSeed()
	if err != nil {
		t.Fatal(err)
	}
	seed := filepath.Join(dir, "a.nk")
	var out bytes.Buffer
	if err := RunCommand(context.Background(), []string{"keygen", seed}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	pub := strings.TrimSpace(out.String())
	if fi, err := os.Stat(seed); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("seed file %v %v", fi, err)
	}
	if err := RunCommand(context.Background(), []string{"keygen", seed}, io.Discard, io.Discard); err == nil {
		t.Fatal("keygen overwrote an existing file")
	}
	out.Reset()
	if err := RunCommand(context.Background(), []string{"pubkey", seed}, &out, io.Discard); err != nil || strings.TrimSpace(out.String()) != pub {
		t.Fatalf("pubkey: %v %q, want %s", err, out.String(), pub)
	}
	list := filepath.Join(dir, "peers")
	os.WriteFile(list, []byte("# every region\na="+pub+"\nb="+otherPub+"\n"), 0o644)
	o := &options{region: "a", seedFile: seed, peerKeys: "@" + list}
	s, k, err := o.reportKeys()
	if err != nil || s.PublicKey() != pub || len(k) != 2 {
		t.Fatalf("reportKeys: %v, %v, %v", s, k, err)
	}
	common := []string{"--region", "a", "--etcd-endpoints", "x"}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no seed", nil, "--report-seed-file is required"},
		{"missing seed file", []string{"--report-seed-file", filepath.Join(dir, "nope")}, "--report-seed-file"},
		{"not a seed", []string{"--report-seed-file", list}, "--report-seed-file"},
		{"bad peer keys", []string{"--report-seed-file", seed, "--report-peer-keys", "a=UNOPE"}, "--report-peer-keys"},
		{"missing peer keys file", []string{"--report-seed-file", seed, "--report-peer-keys", "@" + filepath.Join(dir, "nope")}, "--report-peer-keys"},
		{"own key differs", []string{"--report-seed-file", seed, "--report-peer-keys", "a=" + otherPub}, "PeerKeys"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := RunCommand(context.Background(), append(common, tc.args...), io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestSubcommandHelp: -h, -help and --help print a subcommand's usage and
// do nothing else, where "syncagent keygen --help" wrote a seed into a
// file named --help and exited 0; another flag is an error that writes
// nothing; after "--" a FILE may begin with "-".
func TestSubcommandHelp(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	for _, cmd := range []string{"keygen", "pubkey", "keys"} {
		for _, h := range []string{"-h", "-help", "--help"} {
			var out, errOut bytes.Buffer
			if err := RunCommand(context.Background(), []string{cmd, h}, &out, &errOut); err != nil {
				t.Errorf("%s %s: %v", cmd, h, err)
			}
			if !strings.Contains(errOut.String(), "usage: syncagent "+cmd) || out.Len() > 0 {
				t.Errorf("%s %s: stdout %q, stderr %q; want the usage on stderr", cmd, h, out.String(), errOut.String())
			}
		}
		if err := RunCommand(context.Background(), []string{cmd, "--bogus", "x"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "usage: syncagent "+cmd) {
			t.Errorf("%s --bogus x: %v, want an error with the usage", cmd, err)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) > 0 {
		t.Fatalf("help and a bad flag wrote %v", ents)
	}
	var out bytes.Buffer
	if err := RunCommand(context.Background(), []string{"keygen", "--", "-a.nk"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "-a.nk")); err != nil || !strings.HasPrefix(out.String(), "U") {
		t.Fatalf("keygen -- -a.nk: %v, printed %q", err, out.String())
	}
}
