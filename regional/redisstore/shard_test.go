package redisstore

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// TestMarkerSlots: a store with WithMarkerSlots writes the marker copies
// of its slots only, so a check of a key in its range enforces the
// marker's units and one outside enforces the floor; a single server
// refuses the option.
func TestMarkerSlots(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	r := testutil.StartRedis(t)
	single := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
	t.Cleanup(func() { single.Close() })
	if _, err := New(single, WithMarkerSlots(0, 100)); err == nil || !strings.Contains(err.Error(), "Cluster") {
		t.Fatalf("WithMarkerSlots on a single server: %v", err)
	}
	for _, bad := range [][2]int{{-1, 5}, {5, 5}, {0, Slots + 1}} {
		if _, err := New(single, WithMarkerSlots(bad[0], bad[1])); err == nil {
			t.Errorf("WithMarkerSlots(%d, %d) accepted", bad[0], bad[1])
		}
	}

	c := testutil.StartCluster(t, 3, false)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
	t.Cleanup(func() { client.Close() })
	lo, hi := ShardSlots(1, 2)
	s, err := New(client, WithMarkerSlots(lo, hi))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ctx := ctxT(t)
	run, err := s.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const rule, units, floor = "orders", 600_000, 100_000
	if v, err := s.WriteMarker(ctx, rule, Marker{Inc: 1, Seq: 1, Units: units, Lease: time.Minute, Create: true, RunID: run}); err != nil || v != (Version{1, 1}) {
		t.Fatalf("WriteMarker: %v, %v", v, err)
	}
	keys := map[int]string{}
	for i := 0; len(keys) < 2; i++ {
		k := Key(fmt.Sprint("user:", i), rule)
		keys[ShardOf(k, 2)] = k
	}
	for sh, k := range keys {
		_, res, err := s.Check(ctx, MaxCost, []Bucket{{Key: k, Algorithm: rules.TokenBucket, Capacity: 1_000_000_000, Rate: 1_000_000_000,
			Global: &Global{Rule: rule, Units: 1_000_000, Floor: floor}}})
		if err != nil {
			t.Fatal(err)
		}
		want := int64(floor)
		if sh == 1 {
			want = units
		}
		if res[0].Limit != want {
			t.Errorf("key %s of shard %d (slot %d, marker slots [%d, %d)) enforces %d, want %d", k, sh, HashSlot(k), lo, hi, res[0].Limit, want)
		}
	}
}
