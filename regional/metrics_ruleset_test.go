package regional

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// series counts the series of m's checks counter.
func series(m *Metrics) int {
	ch := make(chan prometheus.Metric, 1024)
	go func() { m.checks.Collect(ch); close(ch) }()
	n := 0
	for range ch {
		n++
	}
	return n
}

// ruleIDs returns n rule ids from prefix.
func ruleIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%06d", prefix, i)
	}
	return ids
}

// A new rule set creates every decision's series of its rules and deletes
// those of the rules it no longer has, and only those.
func TestRuleSetSeries(t *testing.T) {
	m := NewMetrics(prometheus.NewRegistry(), "r")
	m.ruleSet(ruleIDs("a", 3))
	if n := series(m); n != 3*len(ruleDecisions) {
		t.Fatalf("%d series for 3 rules, want %d", n, 3*len(ruleDecisions))
	}
	m.ruleSet(append(ruleIDs("a", 1), "b"))
	if n := series(m); n != 2*len(ruleDecisions) {
		t.Fatalf("%d series after a-000001 and a-000002 left and b came, want %d", n, 2*len(ruleDecisions))
	}
	m.ruleSet(nil)
	if n := series(m); n != 0 {
		t.Fatalf("%d series with no rules, want 0", n)
	}
}

// BenchmarkRuleSetRemoveAll: a rule set of n rules replaced by an empty one
// (every rule deleted at once from etcd).
func BenchmarkRuleSetRemoveAll(b *testing.B) {
	for _, n := range []int{1_000, 5_000} {
		b.Run(fmt.Sprintf("rules=%d", n), func(b *testing.B) {
			ids := ruleIDs("r", n)
			m := NewMetrics(prometheus.NewRegistry(), "r")
			for b.Loop() {
				b.StopTimer()
				m.ruleSet(ids)
				b.StartTimer()
				m.ruleSet(nil)
			}
		})
	}
}
