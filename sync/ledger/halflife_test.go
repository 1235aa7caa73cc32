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
