package agent

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/apportion/apportion/sync/ledger"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestRegistryLostRegionRejoins: etcd lost its data (or was restored from
// an older snapshot) while a region's store kept the marker of its
// incarnation 2. Its agent, restarted, got incarnation 1 from the
// recreated registry; the store refused that incarnation's marker (it
// keeps the highest incarnation's) and the ledger ignored the answers as
// another incarnation's, so the region held its floor for good, with
// nothing logged or counted (an explorer: 150 s and counting, at 2
// regions). Now an incarnation whose store holds a marker it never wrote
// fences (ledger.Output.Superseded), the agent logs it at ERROR and
// counts it in apportion_sync_incarnations_superseded_total, and the
// next incarnation, numbered past the store's, serves again: the region
// takes part in the allocation within liveRestartBound of its start and
// gets its part of what its peer holds. (What the region held before is
// stranded until the rule is put again under a new id: the runbook.) At 2,
// 3 and 10 regions, 10,000 requests per second, two regions loaded alike;
// at every sample the regions together enforce at most the limit. (Not at
// 1/s: a's token, held before the loss, is what stays stranded, so there
// the region takes part again but has nothing to serve until the runbook.)
func TestRegistryLostRegionRejoins(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	for _, n := range []int{2, 3, 10} {
		t.Run(fmt.Sprintf("regions=%d", n), func(t *testing.T) { registryLost(t, n) })
	}
}

func registryLost(t *testing.T, n int) {
	const rate = 10_000
	s, names, rule, keys := liveStack(t, n, rate)
	a := s.regions["a"]
	spec := a.agent.specOf(rule)
	U := spec.ledgerConfig(ledger.DefaultConfig()).Units
	s.probe = memProbe{s: s, floors: floorsOf(spec)}
	sm := startSampler(t, s, U)
	for _, nm := range names[:2] {
		usagetest.Start(t, s.cluster[nm].Connect(t), nm, testRule, testKey, 2*rate)
	}
	fair := U / 3 // each of the two loaded regions' part is half
	testutil.WaitFor(t, liveRestartBound, "a to hold its part", func() bool { return s.enforced("a", testKey) >= fair })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	restart := func() {
		t.Helper()
		if err := a.agent.Close(ctx); err != nil {
			t.Fatal(err)
		}
		a.start(t, s.etcd, keys)
	}
	restart() // incarnation 2: its marker is in a's store
	testutil.WaitFor(t, liveRestartBound, "a's second incarnation to hold its part", func() bool {
		return a.agent.Incarnation(testRule) == 2 && s.enforced("a", testKey) >= fair
	})

	// etcd loses the registry; a's agent restarts.
	if err := a.agent.Close(ctx); err != nil {
		t.Fatal(err)
	}
	reg := NewEtcdRegistry(s.etcd, "", ledger.DefaultConfig())
	for _, p := range []string{reg.Key(testRule), reg.ChunkPrefix()} {
		if _, err := s.etcd.Delete(ctx, p, clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
	}
	a.start(t, s.etcd, keys)
	started := time.Now()
	testutil.WaitFor(t, liveRestartBound, "a to serve again, past its store's marker", func() bool {
		return a.agent.Incarnation(testRule) > 2 && s.enforced("a", testKey) >= U/10
	})
	t.Logf("a serves %d of %d units again %v after its start (incarnation %d; %v incarnations superseded)",
		s.enforced("a", testKey), U, time.Since(started).Round(time.Millisecond), a.agent.Incarnation(testRule), metricValue(a.agent.m.superseded))
	if got := metricValue(a.agent.m.superseded); got < 1 {
		t.Errorf("apportion_sync_incarnations_superseded_total = %v, want at least 1", got)
	}
	sm.finish()
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}
