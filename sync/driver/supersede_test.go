package driver

import (
	"slices"
	"testing"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

func keyReports(names ...string) []ledger.KeyReport {
	out := make([]ledger.KeyReport, len(names))
	for i, n := range names {
		out[i] = ledger.KeyReport{Key: n, Position: int64(i + 1)}
	}
	return out
}

func names(ks []ledger.KeyReport) []string {
	var out []string
	for _, k := range ks {
		out = append(out, k.Key)
	}
	return out
}

// TestSupersede: an earlier report of a rule loses the keys a later report
// of the same rule and incarnation carries, and goes when nothing is left
// that the later one does not carry (its closures); other rules and other
// incarnations are untouched, and the order stays.
func TestSupersede(t *testing.T) {
	c1 := ledger.Closure{Key: "k1", Region: "b", Inc: 1, Retire: 2}
	c2 := ledger.Closure{Key: "k2", Region: "b", Inc: 1, Retire: 1}
	rr := func(rule string, inc, seq uint64, closes []ledger.Closure, ks ...string) wire.RuleReport {
		return wire.RuleReport{Rule: rule, Report: ledger.Report{From: "a", Inc: inc, Seq: seq, Keys: keyReports(ks...), Closes: closes}}
	}
	type want struct {
		rule string
		seq  uint64
		keys []string
	}
	for _, tc := range []struct {
		name string
		in   []wire.RuleReport
		want []want
	}{
		{"one report per rule: untouched",
			[]wire.RuleReport{rr("r1", 1, 5, nil, "a", "b"), rr("r2", 1, 7, nil, "a")},
			[]want{{"r1", 5, []string{"a", "b"}}, {"r2", 7, []string{"a"}}}},
		{"a tick's report and its confirmations': the key goes once",
			[]wire.RuleReport{rr("r1", 1, 5, nil, "k"), rr("r1", 1, 6, nil, "k")},
			[]want{{"r1", 6, []string{"k"}}}},
		{"keys only the earlier has stay in it",
			[]wire.RuleReport{rr("r1", 1, 5, nil, "a", "k", "z"), rr("r2", 1, 3, nil, "k"), rr("r1", 1, 6, nil, "b", "k")},
			[]want{{"r1", 5, []string{"a", "z"}}, {"r2", 3, []string{"k"}}, {"r1", 6, []string{"b", "k"}}}},
		{"three reports: each cut by all the later ones",
			[]wire.RuleReport{rr("r1", 1, 5, nil, "a", "b", "c"), rr("r1", 1, 6, nil, "b"), rr("r1", 1, 7, nil, "c")},
			[]want{{"r1", 5, []string{"a"}}, {"r1", 6, []string{"b"}}, {"r1", 7, []string{"c"}}}},
		{"an emptied report with a closure the later one lacks stays",
			[]wire.RuleReport{rr("r1", 1, 5, []ledger.Closure{c1, c2}, "k"), rr("r1", 1, 6, []ledger.Closure{c2}, "k")},
			[]want{{"r1", 5, nil}, {"r1", 6, []string{"k"}}}},
		{"an emptied report whose closures the later one carries goes",
			[]wire.RuleReport{rr("r1", 1, 5, []ledger.Closure{c1}, "k"), rr("r1", 1, 6, []ledger.Closure{c1, c2}, "k")},
			[]want{{"r1", 6, []string{"k"}}}},
		{"another incarnation's report is not cut",
			[]wire.RuleReport{rr("r1", 1, 9, nil, "k"), rr("r1", 2, 1, nil, "k")},
			[]want{{"r1", 9, []string{"k"}}, {"r1", 1, []string{"k"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := supersede(tc.in)
			if len(got) != len(tc.want) {
				t.Fatalf("%d reports, want %d: %+v", len(got), len(tc.want), got)
			}
			for i, w := range tc.want {
				if got[i].Rule != w.rule || got[i].Report.Seq != w.seq || !slices.Equal(names(got[i].Report.Keys), w.keys) {
					t.Errorf("report %d: %s seq %d keys %v, want %s seq %d keys %v", i, got[i].Rule, got[i].Report.Seq, names(got[i].Report.Keys), w.rule, w.seq, w.keys)
				}
			}
		})
	}
}

// once fails if a message carries a key of a rule twice.
func once(t *testing.T, msgs []wire.Message) {
	t.Helper()
	for i, m := range msgs {
		seen := map[[2]string]bool{}
		for _, rr := range m.Rules {
			for _, k := range rr.Report.Keys {
				id := [2]string{rr.Rule, k.Key}
				if seen[id] {
					t.Fatalf("message %d reports %s's key %s twice", i, rr.Rule, k.Key)
				}
				seen[id] = true
			}
		}
	}
}

// exchange runs driver d (region a, rule r1) against a peer ledger of
// region b for n ticks from tick from, with demand on both sides that
// moves k's shares: b's messages reach a each tick, a's reach b. A store
// answering later is answered (confirm) after the tick, the check
// (before) run first.
func exchange(t *testing.T, d *Driver, p *fakePorts, from, n int, before, confirm func(i, nw, nm int)) {
	t.Helper()
	cfg, peer := peerB(t)
	var toA []wire.RuleReport
	out := peerOutput(peer, &toA)
	read := 0
	for i := from; i < from+n; i++ {
		now := time.Duration(i) * cfg.Interval
		p.now = now
		for _, m := range p.msgs[read:] {
			for _, rr := range m.Rules {
				o, _ := peer.Receive(now, rr.Report)
				out(now, o)
			}
		}
		read = len(p.msgs)
		if len(toA) > 0 {
			d.Receive(wire.Message{From: "b", Rules: toA})
			toA = nil
			if confirm != nil && len(p.writes) > 0 {
				confirm(i, len(p.writes), len(p.msgs))
			}
		}
		// b's demand swings between 5 and 50 a tick, a's the other way.
		ba, aa := int64(1), int64(5)
		if i/20%2 == 1 {
			ba, aa = 5, 1
		}
		peer.Usage(now, "k", 10, ba, 0)
		out(now, peer.Tick(now))
		nw, nm := len(p.writes), len(p.msgs)
		d.Tick([]Usage{{Rule: "r1", Key: "k", Rate: 10, Admitted: aa}})
		if before != nil {
			before(i, nw, nm)
		}
		if confirm != nil && len(p.writes) > nw {
			confirm(i, nw, nm)
		}
	}
}

// TestReportsWaitForTheStore: with a store that answers later, a tick's
// report waits for the answer to the tick's writes and leaves with the
// report of their confirmations in one message, each key once, as with a
// store that answers in Write; with no answer, the next tick sends it.
func TestReportsWaitForTheStore(t *testing.T) {
	// A store that answers in Write: each key once in every message.
	d, p, _, _ := setup(t, true)
	exchange(t, d, p, 1, 200, nil, nil)
	if len(p.msgs) == 0 {
		t.Fatal("no message in 200 ticks")
	}
	once(t, p.msgs)

	// A store that answers later.
	d, p, r, _ := setup(t, false)
	answered := 0
	confirm := func() {
		var ap Applied
		for _, w := range p.writes[answered:] {
			for _, x := range w["r1"] {
				ap.Confirmations = append(ap.Confirmations, ledger.Confirmation{Key: x.Key, Version: x.Version})
			}
		}
		answered = len(p.writes)
		d.Confirmed(r, ap)
	}
	confirm() // the boot marker's
	waited, keyed := 0, 0
	exchange(t, d, p, 1, 200, func(i, nw, nm int) {
		if len(p.writes) > nw && len(p.msgs) != nm {
			t.Fatalf("tick %d: a message left before the store answered the tick's writes", i)
		}
	}, func(i, nw, nm int) {
		p.now += 2 * time.Millisecond
		for range len(p.writes) - answered {
			confirm()
		}
		if len(p.msgs) == nm {
			return
		}
		waited++
		for _, rr := range p.msgs[nm].Rules {
			for _, k := range rr.Report.Keys {
				if k.Key == "k" && len(k.Gave)+len(k.Applied) > 0 {
					keyed++
				}
			}
		}
	})
	if waited == 0 || keyed == 0 {
		t.Fatalf("%d messages left after a store's answer, %d with k's counters: nothing tested", waited, keyed)
	}
	once(t, p.msgs)

	// No answer: the report leaves at the next tick.
	nm := len(p.msgs)
	exchange(t, d, p, 201, 5, nil, nil)
	if len(p.msgs) == nm {
		t.Fatal("with the store silent, no report left in 5 ticks")
	}
}
