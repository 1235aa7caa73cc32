package simulations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/simulations/strategy"
)

// fwd wraps a strategy and passes the disruptions on to it (sim.Run looks
// for them on the strategy it is given, the wrapper).
type fwd struct{ sim.Strategy }

func (f fwd) RegionLost(r int) {
	if x, ok := f.Strategy.(sim.Disrupted); ok {
		x.RegionLost(r)
	}
}

func (f fwd) RegionBack(r int) {
	if x, ok := f.Strategy.(sim.Disrupted); ok {
		x.RegionBack(r)
	}
}

func (f fwd) AgentDown(r int) {
	if x, ok := f.Strategy.(sim.Disrupted); ok {
		x.AgentDown(r)
	}
}

func (f fwd) AgentUp(r int) {
	if x, ok := f.Strategy.(sim.Disrupted); ok {
		x.AgentUp(r)
	}
}

func (f fwd) StoreReset(r int) {
	if x, ok := f.Strategy.(sim.Reset); ok {
		x.StoreReset(r)
	}
}

// tokenTransit is how long a whole token (a limit of 1/s, burst 1) may be
// held by no region: a gift in flight (a round trip between two regions
// of faultScenario, 80 ms, and a store write), with room for one lost
// message's repair. A token split in fractions admits nothing, however
// they sum, so the tests at 1/s ask for a whole token in one region.
const tokenTransit = 500 * time.Millisecond

// tokenGaps follows, per key, how long no region has held the whole token.
type tokenGaps struct {
	since   []time.Duration // since when none has (-1: one holds it)
	longest []time.Duration // the longest such time so far
}

func newTokenGaps(keys int) tokenGaps {
	g := tokenGaps{since: make([]time.Duration, keys), longest: make([]time.Duration, keys)}
	for k := range g.since {
		g.since[k] = -1
	}
	return g
}

// observe records whether some region holds key k's token at now, and
// returns how long none has (0 while one does).
func (g tokenGaps) observe(k int, now time.Duration, held bool) time.Duration {
	switch {
	case held:
		g.since[k] = -1
		return 0
	case g.since[k] < 0:
		g.since[k] = now
	}
	gap := now - g.since[k]
	g.longest[k] = max(g.longest[k], gap)
	return gap
}

// shares returns, for key k, the sum of the regions' shares and the most
// one region holds.
func shares(sh sim.Sharer, env *sim.Env, k int) (sum, most float64) {
	for r := range env.Regions() {
		s := sh.Share(r, k)
		sum, most = sum+s, max(most, s)
	}
	return sum, most
}

// watched wraps a strategy and, from the time after on, counts what it
// admits per key and in the cut region, and samples every key's shares
// (their sum over the regions, and the cut region's own, and how long no
// region held the whole token) every 100 ms.
type watched struct {
	fwd
	env      *sim.Env
	after    time.Duration
	admitted []int64   // per key, from after on
	inCut    int64     // in region cut, from after on
	minSum   []float64 // per key: the least sum of the regions' shares from after on
	cutShare []float64 // per key: the least share of region cut from after on
	minLive  []float64 // per key: the least sum of the other regions' shares from after on
	noToken  tokenGaps // per key: how long no region held a whole token, from after on
	cut      int
}

// cutAt is when faultScenario cuts r1 off; healAt, when it heals.
const cutAt, healAt = 20 * time.Second, 35 * time.Second

func (w *watched) Start(env *sim.Env) error {
	if err := w.Strategy.Start(env); err != nil {
		return err
	}
	w.env = env
	n := len(env.Keys())
	w.admitted = make([]int64, n)
	w.minSum, w.cutShare, w.minLive = make([]float64, n), make([]float64, n), make([]float64, n)
	w.noToken = newTokenGaps(n)
	for k := range n {
		w.minSum[k], w.cutShare[k], w.minLive[k] = 2, 2, 2
	}
	if _, ok := w.Strategy.(sim.Sharer); ok {
		env.After(w.after, w.sample)
	}
	return nil
}

func (w *watched) sample() {
	sh := w.Strategy.(sim.Sharer)
	for k := range w.env.Keys() {
		sum, most := shares(sh, w.env, k)
		cut := sh.Share(w.cut, k)
		w.noToken.observe(k, w.env.Now(), most >= 1-1e-9)
		w.cutShare[k] = min(w.cutShare[k], cut)
		w.minSum[k] = min(w.minSum[k], sum)
		w.minLive[k] = min(w.minLive[k], sum-cut)
	}
	w.env.After(100*time.Millisecond, w.sample)
}

func (w *watched) Admit(region, key int, cost int64) bool {
	ok := w.Strategy.Admit(region, key, cost)
	if ok && w.env.Now() >= w.after {
		w.admitted[key] += cost
		if region == w.cut {
			w.inCut += cost
		}
	}
	return ok
}

// faultScenario: n regions 40 ms apart, keys keys each sent at 0.5x the
// limit by r0 and 0.3x by the other regions together; r1 cut off from the
// others and from the registry from cutAt to healAt (five leases). The
// rule is a token bucket of rate per second, or with window > 0 a quota
// of rate requests per window (a global fixed window).
func faultScenario(t *testing.T, n int, rate float64, keys int, window time.Duration) *scenario.Scenario {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "name: split-%d-%g\nseed: 1\nduration: 70s\nregions:\n", n, rate)
	for i := range n {
		fmt.Fprintf(&b, "  - name: r%d\n", i)
	}
	b.WriteString("network:\n  delay_ms:\n")
	for i := range n - 1 {
		fmt.Fprintf(&b, "    r%d: {", i)
		for j := i + 1; j < n; j++ {
			if j > i+1 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "r%d: 40", j)
		}
		b.WriteString("}\n")
	}
	minShare := 0.1
	if rate < 10 {
		minShare = 0 // a floor of a fraction of a token strands the limit (rules.Rule.CheckFloors)
	}
	rule := fmt.Sprintf("  rate: %g\n  burst: %g\n", rate, rate)
	if window > 0 {
		rule = fmt.Sprintf("  burst: %g\n  window: %v\n", rate, window)
	}
	fmt.Fprintf(&b, "  jitter_ms: 2\n  loss: 0.01\nrule:\n%s  min_share: %g\nsync:\n  lease: 3s\ndemand:\n", rule, minShare)
	for k := range keys {
		fmt.Fprintf(&b, "  - {region: r0, key: k%d, level: 0.5}\n", k)
		b.WriteString("  - {split: {")
		for i := 1; i < n; i++ {
			if i > 1 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "r%d: %g", i, 1/float64(n-1))
		}
		fmt.Fprintf(&b, "}, key: k%d, level: 0.3}\n", k)
	}
	fmt.Fprintf(&b, "events:\n  - {kind: partition, regions: [r1], at: %v, for: %v}\n", cutAt, healAt-cutAt)
	sc, err := scenario.Parse("split", []byte(b.String()))
	if err != nil {
		t.Fatalf("%v\n%s", err, b.String())
	}
	return sc
}

// splitLiveBound is how long after the heal TestPartitionSplitMessages
// gives the shares to come back (measured: 5 s is not always enough at ten
// regions with reports in parts of two keys, r1 then holding 0.017 of the
// limit, half its demand).
const splitLiveBound = 10 * time.Second

// TestPartitionSplitMessages runs a partition of one region for five
// leases, at 2 and 10 regions and at 1 and 10,000 requests per second,
// with every report of more than two keys built and sent in parts of two
// keys and every message merged a key at a time (the agent's windows,
// driver.SendWindow and driver.ReceiveWindow, at their smallest), against
// the same run with the production windows. Safety: neither overshoots in
// any window. Liveness, from splitLiveBound after the heal to the end: at
// 10,000/s every key admits what the ideal admits, the regions' shares sum
// to at least 0.95 of the limit at every sample and r1 holds at least its
// demand; at 1/s (burst 1: one whole token) some region holds the token at
// every sample and the keys admit at least 40% of what the ideal does.
func TestPartitionSplitMessages(t *testing.T) {
	const keys = 6
	for _, n := range []int{2, 10} {
		for _, rate := range []float64{1, 10_000} {
			t.Run(fmt.Sprintf("regions=%d/rate=%g", n, rate), func(t *testing.T) {
				t.Parallel()
				sc := faultScenario(t, n, rate, keys, 0)
				after := healAt + splitLiveBound
				ideal := &watched{fwd: fwd{&strategy.Ideal{}}, after: after, cut: 1}
				whole := &watched{fwd: fwd{&strategy.Ledger{}}, after: after, cut: 1}
				split := &watched{fwd: fwd{&strategy.Ledger{ReceiveWindow: 1, SendWindow: 2}}, after: after, cut: 1}
				res, err := sim.Run(context.Background(), sc, []sim.Strategy{ideal, whole, split}, sim.Options{})
				if err != nil {
					t.Fatal(err)
				}
				led := res.Strategies[1:]
				for _, s := range led {
					t.Logf("%s: utilization %.4f, overshoot %v, %d sync bytes", s.Name, s.Utilization, s.Overshoot, s.SyncBytes)
					for i, o := range s.Overshoot {
						if o > 0 {
							t.Errorf("overshoot %.4f%% in the %v window", 100*o, sim.Windows[i])
						}
					}
				}
				if led[1].SyncBytes <= led[0].SyncBytes {
					t.Errorf("split: %d sync bytes, whole: %d: the reports did not leave in parts", led[1].SyncBytes, led[0].SyncBytes)
				}
				if led[1].Utilization < led[0].Utilization-0.05 {
					t.Errorf("utilization %.4f in parts against %.4f whole", led[1].Utilization, led[0].Utilization)
				}
				var idealSum, splitSum int64
				for k := range keys {
					t.Logf("k%d from %v: admitted ideal %d whole %d split %d; least sum of shares whole %.3f split %.3f; least r1 whole %.3f split %.3f",
						k, after, ideal.admitted[k], whole.admitted[k], split.admitted[k], whole.minSum[k], split.minSum[k], whole.cutShare[k], split.cutShare[k])
					idealSum, splitSum = idealSum+ideal.admitted[k], splitSum+split.admitted[k]
					if rate == 1 {
						// One whole token: some region holds it, but for a move.
						if g := split.noToken.longest[k]; g > tokenTransit {
							t.Errorf("k%d: no region held the whole token for %v", k, g)
						}
						continue
					}
					if float64(split.admitted[k]) < 0.999*float64(ideal.admitted[k]) {
						t.Errorf("k%d: admitted %d, the ideal %d", k, split.admitted[k], ideal.admitted[k])
					}
					if split.minSum[k] < 0.95 {
						t.Errorf("k%d: the regions held %.3f of the limit at a sample", k, split.minSum[k])
					}
					if want := 0.3 / float64(n-1); split.cutShare[k] < want {
						t.Errorf("k%d: r1 held %.3f of the limit at a sample, below its demand %.3f", k, split.cutShare[k], want)
					}
				}
				if rate == 1 && float64(splitSum) < 0.4*float64(idealSum) {
					t.Errorf("admitted %d from %v, the ideal %d", splitSum, after, idealSum)
				}
			})
		}
	}
}

// TestQuotaPartition: a quota of 100, or of 10, requests per 10 s window
// (a global fixed window) sent at 0.8 of it (Poisson), r1 cut off from
// cutAt to healAt, at 2 and 10 regions, with the production windows, next
// to the same run without the cut. No key admits more than the quota in
// any window; from splitLiveBound after the heal the keys admit, against
// one central counter, at least what they admit then without the cut,
// less 5 points: the cut costs nothing once healed. (Small quotas over
// many regions admit about half of the central counter's even without a
// fault, so the run without the cut is the measure, not a fixed figure.)
// At 2 regions r1 sends 3/8 of the demand: had it stayed at its floor
// after the heal, about 30% less would pass.
func TestQuotaPartition(t *testing.T) {
	const keys = 3
	after := healAt + splitLiveBound
	// admitted runs sc and returns the ledger's admissions from after on
	// against the central counter's, and the most a key admitted in one
	// window.
	admitted := func(t *testing.T, sc *scenario.Scenario) (float64, int64, int64) {
		ideal := &watched{fwd: fwd{&strategy.Ideal{}}, after: after, cut: 1}
		led := &watched{fwd: fwd{&strategy.Ledger{}}, after: after, cut: 1}
		res, err := sim.Run(context.Background(), sc, []sim.Strategy{ideal, led}, sim.Options{})
		if err != nil {
			t.Fatal(err)
		}
		var i, l int64
		for k := range keys {
			i, l = i+ideal.admitted[k], l+led.admitted[k]
		}
		return float64(l) / float64(i), res.Strategies[1].WindowMax, led.inCut
	}
	for _, n := range []int{2, 10} {
		for _, quota := range []float64{100, 10} {
			t.Run(fmt.Sprintf("regions=%d/quota=%g", n, quota), func(t *testing.T) {
				t.Parallel()
				sc := faultScenario(t, n, quota, keys, 10*time.Second)
				since, most, inCut := admitted(t, sc)
				sc.Events = nil
				calm, calmMost, calmInCut := admitted(t, sc)
				t.Logf("from %v, against the central counter: %.3f with the cut, %.3f without; most in one window %d and %d of %g; r1 admitted %d and %d", after, since, calm, most, calmMost, quota, inCut, calmInCut)
				if float64(inCut) < 0.8*float64(calmInCut) {
					t.Errorf("r1 admitted %d from %v with the cut, %d without", inCut, after, calmInCut)
				}
				if m := max(most, calmMost); m > int64(quota) {
					t.Errorf("a key admitted %d in one window, quota %g", m, quota)
				}
				if since < calm-0.05 {
					t.Errorf("admitted %.3f of the central counter from %v with the cut, %.3f without", since, after, calm)
				}
			})
		}
	}
}
