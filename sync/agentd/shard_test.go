package agentd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/sync/agent"
)

// TestShardFlags: syncagent layout prints and changes the layout; --shard
// must match it, and more than one shard needs a Redis Cluster.
func TestShardFlags(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	ns := testutil.StartNATS(t)
	e := testutil.StartEtcd(t)
	ctx := context.Background()
	layout := func(args ...string) string {
		var out bytes.Buffer
		if err := RunCommand(ctx, append([]string{"layout", "--etcd-endpoints", e.Endpoint}, args...), &out, io.Discard); err != nil {
			t.Fatalf("layout %v: %v", args, err)
		}
		return strings.TrimSpace(out.String())
	}
	if got := layout(); got != "shards=1 epoch=0" {
		t.Fatalf("no layout key: %q", got)
	}
	run := func(shard string) error {
		return RunCommand(ctx, []string{"--region", "us-east", "--insecure-unsigned-reports", "--redis-addr", r.Addr, "--nats-url", ns.ClientURL(),
			"--etcd-endpoints", e.Endpoint, "--http-addr", "127.0.0.1:0", "--shard", shard}, io.Discard, io.Discard)
	}
	if err := run("0/2"); err == nil || !strings.Contains(err.Error(), "Redis Cluster") {
		t.Fatalf("--shard 0/2 on a single Redis server: %v", err)
	}
	if got := layout("2"); got != "shards=2 epoch=1" {
		t.Fatalf("layout 2: %q", got)
	}
	if err := run("0/1"); !errors.Is(err, agent.ErrLayout) {
		t.Fatalf("--shard 0/1 in a 2-shard layout: %v", err)
	}
	if err := run("2/2"); err == nil {
		t.Fatal("--shard 2/2 accepted")
	}
	if got, want := leaderKey("us-east", agent.Shard{Index: 1, Count: 2, Epoch: 1}), "/ratelimit/syncagent/us-east/shard-1-of-2/leader"; got != want {
		t.Fatalf("leader key %q, want %q", got, want)
	}
	if got := leaderKey("us-east", agent.Shard{Count: 1}); got != "/ratelimit/syncagent/us-east/leader" {
		t.Fatalf("the unsharded agent's leader key changed: %q", got)
	}
}
