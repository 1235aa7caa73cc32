package ledger

import "testing"

// TestDeferReports: with DeferReports a Tick and a confirmation build no
// report but owe one: OwedReport builds it (once) with the state of that
// moment, and a full report owed (every FullEvery-th, or a resync) stays
// full when built later.
func TestDeferReports(t *testing.T) {
	c := newCluster(t, 3)
	for range 4 {
		c.exchange()
	}
	l := c.l[0]
	l.DeferReports()
	c.now += c.cfg.Interval
	l.Usage(c.now, "k", 100, 50, 0)
	seq := l.rseq
	out := l.Tick(c.now)
	if out.Report != nil || l.rseq != seq {
		t.Fatalf("a deferring Tick built report %+v (seq %d -> %d)", out.Report, seq, l.rseq)
	}
	// Built when asked: with the key the Tick left dirty, then not again.
	r := l.OwedReport(c.now)
	if r == nil || r.Seq != seq+1 || len(r.Keys) != 1 || r.Keys[0].Key != "k" {
		t.Fatalf("owed report %+v, want seq %d with k", r, seq+1)
	}
	if again := l.OwedReport(c.now); again != nil {
		t.Fatalf("a second owed report %+v", again)
	}
	// The confirmations of the Tick's writes owe theirs too: one report.
	c.now += c.cfg.Interval
	l.Usage(c.now, "k", 100, 5, 0)
	out = l.Tick(c.now)
	if out.Report != nil || len(out.Writes) == 0 {
		t.Fatalf("tick: report %v, %d writes; want no report and writes", out.Report != nil, len(out.Writes))
	}
	seq = l.rseq
	if conf := c.confirm(0, out); conf.Report != nil {
		t.Fatalf("a deferring ledger's confirmation built report %+v", conf.Report)
	}
	if r := l.OwedReport(c.now); r == nil || r.Seq != seq+1 || l.OwedReport(c.now) != nil {
		t.Fatalf("after a tick and its confirmations: owed report %+v, want one, seq %d", r, seq+1)
	}
	// A full report owed is built full: every active key, changed or not.
	l.Usage(c.now, "other", 100, 5, 0)
	for i := 0; ; i++ {
		if i > 2*c.cfg.FullEvery {
			t.Fatal("no full report owed within 2 FullEvery ticks")
		}
		c.now += c.cfg.Interval
		l.Usage(c.now, "k", 100, 5, 0)
		c.confirm(0, l.Tick(c.now))
		if !l.owedFull {
			l.OwedReport(c.now)
			continue
		}
		r := l.OwedReport(c.now)
		if r == nil || len(r.Keys) < 2 {
			t.Fatalf("full report owed, built %+v: want every active key", r)
		}
		break
	}
}
