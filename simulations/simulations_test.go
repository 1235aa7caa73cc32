package simulations_test

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations"
	"github.com/apportion/apportion/simulations/report"
	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
)

// testDuration shortens the long scenarios for the test (the README's table
// comes from full runs); scenarios not listed run in full.
var testDuration = map[string]time.Duration{
	"skewed":              3 * time.Minute,
	"shift":               6 * time.Minute,
	"follow-the-sun":      30 * time.Minute,
	"hot-key":             45 * time.Second, // every cold key coordinated at 100 ms intervals: 12 s of CPU
	"limit-1-per-second":  3 * time.Minute,
	"limit-10-per-second": 3 * time.Minute,
	"ten-regions":         90 * time.Second,
}

func load(t testing.TB, name string) *scenario.Scenario {
	t.Helper()
	sc, err := scenario.Load(filepath.Join("scenarios", name+".yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

func byName(res *sim.Result, name string) sim.StrategyResult {
	for _, s := range res.Strategies {
		if s.Name == name {
			return s
		}
	}
	panic("no strategy " + name)
}

// TestShippedScenarios smoke-runs every shipped scenario and checks the
// ledger never overshoots (every window, partition and region loss
// included), the ideal never does, and the ledger keeps >= 97% of the
// ideal's utilization in the shift scenario.
func TestShippedScenarios(t *testing.T) {
	files, err := filepath.Glob("scenarios/*.yaml")
	if err != nil || len(files) < 11 {
		t.Fatalf("scenarios: %v %v", files, err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".yaml")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			sc := load(t, name)
			res, err := simulations.Run(context.Background(), sc, sim.Options{Duration: testDuration[name]})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%s", report.Table(res))
			for _, s := range res.Strategies {
				if s.Name == "static" && strings.HasPrefix(name, "limit-1-per-second") && s.Admitted == 0 {
					continue // a quarter token per region admits nothing: the point of the scenario
				}
				if s.Admitted <= 0 || s.Requests != res.Strategies[0].Requests {
					t.Errorf("%s: admitted %d of %d requests", s.Name, s.Admitted, s.Requests)
				}
			}
			for _, n := range []string{"ideal", "ledger"} {
				for i, o := range byName(res, n).Overshoot {
					if o > 0 {
						t.Errorf("%s overshoots by %.4f%% in the %v window", n, 100*o, sim.Windows[i])
					}
				}
			}
			led := byName(res, "ledger")
			// Liveness: after every fault (a partition or a loss over, an
			// agent up again, a store reset, a region lost or back) the
			// ledger's shares reach the targets within faultReachBound.
			for i, sh := range res.Targets {
				if sh.Fault == "" {
					continue
				}
				r, b := led.Reach[i], faultReachBound(sc, sh.Fault)
				t.Logf("ledger after %s at %g s: at the targets %g s later (bound %v)", sh.Fault, sh.At, r, b)
				if r < 0 || time.Duration(r*float64(time.Second)) > b {
					t.Errorf("ledger after %s at %g s: reached the targets %g s later (-1: never), bound %v", sh.Fault, sh.At, r, b)
				}
			}
			switch name {
			case "shift":
				if led.Utilization < 0.97 {
					t.Errorf("ledger utilization %.4f < 0.97", led.Utilization)
				}
				for i, c := range led.Convergence {
					if c < 0 || c > 5 {
						t.Errorf("shift %d: convergence %v s", i, c)
					}
				}
			case "partition":
				if byName(res, "async").Overshoot[1] <= 0 {
					t.Errorf("async usage sync should overshoot across a partition")
				}
			case "skewed":
				if byName(res, "independent").Overshoot[1] <= 0 {
					t.Errorf("independent regions should overshoot")
				}
			case "two-region-partition":
				// Neither side fences during the cut (shorter than the
				// witness lease: sync/ledger doc, Two regions and the
				// witness): each keeps its position and the shares go on
				// after the heal in the same incarnations: 99.96% (74.4%
				// when both fenced to their floors; a permanent outage,
				// 45%, before that).
				if led.Utilization < 0.97 {
					t.Errorf("ledger utilization %.4f < 0.97: a side lost its share during the cut", led.Utilization)
				}
			case "two-region-loss", "two-region-long-partition":
				// The survivor reclaims the lost (or long cut-off) region's
				// share through the witness: 90.51% and 89.91%; without
				// it us-east kept its half, as the static split (73.4%).
				if st := byName(res, "static"); led.Utilization < 0.85 || name == "two-region-loss" && led.Utilization < st.Utilization+0.1 {
					t.Errorf("ledger utilization %.4f, want >= 0.85 (static %.4f): the survivor did not reclaim", led.Utilization, st.Utilization)
				}
			case "daily-quota":
				// The quota holds in every window; the ledger serves the
				// demand out of what the other regions leave unused.
				if led.WindowMax > int64(res.Burst) || byName(res, "ideal").WindowMax != int64(res.Burst) {
					t.Errorf("most admitted in one window: ledger %d, ideal %d, quota %g", led.WindowMax, byName(res, "ideal").WindowMax, res.Burst)
				}
				if byName(res, "independent").WindowMax <= int64(res.Burst) {
					t.Errorf("independent regions should exceed the quota")
				}
				if st := byName(res, "static"); led.Utilization < 0.9 || led.Utilization <= st.Utilization {
					t.Errorf("ledger utilization %.4f, want >= 0.9 and above the static split's %.4f", led.Utilization, st.Utilization)
				}
			case "limit-1-per-second", "limit-1-per-second-moving", "limit-10-per-second":
				// Even demand at 1/s: a token that stays in one region
				// reaches at most 46% (simulations/README.md); on the
				// driver and the store model 33-40% over seeds 1-4 (3 min).
				// Moving demand: the token follows it.
				min := map[string]float64{"limit-1-per-second": 0.33, "limit-1-per-second-moving": 0.85, "limit-10-per-second": 0.9}[name]
				if st := byName(res, "static"); led.Utilization < min || led.Utilization < st.Utilization-0.01 {
					t.Errorf("ledger utilization %.4f, want >= %v and about the static split's %.4f", led.Utilization, min, st.Utilization)
				}
			}
		})
	}
}

// faultReachBound is how long after a fault of a shipped scenario (as
// sim.Shift.Fault names it) the ledger's shares may take to reach the
// targets: faultBound (T_heal plus a restart), plus the etcd timeout for a
// partition (the cut region's start, sent in the cut, may be given up only
// then: TestCutServesAgainSoon); for a region lost, the survivors' wait
// before they reclaim it (among two regions the witness's) plus T_heal.
func faultReachBound(sc *scenario.Scenario, fault string) time.Duration {
	b := faultBound(sc)
	switch {
	case strings.HasSuffix(fault, " lost"):
		cfg, _ := strategy.LedgerConfig(sc)
		if len(sc.Regions) == 2 {
			return b + cfg.WitnessReclaimAfter()
		}
		return b + cfg.ReclaimAfter()
	case strings.HasPrefix(fault, "partition "):
		return b + sc.Sync.EtcdTimeout.D()
	}
	return b
}

func files(t *testing.T, res *sim.Result) []report.File {
	t.Helper()
	fs, err := report.RunFiles(res)
	if err != nil {
		t.Fatal(err)
	}
	return append(fs, report.File{Name: "table", Data: []byte(report.Table(res))})
}

// TestDeterministic: the same seed gives byte-identical outputs (table, CSV,
// JSON, plots); another seed gives other ones.
func TestDeterministic(t *testing.T) {
	sc := load(t, "region-loss")
	run := func(seed uint64) []report.File {
		res, err := simulations.Run(context.Background(), sc, sim.Options{Seed: seed, Duration: 150 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return files(t, res)
	}
	a, b, c := run(7), run(7), run(8)
	for i := range a {
		if !bytes.Equal(a[i].Data, b[i].Data) {
			t.Errorf("%s differs between two runs with the same seed", a[i].Name)
		}
	}
	if bytes.Equal(a[4].Data, c[4].Data) || a[4].Name != "result.json" {
		t.Errorf("seeds 7 and 8 gave the same %s", a[4].Name)
	}
}

func TestSweep(t *testing.T) {
	sc := load(t, "flash-crowd")
	pts, err := simulations.Sweep(context.Background(), sc, "rtt", []string{"0.5", "2", "400ms"}, sim.Options{Duration: 40 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != 3 || pts[2].X != 400 {
		t.Fatalf("points %+v", pts)
	}
	fs, err := report.SweepFiles(pts)
	if err != nil || len(fs) != 9 {
		t.Fatalf("%d files, %v", len(fs), err)
	}
	for _, bad := range [][2]string{{"rtt", "fast"}, {"interval", "-1s"}, {"lease", "10ms"}, {"jitter", "1"}} {
		if _, err := simulations.Sweep(context.Background(), sc, bad[0], []string{bad[1]}, sim.Options{Duration: time.Second}); err == nil {
			t.Errorf("%s=%s accepted", bad[0], bad[1])
		}
	}
}
