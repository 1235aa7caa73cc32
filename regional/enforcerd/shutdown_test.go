package enforcerd

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
)

// TestShutdownDelay: with --shutdown-delay, a stopping ratelimitd answers
// /readyz 503 while it still serves checks, for the delay, and only then
// closes its listeners; a negative delay is refused naming the flag.
func TestShutdownDelay(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	if err := Run(context.Background(), []string{"--region", "x", "--rules", "r.yaml", "--shutdown-delay", "-1s"}, &testutil.SyncBuffer{}, &testutil.SyncBuffer{}); err == nil ||
		!strings.Contains(err.Error(), "--shutdown-delay") {
		t.Fatalf("--shutdown-delay -1s: %v, want an error naming the flag", err)
	}
	r := testutil.StartRedis(t)
	rulesFile := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte("- id: a\n  match: {resource: GET /a}\n  algorithm: token_bucket\n  capacity: 100\n  refill_per_second: 100\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const delay = 1500 * time.Millisecond
	run := startRun(t, "--region", "x", "--redis-addr", r.Addr, "--rules", rulesFile,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--shutdown-delay", delay.String())
	base := "http://" + run.http
	get := func(path string) int {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	check := func() int {
		resp, err := http.Post(base+"/v1/check", "application/json", strings.NewReader(`{"client_key":"k","resource":"GET /a"}`))
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if c := get("/readyz"); c != http.StatusOK {
		t.Fatalf("/readyz before: %d", c)
	}
	stop := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- run.stop() }()
	testutil.WaitFor(t, 5*time.Second, "/readyz 503", func() bool { return get("/readyz") == http.StatusServiceUnavailable })
	if c := check(); c != http.StatusOK {
		t.Fatalf("a check while unready: %d, want 200 (still serving)", c)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(stop); d < delay {
		t.Fatalf("stopped %v after the signal, want at least the delay %v", d, delay)
	}
}
