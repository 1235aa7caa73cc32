package ledger

import (
	"testing"
	"time"
)

// TestDemandHalfLifeSameAtAnyInterval: the demand estimate decays by its
// half-life in time, so one second of the same demand gives the same
// estimate at a 100 ms and a 250 ms interval (1-2^(-1s/250ms) = 15/16 of
// the rate). A weight per interval instead would give 15/16 at 250 ms and
// 1023/1024 at 100 ms.
func TestDemandHalfLifeSameAtAnyInterval(t *testing.T) {
	for _, iv := range []time.Duration{100 * time.Millisecond, 250 * time.Millisecond} {
		cfg := DefaultConfig()
		cfg.MinShare, cfg.Interval = 1, iv
		l, err := New(cfg, "a", []RegionSpec{{"a", 1}, {"b", 1}}, Start{Inc: 1, RunID: "r"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		used := int64(400 * iv.Seconds()) // 400/s of a 1000/s limit: 0.4 of it
		for now := iv; now <= time.Second; now += iv {
			l.Usage(now, "k", 1000, used, 0)
			l.Tick(now)
		}
		want := float64(cfg.Units) * 0.4 * 15 / 16
		if got := float64(l.Position("k").Demand); got < want*0.999 || got > want*1.001 {
			t.Errorf("interval %v: estimate %.0f after 1 s, want %.0f (one second is four half-lives)", iv, got, want)
		}
	}
}

// TestUsageLateHoldsTheEstimate: an interval whose usage is late
// (UsageLate: a stalled NATS server delivers an enforcer's flushes late,
// then all at once) leaves the demand estimate where it was, and the
// usage that arrives later is folded in as one interval as long as the
// wait: after a second of late usage that then arrives, the estimate is
// at least the steady one (and at most the rate). Without UsageLate the same second reads
// as traffic that stopped (the estimate falls to 1/16 of the rate in a
// second), the case the test checks too.
func TestUsageLateHoldsTheEstimate(t *testing.T) {
	const iv = 100 * time.Millisecond
	for _, late := range []bool{true, false} {
		cfg := DefaultConfig()
		cfg.MinShare, cfg.Interval = 1, iv
		l, err := New(cfg, "a", []RegionSpec{{"a", 1}, {"b", 1}}, Start{Inc: 1, RunID: "r"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		const used = 40 // per interval: 400/s of a 1000/s limit
		now := time.Duration(0)
		for range 20 {
			now += iv
			l.Usage(now, "k", 1000, used, 0)
			l.Tick(now)
		}
		steady := l.Position("k").Demand
		lowest := steady
		for range 10 { // a second whose usage is late
			now += iv
			if late {
				l.UsageLate()
			}
			l.Tick(now)
			lowest = min(lowest, l.Position("k").Demand)
		}
		if !late {
			if lowest > steady/8 {
				t.Errorf("without UsageLate, a second without usage left the estimate at %d of %d", lowest, steady)
			}
			continue
		}
		if lowest != steady {
			t.Errorf("the estimate moved from %d to %d while the usage was late", steady, lowest)
		}
		now += iv // the late second's usage arrives with the next interval's
		l.Usage(now, "k", 1000, 11*used, 0)
		l.Tick(now)
		rate := cfg.Units * 4 / 10
		if got := l.Position("k").Demand; got < steady*999/1000 || got > rate*1001/1000 {
			t.Errorf("after the late usage arrived: estimate %d, want from the steady %d to the rate %d", got, steady, rate)
		}
	}
}
