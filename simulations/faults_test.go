package simulations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
)

// recovery wraps a strategy and, every 100 ms from from on, checks that
// the limit is served: at rate 1 (one whole token) some region holds the
// whole token, none for at most tokenTransit; above, the regions' shares
// of every key sum to at least 0.95 of the limit and region 1 holds at
// least want of it. It keeps the last sample at which that failed.
type recovery struct {
	fwd
	env     *sim.Env
	from    time.Duration
	token   bool
	want    float64
	lastBad time.Duration // -1: none
	badSum  float64       // the shares' sum (at 1/s: the most one region held) then
	badR1   float64
	noToken tokenGaps
}

func (w *recovery) Start(env *sim.Env) error {
	if err := w.Strategy.Start(env); err != nil {
		return err
	}
	w.env, w.lastBad = env, -1
	w.noToken = newTokenGaps(len(env.Keys()))
	env.After(w.from, w.sample)
	return nil
}

func (w *recovery) sample() {
	sh := w.Strategy.(sim.Sharer)
	now := w.env.Now()
	for k := range w.env.Keys() {
		sum, most := shares(sh, w.env, k)
		r1 := sh.Share(1, k)
		bad := sum < 0.95 || r1 < w.want
		if w.token {
			bad, sum = w.noToken.observe(k, now, most >= 1-1e-9) > tokenTransit, most
		}
		if bad {
			w.lastBad, w.badSum, w.badR1 = now, sum, r1
		}
	}
	w.env.After(100*time.Millisecond, w.sample)
}

// Share passes the wrapped strategy's shares on (the run's share series).
func (w *recovery) Share(r, k int) float64 { return w.Strategy.(sim.Sharer).Share(r, k) }

// faultAt is when TestFaultsServeAgain's faults begin.
const faultAt = 20 * time.Second

// faultCases are the faults TestFaultsServeAgain plays on r1 of
// faultScenario (r0 sending 0.5 of the limit, the others 0.3 together);
// each sets its events (and clocks) and returns when the fault ends.
var faultCases = []struct {
	name  string
	apply func(sc *scenario.Scenario) (end time.Duration)
}{
	{"agent-restart", func(sc *scenario.Scenario) time.Duration {
		// r1's agent dies (its state lost) and is back 2 s later.
		sc.Events = []scenario.Event{{Kind: "agent_restart", Regions: []string{"r1"}, At: scenario.Duration(faultAt), For: scenario.Duration(2 * time.Second)}}
		return faultAt + 2*time.Second
	}},
	{"redis-restart", func(sc *scenario.Scenario) time.Duration {
		// r1's Redis restarts empty; its agent carries on.
		sc.Events = []scenario.Event{{Kind: "store_reset", Regions: []string{"r1"}, At: scenario.Duration(faultAt)}}
		return faultAt
	}},
	{"node-restart", func(sc *scenario.Scenario) time.Duration {
		// r1's Redis and agent restart together, both empty; the agent is
		// back 2 s later.
		sc.Events = []scenario.Event{
			{Kind: "store_reset", Regions: []string{"r1"}, At: scenario.Duration(faultAt)},
			{Kind: "agent_restart", Regions: []string{"r1"}, At: scenario.Duration(faultAt), For: scenario.Duration(2 * time.Second)},
		}
		return faultAt + 2*time.Second
	}},
	{"lossy-links", func(sc *scenario.Scenario) time.Duration {
		// Four in five messages to and from r1 dropped for 15 s (its
		// reports, its peers' reports and acknowledgements; etcd is
		// reachable).
		sc.Events = []scenario.Event{{Kind: "loss", Regions: []string{"r1"}, At: scenario.Duration(faultAt), For: scenario.Duration(15 * time.Second), Loss: 0.8}}
		return faultAt + 15*time.Second
	}},
	{"partition-clocks-at-bound", func(sc *scenario.Scenario) time.Duration {
		// faultScenario's partition of r1 (five leases), every clock at
		// the edge of the guarantee: r1's agent clock fast by sync.clock_error
		// and its store clock slow by as much (its leases run longest in
		// real time), the others' agent clocks slow.
		rho := *sc.Sync.ClockError
		for i := range sc.Regions {
			fast, slow := rho, -rho
			sc.Regions[i].AgentClock = &slow
			if i == 1 {
				sc.Regions[i].AgentClock, sc.Regions[i].StoreClock = &fast, slow
			}
		}
		return healAt
	}},
}

// faultBound is how long after a fault of faultCases ends TestFaultsServeAgain
// gives the limit to be served again: invariant 4's T_heal
// (ledger.Config.HealBound, with a registry change reaching an agent
// within a poll and a registry round trip), plus the restart of what
// restarted: an agent's new incarnation (a registry round trip) and its
// first marker (a store round trip), or an empty Redis seen at the agent's
// next tick and its records and marker written again (an interval and two
// store round trips).
func faultBound(sc *scenario.Scenario) time.Duration {
	c, _ := strategy.LedgerConfig(sc)
	y := sc.Sync
	reg := time.Duration(2 * *sc.Network.RegistryMs * 1e6)
	store := time.Duration(2 * *y.StoreMs * 1e6)
	var delay time.Duration
	for i := range sc.Regions {
		for j := range sc.Regions {
			delay = max(delay, sc.Delay(i, j))
		}
	}
	rtt := 2 * (delay + time.Duration(sc.Network.JitterMs*1e6))
	return c.HealBound(y.RegistryPoll.D()+reg, rtt) + max(reg+store, c.Interval+2*store)
}

// TestFaultsServeAgain: every fault of faultCases on r1, at 2 and 10
// regions and at 1 and 10,000 requests per second: no window overshoots,
// and from faultBound after the fault ends (6.7 s) to the end of the run
// the limit is served at every sample: at 1/s some region holds the whole
// token (none for at most tokenTransit); at 10,000/s the shares sum to
// 0.95 of the limit and r1 holds its demand.
// The time it took is logged (the worst, 4.5 s, is the partition at ten
// regions; a restart takes 1.2 s at most, a Redis restart 0.3 s, the
// loss 1 s).
func TestFaultsServeAgain(t *testing.T) {
	const keys = 3
	for _, fc := range faultCases {
		for _, n := range []int{2, 10} {
			for _, rate := range []float64{1, 10_000} {
				t.Run(fmt.Sprintf("%s/regions=%d/rate=%g", fc.name, n, rate), func(t *testing.T) {
					t.Parallel()
					sc := faultScenario(t, n, rate, keys, 0)
					end := fc.apply(sc)
					sc.Duration = scenario.Duration(end + 30*time.Second)
					led := &recovery{fwd: fwd{&strategy.Ledger{}}, from: 10 * time.Second, token: rate == 1, want: 0.3 / float64(n-1)}
					res, err := sim.Run(context.Background(), sc, []sim.Strategy{led}, sim.Options{})
					if err != nil {
						t.Fatal(err)
					}
					for i, o := range res.Strategies[0].Overshoot {
						if o > 0 {
							t.Errorf("overshoot %.4f%% in the %v window", 100*o, sim.Windows[i])
						}
					}
					took, bound := max(0, led.lastBad+100*time.Millisecond-end), faultBound(sc)
					t.Logf("%s: served again %v after the fault ended at %v (bound %v; last sample short: %v, shares summing to %.3f, r1 %.3f)",
						t.Name(), took, end, bound, led.lastBad, led.badSum, led.badR1)
					if took > bound {
						t.Errorf("the limit was not served at %v, %v after the fault ended (bound %v): the shares summed to %.3f, r1 held %.3f",
							led.lastBad, led.lastBad-end, bound, led.badSum, led.badR1)
					}
				})
			}
		}
	}
}
