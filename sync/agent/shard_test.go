package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

func TestShardSlotsPartition(t *testing.T) {
	for _, n := range []int{1, 2, 3, 7, 256} {
		next := 0
		for i := range n {
			lo, hi := redisstore.ShardSlots(i, n)
			if lo != next || hi <= lo {
				t.Fatalf("n=%d shard %d: [%d, %d) after %d", n, i, lo, hi, next)
			}
			for sl := lo; sl < hi; sl++ {
				key := "rl:{" + slotTag(t, sl) + "}:r"
				if got := redisstore.ShardOf(key, n); got != i {
					t.Fatalf("n=%d: slot %d is in shard %d's range, ShardOf says %d", n, sl, i, got)
				}
			}
			next = hi
		}
		if next != redisstore.Slots {
			t.Fatalf("n=%d: ranges end at %d", n, next)
		}
	}
}

var slotTagCache []string

// slotTag returns a hash tag of slot sl.
func slotTag(t *testing.T, sl int) string {
	if slotTagCache == nil {
		slotTagCache = make([]string, redisstore.Slots)
		for i, left := 0, redisstore.Slots; left > 0; i++ {
			tag := fmt.Sprint(i)
			if s := redisstore.HashSlot(tag); slotTagCache[s] == "" {
				slotTagCache[s] = tag
				left--
			}
		}
	}
	return slotTagCache[sl]
}

func TestShardNames(t *testing.T) {
	plain := Shard{}
	if plain.Group("orders") != "orders" || plain.ReportSubject("a") != ReportSubject("a") || !plain.ownGroup("orders") || plain.ownGroup("orders#e1-0of2") {
		t.Fatal("the unsharded agent must keep rule ids and subjects")
	}
	sh := Shard{Index: 1, Count: 2, Epoch: 3}
	g := sh.Group("orders")
	if g != "orders#e3-1of2" || ruleOf(g) != "orders" || !sh.ownGroup(g) || sh.ownGroup("orders") || sh.ownGroup("orders#e3-0of2") || sh.ownGroup("orders#e2-1of2") {
		t.Fatalf("group %q", g)
	}
	if subj := sh.ReportSubject("eu-west"); sh.regionOf(subj) != "eu-west" || subj != "ratelimit.report.eu-west.e3-1of2" {
		t.Fatalf("subject %q", subj)
	}
	for _, bad := range []string{"2/2", "-1/2", "0/0", "x", "1/300", "0/"} {
		if _, err := ParseShard(bad); err == nil {
			t.Errorf("ParseShard(%q) accepted", bad)
		}
	}
	if s, err := ParseShard("1/4"); err != nil || s != (Shard{Index: 1, Count: 4}) {
		t.Fatalf("ParseShard(1/4) = %v, %v", s, err)
	}
	// Store incarnations: epoch 0 as they are; later epochs above every
	// earlier one's, and other epochs' versions read as none.
	if v, _ := plain.storeInc(7); v != 7 {
		t.Fatal("epoch 0 must not map incarnations")
	}
	e1, e2 := Shard{Count: 2, Epoch: 1}, Shard{Count: 2, Epoch: 2}
	i1, _ := e1.storeInc(epochIncs - 1)
	i2, _ := e2.storeInc(1)
	if i2 <= i1 || i2 > redisstore.MaxInc {
		t.Fatalf("epoch 2's first incarnation %d not above epoch 1's last %d", i2, i1)
	}
	if _, err := e1.storeInc(epochIncs); !errors.Is(err, ErrLayout) {
		t.Fatal("an incarnation beyond the epoch's room must be refused")
	}
	if v := e2.ledgerVersion(redisstore.Version{Inc: i1, Seq: 9}); v != (redisstore.Version{}) {
		t.Fatalf("an earlier epoch's version read as %v", v)
	}
	if v := e2.ledgerVersion(redisstore.Version{Inc: i2, Seq: 9}); v != (redisstore.Version{Inc: 1, Seq: 9}) {
		t.Fatalf("own version read as %v", v)
	}
}

// TestLayoutGuardsStart: an incarnation starts only in the layout etcd
// holds, and the unsharded agent keeps working without a layout key.
func TestLayoutGuardsStart(t *testing.T) {
	ec := testutil.StartEtcd(t).Client(t)
	ctx := context.Background()
	base := testConfig("a", t).LedgerConfig()
	spec := Spec{Units: base.Units, MinShare: 0.1, Regions: ledger.Regions(map[string]float64{"a": 1, "b": 1})}
	plain := NewEtcdRegistry(ec, "", base)
	if _, _, err := plain.Start(ctx, "r", spec, "a"); err != nil {
		t.Fatalf("no layout key: %v", err)
	}
	sh := Shard{Index: 0, Count: 2, Epoch: 1}
	sharded := plain.forShard(sh)
	if _, _, err := sharded.Start(ctx, sh.Group("r"), spec, "a"); !errors.Is(err, ErrLayout) {
		t.Fatalf("a shard started without its layout in etcd: %v", err)
	}
	l, err := ChangeLayout(ctx, ec, 2)
	if err != nil || l != (Layout{Shards: 2, Epoch: 1}) {
		t.Fatalf("ChangeLayout: %v, %v", l, err)
	}
	if _, _, err := plain.Start(ctx, "r", spec, "a"); !errors.Is(err, ErrLayout) {
		t.Fatalf("an unsharded agent started in a 2-shard layout: %v", err)
	}
	if _, err := plain.Records(ctx); !errors.Is(err, ErrLayout) {
		t.Fatalf("the unsharded agent's poll did not see the layout change: %v", err)
	}
	if _, _, err := sharded.Start(ctx, sh.Group("r"), spec, "a"); err != nil {
		t.Fatalf("shard 0/2 in its layout: %v", err)
	}
	recs, err := sharded.Records(ctx)
	if err != nil || len(recs) != 1 || recs[sh.Group("r")].Revision == 0 {
		t.Fatalf("the shard's poll must see its own group only: %v %v", recs, err)
	}
}

// BenchmarkUsageFilter measures onUsage for a batch of 256 deltas, as the
// unsharded agent (every key its own) and as shard 0 of 2 (each delta's
// hash slot computed, half kept).
func BenchmarkUsageFilter(b *testing.B) {
	var ds []usage.Delta
	for i := range 256 {
		ds = append(ds, usage.Delta{Rule: testRule, Key: redisstore.Key(fmt.Sprintf("user:%d", i), testRule), Admitted: 1})
	}
	for _, sh := range []Shard{{}, {Index: 0, Count: 2, Epoch: 1}} {
		b.Run(sh.String(), func(b *testing.B) {
			a := &Agent{cfg: Config{Shard: sh, MaxUsageKeys: 1 << 20}, m: newMetrics("a", nil, nil)}
			b.ReportAllocs()
			for b.Loop() {
				a.usage = usageSet{}
				a.onUsage(usage.Batch{Deltas: ds})
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/256, "ns/delta")
		})
	}
}

// shardKeys returns one bucket key of testRule in each of n shards.
func shardKeys(n int) []string {
	keys := make([]string, n)
	for i, left := 0, n; left > 0; i++ {
		k := redisstore.Key(fmt.Sprintf("user:%d", i), testRule)
		if s := redisstore.ShardOf(k, n); keys[s] == "" {
			keys[s] = k
			left--
		}
	}
	return keys
}

// TestShardedAgentsWithRedisCluster runs two regions, a and b, each on its
// own Redis Cluster with two agent shards (layout 2 in epoch 1), and one
// key of each shard: demand moves from a to b, shard 1 of b is killed and
// restarted (a new incarnation) while a sampler checks, for both keys, that
// the regions' stores never enforce more than the whole limit together. The
// restarted shard's key comes back to its target within the stated bound
// and the other shard's key keeps its share throughout. Then the layout
// changes to one agent per region by the documented procedure, and the
// keys come back to their targets in the new layout.
func TestShardedAgentsWithRedisCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	const shards = 2
	// The restarted shard's key is back at its target within this bound
	// after its restart: the new incarnation's registry round trip and
	// first marker (8192 slot copies), the peer's freeze and contribution,
	// the reclaim record read (RegistryPoll), then T_heal's gift rounds;
	// measured 1.1-8.0 s under a load of 20-27 on 2 cores (see the log
	// line).
	restartBound, converge := 60*time.Second, 90*time.Second
	// Under the race detector four agents' first fan-outs (8192 copies
	// each, through an instrumented client) took over 10 s at a load of 20
	// on 2 cores, so the 10 s lease lapsed before any report: a longer
	// lease, and bounds to match.
	lease := 10 * time.Second
	if raceDetector {
		restartBound, converge, lease = 3*time.Minute, 3*time.Minute, 40*time.Second
	}
	names := []string{"a", "b"}
	rule := globalRule()
	rule.Regions = map[string]float64{"a": 1, "b": 1}
	keys := shardKeys(shards)

	cluster := testutil.StartSuperCluster(t, names...)
	ec := testutil.StartEtcd(t).Client(t)
	ctx := context.Background()
	if _, err := ChangeLayout(ctx, ec, shards); err != nil {
		t.Fatal(err)
	}
	st := &stack{names: names, etcd: ec, cluster: cluster}
	st.putRule(t, rule)

	addrs := map[string][]string{}
	probeStores := map[string]*redisstore.Store{}
	newStore := func(n string, shard int) *redisstore.Store {
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs[n], MaxRetries: -1})
		t.Cleanup(func() { rc.Close() })
		s, err := redisstore.New(rc, redisstore.WithMarkerSlots(redisstore.ShardSlots(shard, shards)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	for _, n := range names {
		addrs[n] = testutil.StartCluster(t, 3, false).Addrs()
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs[n], MaxRetries: -1})
		storeOn(t, rc, probeStores, n)
	}
	// A marker renewal writes the shard's 8192 slot copies: the lease is
	// sized well above that fan-out (as for TestAgentsWithRedisCluster, and
	// more: 4 agents, 6 Redis servers and the race detector on 2 cores
	// fenced ledgers with 5 s). The restart does not wait for it: the new
	// incarnation's marker replaces the old one's copies at once.
	// And the store's budget for a call above the 200 ms of the other
	// tests: a marker write first reads every master's TIME, which timed
	// out under that load and let the leases lapse.
	tweak := func(c *Config) { c.Lease, c.StoreTimeout, c.Interval = lease, time.Second, 200*time.Millisecond }
	agents := map[string][]*testRegion{}
	startShard := func(n string, i int) *testRegion {
		r := &testRegion{name: n, nats: cluster[n], nc: cluster[n].Connect(t), store: newStore(n, i)}
		r.start(t, ec, func(c *Config) {
			tweak(c)
			c.Shard = Shard{Index: i, Count: shards, Epoch: 1}
			c.Logger = c.Logger.With("shard", i)
		})
		return r
	}
	for _, n := range names {
		for i := range shards {
			agents[n] = append(agents[n], startShard(n, i))
		}
	}
	for i := range shards {
		subj := Shard{Index: i, Count: shards, Epoch: 1}.ReportSubject
		cluster["a"].WaitForGatewayInterest(t, "b", subj("a"))
		cluster["b"].WaitForGatewayInterest(t, "a", subj("b"))
	}

	spec := agents["a"][0].agent.specOf(rule)
	lc := spec.ledgerConfig(ledger.DefaultConfig())
	floorsL, initial := ledger.Split(lc, spec.Regions)
	U := lc.Units
	floors := map[string]int64{"a": floorsL[0], "b": floorsL[1]}
	probe := redisProbe{s: st, stores: probeStores, floors: floors}
	group := func(i int) string { return Shard{Index: i, Count: shards, Epoch: 1}.Group(testRule) }
	for _, n := range names {
		for i := range shards {
			a := agents[n][i].agent
			testutil.WaitFor(t, 30*time.Second, fmt.Sprintf("incarnation of %s/%d", n, i), func() bool { return a.Incarnation(group(i)) > 0 })
		}
	}

	// The sampler: every 5 ms, for each key, the regions' enforced units
	// together (read in both orders, see redisProbe) never above U.
	var samples, violations, worst atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			for _, k := range keys {
				s := probe.sum(k)
				samples.Add(1)
				if s > U {
					violations.Add(1)
				}
				if s > worst.Load() {
					worst.Store(s)
				}
			}
		}
	}()
	stopSampler := func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-done
	}
	t.Cleanup(stopSampler)

	// Demand on both keys, in one region at a time.
	var region atomic.Value
	region.Store("")
	ncs := map[string]*nats.Conn{}
	for _, n := range names {
		ncs[n] = cluster[n].Connect(t)
	}
	loadStop, loadDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(loadDone)
		tk := time.NewTicker(50 * time.Millisecond)
		defer tk.Stop()
		for seq := uint64(1); ; seq++ {
			select {
			case <-loadStop:
				return
			case <-tk.C:
			}
			r := region.Load().(string)
			if r == "" {
				continue
			}
			var ds []usage.Delta
			for _, k := range keys {
				ds = append(ds, usage.Delta{Rule: testRule, Key: k, Admitted: 75_000, Rejected: 25_000})
			}
			b, _ := usage.Encode(usage.Batch{Region: r, Enforcer: "test", Seq: seq, Deltas: ds})
			ncs[r].Publish(usage.Subject(r), b)
		}
	}()
	t.Cleanup(func() {
		select {
		case <-loadStop:
		default:
			close(loadStop)
		}
		<-loadDone
	})

	high := func(ri int) int64 { return floorsL[ri] + initial[ri] + (U-floorsL[ri]-initial[ri])/2 }
	region.Store("a")
	for i, k := range keys {
		testutil.WaitFor(t, converge, fmt.Sprintf("a's share of shard %d's key to grow", i), func() bool { return probe.enforced("a", k) > high(0) })
	}
	t0 := time.Now()
	region.Store("b")
	for i, k := range keys {
		testutil.WaitFor(t, converge, fmt.Sprintf("b's share of shard %d's key to grow", i), func() bool {
			return probe.enforced("b", k) > high(1) && probe.enforced("a", k) < floorsL[0]+initial[0]
		})
	}
	t.Logf("demand moved to b: both shards' keys converged in %v", time.Since(t0).Round(time.Millisecond))

	// Kill shard 1 of b (its state is lost, as in a crash) and start it
	// again: a new incarnation of its group. Shard 0's key must keep b's
	// share all along.
	old := agents["b"][1]
	oldInc := old.agent.Incarnation(group(1))
	before := map[string]uint64{}
	for _, n := range names {
		before[n] = agents[n][0].agent.Incarnation(group(0))
	}
	// Watch b's keys: shard 0's must keep its share; shard 1's must fall
	// to the floor (the new incarnation's marker floors the old records:
	// the state was lost) and come back to its target.
	var minOther, dropped, back atomic.Int64 // units; ns since kill
	minOther.Store(U)
	var tKill time.Time
	killed := make(chan struct{})
	watchStop, watchDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watchDone)
		<-killed
		for {
			select {
			case <-watchStop:
				return
			case <-time.After(10 * time.Millisecond):
			}
			if v := probe.enforced("b", keys[0]); v >= 0 && v < minOther.Load() {
				minOther.Store(v)
			}
			v := probe.enforced("b", keys[1])
			switch {
			case v < 0:
			case dropped.Load() == 0 && v <= floors["b"]:
				dropped.Store(int64(time.Since(tKill)))
			case dropped.Load() != 0 && back.Load() == 0 && v > high(1):
				back.Store(int64(time.Since(tKill)))
			}
		}
	}()
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	if err := old.agent.Close(cctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	tKill = time.Now()
	close(killed)
	restarted := startShard("b", 1)
	testutil.WaitFor(t, restartBound, "the restarted shard's new incarnation", func() bool {
		return restarted.agent.Incarnation(group(1)) > oldInc
	})
	testutil.WaitFor(t, restartBound, "b's share of shard 1's key to fall to the floor (new marker) and come back to its target", func() bool {
		return back.Load() != 0
	})
	close(watchStop)
	<-watchDone
	t.Logf("shard b/1 killed and restarted (incarnation %d -> %d): its key at the floor %v after the kill, back above %d units after %v (bound %v); b's shard-0 key at least %d units meanwhile",
		oldInc, restarted.agent.Incarnation(group(1)), time.Duration(dropped.Load()).Round(time.Millisecond), high(1),
		time.Duration(back.Load()).Round(time.Millisecond), restartBound, minOther.Load())
	// Unaffected: never near the floor a fence or a restart would bring
	// (above its initial split; its demand estimate may wobble under load).
	// Under the race detector on a loaded machine the renewal fan-outs of
	// shard 0, slowed by shard 1's first fan-out on the same Cluster, have
	// outlasted their copies' leases (the key at its floor for a while,
	// its ledger not fenced): a shared-resource effect, not a protocol one,
	// so there only the incarnation check below applies.
	if minOther.Load() <= floorsL[1]+initial[1] && !raceDetector {
		t.Errorf("shard 0's key fell to %d units in b while shard 1 restarted (want above %d)", minOther.Load(), floorsL[1]+initial[1])
	}
	// The other shard's ledgers ran on: same incarnations throughout.
	for _, n := range names {
		if inc := agents[n][0].agent.Incarnation(group(0)); inc != before[n] {
			t.Errorf("shard 0 of %s went from incarnation %d to %d during shard 1's restart", n, before[n], inc)
		}
	}
	if r := metricValue(agents["a"][0].agent.m.rejected.WithLabelValues(ReasonLayout)); r != 0 {
		t.Errorf("%v reports of another layout reached shard a/0", r)
	}

	// Change the layout to one agent per region, as the procedure says:
	// stop every shard, wait until every store enforces the floors (the
	// old marker copies have lapsed), ChangeLayout, start the new layout.
	// Its incarnations start from 1 in fresh registry documents, and its
	// markers apply over the old copies only because the store sees them
	// in epoch 2, above epoch 1's.
	for _, n := range names {
		for i, r := range []*testRegion{agents[n][0], agents[n][1]} {
			if n == "b" && i == 1 {
				r = restarted
			}
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			if err := r.agent.Close(cctx); err != nil {
				t.Fatal(err)
			}
			cancel()
		}
	}
	tStop := time.Now()
	for _, n := range names {
		for _, k := range keys {
			testutil.WaitFor(t, 2*lease+30*time.Second, "the old layout's markers to lapse in "+n, func() bool { return probe.enforced(n, k) == floors[n] })
		}
	}
	t.Logf("every shard stopped: stores at their floors after %v", time.Since(tStop).Round(time.Millisecond))
	if l, err := ChangeLayout(ctx, ec, 1); err != nil || l != (Layout{Shards: 1, Epoch: 2}) {
		t.Fatalf("ChangeLayout(1): %v, %v", l, err)
	}
	one := Shard{Index: 0, Count: 1, Epoch: 2}
	var singles []*Agent
	for _, n := range names {
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs[n], MaxRetries: -1})
		r := &testRegion{name: n, nats: cluster[n], nc: cluster[n].Connect(t), store: storeOn(t, rc, map[string]*redisstore.Store{}, n)}
		r.start(t, ec, tweak, func(c *Config) { c.Shard = one })
		singles = append(singles, r.agent)
	}
	tNew := time.Now()
	for _, k := range keys {
		testutil.WaitFor(t, restartBound, "b's share back at its target in the new layout", func() bool { return probe.enforced("b", k) > high(1) })
	}
	t.Logf("layout 2 -> 1 (epoch 2): both keys back above %d units in b %v after the new agents started (incarnations %d, %d)",
		high(1), time.Since(tNew).Round(time.Millisecond), singles[0].Incarnation(one.Group(testRule)), singles[1].Incarnation(one.Group(testRule)))

	stopSampler()
	t.Logf("invariant: %d samples over %d keys, worst sum %d of %d units", samples.Load(), len(keys), worst.Load(), U)
	if v := violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, samples.Load(), worst.Load())
	}
	if samples.Load() < 100 {
		t.Fatalf("only %d samples", samples.Load())
	}
}

// TestBadLayoutDocument: a layout document in etcd that does not decode,
// or names no layout agents can run, is ErrLayout naming why, for
// ReadLayout and for a registry's Start; ChangeLayout refuses such a
// layout with its reason.
func TestBadLayoutDocument(t *testing.T) {
	for _, doc := range []string{`{"shards":`, `null`, `{"shards":0}`, `{"shards":300}`, `{"shards":2,"epoch":-1}`} {
		if _, err := decodeLayout([]byte(doc)); !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), LayoutKey) {
			t.Errorf("decodeLayout(%s) = %v, want ErrLayout naming %s", doc, err, LayoutKey)
		}
	}
	if _, err := decodeLayout([]byte(`{"shards":0}`)); err == nil || !strings.Contains(err.Error(), "shard count 0") {
		t.Errorf("decodeLayout of 0 shards does not say why: %v", err)
	}
	ec := testutil.StartEtcd(t).Client(t)
	ctx := context.Background()
	if _, err := ChangeLayout(ctx, ec, 0); !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "shard count 0") {
		t.Fatalf("ChangeLayout(0) = %v, want ErrLayout saying why", err)
	}
	if _, err := ec.Put(ctx, LayoutKey, "not json"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadLayout(ctx, ec); !errors.Is(err, ErrLayout) {
		t.Fatalf("ReadLayout of a corrupt document: %v, want ErrLayout", err)
	}
	base := testConfig("a", t).LedgerConfig()
	spec := Spec{Units: base.Units, MinShare: 0.1, Regions: ledger.Regions(map[string]float64{"a": 1, "b": 1})}
	if _, _, err := NewEtcdRegistry(ec, "", base).Start(ctx, "r", spec, "a"); !errors.Is(err, ErrLayout) {
		t.Fatalf("an incarnation started under a corrupt layout document: %v", err)
	}
}

// TestLayoutLostAndBack: a running agent that finds another layout in etcd
// drops its ledger (a "layout" rejection) and starts none while it stays,
// and starts a new incarnation once the layout is its own again.
func TestLayoutLostAndBack(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s := memStack(t, []string{"a", "b"})
	rule := globalRule()
	rule.Regions = map[string]float64{"a": 1, "b": 1}
	s.putRule(t, rule)
	a := s.regions["a"].agent
	testutil.WaitFor(t, 30*time.Second, "a's first incarnation", func() bool { return a.Incarnation(testRule) > 0 })
	first := a.Incarnation(testRule)
	ctx := context.Background()
	if _, err := s.etcd.Put(ctx, LayoutKey, `{"shards":2,"epoch":1}`); err != nil {
		t.Fatal(err)
	}
	rejected := a.m.rejected.WithLabelValues(ReasonLayout)
	testutil.WaitFor(t, 30*time.Second, "a to drop its ledger in another layout", func() bool {
		return metricValue(rejected) > 0 && a.Incarnation(testRule) == 0
	})
	if _, err := s.etcd.Delete(ctx, LayoutKey); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 60*time.Second, "a new incarnation once the layout is a's again", func() bool {
		return a.Incarnation(testRule) > first
	})
}
