package ledger

import (
	"fmt"
	"maps"
	"slices"
	"testing"
)

// Each visits every key held exactly once, with Position's view: keys
// merged into the sorted order, keys created since, forgotten keys still
// in either list (skipped), and a forgotten name created again.
func TestEachVisitsEveryKeyOnce(t *testing.T) {
	c := newCluster(t, 3)
	l := c.l[0]
	for i := range 20 {
		l.Usage(c.now, fmt.Sprintf("k%02d", i), 100, int64(i), 0)
	}
	c.exchange() // Tick: the 20 are merged into l.sorted
	for _, n := range []string{"k03", "k07", "k11"} {
		l.forget(l.keys[n])
	}
	for i := 20; i < 25; i++ {
		l.Usage(c.now, fmt.Sprintf("k%02d", i), 100, 1, 0) // in l.added
	}
	l.forget(l.keys["k22"])          // forgotten while in l.added
	l.Usage(c.now, "k07", 100, 5, 0) // forgotten, then created again
	if len(l.sorted) == 0 || len(l.added) == 0 {
		t.Fatalf("setup: sorted %d, added %d keys; want both", len(l.sorted), len(l.added))
	}
	seen := map[string]int{}
	l.Each(func(name string, s Share) {
		seen[name]++
		if p := l.Position(name); s != p {
			t.Errorf("%s: Each %+v, Position %+v", name, s, p)
		}
	})
	want := slices.Sorted(maps.Keys(l.keys))
	if got := slices.Sorted(maps.Keys(seen)); !slices.Equal(got, want) {
		t.Fatalf("Each visited %v, the ledger holds %v", got, want)
	}
	for n, times := range seen {
		if times != 1 {
			t.Errorf("%s visited %d times", n, times)
		}
	}
}

// BenchmarkEach walks a ledger of 1,000,000 keys (the agent's loop does,
// for the shares view and the hottest-keys metrics at every scrape).
//
//	go test -run '^$' -bench Each -benchtime 10x ./sync/ledger/
func BenchmarkEach(b *testing.B) {
	_, l := millionKeys(b)
	b.ResetTimer()
	for range b.N {
		var sum int64
		l.Each(func(_ string, s Share) { sum += s.Units })
	}
}

// BenchmarkFreezeAndReset freezes a peer's incarnation and tells of a store
// reset on a ledger of 1,000,000 keys: both visit every key in name order
// on the agent's loop, when a peer restarts or is reclaimed and when Redis
// comes back empty.
//
//	go test -run '^$' -bench FreezeAndReset -benchtime 5x ./sync/ledger/
func BenchmarkFreezeAndReset(b *testing.B) {
	c, l := millionKeys(b)
	b.Run("freeze", func(b *testing.B) {
		for range b.N {
			l.freeze(1, l.peers[1].inc, c.now)
		}
	})
	b.Run("store-reset", func(b *testing.B) {
		for i := range b.N {
			l.StoreReset(c.now, fmt.Sprint("run-", i))
		}
	})
}

// millionKeys is a three-region cluster whose first ledger holds 1,000,000
// keys, merged into its name order.
func millionKeys(b *testing.B) (*cluster, *Ledger) {
	c := newCluster(b, 3)
	l := c.l[0]
	for i := range 1_000_000 {
		l.Usage(c.now, fmt.Sprintf("rl:{user:%d}:r", i), 100, 1, 0)
	}
	l.mergeKeys()
	return c, l
}
