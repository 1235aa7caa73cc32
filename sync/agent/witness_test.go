package agent

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestTwoRegionLossWitness: two regions, both sending twice a global
// limit, so each holds about half; then b's agent stops for good (its
// reports and its witness renewals stop; its store stays, its marker
// lapses to the floor). a takes b's witness key in etcd once b has been
// silent and its key unchanged for the witness's reclaim wait, and
// reclaims what b held: within that wait plus witnessSlack, a holds all
// but b's floor. At every sample the two stores together enforce at most
// the limit. b's agent then comes back: its witness key is written again,
// and b's share follows its demand again. Real agents on an embedded NATS
// super-cluster and etcd, the in-memory contract store.
func TestTwoRegionLossWitness(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	names := []string{"a", "b"}
	const witness = 2 * time.Second
	tweak := func(c *Config) {
		c.PeerKeys = testPeerKeys(t, names...)
		c.WitnessLease = witness
	}
	s := memStack(t, names, tweak)
	const rate = 10_000
	s.putRule(t, rules.Rule{ID: testRule, Match: map[string]string{"resource": "POST /orders"}, Key: []string{"client_key"},
		Algorithm: rules.TokenBucket, Capacity: rate, RefillPerSecond: rate, Scope: rules.Global, MinShare: 0.1,
		Regions: map[string]float64{"a": 1, "b": 1}})
	a, b := s.regions["a"], s.regions["b"]
	testutil.WaitFor(t, 20*time.Second, "both incarnations", func() bool {
		return a.agent.Incarnation(testRule) > 0 && b.agent.Incarnation(testRule) > 0
	})
	spec := a.agent.specOf(rules.Rule{ID: testRule, Scope: rules.Global, MinShare: 0.1, Regions: map[string]float64{"a": 1, "b": 1}})
	cfg := spec.ledgerConfig(ledger.DefaultConfig())
	U, floors := cfg.Units, floorsOf(spec)
	s.probe = memProbe{s: s, floors: floors}
	sm := startSampler(t, s, U)
	stopA := usagetest.Publish(t, s.cluster["a"].Connect(t), "a", testRule, testKey, 2*rate)
	defer stopA()
	stopB := usagetest.Publish(t, s.cluster["b"].Connect(t), "b", testRule, testKey, 2*rate)
	// b has written its witness key and a has read it (a region that never
	// wrote one is never taken).
	testutil.WaitFor(t, 20*time.Second, "a to see b's witness key", func() bool {
		var rev int64
		_ = a.agent.onLoop(context.Background(), func() { rev = a.agent.drv.SeenWitness("b") })
		return rev > 0
	})
	testutil.WaitFor(t, 20*time.Second, "b to hold a third of the limit", func() bool { return s.enforced("b", testKey) >= U/3 })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stopB()
	if err := b.agent.Close(ctx); err != nil {
		t.Fatal(err)
	}
	lost := time.Now()
	held := s.enforced("b", testKey)
	lc := a.agent.lcfg
	bound := lc.WitnessReclaimAfter() + witnessSlack
	testutil.WaitFor(t, bound, "a to reclaim b's share", func() bool { return s.enforced("a", testKey) >= U-floors["b"] })
	took := time.Since(lost)
	t.Logf("b held %d of %d units when its agent stopped; a holds all but b's floor (%d) %v later (reclaim wait %v, bound %v)",
		held, U, floors["b"], took.Round(time.Millisecond), lc.WitnessReclaimAfter(), bound)
	if took < lc.WitnessReclaimAfter() {
		t.Errorf("a reclaimed %v after b stopped, before the wait %v", took, lc.WitnessReclaimAfter())
	}
	if n := metricValue(a.agent.m.witnessTakes); n != 1 {
		t.Errorf("a took %v witness keys, want 1", n)
	}

	// b comes back: a new agent, a new incarnation; its demand is half.
	b.start(t, s.etcd, tweak)
	stopB = usagetest.Publish(t, s.cluster["b"].Connect(t), "b", testRule, testKey, 2*rate)
	defer stopB()
	back := time.Now()
	testutil.WaitFor(t, liveRestartBound, "b's share back", func() bool { return s.enforced("b", testKey) >= U/3 })
	t.Logf("b holds %d units %v after its return", s.enforced("b", testKey), time.Since(back).Round(time.Millisecond))
	if n := metricValue(b.agent.m.witness.WithLabelValues("renewed")); n < 1 {
		t.Errorf("b's new agent renewed its witness key %v times", n)
	}
	// A restarted agent's first write replaces the key whoever wrote it:
	// the take is not counted as taken on its side (docs/operations.md,
	// Region lost, step 6), only on the survivor's (witnessTakes above).
	if n := metricValue(b.agent.m.witness.WithLabelValues("taken")); n != 0 {
		t.Errorf("b's new agent counted its witness key taken %v times, want 0", n)
	}
	sm.finish()
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}

// witnessSlack is what TestTwoRegionLossWitness allows beyond the reclaim
// wait: a registry poll to see b's key, the take, the contribution and the
// registry's record (etcd round trips each), a tick, a store write.
const witnessSlack = 5 * time.Second

// TestWitnessKeys: the etcd side of the witness against an embedded etcd.
// A first renewal writes the key over whatever is there; later ones go by
// compare-and-swap on the revision written last; a take succeeds only at
// the revision it names, after which the owner's renewal reports the key
// taken and writes it again. Each shard group reads only its own keys.
func TestWitnessKeys(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts etcd")
	}
	ec := testutil.StartEtcd(t).Client(t)
	ctx := context.Background()
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	other := reg.forShard(Shard{Index: 1, Count: 2, Epoch: 1})
	rev, taken, err := reg.renewWitness(ctx, "a", 0, "renewed by a 1", "")
	if err != nil || taken || rev == 0 {
		t.Fatalf("first renewal: rev %d taken %v err %v", rev, taken, err)
	}
	rev2, taken, err := reg.renewWitness(ctx, "a", rev, "renewed by a 2", "")
	if err != nil || taken || rev2 <= rev {
		t.Fatalf("renewal at %d: rev %d taken %v err %v", rev, rev2, taken, err)
	}
	if _, _, err := other.renewWitness(ctx, "a", 0, "shard 1 of a", ""); err != nil {
		t.Fatal(err)
	}
	if _, _, err := reg.renewWitness(ctx, "b", 0, "renewed by b", ""); err != nil {
		t.Fatal(err)
	}
	// The registry poll reads the keys in its own transaction.
	read := func() map[string]int64 {
		t.Helper()
		if _, err := reg.Records(ctx); err != nil {
			t.Fatal(err)
		}
		return reg.readWitness()
	}
	if got := read(); len(got) != 2 || got["a"] != rev2 || got["b"] == 0 {
		t.Fatalf("read %v, want a at %d and b", got, rev2)
	}
	all, err := ec.Get(ctx, reg.WitnessPrefix(), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if got := other.witnessRevs(all.Kvs); len(got) != 1 || got["a"] == 0 || got["a"] == rev2 {
		t.Fatalf("shard 1 read %v, want only its own key of a", got)
	}
	// b takes a's key: not at a stale revision, at the current one.
	if ok, err := reg.takeWitness(ctx, "a", rev, "taken by b"); err != nil || ok {
		t.Fatalf("take at the stale revision %d: ok %v err %v", rev, ok, err)
	}
	if ok, err := reg.takeWitness(ctx, "a", rev2, "taken by b"); err != nil || !ok {
		t.Fatalf("take at %d: ok %v err %v", rev2, ok, err)
	}
	rev3, taken, err := reg.renewWitness(ctx, "a", rev2, "renewed by a 3", "renewed by a 2")
	if err != nil || !taken || rev3 <= rev2 {
		t.Fatalf("renewal after the take: rev %d taken %v err %v, want taken and written again", rev3, taken, err)
	}
	if got := read(); got["a"] != rev3 {
		t.Fatalf("a's key at %d after it was written again, want %d", got["a"], rev3)
	}
	// A renewal whose answer was lost: the key moved, but to a's own value.
	lost, _, err := reg.renewWitness(ctx, "a", rev3, "renewed by a 4", "")
	if err != nil {
		t.Fatal(err)
	}
	rev5, taken, err := reg.renewWitness(ctx, "a", rev3, "renewed by a 5", "renewed by a 4")
	if err != nil || taken || rev5 <= lost {
		t.Fatalf("renewal after a lost answer: rev %d taken %v err %v, want written, not taken", rev5, taken, err)
	}
}
