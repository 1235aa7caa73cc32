package redisstore

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// writeEveryKind writes every kind of key the project writes through s:
// each regional algorithm, global token buckets and fixed and sliding
// windows with no record, a held record (with the Hold the sync agent
// gives it) and a Release record, a global key checked regionally, and
// the rules' markers. It returns the keys it wrote besides the markers.
func writeEveryKind(t *testing.T, s *Store, hold time.Duration) []string {
	t.Helper()
	ctx := ctxT(t)
	run, err := s.RunID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	check := func(bs ...Bucket) {
		t.Helper()
		if _, _, err := s.Check(ctx, 1, bs); err != nil {
			t.Fatal(err)
		}
		for _, b := range bs {
			keys = append(keys, b.Key)
		}
	}
	globals := []struct {
		rule string
		alg  rules.Algorithm
	}{{"g-tb", rules.TokenBucket}, {"g-fw", rules.FixedWindow}, {"g-sw", rules.SlidingWindow}}
	// the markers first: on a Cluster their fan-out takes seconds, which
	// would outlast some keys' TTLs
	for _, g := range globals {
		if _, err := s.WriteMarker(ctx, g.rule, Marker{Inc: 1, Seq: 1, Units: 300, Lease: time.Minute, Create: true, RunID: run}); err != nil {
			t.Fatal(err)
		}
	}
	for c := range 4 {
		tag := fmt.Sprintf("client-%d", c)
		check(tokenBucket(Key(tag, "tb"), 600, 1),
			Bucket{Key: Key(tag, "lb"), Algorithm: rules.LeakyBucket, Capacity: 600_000, Rate: 1000},
			window(Key(tag, "fw"), rules.FixedWindow, 3, time.Minute),
			window(Key(tag, "sw"), rules.SlidingWindow, 3, time.Minute),
			window(Key(tag, "sl"), rules.SlidingLog, 3, time.Minute))
	}
	for _, g := range globals {
		bucket := func(key string) Bucket {
			if g.alg == rules.TokenBucket { // 10 min to fill from empty
				return Bucket{Key: key, Algorithm: rules.TokenBucket, Capacity: 600 * gCap, Rate: gRate, Global: &Global{Rule: g.rule, Units: gUnits, Floor: gFloor}}
			}
			return globalWindow(g.alg, g.rule, key)
		}
		rec := func(key string, seq uint64, units int64, release bool) ShareRecord {
			r := record(g.rule, key, 1, seq, units)
			r.Capacity = 600 * gCap
			if g.alg != rules.TokenBucket {
				r = windowRecord(g.alg, key, 1, seq, units)
			}
			r.Release, r.Hold = release, hold
			return r
		}
		none, held, rel, scope := Key("none", g.rule), Key("held", g.rule), Key("released", g.rule), Key("scope", g.rule)
		if _, err := s.WriteShares(ctx, g.rule, []ShareRecord{rec(held, 2, 600, false), rec(rel, 2, 600, false), rec(scope, 2, 600, false)}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.WriteShares(ctx, g.rule, []ShareRecord{rec(rel, 3, 300, true)}); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{none, held, rel} { // one hash tag per request
			check(bucket(k))
		}
		// a rule that changes scope: a regional check of a global key
		regional := tokenBucket(scope, 600, 1)
		if g.alg != rules.TokenBucket {
			regional = window(scope, g.alg, 3, time.Minute)
		}
		check(regional)
	}
	return keys
}

// scanTTLs lists every key of c (SCAN) with its PTTL.
func scanTTLs(ctx context.Context, c *redis.Client) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	iter := c.Scan(ctx, 0, "*", 1000).Iterator()
	for iter.Next(ctx) {
		out[iter.Val()] = 0
	}
	if err := iter.Err(); err != nil {
		return nil, err
	}
	for k := range out {
		d, err := c.PTTL(ctx, k).Result()
		if err != nil {
			return nil, err
		}
		out[k] = d
	}
	return out, nil
}

// checkBounded requires every key listed to have a TTL of at most max (the
// held records' Hold, which they have), but the markers: at most perRule
// of them per rule, which names them.
func checkBounded(t *testing.T, ttls map[string]time.Duration, rules []string, perRule int, max time.Duration) (markers int) {
	t.Helper()
	per := map[string]int{}
	for k, d := range ttls {
		if strings.HasPrefix(k, "rl:marker:") {
			rule := k[strings.LastIndexByte(k, ':')+1:]
			per[rule]++
			markers++
			continue
		}
		if d <= 0 || d > max {
			t.Errorf("key %s: PTTL %v, want a TTL of at most %v", k, d, max)
		}
		if strings.HasPrefix(k, "rl:{held}:") && d < max-time.Minute {
			t.Errorf("held record %s: PTTL %v, want its Hold (%v)", k, d, max)
		}
	}
	for r, n := range per {
		found := false
		for _, want := range rules {
			found = found || r == want
		}
		if !found || n > perRule {
			t.Errorf("rule %q: %d marker keys, want at most %d of a rule written", r, n, perRule)
		}
	}
	return markers
}

// TestEveryKeyHasATTL lists every key the store writes (SCAN, PTTL) after
// a run with every kind: each has a TTL, at most the held records' Hold,
// but the markers, one per rule (bounded by the rules, not the keys).
func TestEveryKeyHasATTL(t *testing.T) {
	e := newEnv(t, true)
	hold := 30 * time.Minute
	keys := writeEveryKind(t, e.store, hold)
	ttls, err := scanTTLs(ctxT(t), e.client)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if _, ok := ttls[k]; !ok {
			t.Fatalf("%s was not written (%d keys scanned)", k, len(ttls))
		}
	}
	if m := checkBounded(t, ttls, []string{"g-tb", "g-fw", "g-sw"}, 1, hold); m != 3 {
		t.Fatalf("%d markers, want 3", m)
	}
	t.Logf("%d keys: every one has a TTL of at most %v but the 3 markers", len(ttls), hold)
}

// TestClusterEveryKeyHasATTL is TestEveryKeyHasATTL on a Cluster, every
// master scanned: a rule's markers are its 16384 slot copies.
func TestClusterEveryKeyHasATTL(t *testing.T) {
	e := newClusterEnv(t)
	hold := 30 * time.Minute
	keys := writeEveryKind(t, e.store, hold)
	var mu sync.Mutex
	ttls := map[string]time.Duration{}
	err := e.client.ForEachMaster(ctxT(t), func(ctx context.Context, c *redis.Client) error {
		m, err := scanTTLs(ctx, c)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		for k, d := range m {
			ttls[k] = d
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if _, ok := ttls[k]; !ok {
			t.Fatalf("%s was not written (%d keys scanned)", k, len(ttls))
		}
	}
	if m := checkBounded(t, ttls, []string{"g-tb", "g-fw", "g-sw"}, 16384, hold); m != 3*16384 {
		t.Fatalf("%d markers, want 3 x 16384", m)
	}
	t.Logf("%d keys: every one has a TTL of at most %v but the 3 x 16384 marker copies", len(ttls), hold)
}
