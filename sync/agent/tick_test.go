package agent

import (
	"testing"
	"time"

	"github.com/apportion/apportion/regional/usage"
)

// TestNextTick: at intervals of at least the enforcers' flush interval the
// loop ticks halfway between two flushes (usage.NextFlush), every tick
// after now and each interval holding as many flushes as its length in
// flush intervals; shorter intervals tick at their own multiples.
func TestNextTick(t *testing.T) {
	p := usage.DefaultInterval
	base := time.Date(2026, 12, 3, 15, 0, 0, 0, time.UTC)
	for _, interval := range []time.Duration{100 * time.Millisecond, 250 * time.Millisecond, time.Second, 150 * time.Millisecond, 20 * time.Millisecond} {
		now := base.Add(7 * time.Millisecond)
		prev := time.Time{}
		for i := 0; i < 40; i++ {
			next := nextTick(now, interval)
			if !next.After(now) {
				t.Fatalf("interval %v: nextTick(%v) = %v, not after it", interval, now, next)
			}
			if interval >= p {
				if off := next.Sub(next.Truncate(p)); off != p/2 {
					t.Fatalf("interval %v: tick %v is %v past a flush, want %v", interval, next, off, p/2)
				}
				if !prev.IsZero() {
					flushes := 0
					for f := usage.NextFlush(prev, p); f.Before(next); f = usage.NextFlush(f, p) {
						flushes++
					}
					if d := next.Sub(prev); flushes != int(d/p) || d < interval-p || d > interval+p {
						t.Fatalf("interval %v: %v to %v (%v) holds %d flushes", interval, prev, next, d, flushes)
					}
				}
			} else if next.Sub(next.Truncate(interval)) != 0 {
				t.Fatalf("interval %v: tick %v is not a multiple of it", interval, next)
			}
			prev = next
			now = next.Add(time.Duration(i%3) * time.Millisecond) // a tick's own time
		}
	}
}
