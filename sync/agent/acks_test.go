package agent

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// TestPeerUnacknowledged: b's --report-peer-keys lacks a's key, so b
// refuses every report of a (unknown_key, counted on b's side only) while
// a accepts b's and c's. a's apportion_sync_peer_unacknowledged is 1 for b
// and 0 for c, and a WARN names b; c, which reads a, is not flagged, nor
// is any peer by b or c. Once b's agent runs with a's key, a's gauge for b
// returns to 0.
func TestPeerUnacknowledged(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	logs := map[string]logRecorder{"a": newLogRecorder(), "b": newLogRecorder(), "c": newLogRecorder()}
	deafB := func(c *Config) {
		c.Logger = slog.New(logs[c.Region]).With("region", c.Region)
		if c.Region == "b" {
			c.PeerKeys = testPeerKeys(t, "b", "c")
		}
	}
	s := memStack(t, []string{"a", "b", "c"}, deafB)
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	a, b := s.regions["a"], s.regions["b"]
	gauge := func(r *testRegion, peer string) float64 {
		return metricValue(r.agent.m.unacked.WithLabelValues(peer))
	}
	testutil.WaitFor(t, 20*time.Second, "a to flag b as not acknowledging it", func() bool {
		return gauge(a, "b") == 1
	})
	if g := gauge(a, "c"); g != 0 {
		t.Errorf("a flags c, which reads a's reports: %v", g)
	}
	if age := metricValue(a.agent.m.ackAge.WithLabelValues("c")); age > 2 {
		t.Errorf("a's apportion_sync_peer_ack_age_seconds for c, a healthy peer: %v, want under 2", age)
	}
	for _, r := range []*testRegion{b, s.regions["c"]} {
		for _, p := range []string{"a", "b", "c"} {
			if p != r.name && gauge(r, p) != 0 {
				t.Errorf("%s flags %s", r.name, p)
			}
		}
	}
	if l := logs["a"].find("acknowledges none of this agent's reports", map[string]string{"peer": "b", "level": "WARN"}); len(l) == 0 {
		t.Error("no WARN naming b in a's log")
	}
	if l := logs["a"].find("acknowledges none of this agent's reports", map[string]string{"peer": "c"}); len(l) != 0 {
		t.Errorf("a's log names c: %v", l[0])
	}

	// b learns a's key: its agent restarts with it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.agent.Close(ctx); err != nil {
		t.Fatal(err)
	}
	b.start(t, s.etcd, func(c *Config) { c.Logger = slog.New(logs["b"]).With("region", "b") })
	testutil.WaitFor(t, 20*time.Second, "a's gauge for b back at 0 once b reads a", func() bool {
		return gauge(a, "b") == 0
	})
}

// TestAckAge: apportion_sync_peer_ack_age_seconds is the age of the
// oldest report of ours a peer has not acknowledged. On a healthy link
// (each report acknowledged in the peer's next one) it stays under a
// second; behind a link slower than the reports (an explorer: a 20 KB/s
// gateway, every report arriving in order and ever later, nothing else
// showing it) the peer still acknowledges a newer report every time, and
// the age grows with the backlog. What the agent keeps is bounded: a
// rule's reports acknowledged by every peer go, and at most maxPubs stay.
func TestAckAge(t *testing.T) {
	const rule, iv = "orders", 100 * time.Millisecond
	t0 := time.Unix(1_000_000, 0)
	ack := func(tr *ackTrack, at time.Time, peer string, seq uint64) {
		tr.heard(at, peer, "a", wire.Message{From: peer, Rules: []wire.RuleReport{{Rule: rule,
			Report: ledger.Report{From: peer, Inc: 1, Acks: []ledger.Ack{{Region: "a", Inc: 1, Seq: seq}}}}}})
	}

	// Healthy: each report acknowledged by both peers a little later.
	var tr ackTrack
	for seq := uint64(1); seq <= 100; seq++ {
		at := t0.Add(time.Duration(seq) * iv)
		tr.sentReport(at, rule, 1, seq)
		tr.sentReport(at, rule, 1, seq) // a second part: one report
		if seq > 2 {
			ack(&tr, at.Add(30*time.Millisecond), "b", seq-2)
			ack(&tr, at.Add(40*time.Millisecond), "c", seq-1)
		}
		for _, p := range []string{"b", "c"} {
			if age := tr.ackAge(at.Add(50*time.Millisecond), p); age > time.Second {
				t.Fatalf("healthy link: %s's acknowledgement age %v at report %d", p, age, seq)
			}
		}
	}
	if n := len(tr.pubs[rule]); n > 3 {
		t.Errorf("%d reports kept on a healthy link, want the few not acknowledged yet", n)
	}

	// Behind a slow link: c acknowledges a newer report every 1.85 s,
	// each published ever longer ago (the backlog grows by 0.9 s a second).
	tr = ackTrack{}
	var lastAge time.Duration
	for i := 1; i <= 300; i++ { // 30 s of reports
		at := t0.Add(time.Duration(i) * iv)
		tr.sentReport(at, rule, 1, uint64(i))
		if i%18 == 0 { // every 1.8 s, a report published at a tenth of the time so far
			ack(&tr, at, "c", uint64(i/10))
			age := tr.ackAge(at, "c")
			if age < lastAge {
				t.Fatalf("the age fell from %v to %v with the backlog growing", lastAge, age)
			}
			lastAge = age
		}
	}
	if lastAge < 20*time.Second {
		t.Errorf("behind the slow link the acknowledgement age is %v after 30 s, want the backlog's (about 27 s)", lastAge)
	}
	if n := len(tr.pubs[rule]); n > maxPubs {
		t.Errorf("%d reports kept, want at most %d", n, maxPubs)
	}

	// A peer that acknowledges nothing more: at most maxPubs kept, and
	// none once it has been silent for pubHorizon.
	tr = ackTrack{}
	tr.sentReport(t0, rule, 1, 1)
	ack(&tr, t0, "b", 1)
	for i := 2; i <= 2*maxPubs; i++ {
		tr.sentReport(t0.Add(time.Duration(i)*iv), rule, 1, uint64(i))
	}
	if n := len(tr.pubs[rule]); n != maxPubs {
		t.Errorf("%d reports kept for a peer that stopped acknowledging, want %d", n, maxPubs)
	}
	tr.trim(t0.Add(2*maxPubs*iv+pubHorizon+time.Second), rule)
	if n := len(tr.pubs[rule]); n != 0 {
		t.Errorf("%d reports kept after pubHorizon, want 0", n)
	}
}
