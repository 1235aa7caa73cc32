package ledger

import (
	"fmt"
	"testing"
	"time"
)

// TestHeld: Held lists the keys whose last write is confirmed and not a
// Release record, with that write's version, units and time; Refreshed
// moves the time for that version only; a Release record, an unconfirmed
// write and a fenced ledger are not held.
func TestHeld(t *testing.T) {
	cfg := simConfig()
	l, err := New(cfg, "a", []RegionSpec{{"a", 1}, {"b", 1}}, Start{Inc: 1, RunID: "run"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	held := func() string {
		var s string
		l.Held(func(name string, v Version, units int64, at time.Duration) bool {
			s += fmt.Sprintf("%s@%d:%d:%v ", name, v.Seq, units, at)
			return true
		})
		return s
	}
	now := cfg.Interval
	l.Usage(now, "x", 100, 5, 0)
	l.Usage(now, "y", 100, 5, 0)
	ws := map[string]Write{}
	for _, w := range l.Tick(now).Writes {
		ws[w.Key] = w
	}
	x, y := ws["x"], ws["y"]
	if x.Key == "" || y.Key == "" || x.Release || y.Release {
		t.Fatalf("want records of x and y, got %+v", ws)
	}
	if got := held(); got != "" {
		t.Fatalf("held before any confirmation: %s", got)
	}
	l.ShareApplied(now, "x", x.Version)
	want := fmt.Sprintf("x@%d:%d:%v ", x.Version.Seq, x.Units, now)
	if got := held(); got != want {
		t.Fatalf("held %q, want %q (y unconfirmed)", got, want)
	}
	l.Refreshed("x", Version{x.Version.Inc, x.Version.Seq - 1}, time.Hour) // not its last write
	l.Refreshed("y", y.Version, time.Hour)                                 // not confirmed
	if got := held(); got != want {
		t.Fatalf("held %q after refreshes of other versions, want %q", got, want)
	}
	l.Refreshed("x", x.Version, time.Hour)
	if got, want := held(), fmt.Sprintf("x@%d:%d:1h0m0s ", x.Version.Seq, x.Units); got != want {
		t.Fatalf("held %q after x's refresh, want %q", got, want)
	}
	l.fenced = true
	if got := held(); got != "" {
		t.Fatalf("a fenced ledger holds %q", got)
	}
	l.fenced = false
	// No more usage: the keys go idle and are written as Release records.
	released := false
	for i := 0; i < 1000 && !released; i++ {
		now += cfg.Interval
		for _, w := range l.Tick(now).Writes {
			if w.Key == "x" && w.Release {
				l.ShareApplied(now, w.Key, w.Version)
				released = true
			}
		}
	}
	if !released {
		t.Fatal("x never written as a Release record")
	}
	if got := held(); got != "" {
		t.Fatalf("held %q after x's Release record, want nothing", got)
	}
}
