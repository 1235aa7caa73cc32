package driver

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// fakePorts records every port call; sync confirms writes in Write.
type fakePorts struct {
	t        *testing.T
	now      time.Duration
	sync     bool
	writes   []map[string][]ledger.Write
	msgs     []wire.Message
	contribs int
	starts   []string
	fenced   []ledger.Incarnation
	rejected []string
	// refuse: a write of the key below units is refused as a window store
	// does (Need units, Until holdFor); its confirmation still comes.
	refuse       map[string]int64
	holdFor      time.Duration
	takes        []string // region@rev of every Take
	contribRules []string // rule of every Contribute
}

func (f *fakePorts) Now() time.Duration { return f.now }

func (f *fakePorts) Write(ws map[*Rule][]ledger.Write) map[*Rule]Applied {
	rec := map[string][]ledger.Write{}
	out := map[*Rule]Applied{}
	for r, w := range ws {
		rec[r.ID] = w
		ap := out[r]
		for _, x := range w {
			ap.Confirmations = append(ap.Confirmations, ledger.Confirmation{Key: x.Key, Version: x.Version})
			if need, ok := f.refuse[x.Key]; ok && x.Units < need {
				ap.Refused = append(ap.Refused, Refusal{Key: x.Key, Need: need, Until: f.holdFor})
			}
		}
		out[r] = ap
	}
	f.writes = append(f.writes, rec)
	if !f.sync {
		return nil
	}
	return out
}

// Publish keeps a copy of m: a report built a part at a time reuses a
// part's slices for the next (Ports.Publish).
func (f *fakePorts) Publish(m wire.Message) {
	m.Rules = slices.Clone(m.Rules)
	for i := range m.Rules {
		ks := slices.Clone(m.Rules[i].Report.Keys)
		for j := range ks {
			ks[j].Gave, ks[j].Applied = slices.Clone(ks[j].Gave), slices.Clone(ks[j].Applied)
		}
		m.Rules[i].Report.Keys = ks
	}
	f.msgs = append(f.msgs, m)
}

func (f *fakePorts) Contribute(r *Rule, cs []ledger.Contribution) {
	f.contribs++
	f.contribRules = append(f.contribRules, r.ID)
}
func (f *fakePorts) Close(r *Rule, by ledger.Incarnation) {}
func (f *fakePorts) Start(r *Rule)                        { f.starts = append(f.starts, r.ID) }
func (f *fakePorts) Fenced(r *Rule, inc ledger.Incarnation, _ ledger.Version) {
	f.fenced = append(f.fenced, inc)
}
func (f *fakePorts) Rejected(reason, peer, rule string, err error) {
	f.rejected = append(f.rejected, reason)
}
func (f *fakePorts) Reclaimed(r *Rule, rec ledger.Record) {}
func (f *fakePorts) Take(region string, rev int64) {
	f.takes = append(f.takes, fmt.Sprintf("%s@%d", region, rev))
}

func newLedger(t *testing.T, self string, reg *ledger.Registry, cfg ledger.Config, specs []ledger.RegionSpec, now time.Duration) *ledger.Ledger {
	t.Helper()
	st, err := reg.Start(self)
	if err != nil {
		t.Fatal(err)
	}
	st.RunID = "run1"
	led, err := ledger.New(cfg, self, specs, st, now)
	if err != nil {
		t.Fatal(err)
	}
	return led
}

func setup(t *testing.T, sync bool, adjust ...func(*ledger.Config)) (*Driver, *fakePorts, *Rule, *ledger.Ledger) {
	cfg := ledger.DefaultConfig()
	for _, f := range adjust {
		f(&cfg)
	}
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	reg, err := ledger.NewRegistry(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	p := &fakePorts{t: t, sync: sync}
	d := New("a", p)
	r := d.Add("r1")
	if d.Add("r1") != r {
		t.Fatal("Add of a present rule made a new one")
	}
	d.Tick(nil)
	if len(p.starts) != 1 || p.starts[0] != "r1" {
		t.Fatalf("a rule without a ledger: starts %v, want [r1]", p.starts)
	}
	led := newLedger(t, "a", reg, cfg, specs, 0)
	if !d.Started(r, led) {
		t.Fatal("Started refused the current rule")
	}
	if len(p.writes) != 1 || len(p.writes[0]["r1"]) == 0 {
		t.Fatalf("Started wrote %v, want the boot marker in one batch at once", p.writes)
	}
	return d, p, r, led
}

// TestFlushSynchronous: the start writes the marker, and a store that
// confirms in Write gets the confirmation fed back in the same flush, so
// the first report leaves at once (the Tick's report is built when the
// batch leaves: ledger.DeferReports); a tick's writes are confirmed in its
// flush too, and its reports leave in one message from the region.
func TestFlushSynchronous(t *testing.T) {
	d, p, r, _ := setup(t, true)
	if len(p.msgs) != 1 || len(p.msgs[0].Rules) != 1 || p.msgs[0].Rules[0].Report.Seq != 1 {
		t.Fatalf("published %+v at the start, want the first report (seq 1) once the marker is confirmed", p.msgs)
	}
	p.msgs = nil
	p.now = 100 * time.Millisecond
	d.Tick([]Usage{{Rule: "r1", Key: "k", Rate: 10, Admitted: 5}, {Rule: "nope", Key: "k", Rate: 10, Admitted: 5}})
	if len(p.writes) == 0 || len(p.writes[0]["r1"]) == 0 {
		t.Fatalf("no store writes after the first tick: %v", p.writes)
	}
	if len(p.msgs) != 1 || p.msgs[0].From != "a" || len(p.msgs[0].Rules) == 0 || p.msgs[0].Rules[0].Rule != "r1" {
		t.Fatalf("published %+v, want one message from a with r1's report", p.msgs)
	}
	if rs := p.msgs[0].Rules; len(rs[len(rs)-1].Report.Keys) != 1 || rs[len(rs)-1].Report.Keys[0].Key != "k" {
		t.Fatalf("the tick's message %+v does not report k", rs)
	}
	// The report names the rule's regions as the ledger lists them, and
	// encodes (wire format 3 needs the list).
	if g := p.msgs[0].Rules[0].Regions; g == nil || !slices.Equal(g.Names(), []string{"a", "b"}) {
		t.Errorf("report's region list %v, want [a b]", g)
	}
	if _, err := wire.Encode(p.msgs[0]); err != nil {
		t.Errorf("published message does not encode: %v", err)
	}
	if !r.Led.Position("k").Active {
		t.Error("a key with usage is not coordinated")
	}
}

// TestConfirmedLater: a store that confirms later gets nothing fed back
// from Write; Confirmed feeds and flushes; confirmations for a removed rule
// are ignored.
func TestConfirmedLater(t *testing.T) {
	d, p, r, _ := setup(t, false)
	p.now = 100 * time.Millisecond
	d.Tick([]Usage{{Rule: "r1", Key: "k", Rate: 10, Admitted: 5}})
	if len(p.writes) != 2 {
		t.Fatalf("%d write batches after the boot marker's, want 1 (no confirmation, no second round)", len(p.writes)-1)
	}
	var cs Applied
	for _, b := range p.writes {
		for _, w := range b["r1"] {
			cs.Confirmations = append(cs.Confirmations, ledger.Confirmation{Key: w.Key, Version: w.Version})
		}
	}
	p.now = 110 * time.Millisecond
	d.Confirmed(r, cs)
	d.Remove("r1")
	n := len(p.writes) + len(p.msgs)
	d.Confirmed(r, cs)
	d.Contributed(r, []ledger.Record{{}})
	d.Records(map[string]RuleRecords{"r1": {Revision: 9}})
	if len(p.writes)+len(p.msgs) != n {
		t.Error("a removed rule's late results reached the ports")
	}
	if d.Started(r, r.Led) {
		t.Error("Started accepted a removed rule")
	}
}

// TestReceiveRejects: unknown rules, replayed reports and reports of
// another region list of the rule are rejected with their reasons before
// the ledger sees them; an accepted report says so. The messages travel
// encoded and are read with the driver's Lists, as the agent reads them.
func TestReceiveRejects(t *testing.T) {
	d, p, _, _ := setup(t, true)
	cfg := ledger.DefaultConfig()
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	reg, _ := ledger.NewRegistry(cfg, specs)
	reg.Start("a")
	peer := newLedger(t, "b", reg, cfg, specs, 0)
	var out ledger.Output
	for i := 1; out.Report == nil && i < 10; i++ {
		out = peer.Tick(time.Duration(i) * 100 * time.Millisecond)
		for _, w := range out.Writes {
			if o := peer.ShareApplied(time.Duration(i)*100*time.Millisecond, w.Key, w.Version); o.Report != nil {
				out = o
			}
		}
	}
	if out.Report == nil {
		t.Fatal("peer made no report")
	}
	ab, _ := wire.NewRegions([]string{"a", "b"})
	abc, _ := wire.NewRegions([]string{"a", "b", "c"})
	travel := func(m wire.Message) wire.Message {
		t.Helper()
		b, err := wire.Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := wire.Decode(b, d.Lists())
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	m := wire.Message{From: "b", Rules: []wire.RuleReport{{Rule: "r1", Regions: ab, Report: *out.Report}, {Rule: "other", Regions: ab, Report: *out.Report}}}
	if !d.Receive(travel(m)) {
		t.Errorf("a peer's first report was not accepted (rejected %v)", p.rejected)
	}
	if d.Receive(travel(m)) {
		t.Error("a replayed report was accepted")
	}
	next := *out.Report
	next.Seq++
	if d.Receive(travel(wire.Message{From: "b", Rules: []wire.RuleReport{{Rule: "r1", Regions: abc, Report: next}}})) {
		t.Error("a report of another region list was accepted")
	}
	want := []string{ReasonUnknownRule, ReasonReplayed, ReasonUnknownRule, ReasonRegions}
	if len(p.rejected) != len(want) {
		t.Fatalf("rejected %v, want %v", p.rejected, want)
	}
	for i := range want {
		if p.rejected[i] != want[i] {
			t.Fatalf("rejected %v, want %v", p.rejected, want)
		}
	}
}

func TestRejectReason(t *testing.T) {
	for err, want := range map[error]string{
		ledger.ErrUnknownRegion: ReasonUnknownReg, ledger.ErrBackwards: ReasonBackwards,
		ledger.ErrImplausible: ReasonImplausible, errors.New("x"): ReasonOther,
		wire.ErrRegions: ReasonRegions, wire.ErrUnknownRule: ReasonUnknownRule,
	} {
		if got := RejectReason(err); got != want {
			t.Errorf("RejectReason(%v) = %s, want %s", err, got, want)
		}
	}
}

// TestHoldBeforeConfirmations: a window store refuses every lowering of k
// below its base (the key has used that much of its window). The driver
// hands the refusal to Ledger.Hold before it feeds the flush's
// confirmations, so the confirmation of the refused write (which this fake
// store even confirms at the new version) never lowers a's position below
// the hold.
func TestHoldBeforeConfirmations(t *testing.T) {
	d, p, r, led := setup(t, true)
	cfg, peer := peerB(t)
	need := led.Base()
	p.refuse, p.holdFor = map[string]int64{"k": need}, time.Minute
	var toA []wire.RuleReport
	out := peerOutput(peer, &toA)
	refusals := 0
	for i := 1; i <= 300; i++ {
		now := time.Duration(i) * cfg.Interval
		p.now = now
		for _, m := range p.msgs {
			for _, rr := range m.Rules {
				o, _ := peer.Receive(now, rr.Report)
				out(now, o)
			}
		}
		p.msgs = nil
		if len(toA) > 0 {
			d.Receive(wire.Message{From: "b", Rules: toA})
			toA = nil
		}
		peer.Usage(now, "k", 10, 1, 4) // b's demand: 50/s of a 10/s limit
		out(now, peer.Tick(now))
		p.writes = nil
		d.Tick([]Usage{{Rule: "r1", Key: "k", Rate: 10, Admitted: 1}})
		for _, b := range p.writes {
			for _, w := range b["r1"] {
				if w.Key == "k" && w.Units < need {
					refusals++
				}
			}
		}
		if u := r.Led.Position("k").Units; u < need {
			t.Fatalf("tick %d: a's position %d is below the hold %d: a refused gift was confirmed", i, u, need)
		}
	}
	if refusals == 0 {
		t.Fatal("a never tried to lower k: the refusal went untested")
	}
}

// peerOutput returns what a peer ledger does with its outputs: its
// reports are queued in to (rule r1), its writes confirmed at once.
func peerOutput(peer *ledger.Ledger, to *[]wire.RuleReport) func(now time.Duration, o ledger.Output) {
	return func(now time.Duration, o ledger.Output) {
		for o.Report != nil || len(o.Writes) > 0 {
			if o.Report != nil {
				*to = append(*to, wire.RuleReport{Rule: "r1", Report: *o.Report})
			}
			var cs []ledger.Confirmation
			for _, w := range o.Writes {
				cs = append(cs, ledger.Confirmation{Key: w.Key, Version: w.Version})
			}
			if len(cs) == 0 {
				break
			}
			o = peer.SharesApplied(now, cs)
		}
	}
}

// peerB returns the default config and a ledger of region b of rule r1
// (regions a and b), a's incarnation started in the same registry.
func peerB(t *testing.T) (ledger.Config, *ledger.Ledger) {
	t.Helper()
	cfg := ledger.DefaultConfig()
	specs := []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}
	reg, err := ledger.NewRegistry(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Start("a"); err != nil {
		t.Fatal(err)
	}
	peer := newLedger(t, "b", reg, cfg, specs, 0)
	return cfg, peer
}
