package ledger

import (
	"math/rand"
	"testing"
)

// cycleRun moves one key's demand between three regions in random phases,
// then leaves it idle, checking the sum at every interval. It returns the
// number of idle intervals until every ledger forgot the key (0: never
// within 400).
func cycleRun(t *testing.T, seed int64) int {
	c := newCluster(t, 3)
	rng := rand.New(rand.NewSource(seed))
	levels := []int64{0, 0, 30, 80}
	run := func(n int) {
		for i := 0; i < n; i++ {
			c.exchange()
			if s := c.sum("k"); s > c.cfg.Units {
				t.Fatalf("seed %d: sum %d > %d", seed, s, c.cfg.Units)
			}
		}
	}
	for p := 0; p < 6; p++ {
		for i := range c.use {
			c.use[i] = levels[rng.Intn(len(levels))]
		}
		run(5 + rng.Intn(20))
	}
	clear(c.use)
	for n := 1; n <= 400; n++ {
		run(1)
		gone := true
		for _, l := range c.l {
			gone = gone && l.keys["k"] == nil
		}
		if gone {
			return n
		}
	}
	for i, l := range c.l {
		k := l.keys["k"]
		t.Logf("seed %d r%d: active %v pos %d frozen %d pairs %+v", seed, i, k.active, l.Position("k").Units, k.frozen(), l.pairsOf(k))
	}
	return 0
}

// TestCycleSettled moves a key's units around three regions so that they
// come back to the bases along other pairs than they went (a cycle), and
// checks that, idle, the cycle is settled by gifts (settle.go) and every
// ledger forgets the key.
func TestCycleSettled(t *testing.T) {
	stuck, worst := 0, 0
	for seed := int64(1); seed <= 60; seed++ {
		n := cycleRun(t, seed)
		if n == 0 {
			stuck++
		}
		worst = max(worst, n)
	}
	if stuck > 0 {
		t.Fatalf("%d of 60 runs keep the key", stuck)
	}
	t.Logf("60 runs: every ledger forgot the key within %d idle intervals", worst)
}
