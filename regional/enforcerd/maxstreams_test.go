package enforcerd

import (
	"bufio"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"golang.org/x/net/http2"
)

// TestGRPCMaxStreams: the gRPC port announces a limit on concurrent calls
// per connection (SETTINGS_MAX_CONCURRENT_STREAMS, --grpc-max-streams,
// default DefaultMaxStreams), so that one client opening streams it never
// reads cannot make the enforcer hold memory without bound; gRPC's default
// announces none. A value below 1 is refused naming the flag.
func TestGRPCMaxStreams(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	rulesFile := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte("- id: a\n  match: {resource: GET /a}\n  algorithm: token_bucket\n  capacity: 100\n  refill_per_second: 100\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Run(t.Context(), []string{"--region", "x", "--rules", rulesFile, "--grpc-max-streams", "0"}, &testutil.SyncBuffer{}, &testutil.SyncBuffer{}); err == nil ||
		!strings.Contains(err.Error(), "--grpc-max-streams") {
		t.Fatalf("--grpc-max-streams 0: %v, want an error naming the flag", err)
	}
	r := testutil.StartRedis(t)
	for _, tc := range []struct {
		args []string
		want uint32
	}{
		{nil, DefaultMaxStreams},
		{[]string{"--grpc-max-streams", "7"}, 7},
	} {
		args := append([]string{"--region", "x", "--redis-addr", r.Addr, "--rules", rulesFile,
			"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"}, tc.args...)
		run := startRun(t, args...)
		if got := serverMaxStreams(t, run.grpc); got != tc.want {
			t.Errorf("%v: the server announces SETTINGS_MAX_CONCURRENT_STREAMS %d, want %d", tc.args, got, tc.want)
		}
		if err := run.stop(); err != nil {
			t.Fatal(err)
		}
	}
}

// serverMaxStreams opens an HTTP/2 connection to addr and returns the
// SETTINGS_MAX_CONCURRENT_STREAMS of the server's first SETTINGS frame (0:
// not announced, that is unlimited).
func serverMaxStreams(t *testing.T, addr string) uint32 {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, bufio.NewReader(c))
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("reading the server's SETTINGS: %v", err)
		}
		sf, ok := f.(*http2.SettingsFrame)
		if !ok || sf.IsAck() {
			continue
		}
		v, _ := sf.Value(http2.SettingMaxConcurrentStreams)
		return v
	}
}
