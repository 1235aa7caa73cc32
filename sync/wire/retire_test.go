package wire

import (
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
)

// TestMassRetirementFitsParts: the ledger's closures travel in the header
// that every part of a split report repeats. Two ledgers, 3,000 keys that
// all go idle at once, every report encoded as the agent encodes it under
// a NATS max_payload of 64 KiB (parts of 64 KiB, closures within a
// quarter of that, as sync/agent sets Config.MaxClosureBytes). Every
// report encodes, every key is forgotten by both, and every report
// decodes back to what was sent. Without the room (all 3,000 closures in
// one header, about 90 KB) the header alone outgrew a part and the
// region's reports stopped.
func TestMassRetirementFitsParts(t *testing.T) {
	const keys, part = 3000, 64 << 10
	cfg := ledger.DefaultConfig()
	cfg.Interval, cfg.Lease, cfg.Margin, cfg.StoreTimeout = 100*time.Millisecond, time.Second, 200*time.Millisecond, 50*time.Millisecond
	cfg.IdleAfter, cfg.FullEvery, cfg.Hysteresis, cfg.HalfLife, cfg.DemandTokens = 2*time.Second, 5, 0, 0, 0
	cfg.MaxClosureBytes = part / 4
	specs := []ledger.RegionSpec{{Name: "eu", Weight: 1}, {Name: "us", Weight: 1}}
	reg, err := ledger.NewRegistry(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	var now time.Duration
	ls := make([]*ledger.Ledger, 2)
	for i, sp := range specs {
		st, err := reg.Start(sp.Name)
		if err != nil {
			t.Fatal(err)
		}
		if ls[i], err = ledger.New(cfg, sp.Name, specs, st, now); err != nil {
			t.Fatal(err)
		}
	}
	names, err := NewRegions([]string{"eu", "us"})
	if err != nil {
		t.Fatal(err)
	}
	name := func(i int) string { return fmt.Sprintf("rl:{user:%06d}:orders", i) }
	var parts, mostCloses int
	// send encodes a report as the agent does, decodes every part and
	// delivers it to the other ledger; it returns the reports that the
	// receiver's confirmed writes produce.
	var send func(from int, r *ledger.Report)
	confirm := func(i int, out ledger.Output) {
		for _, w := range out.Writes {
			if o := ls[i].ShareApplied(now, w.Key, w.Version); o.Report != nil {
				send(i, o.Report)
			}
		}
	}
	send = func(from int, r *ledger.Report) {
		if r == nil {
			return
		}
		mostCloses = max(mostCloses, len(r.Closes))
		enc, err := EncodeSplit(Message{From: r.From, Rules: []RuleReport{{Rule: "orders", Regions: names, Report: *r}}}, part)
		if err != nil {
			t.Fatalf("%s's report of %d keys, %d closures: %v", r.From, len(r.Keys), len(r.Closes), err)
		}
		for _, b := range enc {
			parts++
			m, err := Decode(b, func(string) *Regions { return names })
			if err != nil {
				t.Fatal(err)
			}
			out, err := ls[1-from].Receive(now, m.Rules[0].Report)
			if err != nil {
				t.Fatalf("%s refuses a part of %s's report: %v", specs[1-from].Name, r.From, err)
			}
			confirm(1-from, out)
		}
	}
	round := func(use bool) {
		now += cfg.Interval
		for i, l := range ls {
			if use && i == 1 {
				for k := 0; k < keys; k++ {
					l.Usage(now, name(k), 100, 40, 0)
				}
			}
			out := l.Tick(now)
			confirm(i, out)
			send(i, out.Report)
		}
	}
	for r := 0; r < 20; r++ { // us wants every key: eu gives
		round(true)
	}
	if p := ls[0].Position(name(0)).Units; p >= ls[0].Position("never-used").Units {
		t.Fatalf("setup: eu gave nothing (%d)", p)
	}
	rounds := 0
	for ; rounds < 1000 && (len(ls[0].Keys()) > 0 || len(ls[1].Keys()) > 0 || mostCloses == 0); rounds++ {
		round(false)
	}
	if len(ls[0].Keys()) > 0 || len(ls[1].Keys()) > 0 {
		t.Fatalf("after %d rounds eu holds %d keys, us %d", rounds, len(ls[0].Keys()), len(ls[1].Keys()))
	}
	if mostCloses*(len(name(0))+24) < part/4/2 {
		t.Fatalf("at most %d closures in a report: the room was never used", mostCloses)
	}
	t.Logf("%d keys retired at once: forgotten in %d intervals, %d parts, at most %d closures in a report", keys, rounds, parts, mostCloses)
}
