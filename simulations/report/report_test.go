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

// TestSweepClockAndQuota: the sweep says what a run says: the clock
// warning above its table, the quota line of each value below it, and
// window_max as sweep.csv's last column (empty for a token bucket).
func TestSweepClockAndQuota(t *testing.T) {
	run := func(window float64, wmax int64) *sim.Result {
		return &sim.Result{Scenario: "q", Seed: 1, Burst: 50, RuleWindowS: window, OutsideClockGuarantee: []string{"region a: store clock rate error 0.1"},
			Strategies: []sim.StrategyResult{{Name: "ideal", Overshoot: []float64{0, 0, 0}, WindowMax: 50}, {Name: "ledger", Overshoot: []float64{0, 0, 0}, WindowMax: wmax}}}
	}
	pts := []simulations.Point{{Param: "lease", Value: "1s", X: 1000, Result: run(10, 51)}, {Param: "lease", Value: "2s", X: 2000, Result: run(10, 50)}}
	table := SweepTable(pts)
	for _, want := range []string{
		"outside the clock guarantee (the ledger's bounds do not apply): region a: store clock rate error 0.1\n",
		"lease 1s: quota 50 per 10s: most admitted in one window: ideal 50, ledger 51\n",
		"lease 2s: quota 50 per 10s: most admitted in one window: ideal 50, ledger 50\n",
	} {
		if !bytes.Contains([]byte(table), []byte(want)) {
			t.Errorf("sweep table without %q:\n%s", want, table)
		}
	}
	rows, err := csv.NewReader(bytes.NewReader(SweepCSV(pts))).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if h := rows[0]; h[len(h)-1] != "window_max" || rows[2][len(h)-1] != "51" || rows[4][len(h)-1] != "50" {
		t.Errorf("sweep.csv %v: want window_max last, 51 for lease 1s's ledger, 50 for 2s's", rows)
	}
	pts = []simulations.Point{{Param: "lease", Value: "1s", X: 1000, Result: run(0, 0)}}
	if rows, _ = csv.NewReader(bytes.NewReader(SweepCSV(pts))).ReadAll(); rows[1][len(rows[0])-1] != "" {
		t.Errorf("token bucket: window_max %q, want empty", rows[1][len(rows[0])-1])
	}
	if bytes.Contains([]byte(SweepTable(pts)), []byte("quota")) {
		t.Error("token bucket: a quota line in the sweep table")
	}
}
