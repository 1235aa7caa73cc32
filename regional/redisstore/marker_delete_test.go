package redisstore

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

func TestUnescapeRule(t *testing.T) {
	for _, id := range []string{"orders", "a:b", "50%", "{x}", "%7B:%25", "ü"} {
		var sb strings.Builder
		escape(&sb, id, true)
		b := sb.String()
		got, ok := unescapeRule(string(b))
		if !ok || got != id {
			t.Errorf("unescapeRule(%q) = %q, %v; want %q", b, got, ok, id)
		}
	}
	for _, bad := range []string{"", "a:b", "%", "%2", "%41", "{x"} {
		if got, ok := unescapeRule(bad); ok {
			t.Errorf("unescapeRule(%q) = %q, accepted", bad, got)
		}
	}
}

// TestDeleteMarker: DeleteMarker deletes a rule's marker (a check then
// enforces the floor, and the other rule's marker stays), MarkerRules
// lists the rules with a marker (ids escaped in the keys read back), and a
// Create afterwards makes a new marker. On a Cluster a store with
// WithMarkerSlots lists and deletes the copies of its slots only.
func TestDeleteMarker(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	const units, floor = 600_000, 100_000
	enforced := func(t *testing.T, s *Store, rule, key string) int64 {
		_, res, err := s.Check(ctxT(t), MaxCost, []Bucket{{Key: key, Algorithm: rules.TokenBucket, Capacity: 1_000_000_000, Rate: 1_000_000_000,
			Global: &Global{Rule: rule, Units: 1_000_000, Floor: floor}}})
		if err != nil {
			t.Fatal(err)
		}
		return res[0].Limit
	}
	create := func(t *testing.T, s *Store, rule string, inc uint64) {
		run, err := s.RunID(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		if v, err := s.WriteMarker(ctxT(t), rule, Marker{Inc: inc, Seq: 1, Units: units, Lease: time.Minute, Create: true, RunID: run}); err != nil || v != (Version{inc, 1}) {
			t.Fatalf("WriteMarker %s: %v, %v", rule, v, err)
		}
	}
	list := func(t *testing.T, s *Store) []string {
		rs, err := s.MarkerRules(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		return rs
	}
	const gone, kept = "gone:a%{b}", "kept"

	t.Run("single", func(t *testing.T) {
		r := testutil.StartRedis(t)
		client := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
		t.Cleanup(func() { client.Close() })
		s, err := New(client)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		create(t, s, gone, 1)
		create(t, s, kept, 1)
		key := Key("user:1", gone)
		if got := list(t, s); !slices.Equal(got, []string{gone, kept}) {
			t.Fatalf("MarkerRules = %q", got)
		}
		if e := enforced(t, s, gone, key); e != units {
			t.Fatalf("before the delete: %d, want %d", e, units)
		}
		if err := s.DeleteMarker(ctxT(t), gone); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteMarker(ctxT(t), gone); err != nil { // none left: no error
			t.Fatal(err)
		}
		if got := list(t, s); !slices.Equal(got, []string{kept}) {
			t.Fatalf("MarkerRules after the delete = %q", got)
		}
		if e := enforced(t, s, gone, key); e != floor {
			t.Fatalf("after the delete: %d, want the floor %d", e, floor)
		}
		create(t, s, gone, 2)
		if e := enforced(t, s, gone, key); e != units {
			t.Fatalf("re-created: %d, want %d", e, units)
		}
	})

	t.Run("cluster-shard", func(t *testing.T) {
		c := testutil.StartCluster(t, 3, false)
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
		t.Cleanup(func() { client.Close() })
		var shards [2]*Store
		for i := range shards {
			lo, hi := ShardSlots(i, 2)
			s, err := New(client, WithMarkerSlots(lo, hi))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			shards[i] = s
			create(t, s, gone, 1)
		}
		create(t, shards[0], kept, 1)
		if got := list(t, shards[1]); !slices.Equal(got, []string{gone}) {
			t.Fatalf("shard 1's MarkerRules = %q", got)
		}
		keys := map[int]string{}
		for i := 0; len(keys) < 2; i++ {
			k := Key(string(rune('a'+i%26))+string(rune('0'+i/26)), gone)
			keys[ShardOf(k, 2)] = k
		}
		if err := shards[1].DeleteMarker(ctxT(t), gone); err != nil {
			t.Fatal(err)
		}
		// Shard 1's copies are gone, shard 0's stay.
		if e := enforced(t, shards[0], gone, keys[1]); e != floor {
			t.Errorf("shard 1's key after its delete: %d, want the floor", e)
		}
		if e := enforced(t, shards[0], gone, keys[0]); e != units {
			t.Errorf("shard 0's key after shard 1's delete: %d, want %d", e, units)
		}
		if got := list(t, shards[1]); len(got) != 0 {
			t.Errorf("shard 1's MarkerRules after its delete = %q", got)
		}
		if got := list(t, shards[0]); !slices.Equal(got, []string{gone, kept}) {
			t.Errorf("shard 0's MarkerRules = %q", got)
		}
		if err := shards[0].DeleteMarker(ctxT(t), gone); err != nil {
			t.Fatal(err)
		}
		n := 0
		var mu sync.Mutex
		err := client.ForEachMaster(ctxT(t), func(ctx context.Context, m *redis.Client) error {
			ks, err := m.Keys(ctx, "rl:marker:*").Result()
			mu.Lock()
			n += len(ks)
			mu.Unlock()
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if lo, hi := ShardSlots(0, 2); n != hi-lo {
			t.Errorf("%d marker keys left, want shard 0's %d copies of %s", n, hi-lo, kept)
		}
		create(t, shards[1], gone, 2)
		if e := enforced(t, shards[1], gone, keys[1]); e != units {
			t.Errorf("re-created: %d, want %d", e, units)
		}
	})
}
