package report

import (
	"bytes"
	"encoding/csv"
	"testing"

	"github.com/apportion/apportion/simulations"
	"github.com/apportion/apportion/simulations/sim"
)

// TestCSVNeverAndNA: "never settled" is -1 and "no shares" (n/a) is empty
// in both summary.csv's convergence_s and sweep.csv's convergence_mean_s
// (the mean settle time of the shifts that settled).
func TestCSVNeverAndNA(t *testing.T) {
	res := &sim.Result{Scenario: "s", Seed: 1, Targets: []sim.Shift{{At: 10}, {At: 20}}, Strategies: []sim.StrategyResult{
		{Name: "ideal", Overshoot: []float64{0, 0, 0}},
		{Name: "static", Overshoot: []float64{0, 0, 0}, HasShares: true, Reach: []float64{-1, -1}, Convergence: []float64{-1, -1}},
		{Name: "ledger", Overshoot: []float64{0, 0, 0}, HasShares: true, Reach: []float64{1, -1}, Convergence: []float64{2, -1}},
	}}
	column := func(data []byte, name string) map[string]string {
		t.Helper()
		rows, err := csv.NewReader(bytes.NewReader(data)).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		col, strat := -1, -1
		for i, h := range rows[0] {
			switch h {
			case name:
				col = i
			case "strategy":
				strat = i
			}
		}
		if col < 0 || strat < 0 {
			t.Fatalf("no column %s or strategy in %v", name, rows[0])
		}
		out := map[string]string{}
		for _, r := range rows[1:] {
			out[r[strat]] = r[col]
		}
		return out
	}
	sum := column(SummaryCSV(res), "convergence_s")
	sweep := column(SweepCSV([]simulations.Point{{Param: "lease", Value: "3s", X: 3000, Result: res}}), "convergence_mean_s")
	for _, c := range []struct{ strategy, summary, sweep string }{
		{"ideal", "", ""},
		{"static", "-1 -1", "-1"},
		{"ledger", "2 -1", "2"},
	} {
		if sum[c.strategy] != c.summary || sweep[c.strategy] != c.sweep {
			t.Errorf("%s: summary.csv %q, sweep.csv %q; want %q and %q", c.strategy, sum[c.strategy], sweep[c.strategy], c.summary, c.sweep)
		}
	}
}
