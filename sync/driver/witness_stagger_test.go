package driver

import (
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
)

// TestWitnessTakeStaggeredRules: two rules of one agent whose last
// reports from the silent peer b arrived 300 ms apart (each rule reports
// at its own heartbeat phase). The rule that heard b first asks for the
// take, which succeeds a few ms later (the agent's etcd round trip); the
// other rule's own silence is then 300 ms short of the wait, and it must
// freeze b once it is not (within a second of the take). Before, nothing
// remembered the take: it asked again only once the take's own revision of
// the key had been seen for a whole wait, a second take 62 s later, and a
// region whose agent stopped kept that rule's share stranded for that long
// (found with SIGSTOP and kill -9 on the real binaries).
func TestWitnessTakeStaggeredRules(t *testing.T) {
	cfg := ledger.DefaultConfig()
	cfg.WitnessLease = time.Minute
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	p := &fakePorts{t: t, sync: true}
	d := New("a", p)
	r1, r2 := d.Add("r1"), d.Add("r2")
	start := func(now time.Duration) *ledger.Ledger {
		reg, err := ledger.NewRegistry(cfg, specs)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := reg.Start("b"); err != nil {
			t.Fatal(err)
		}
		return newLedger(t, "a", reg, cfg, specs, now)
	}
	d.WitnessRenewed(0)
	d.WitnessSeen("b", 5)
	// A ledger's "heard" of b starts at its start (b is Live): r1 "heard"
	// b at 0, r2 at 300 ms, as two rules whose last reports from b came
	// in two heartbeats 300 ms apart.
	d.Started(r1, start(0))
	p.now = 300 * time.Millisecond
	d.Started(r2, start(p.now))
	wait := cfg.WitnessReclaimAfter()
	var firstTake, secondTake, r2Froze time.Duration
	taken := 0
	for p.now = 400 * time.Millisecond; p.now < 3*wait; p.now += cfg.Interval {
		d.WitnessRenewed(p.now)
		if taken > 0 {
			d.WitnessSeen("b", int64(5+taken)) // the poll sees the take's revision
		} else {
			d.WitnessSeen("b", 5)
		}
		n := len(p.takes)
		c0 := len(p.contribRules)
		d.Tick(nil)
		for _, r := range p.contribRules[c0:] {
			t.Logf("tick at %v: %s froze b and contributed", p.now, r)
			if r == "r2" && r2Froze == 0 {
				r2Froze = p.now
			}
		}
		if len(p.takes) > n {
			if taken == 0 {
				firstTake = p.now
			} else {
				secondTake = p.now
			}
			rev := int64(5 + taken)
			p.now += 5 * time.Millisecond // the etcd round trip
			before := len(p.contribRules)
			d.Taken("b", rev, true)
			taken++
			for _, r := range p.contribRules[before:] {
				t.Logf("take #%d at %v (rev %d): %s froze b and contributed", taken, p.now, rev, r)
				if r == "r2" && r2Froze == 0 {
					r2Froze = p.now
				}
			}
		}
		if r2Froze > 0 {
			break
		}
	}
	t.Logf("wait %v; first take %v; second take %v; r2 froze b at %v", wait, firstTake, secondTake, r2Froze)
	if r2Froze == 0 || r2Froze > firstTake+time.Second {
		t.Errorf("r2 froze b %v after the first take (a second take %v after the first): its reclaim stalled a whole wait", r2Froze-firstTake, secondTake-firstTake)
	}
}
