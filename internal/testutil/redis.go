// Package testutil ties the real servers of internal/launch (redis-server
// processes on free ports, embedded NATS and embedded etcd) to a test: each
// helper fails the test with a clear message when a server cannot start
// (never skips), and registers its cleanup with tb.Cleanup, so a test leaves
// nothing running.
package testutil

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/launch"
)

// Redis is a redis-server process started for one test.
type Redis struct {
	*launch.Redis
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	p, err := launch.FreePort()
	if err != nil {
		tb.Fatalf("testutil: %v", err)
	}
	return p
}

// RedisServerPath returns the redis-server binary or fails the test with a
// message that says how to install it. It never skips.
func RedisServerPath(tb testing.TB) string {
	tb.Helper()
	p, err := launch.RedisServerPath()
	if err != nil {
		tb.Fatalf("testutil: %v", err)
	}
	return p
}

// StartRedis starts a redis-server on a free port, with no persistence, and
// stops it when the test ends.
func StartRedis(tb testing.TB, extraArgs ...string) *Redis {
	tb.Helper()
	RedisServerPath(tb)
	r, err := launch.StartRedis(tb.TempDir(), extraArgs...)
	if err != nil {
		tb.Fatalf("testutil: start redis-server: %v", err)
	}
	tb.Cleanup(r.Stop)
	return &Redis{r}
}

// Restart starts the server again on the same port (empty: no persistence).
func (r *Redis) Restart(tb testing.TB) {
	tb.Helper()
	if err := r.Redis.Restart(); err != nil {
		tb.Fatalf("testutil: %v", err)
	}
}

// WaitFor polls cond every few milliseconds until it returns true or the
// timeout passes, then fails the test with msg.
func WaitFor(tb testing.TB, timeout time.Duration, msg string, cond func() bool) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		if cond() {
			return
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("testutil: timed out after %v waiting for %s", timeout, msg)
		case <-t.C:
		}
	}
}

// StartCluster starts a Redis Cluster of masters masters (and, with
// replicas, one replica each) through launch.StartCluster, and stops it when
// the test ends.
func StartCluster(tb testing.TB, masters int, replicas bool) *launch.Cluster {
	tb.Helper()
	RedisServerPath(tb)
	c, err := launch.StartCluster(tb.TempDir(), masters, replicas)
	if err != nil {
		tb.Fatalf("testutil: start redis cluster: %v", err)
	}
	tb.Cleanup(c.Stop)
	return c
}
