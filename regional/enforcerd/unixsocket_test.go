package enforcerd

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/redis/go-redis/v9"
)

// TestRedisUnixSocket: ratelimitd --redis-addr unix:///PATH checks against
// the Redis on that socket (a bucket of 2 admits 2 and refuses the third),
// and watches that Redis's scheduling as it does a loopback one (a socket
// is this host's).
func TestRedisUnixSocket(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	sock, err := os.MkdirTemp("", "rl-sock") // short: a socket path has at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sock) })
	path := filepath.Join(sock, "redis.sock")
	r := testutil.StartRedis(t, "--unixsocket", path, "--unixsocketperm", "700")
	rulesFile := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte("- id: orders\n  match: {resource: POST /orders}\n  algorithm: token_bucket\n  capacity: 2\n  refill_per_second: 0.001\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	run := startRun(t, "--region", "us-east", "--redis-addr", "unix://"+path, "--rules", rulesFile,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--timeout", "1s")
	client := run.client(t)
	for i, want := range []bool{true, true, false} {
		resp, err := client.CheckLimit(context.Background(), &ratelimitv1.CheckLimitRequest{ClientKey: "user:1", Resource: "POST /orders"})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Allowed != want || resp.FailOpen {
			t.Fatalf("check %d: allowed %v fail_open %v, want allowed %v from Redis", i+1, resp.Allowed, resp.FailOpen, want)
		}
	}
	// The bucket is in the Redis behind the socket (the test reads it over TCP).
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer rc.Close()
	if keys, err := rc.Keys(context.Background(), "rl:*").Result(); err != nil || len(keys) != 1 {
		t.Fatalf("buckets in the socket's Redis: %q, %v; want 1", keys, err)
	}
	watching := fmt.Sprintf("pid=%d", r.PID())
	testutil.WaitFor(t, 10*time.Second, "the local Redis watch", func() bool {
		return strings.Contains(run.stderr.String(), "watching the local Redis") && strings.Contains(run.stderr.String(), watching)
	})
	if err := run.stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
}
