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
)

// etcdCuts are how long TestCutServesAgainSoon cuts r1 off: long enough
// for the backoff of its failed starts (driver.StartBackoff, each failure
// a call given up after EtcdTimeout) to reach its 10 s cap, and 5 s apart
// across one cycle of a start given up (5 s) and its backoff (10 s), so
// that the heals fall at different points of it. Without registryBack the
// 65 s cut fails at 3 and 10 regions (r1 below its demand 7 s after the
// heal); the retry of a start in flight (ruleState.again) is not reached
// here, as the polls sent in the cut are given up no sooner than the
// starts: the agent's TestStartWhenRegistryBack covers it.
var etcdCuts = []time.Duration{55 * time.Second, 60 * time.Second, 65 * time.Second}

// etcdBackBound is how long after the heal TestCutServesAgainSoon gives
// r1's share to come back: a start sent just before the heal is given up
// after EtcdTimeout (5 s) and then tried at once, or the first registry
// read that succeeds after the heal (one sent in the cut is given up after
// EtcdTimeout too; then within driver.PollWait's 2 s) starts one; then a
// Start round trip, the marker and a round of gifts (about a second at
// 40 ms between regions).
const etcdBackBound = driver.DefaultEtcdTimeout + 2*time.Second

// TestCutServesAgainSoon: r1 cut off from its peers and from etcd for
// each of etcdCuts, at 2, 3 and 10 regions and at 1 and 10,000 requests
// per second. r1 falls to its floor in the cut (among two regions once the
// witness lease of a minute has passed, and the other takes its key), and
// its new incarnation cannot start until etcd answers again; the first
// registry read that succeeds after the outage starts it at once, or
// marks a start still in flight to be tried again at once when it fails
// (the agent's registryBack), where before the start waited for its
// backoff of up to 10 s. From etcdBackBound after the heal to the end: at
// 10,000/s r1 holds at least its demand (0.3 of the limit over the other
// regions) and the regions at least 0.95 of the limit at every sample; at
// 1/s some region holds the one token at every sample. No window
// overshoots.
func TestCutServesAgainSoon(t *testing.T) {
	const keys = 3
	for _, cut := range etcdCuts {
		for _, n := range []int{2, 3, 10} {
			for _, rate := range []float64{1, 10_000} {
				t.Run(fmt.Sprintf("cut=%v/regions=%d/rate=%g", cut, n, rate), func(t *testing.T) {
					t.Parallel()
					sc := faultScenario(t, n, rate, keys, 0)
					sc.Events[0].For = scenario.Duration(cut)
					heal := cutAt + cut
					sc.Duration = scenario.Duration(heal + 30*time.Second)
					after := heal + etcdBackBound
					led := &watched{fwd: fwd{&strategy.Ledger{}}, after: after, cut: 1}
					res, err := sim.Run(context.Background(), sc, []sim.Strategy{led}, sim.Options{})
					if err != nil {
						t.Fatal(err)
					}
					for i, o := range res.Strategies[0].Overshoot {
						if o > 0 {
							t.Errorf("overshoot %.4f%% in the %v window", 100*o, sim.Windows[i])
						}
					}
					for k := range keys {
						t.Logf("k%d from %v: least sum of shares %.3f, least r1 %.3f", k, after, led.minSum[k], led.cutShare[k])
						if rate == 1 {
							if g := led.noToken.longest[k]; g > tokenTransit {
								t.Errorf("k%d: no region held the whole token for %v", k, g)
							}
							continue
						}
						if led.minSum[k] < 0.95 {
							t.Errorf("k%d: the regions held %.3f of the limit at a sample", k, led.minSum[k])
						}
						if want := 0.3 / float64(n-1); led.cutShare[k] < want {
							t.Errorf("k%d: r1 held %.3f of the limit at a sample from %v, below its demand %.3f", k, led.cutShare[k], after, want)
						}
					}
				})
			}
		}
	}
}
