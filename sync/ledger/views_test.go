package ledger

import (
	"testing"
	"time"
)

// TestWholeTokenViews replays the TestRandomized seeds in which a small limit
// (a burst of 4 in whole tokens, four regions) never settled: a region gave
// tokens to two regions at once, each receiver, not yet seeing the other's
// raise, computed a pool short by the units in flight to it and gave its new
// token back, and the giver, seeing the whole pool again, gave them out again,
// for good. Seed 1929 with the defaults; 106 and 631 with a demand band of
// 0.25 and a 1 s heartbeat. give now holds whole-token gifts back while its
// views of the key disagree (Ledger.consistent, at most Config.holdTicks
// Ticks): every key must be at its targets at the end of the calm phase and
// stay there through its last third, within the bound of a heal.
func TestWholeTokenViews(t *testing.T) {
	for _, c := range []struct {
		seed            int64
		band, heartbeat string
	}{
		{1929, "", ""},
		{106, "0.25", "1s"},
		{631, "0.25", "1s"},
	} {
		t.Setenv("LEDGER_BAND", c.band)
		t.Setenv("LEDGER_HEARTBEAT", c.heartbeat)
		o := randomOpts(c.seed)
		cfg := s0cfg(o)
		if cfg.Quantum <= 1 {
			t.Fatalf("seed %d: not a whole-token seed (Quantum %d): randomOpts changed", c.seed, cfg.Quantum)
		}
		if def := simConfig(); c.band == "" && (cfg.DemandBand != def.DemandBand || cfg.HeartbeatEvery != def.HeartbeatEvery) ||
			c.band != "" && (cfg.DemandBand != 0.25 || cfg.HeartbeatEvery != time.Second) {
			t.Fatalf("seed %d: band %v heartbeat %v, want %q %q", c.seed, cfg.DemandBand, cfg.HeartbeatEvery, c.band, c.heartbeat)
		}
		res := runSim(t, c.seed, o)
		b := randomHealBound(cfg)
		switch {
		case res.violation != "":
			t.Errorf("seed %d band %q heartbeat %q: SAFETY: %s", c.seed, c.band, c.heartbeat, res.violation)
		case res.liveness != "":
			t.Errorf("seed %d band %q heartbeat %q: off the targets at the end: %s", c.seed, c.band, c.heartbeat, res.liveness)
		case res.strayed != "":
			t.Errorf("seed %d band %q heartbeat %q: off the targets again: %s", c.seed, c.band, c.heartbeat, res.strayed)
		case res.healedIn < 0 || res.healedIn > b:
			t.Errorf("seed %d band %q heartbeat %q: at the targets %v after the heal, bound %v", c.seed, c.band, c.heartbeat, res.healedIn, b)
		default:
			t.Logf("seed %d band %q heartbeat %q: at the targets %v after the heal (bound %v)", c.seed, c.band, c.heartbeat, res.healedIn, b)
		}
	}
}

// TestHoldCapped: the hold on disagreeing views delays a whole-token gift by
// at most Config.holdTicks Ticks and never stops it. Three regions, a burst
// of 4; r1 holds the tokens, then most of the demand moves to r0. r1's views
// are forced to disagree at every Tick (it forgets which reports its peers
// acknowledged: as if a peer never heard another): r1 must hold (a Tick
// with waited > 0) and still give to r0 within holdTicks + 1 Ticks of the
// move (one exchange for r0's demand to reach r1), no later than with its
// views as they are.
func TestHoldCapped(t *testing.T) {
	run := func(force bool) (gave, held, cap int) {
		c := newCluster(t, 3)
		for _, l := range c.l {
			l.cfg.Quantum = l.cfg.Units / 4
		}
		c.use = []int64{0, 100, 0}
		for range 30 {
			c.exchange()
		}
		if p := c.l[1].Position("k").Units; p < c.l[1].cfg.Quantum {
			t.Fatalf("r1 holds %d units before the move, want a token (%d)", p, c.l[1].cfg.Quantum)
		}
		c.use = []int64{400, 20, 0}
		k := c.l[1].keys["k"]
		before := c.l[1].pair(k, 0).give
		for n := 1; n <= 40; n++ {
			if force {
				for i := range c.l[1].peers {
					clear(c.l[1].peers[i].heardOf)
				}
			}
			c.exchange()
			held = max(held, int(k.waited))
			if c.l[1].pair(k, 0).give > before {
				return n, held, c.l[1].cfg.holdTicks()
			}
		}
		return -1, held, c.l[1].cfg.holdTicks()
	}
	free, _, _ := run(false)
	gave, held, cap := run(true)
	switch {
	case gave < 0:
		t.Fatalf("with its views forced to disagree r1 never gave to r0 (held up to %d Ticks, holdTicks %d)", held, cap)
	case held == 0:
		t.Fatalf("with its views forced to disagree r1 never held its gift")
	case gave > cap+1 || gave < free:
		t.Fatalf("with its views forced to disagree r1 gave to r0 %d Ticks after the move, want %d (as without) to holdTicks+1 = %d", gave, free, cap+1)
	}
	t.Logf("r1 gave to r0 %d Ticks after the move with its views forced to disagree (held up to %d Ticks, holdTicks %d), %d without", gave, held, cap, free)
}
