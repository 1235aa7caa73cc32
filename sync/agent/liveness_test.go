package agent

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
	dto "github.com/prometheus/client_model/go"
)

// liveRestartBound is how long after its agent restarts a region whose
// clients send all the demand may take to serve the whole limit again.
// What it takes: the peers hear the new incarnation, freeze the old one
// and reclaim what it held through etcd (a registry round trip each; with
// three regions or more they may have reclaimed it by its silence
// already), the new incarnation's demand estimate counts, and the gifts
// reach it. Measured 0.3-1.1 s in every case, also with the race detector
// while a fuzz pass used both cores, and 0.1-0.2 s after a store restart
// (restartLiveness logs each case's time).
const liveRestartBound = 10 * time.Second

// TestRestartLiveness: one region's clients send twice a global limit, the
// others nothing, so the busy region holds the limit; then its agent stops
// (its state dropped, as in a crash) and a new one starts at once, or after
// three leases (by then, with three regions or more, the others have
// reclaimed what it held by its silence; with two the other keeps its
// position). The new incarnation's marker floors what the old one held.
// Within liveRestartBound of the start the region holds the whole limit
// again, and at every sample the regions' stores together enforce at most
// the limit. The same when the region's store restarts empty instead (a
// Redis restart: a new run id, no marker, no records): the agent re-writes
// its records and re-creates its marker. At 2 and 10 regions, at 1 and
// 10,000 requests per second (burst the same): real agents on an embedded
// NATS super-cluster and etcd, the in-memory contract store.
func TestRestartLiveness(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	lease := testConfig("a", t).Lease
	for _, n := range []int{2, 10} {
		for _, rate := range []int64{1, 10_000} {
			for _, down := range []time.Duration{0, 3 * lease} {
				t.Run(fmt.Sprintf("regions=%d/rate=%d/down=%v", n, rate, down), func(t *testing.T) { restartLiveness(t, n, rate, down, false) })
			}
			t.Run(fmt.Sprintf("regions=%d/rate=%d/store", n, rate), func(t *testing.T) { restartLiveness(t, n, rate, 0, true) })
		}
	}
}

// liveStack starts n regions named a, b, ... over memStores (the tweaks
// applied to every agent's configuration, after the peers' keys), puts a
// global token bucket of rate per second (burst the same) over all of them
// with equal weights, and waits for every region's incarnation. keys sets
// the peers' keys, for an agent started again.
func liveStack(t *testing.T, n int, rate int64, tweak ...func(*Config)) (s *stack, names []string, rule rules.Rule, keys func(*Config)) {
	for i := range n {
		names = append(names, string(rune('a'+i)))
	}
	keys = func(c *Config) { c.PeerKeys = testPeerKeys(t, names...) }
	s = memStack(t, names, append([]func(*Config){keys}, tweak...)...)
	rule = rules.Rule{ID: testRule, Match: map[string]string{"resource": "POST /orders"}, Key: []string{"client_key"},
		Algorithm: rules.TokenBucket, Capacity: rate, RefillPerSecond: float64(rate), Scope: rules.Global,
		Regions: map[string]float64{}}
	for _, nm := range names {
		rule.Regions[nm] = 1
	}
	s.putRule(t, rule)
	s.waitIncarnations(t)
	return s, names, rule, keys
}

func restartLiveness(t *testing.T, n int, rate int64, down time.Duration, store bool) {
	s, names, rule, keys := liveStack(t, n, rate)
	a := s.regions["a"]
	spec := a.agent.specOf(rule)
	U := spec.ledgerConfig(ledger.DefaultConfig()).Units
	s.probe = memProbe{s: s, floors: floorsOf(spec)}
	// Serving the limit: a whole token of one (burst 1 is all of it), nine
	// tenths of ten thousand.
	serving := U
	if rate > 1 {
		serving = U * 9 / 10
	}

	sm := startSampler(t, s, U)
	stopLoad := usagetest.Publish(t, s.cluster["a"].Connect(t), "a", testRule, testKey, 2*float64(rate))
	t0 := time.Now()
	testutil.WaitFor(t, liveRestartBound, "a to hold the limit", func() bool { return s.enforced("a", testKey) >= serving })
	t.Logf("a holds %d of %d units %v after its demand began", s.enforced("a", testKey), U, time.Since(t0).Round(time.Millisecond))

	var fault string
	back := func() bool { return true } // besides a's enforced units
	if store {
		s.world.mu.Lock()
		a.mem.resetLocked("a")
		s.world.mu.Unlock()
		fault = "a's store restarted empty"
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		oldInc := a.agent.Incarnation(testRule)
		if err := a.agent.Close(ctx); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		if down > 0 && n > 2 {
			// The others reclaim a's share by its silence: a is at its floor
			// and they hold the rest (a's units go where the demand is not,
			// and come back when a's new incarnation reports its demand).
			testutil.WaitFor(t, liveRestartBound, "the others to reclaim a's share", func() bool {
				return s.enforced("a", testKey) == 0 && others(s, names[1:]) >= serving
			})
			t.Logf("the others reclaimed a's share %v after it stopped", time.Since(stopped).Round(time.Millisecond))
		}
		// The rest of the outage: its length, not synchronisation. With two
		// regions the other cannot tell a silent agent from a cut link and
		// keeps its position (sync/ledger doc, Partitions): it reclaims a's
		// old incarnation when it hears the new one.
		time.Sleep(time.Until(stopped.Add(down)))
		if down > 0 {
			t.Logf("after %v down: a enforces %d units, the others hold %d", down, s.enforced("a", testKey), others(s, names[1:]))
		}
		a.start(t, s.etcd, keys)
		fault = fmt.Sprintf("a's agent restarted (incarnation %d)", oldInc)
		back = func() bool { return a.agent.Incarnation(testRule) > oldInc }
	}
	t1 := time.Now()
	low := U // a's least enforced units since the fault
	testutil.WaitFor(t, liveRestartBound, "a to serve the limit again", func() bool {
		e := s.enforced("a", testKey)
		low = min(low, e)
		return e >= serving && back()
	})
	took := time.Since(t1)
	stopLoad()
	sm.finish()
	t.Logf("%s: a fell to %d units, held %d of %d again after %v (bound %v, incarnation %d); %d samples, worst sum %d",
		fault, low, s.enforced("a", testKey), U, took.Round(time.Millisecond), liveRestartBound, a.agent.Incarnation(testRule),
		sm.samples.Load(), sm.worst.Load())
	if low >= serving {
		t.Errorf("a never fell below %d units after the fault: it was not a fault", serving)
	}
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}

// others is what the agents of names hold of testKey.
func others(s *stack, names []string) int64 {
	var sum int64
	for _, nm := range names {
		sum += s.regions[nm].agent.Shares(testRule)[testKey]
	}
	return sum
}

// apportion_sync_fenced (the ApportionRegionFenced alert) is 1 while a
// region holds its floor because it hears no peer: from its ledger's fence
// until a peer's report arrives again, not only for the milliseconds
// before the fenced ledger's new incarnation starts. At 3 and 10 regions
// (two regions do not fence while they reach etcd: the witness), at 1 and
// 10,000 requests per second.
func TestFencedGaugeLastsUntilAPeerIsHeard(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	for _, n := range []int{3, 10} {
		for _, rate := range []int64{1, 10_000} {
			t.Run(fmt.Sprintf("regions=%d/rate=%d", n, rate), func(t *testing.T) { fencedGauge(t, n, rate) })
		}
	}
}

func fencedGauge(t *testing.T, n int, rate int64) {
	s, names, _, keys := liveStack(t, n, rate)
	a := s.regions["a"]
	fenced := func() float64 {
		var m dto.Metric
		if err := a.agent.m.fenced.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetGauge().GetValue()
	}
	if f := fenced(); f != 0 {
		t.Fatalf("fenced = %v with every peer up, want 0", f)
	}
	inc := a.agent.Incarnation(testRule)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, nm := range names[1:] {
		if err := s.regions[nm].agent.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	lease := testConfig("a", t).Lease
	testutil.WaitFor(t, 5*lease, "a to fence", func() bool { return a.agent.Incarnation(testRule) > inc && fenced() == 1 })
	// Alone, a stays at its floor: the gauge stays up through later leases
	// (and the new incarnations they bring).
	deadline := time.Now().Add(2 * lease)
	for time.Now().Before(deadline) {
		if f := fenced(); f != 1 {
			t.Fatalf("fenced = %v %v into a's isolation, want 1 until a peer is heard", f, time.Until(deadline))
		}
		time.Sleep(lease / 10) // sampling the gauge, not synchronising
	}
	back := time.Now()
	s.regions["b"].start(t, s.etcd, keys)
	testutil.WaitFor(t, 5*lease, "the gauge to drop once b is heard", func() bool { return fenced() == 0 })
	t.Logf("fenced back to 0 %v after b's agent started (bound %v)", time.Since(back).Round(time.Millisecond), 5*lease)
}
