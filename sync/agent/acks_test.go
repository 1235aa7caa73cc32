package agent

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
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
