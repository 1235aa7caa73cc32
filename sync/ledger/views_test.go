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
