package agent

import (
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/prometheus/client_golang/prometheus"
)

// TestStalledUsageKeepsTheShare: a NATS server that stalls for a second
// (SIGSTOP, CPU starvation: it holds its connections and delivers
// nothing, then everything) kept a region's enforcers' usage from its
// agent; the agent read the second as traffic that stopped, its demand
// estimate decayed (half in 250 ms) and it gave its share of the busy key
// away, running at about its floor until NATS delivered again (an
// explorer: every region's admissions fell to about its floor 0.4-0.6 s
// into each 1 s stall). Every enforcer now sends a batch at every flush,
// an empty one when it has no usage, and the agent waits for the usage of
// an enforcer that missed a flush (Config.UsageGrace): through a 1 s
// stall the busy region keeps at least 90% of its share. A stall longer
// than the grace reads as traffic that stopped once the grace is over,
// and the region serves the limit again within liveRestartBound of the
// stall's end. Traffic that really stops (empty batches) makes no tick
// wait. At every sample the regions together enforce at most the limit.
// At 2 and 10 regions, 1 and 10,000 requests per second (burst the same);
// and with UsageGrace 0 (the agent before) at 3 regions, where the same
// 1 s stall takes the share below half of it: the test can fail.
func TestStalledUsageKeepsTheShare(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	for _, n := range []int{2, 10} {
		for _, rate := range []int64{1, 10_000} {
			t.Run(fmt.Sprintf("regions=%d/rate=%d", n, rate), func(t *testing.T) { stalledUsage(t, n, rate, DefaultUsageGrace) })
		}
	}
	t.Run("regions=3/rate=10000/grace=0", func(t *testing.T) { stalledUsage(t, 3, 10_000, 0) })
}

func stalledUsage(t *testing.T, n int, rate int64, grace time.Duration) {
	s, _, rule, _ := liveStack(t, n, rate, func(c *Config) { c.UsageGrace = grace })
	a := s.regions["a"]
	spec := a.agent.specOf(rule)
	U := spec.ledgerConfig(ledger.DefaultConfig()).Units
	s.probe = memProbe{s: s, floors: floorsOf(spec)}
	serving := U // a whole token of one (burst 1 is all of it)
	if rate > 1 {
		serving = U * 9 / 10
	}
	sm := startSampler(t, s, U)
	load := usagetest.Start(t, s.cluster["a"].Connect(t), "a", testRule, testKey, 2*float64(rate))
	// settled: a holds the limit, and reports a demand of the whole limit
	// at least (a demand short of it, within the band of the estimate
	// that rose past it, gives part of the share to the other regions'
	// spare whenever a next gives: not the stall's doing).
	settled := func() bool {
		var reported int64
		a.agent.onLoop(t.Context(), func() {
			if st := a.agent.rules[testRule]; st != nil && st.Led != nil {
				reported = st.Led.Position(testKey).Reported
			}
		})
		return reported >= U && s.enforced("a", testKey) >= serving
	}
	testutil.WaitFor(t, liveRestartBound, "a to hold the limit", settled)
	// lowest samples a's enforced units for d.
	lowest := func(d time.Duration) int64 {
		low := s.enforced("a", testKey)
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(10 * time.Millisecond) { // sampling, not synchronising
			low = min(low, s.enforced("a", testKey))
		}
		return low
	}

	// A stall within the grace.
	before, late0 := s.enforced("a", testKey), metricValue(a.agent.m.lateTicks)
	load.Stall()
	low := lowest(time.Second)
	load.Busy()
	late := metricValue(a.agent.m.lateTicks) - late0
	t.Logf("a 1 s stall of a's usage: a enforced %d of %d units at the lowest, %d before; %v ticks waited", low, U, before, late)
	if grace == 0 {
		if low >= before/2 {
			t.Errorf("without the wait, a stall of a's usage left it %d of the %d units: the test shows nothing", low, before)
		}
		return
	}
	if low < before*9/10 {
		t.Errorf("a's share fell to %d of %d during the stall (want at least 90%%: the usage was late, not zero)", low, before)
	}
	if late < 5 {
		t.Errorf("apportion_sync_usage_late_ticks_total rose by %v over the stall, want about 10", late)
	}
	if e := metricValue(a.agent.m.enforcers); e != 1 {
		t.Errorf("apportion_sync_usage_enforcers = %v, want 1", e)
	}

	// A stall longer than the grace, then the region serves again.
	testutil.WaitFor(t, liveRestartBound, "a to hold the limit again", settled)
	load.Stall()
	low = lowest(grace + time.Second)
	load.Busy()
	end := time.Now()
	testutil.WaitFor(t, liveRestartBound, "a to serve the limit after a long stall", func() bool { return s.enforced("a", testKey) >= serving })
	t.Logf("a %v stall: a enforced %d units at the lowest, and %d again %v after it ended (bound %v)",
		grace+time.Second, low, s.enforced("a", testKey), time.Since(end).Round(time.Millisecond), liveRestartBound)

	// Traffic that stops: no tick waits.
	late0 = metricValue(a.agent.m.lateTicks)
	load.Idle()
	lowest(time.Second)
	if late := metricValue(a.agent.m.lateTicks) - late0; late > 1 {
		t.Errorf("%v ticks waited for usage after a's traffic stopped (its enforcer sent empty batches), want none", late)
	}
	sm.finish()
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}

// TestUsageLateBounded: the demand estimates wait for late usage at most
// UsageGrace at a time, whatever the enforcer ids (anyone who can publish
// on the usage subject can send batches of any id, and stop): an id heard
// once is late for a grace and then forgotten, ids that keep coming make
// ticks observe at least once a grace, and at most maxEnforcers ids are
// kept, further ones making nothing late.
func TestUsageLateBounded(t *testing.T) {
	const grace = 2 * time.Second
	a := &Agent{cfg: Config{UsageGrace: grace}, m: &metrics{
		enforcers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "e"}),
		lateTicks: prometheus.NewCounter(prometheus.CounterOpts{Name: "l"}),
	}}
	t0 := time.Unix(1_000_000, 0)
	heard := func(id string, at time.Time) {
		a.usageMu.Lock()
		a.heardEnforcer(id, at)
		a.usageMu.Unlock()
	}

	// One enforcer heard at every flush: never late; silent: late from
	// lateAfter until grace, then forgotten.
	for i := range 10 {
		at := t0.Add(time.Duration(i) * usage.DefaultInterval)
		heard("e1", at)
		if a.usageLate(at.Add(usage.DefaultInterval / 2)) {
			t.Fatalf("an enforcer heard half a flush ago is late")
		}
	}
	last := t0.Add(9 * usage.DefaultInterval)
	if !a.usageLate(last.Add(lateAfter + time.Millisecond)) {
		t.Errorf("an enforcer silent for more than a flush and a quarter is not late")
	}
	if a.usageLate(last.Add(grace + time.Millisecond)) {
		t.Errorf("an enforcer silent for more than the grace still makes the usage late")
	}
	if n := len(a.enforcers); n != 0 {
		t.Errorf("%d enforcers kept after the grace, want 0", n)
	}

	// A new id every tick, each heard once: the estimates wait at most a
	// grace at a time.
	now, waited, longest := t0.Add(time.Hour), time.Duration(0), time.Duration(0)
	for i := range 200 {
		heard(fmt.Sprintf("rogue-%d", i), now)
		now = now.Add(usage.DefaultInterval)
		if a.usageLate(now) {
			waited += usage.DefaultInterval
			longest = max(longest, waited)
		} else {
			waited = 0
		}
	}
	if longest > grace {
		t.Errorf("ids heard once each kept the estimates waiting %v at a stretch, want at most %v", longest, grace)
	}

	// At most maxEnforcers ids.
	a.enforcers = nil
	for i := range maxEnforcers + 100 {
		heard(fmt.Sprintf("id-%d", i), now)
	}
	if n := len(a.enforcers); n != maxEnforcers {
		t.Errorf("%d ids kept, want %d", n, maxEnforcers)
	}
}
