package ledger

import (
	"testing"
	"time"
)

// TestGiftWait: while some region wants more than its floor, an excess
// over the target of at most GiftBand of the units is given only on the
// Tick after it has been held back giftWaitTicks Ticks in a row, and an
// excess that goes away in between starts the count again; a larger excess
// is given at once; whole-token keys (Quantum) and keys at rest never wait;
// GiftWait 0 gives at once.
func TestGiftWait(t *testing.T) {
	// give runs on a's ledger with b's view set by hand: a holds its base
	// (500,000 of 1,000,000, floors 50,000) and reports wantA above its
	// floor, b reports its base and wantB. The two wants add up to the
	// pool (900,000), so a's target is wantA and its excess 450,000-wantA.
	setup := func(t *testing.T, cfg Config, wantA, wantB int64) (*Ledger, *key, time.Duration) {
		t.Helper()
		l, err := New(cfg, "a", []RegionSpec{{"a", 1}, {"b", 1}}, Start{Inc: 1, RunID: "run"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		now := cfg.Interval
		l.Usage(now, "k", 100, 5, 0)
		l.Tick(now)
		k := l.keys["k"]
		if k == nil || l.position(k) != 500_000 || l.floor[0] != 50_000 {
			t.Fatalf("setup: key %v, position %d, floor %d", k, l.position(k), l.floor[0])
		}
		k.active = true
		k.sentDem = float32(l.floor[0] + wantA)
		p := &l.peers[1]
		p.inc, p.seen, p.heard, p.base = 1, true, now, 500_000
		pr := l.pair(k, 1)
		pr.peerSeq, pr.peerPos, pr.peerDemand = 1, 500_000, l.floor[1]+wantB
		return l, k, now
	}
	// ticks runs give up to max times and returns on which run (1-based)
	// a's gift to b first grew, 0 if never.
	ticks := func(l *Ledger, k *key, now time.Duration, max int) int {
		for n := 1; n <= max; n++ {
			now += l.cfg.Interval
			l.peers[1].heard = now
			l.give(k, now)
			if l.pair(k, 1).give > 0 {
				return n
			}
		}
		return 0
	}
	cfg := simConfig()
	cfg.GiftBand, cfg.GiftWait = 0.02, time.Second // 10 Ticks of 100 ms
	if cfg.giftWaitTicks() != 10 {
		t.Fatalf("giftWaitTicks = %d, want 10", cfg.giftWaitTicks())
	}

	t.Run("small excess waits", func(t *testing.T) {
		l, k, now := setup(t, cfg, 440_000, 460_000) // excess 10,000: 1% of the units
		if n := ticks(l, k, now, 20); n != 11 {
			t.Fatalf("a 1%% excess was given on Tick %d, want 11 (held back 10)", n)
		}
		if g := l.pair(k, 1).give; g != 10_000 {
			t.Fatalf("gave %d, want the whole excess 10,000", g)
		}
	})
	t.Run("an excess that goes away starts the count again", func(t *testing.T) {
		l, k, now := setup(t, cfg, 440_000, 460_000)
		if n := ticks(l, k, now, 6); n != 0 {
			t.Fatalf("given on Tick %d of 6", n)
		}
		now += 6 * cfg.Interval
		k.sentDem = float32(l.floor[0] + 450_000) // a at its target: nothing to give
		if n := ticks(l, k, now, 1); n != 0 {
			t.Fatal("given with no excess")
		}
		now += cfg.Interval
		k.sentDem = float32(l.floor[0] + 440_000)
		if n := ticks(l, k, now, 20); n != 11 {
			t.Fatalf("given on Tick %d after the excess came back, want 11", n)
		}
	})
	t.Run("large excess at once", func(t *testing.T) {
		l, k, now := setup(t, cfg, 300_000, 600_000) // excess 150,000
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("a 15%% excess was given on Tick %d, want 1", n)
		}
	})
	t.Run("band edge", func(t *testing.T) {
		l, k, now := setup(t, cfg, 430_000, 470_000) // excess 20,000: exactly 2%
		if n := ticks(l, k, now, 20); n != 11 {
			t.Fatalf("an excess of exactly GiftBand was given on Tick %d, want 11", n)
		}
		l, k, now = setup(t, cfg, 429_999, 470_001) // 20,001: above it
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("an excess above GiftBand was given on Tick %d, want 1", n)
		}
	})
	t.Run("GiftWait 0", func(t *testing.T) {
		c := cfg
		c.GiftWait = 0
		l, k, now := setup(t, c, 440_000, 460_000)
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("with GiftWait 0 given on Tick %d, want 1", n)
		}
	})
	t.Run("at rest", func(t *testing.T) {
		// Nobody wants more than its floor: the positions go back to the
		// bases at once, whatever GiftBand, so the key can go idle. a
		// holds 10,000 units a reclaim paid it, b 10,000 less.
		l, k, now := setup(t, cfg, 0, 0)
		k.rareState().extra = 10_000
		l.pair(k, 1).peerPos = 490_000
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("at rest a 1%% excess was given on Tick %d, want 1", n)
		}
		// And a debt is paid at once too (settle.go).
		l, k, now = setup(t, cfg, 0, 0)
		l.pair(k, 1).recv = 10_000 // b gave a 10,000 units earlier
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("at rest a 1%% debt was paid on Tick %d, want 1", n)
		}
	})
	t.Run("whole tokens", func(t *testing.T) {
		c := cfg
		c.Quantum = QuantumOf(c.Units, 100) // 10,000 units a token
		c.KeepToken = 0
		l, k, now := setup(t, c, 440_000, 460_000)
		if n := ticks(l, k, now, 20); n != 1 {
			t.Fatalf("a whole token was given on Tick %d, want 1 (no wait with Quantum)", n)
		}
	})
}
