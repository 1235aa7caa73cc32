package simulations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
)

// lossAt is when lossScenario loses r1 for good.
const lossAt = 20 * time.Second

// lossScenario is faultScenario with r0 sending 1.2x the limit instead of
// 0.5x, and r1 lost for good (traffic, agent and store) at lossAt instead
// of cut off. The production defaults otherwise: a lease of 3 s and,
// between two regions, the witness lease of a minute.
func lossScenario(t *testing.T, n int, rate float64, keys int, duration time.Duration) *scenario.Scenario {
	t.Helper()
	sc := faultScenario(t, n, rate, keys, 0)
	for i := range sc.Demand {
		if sc.Demand[i].Region == "r0" {
			sc.Demand[i].Level = 1.2
		}
	}
	sc.Duration = scenario.Duration(duration)
	sc.Events = []scenario.Event{{Kind: "region_loss", Regions: []string{"r1"}, At: scenario.Duration(lossAt)}}
	return sc
}

// TestRegionLossServesTheLimit: r1 is lost for good, at 2 and 10 regions
// and at 1 and 10,000 requests per second, r0 asking more than the whole
// limit. The survivors reclaim what r1 held: among ten regions a lease
// after the loss (ledger.Config.ReclaimAfter), between two through the
// witness (WitnessReclaimAfter: a minute by default). From that bound plus
// five seconds to the end: the live regions' shares sum to all but r1's
// floor at every sample (at 1/s: some live region holds the one token; at
// ten regions less what is in flight between the survivors, up to 0.02 of
// the limit, where r1 held about 0.043), and the keys admit at least what
// one central bucket does less r1's floor and 1% (at 1/s, 90%: a single
// token, placed on estimates of a few requests). No window overshoots.
func TestRegionLossServesTheLimit(t *testing.T) {
	const keys = 3
	cfg := ledger.DefaultConfig()
	cfg.WitnessLease = driver.DefaultWitnessLease
	for _, n := range []int{2, 10} {
		for _, rate := range []float64{1, 10_000} {
			t.Run(fmt.Sprintf("regions=%d/rate=%g", n, rate), func(t *testing.T) {
				t.Parallel()
				wait := cfg.ReclaimAfter()
				if n == 2 {
					wait = cfg.WitnessReclaimAfter()
				}
				after := lossAt + wait + 5*time.Second
				sc := lossScenario(t, n, rate, keys, after+30*time.Second)
				ideal := &watched{fwd: fwd{&strategy.Ideal{}}, after: after, cut: 1}
				led := &watched{fwd: fwd{&strategy.Ledger{}}, after: after, cut: 1}
				res, err := sim.Run(context.Background(), sc, []sim.Strategy{ideal, led}, sim.Options{})
				if err != nil {
					t.Fatal(err)
				}
				s := res.Strategies[1]
				for i, o := range s.Overshoot {
					if o > 0 {
						t.Errorf("overshoot %.4f%% in the %v window", 100*o, sim.Windows[i])
					}
				}
				floor, want := 0.0, 0.9
				if rate >= 10 {
					floor = 0.1 / float64(n) // r1's, equal weights
					want = 1 - floor - 0.01
				}
				inFlight := 1e-3
				if n > 2 {
					inFlight = 0.02
				}
				var i, l int64
				for k := range keys {
					i, l = i+ideal.admitted[k], l+led.admitted[k]
					if led.minLive[k] < 1-floor-inFlight {
						t.Errorf("k%d: the live regions held %.4f of the limit at a sample from %v, want %.4f", k, led.minLive[k], after, 1-floor)
					}
				}
				t.Logf("from %v (the loss at %v, reclaim wait %v): admitted %d, the ideal %d (%.3f); least live shares %v",
					after, lossAt, wait, l, i, float64(l)/float64(i), led.minLive)
				if float64(l) < want*float64(i) {
					t.Errorf("admitted %d from %v, the ideal %d: below %.3f of it", l, after, i, want)
				}
			})
		}
	}
}

// TestConvergenceAfterLossWithFloor: three regions with min_share 0.3, c
// lost for good at 5 s. The targets leave c its floor (0.1 of the limit,
// above ConvergeTolerance) while the ledger samples c's share at 0:
// convergence compares only the regions that are up, so the ledger
// reaches and settles after the loss (it once read "reach never").
func TestConvergenceAfterLossWithFloor(t *testing.T) {
	sc, err := scenario.Parse("lost-floor", []byte(`name: lost-floor
duration: 60s
regions: [{name: a}, {name: b}, {name: c}]
network: {delay_ms: {a: {b: 50, c: 50}, b: {c: 50}}}
rule: {rate: 90, min_share: 0.3}
demand:
  - {region: a, shape: constant, level: 1, arrivals: uniform}
  - {region: b, shape: constant, level: 1, arrivals: uniform}
  - {region: c, shape: constant, level: 1, arrivals: uniform}
events:
  - {kind: region_loss, regions: [c], at: 5s}
`))
	if err != nil {
		t.Fatal(err)
	}
	res, err := sim.Run(context.Background(), sc, strategy.All(), sim.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var lost *sim.Shift
	for i := range res.Targets {
		if res.Targets[i].Fault == "region_loss c lost" {
			lost = &res.Targets[i]
		}
	}
	if lost == nil || len(lost.Lost) != 1 || lost.Lost[0] != 2 || lost.Targets[2] <= sim.ConvergeTolerance {
		t.Fatalf("shifts %+v: want c's loss, c lost, its floor above the tolerance", res.Targets)
	}
	for _, s := range res.Strategies {
		if s.Name != "ledger" {
			continue
		}
		for i, sh := range res.Targets {
			if sh.At >= 5 && (s.Reach[i] < 0 || s.Convergence[i] < 0) {
				t.Errorf("ledger after the shift at %gs (%s): reach %v s, settle %v s, want finite", sh.At, sh.Fault, s.Reach[i], s.Convergence[i])
			}
		}
	}
}
