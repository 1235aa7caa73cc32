package driver

import (
	"slices"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
)

// TestWitnessTake: the driver feeds what it learns of the witness keys to
// every ledger, and to one started later; a silent peer's key is asked to
// be taken once while a take is in flight, whichever rule asks; a take
// that succeeded freezes the peer in the ledgers that asked (their
// contributions go to the registry); WitnessLost stops the renewals
// keeping the lease of the ledgers alive then.
func TestWitnessTake(t *testing.T) {
	cfg := ledger.DefaultConfig()
	cfg.WitnessLease = 3 * time.Second
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	reg, err := ledger.NewRegistry(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Start("b"); err != nil { // b's first life exists before a's: a may freeze it by silence
		t.Fatal(err)
	}
	p := &fakePorts{t: t, sync: true}
	d := New("a", p)
	r1, r2 := d.Add("r1"), d.Add("r2")
	d.WitnessRenewed(0)
	d.WitnessSeen("b", 5)
	d.Started(r1, newLedger(t, "a", reg, cfg, specs, 0))
	p.now = time.Second
	d.WitnessSeen("b", 5) // the same revision: still first seen at 0
	d.Started(r2, newLedger(t, "a", reg, cfg, specs, p.now))
	wait := cfg.WitnessReclaimAfter()
	for p.now = 2 * time.Second; p.now < wait+3*time.Second; p.now += cfg.Interval {
		d.WitnessRenewed(p.now) // this region reaches etcd; b says nothing
		d.Tick(nil)
		if len(p.takes) > 0 && p.now < wait {
			t.Fatalf("take asked at %v, before the wait %v", p.now, wait)
		}
	}
	if !slices.Equal(p.takes, []string{"b@5"}) {
		t.Fatalf("takes %v, want one take of b's key at revision 5", p.takes)
	}
	if len(p.fenced) != 0 {
		t.Fatalf("fenced %v while the witness was renewed", p.fenced)
	}
	d.Taken("b", 5, true)
	if p.contribs == 0 {
		t.Fatal("no contribution to b's reclaim after the take")
	}
	// r1 froze b (its first incarnation), and so did r2, whose own wait
	// (from its start, 1 s later) had passed too: both rules' reports
	// acknowledge b/1 as frozen.
	p.msgs = nil
	for range 20 { // a heartbeat's time: a report of each rule
		p.now += cfg.Interval
		d.WitnessRenewed(p.now)
		d.Tick(nil)
	}
	frozen := map[string]bool{}
	for _, m := range p.msgs {
		for _, rr := range m.Rules {
			for _, ack := range rr.Report.Acks {
				frozen[rr.Rule] = frozen[rr.Rule] || ack.Region == "b" && ack.Inc == 1 && ack.Frozen
			}
		}
	}
	if !frozen["r1"] || !frozen["r2"] {
		t.Fatalf("b/1 acknowledged as frozen by %v, want r1 and r2", frozen)
	}
	// The key lost: renewals keep no ledger alive then. r1's incarnation
	// (a/1, holding its initial part above the floor) fences once its ack
	// deadline (nobody acknowledges it) has passed; r2's (a/2, a later
	// one: its floor only) has nothing to give up and carries on.
	d.WitnessLost()
	end := p.now + cfg.WitnessLease
	for ; p.now < end && len(p.fenced) == 0; p.now += cfg.Interval {
		d.WitnessRenewed(p.now)
		d.Tick(nil)
	}
	if !slices.Equal(p.fenced, []ledger.Incarnation{{Region: "a", Inc: 1}}) || r1.Led != nil || r2.Led == nil {
		t.Fatalf("fenced %v after the key was lost, want a/1 (r1's) only", p.fenced)
	}
}
