package testutil

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric is the value of metric name in g: the sum over its series whose
// labels include labels (nil: every series), counters, gauges and untyped
// alike; found is false when no series matches.
func Metric(tb testing.TB, g prometheus.Gatherer, name string, labels map[string]string) (v float64, found bool) {
	tb.Helper()
	mfs, err := g.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, want := range labels {
				if have[k] != want {
					continue series
				}
			}
			found = true
			switch {
			case m.GetCounter() != nil:
				v += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				v += m.GetGauge().GetValue()
			case m.GetUntyped() != nil:
				v += m.GetUntyped().GetValue()
			}
		}
	}
	return v, found
}
