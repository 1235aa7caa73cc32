package ledger

import (
	"testing"
	"time"
)

// TestHeartbeat: with HeartbeatEvery, a Tick with nothing changed reports
// only once the heartbeat (bounded by the lease: Config.heartbeat) has
// passed since the last report, and a changed key is reported at the next
// Tick.
func TestHeartbeat(t *testing.T) {
	c := newCluster(t, 3)
	for i := 0; i < 4; i++ {
		c.exchange()
	}
	l := c.l[0]
	l.cfg.HeartbeatEvery = time.Second
	hb := l.cfg.heartbeat()
	if want := (time.Duration(float64(l.cfg.Lease)*(1-l.cfg.Rho)/(1+l.cfg.Rho)) - l.cfg.StoreTimeout - l.cfg.Interval) / 4; hb != want || hb <= l.cfg.Interval {
		t.Fatalf("heartbeat %v, want %v (above the interval %v)", hb, want, l.cfg.Interval)
	}
	for i := range c.l {
		c.l[i].cfg.HeartbeatEvery = l.cfg.HeartbeatEvery
	}
	last, seq := l.lastSent, l.rseq
	reports := 0
	for range 30 { // every region ticks and hears the others' reports
		c.exchange()
		if l.fenced {
			t.Fatal("fenced")
		}
		if l.rseq != seq {
			reports++
			if l.lastSent-last < hb || l.rseq != seq+1 {
				t.Fatalf("report %v after the last, heartbeat %v, with nothing changed", l.lastSent-last, hb)
			}
		} else if c.now-last >= hb {
			t.Fatalf("no report %v after the last (heartbeat %v)", c.now-last, hb)
		}
		last, seq = l.lastSent, l.rseq
	}
	if reports == 0 || reports == 30 {
		t.Fatalf("%d reports in 30 ticks", reports)
	}
	// A key with usage changes: reported at the next Tick.
	now := c.now + l.cfg.Interval
	l.Usage(now, "k2", 100, 5, 0)
	r := l.Tick(now).Report
	if r == nil || len(r.Keys) == 0 || r.Keys[0].Key != "k2" {
		t.Fatalf("a changed key was not reported at once: %+v", r)
	}
}
