package main

import (
	"context"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
)

// A burst at a freshly started ratelimitd: 1,000 concurrent callers send 3
// checks each on one key the moment the ready line is out. Connections and
// scripts are warm by then (no script is loaded on the request path), no
// answer comes from the failure policy, and at most the bucket's bound is
// admitted. --timeout 100ms: see TestColdBurstNeverFailsOpen in regional.
func TestColdStartBurst(t *testing.T) {
	integration(t)
	r := testutil.StartRedis(t)
	rulesPath := filepath.Join(t.TempDir(), "rules.json")
	writeRules(t, rulesPath, `[{"id":"burst","algorithm":"token_bucket","capacity":100,"refill_per_second":1}]`)
	s := startInProcess(t, "--region", "us-east", "--redis-addr", r.Addr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--rules", rulesPath, "--timeout", "100ms")
	if resp, err := http.Get("http://" + s.http + "/readyz"); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz at the ready line: %v %v", resp, err)
	}
	c := dial(t, s.grpc)
	var mu sync.Mutex
	var allowed, failOpen, rejected, errs int
	var wg sync.WaitGroup
	start := time.Now()
	for g := 0; g < 1000; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 3; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "tenant:1"})
				cancel()
				mu.Lock()
				switch {
				case err != nil:
					errs++
				case resp.FailOpen:
					failOpen++
				case resp.Allowed:
					allowed++
				default:
					rejected++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	t.Logf("1000 x 3 at start: allowed=%d rejected=%d fail_open=%d errors=%d in %v", allowed, rejected, failOpen, errs, elapsed)
	if errs > 0 || failOpen > 0 {
		t.Fatalf("%d errors and %d fail-open answers with a healthy Redis", errs, failOpen)
	}
	if bound := 100 + int(elapsed.Seconds()) + 1; allowed > bound {
		t.Fatalf("allowed %d, bound %d", allowed, bound)
	}
	resp, err := http.Get("http://" + s.http + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if m := regexp.MustCompile(`(?m)^apportion_script_loads_total\{[^}]*\} (\S+)`).FindSubmatch(body); m == nil || string(m[1]) != "0" {
		t.Fatalf("script loads on the request path: %q, want 0 (loaded before the ready line)", m)
	}
}
