package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	testRule = "orders"
	testKey  = "rl:{user:42}:orders"
)

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.DiscardHandler)
}

func globalRule() rules.Rule {
	return rules.Rule{ID: testRule, Match: map[string]string{"resource": "POST /orders"}, Key: []string{"client_key"},
		Algorithm: rules.TokenBucket, Capacity: 1_000_000, RefillPerSecond: 1_000_000, Scope: rules.Global,
		Regions: map[string]float64{"a": 1, "b": 1, "c": 1}, MinShare: 0.1}
}

type testRegion struct {
	name  string
	nats  *testutil.NATSServer
	nc    *nats.Conn
	store Store
	mem   *memStore
	agent *Agent
	reg   *prometheus.Registry
}

// testInterval, when set, overrides the agents' sync interval (the scale
// benchmark uses a longer one: 3 agents with 100,000 keys share 2 cores).
var testInterval time.Duration

// testUsageKeys, when set, raises the agents' MaxUsageKeys to it (the
// default, 100,000 keys buffered per interval, would drop the usage of the
// 1,000,000-key benchmark's other keys, and its ledgers would never hold
// them all).
var testUsageKeys int

func testConfig(region string, t testing.TB) Config {
	cfg := DefaultConfig()
	cfg.Region, cfg.Interval, cfg.Lease, cfg.Margin = region, 100*time.Millisecond, time.Second, 300*time.Millisecond
	cfg.StoreTimeout = 200 * time.Millisecond
	cfg.RegistryPoll = 200 * time.Millisecond
	cfg.Logger = testLogger(t).With("region", region)
	cfg.Signer, cfg.PeerKeys = testSigner(t, region), testPeerKeys(t, "a", "b", "c")
	return cfg
}

func (r *testRegion) start(t testing.TB, ec *clientv3.Client, tweak ...func(*Config)) {
	t.Helper()
	cfg := testConfig(r.name, t)
	if testInterval > 0 {
		// The default configuration's lease of 30 intervals (3 s at
		// 100 ms): at 10 (5 s at 500 ms) the three loaded agents' report
		// round trips outlasted the lease, and every ledger fenced every
		// 10-20 s.
		cfg.Interval, cfg.Lease = testInterval, 30*testInterval
	}
	cfg.MaxUsageKeys = max(cfg.MaxUsageKeys, testUsageKeys)
	for _, f := range tweak {
		f(&cfg)
	}
	r.reg = prometheus.NewRegistry()
	cfg.Metrics = r.reg
	w, err := etcdstore.NewWatcher(ec, etcdstore.WithLogger(cfg.Logger))
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(cfg, r.store, r.nc, NewEtcdRegistry(ec, "", cfg.LedgerConfig()), w)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	r.agent = a
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := a.Close(ctx); err != nil {
			t.Errorf("close %s: %v", r.name, err)
		}
	})
}

// stack is three regions on a NATS super-cluster sharing one etcd.
type stack struct {
	regions map[string]*testRegion
	names   []string
	etcd    *clientv3.Client
	world   *world
	cluster map[string]*testutil.NATSServer
	probe   probe
}

// waitIncarnations waits until every region's agent runs testRule's ledger.
func (s *stack) waitIncarnations(t testing.TB) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, "every region's incarnation", func() bool {
		for _, n := range s.names {
			if s.regions[n].agent.Incarnation(testRule) == 0 {
				return false
			}
		}
		return true
	})
}

// probe reads what the regions' stores enforce.
type probe interface {
	// enforced is the units region's store enforces for key now.
	enforced(region, key string) int64
	// sum is one sample of the regions' enforced units for key together.
	sum(key string) int64
}

func newStack(t testing.TB, mkStore func(name string) (Store, *memStore)) *stack {
	return newStackOf(t, []string{"a", "b", "c"}, mkStore)
}

func newStackOf(t testing.TB, names []string, mkStore func(name string) (Store, *memStore), tweak ...func(*Config)) *stack {
	s := &stack{regions: map[string]*testRegion{}, names: names, world: &world{}}
	s.cluster = testutil.StartSuperCluster(t, names...)
	s.etcd = testutil.StartEtcd(t).Client(t)
	for _, n := range names {
		st, mem := mkStore(n)
		r := &testRegion{name: n, nats: s.cluster[n], nc: s.cluster[n].Connect(t), store: st, mem: mem}
		s.regions[n] = r
		r.start(t, s.etcd, tweak...)
	}
	for _, x := range names {
		for _, y := range names {
			if x != y {
				s.cluster[x].WaitForGatewayInterest(t, y, ReportSubject(x))
			}
		}
	}
	return s
}

// memStack is a stack of regions names over memStores sharing one world.
func memStack(t testing.TB, names []string, tweak ...func(*Config)) *stack {
	w := &world{}
	s := newStackOf(t, names, func(n string) (Store, *memStore) {
		m := newMemStore(w, n)
		return m, m
	}, tweak...)
	s.world = w
	return s
}

func (s *stack) putRule(t testing.TB, r rules.Rule) {
	t.Helper()
	st, err := etcdstore.New(s.etcd)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Put(context.Background(), r, 0); err != nil {
		t.Fatal(err)
	}
}

// loadGen publishes usage for testKey in one region at a time.
type loadGen struct {
	region atomic.Value // string; "" for none
	stop   chan struct{}
	done   chan struct{}
}

func startLoad(t *testing.T, s *stack) *loadGen {
	g := &loadGen{stop: make(chan struct{}), done: make(chan struct{})}
	g.region.Store("")
	ncs := map[string]*nats.Conn{}
	for _, n := range s.names {
		ncs[n] = s.cluster[n].Connect(t)
	}
	go func() {
		defer close(g.done)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		seq := uint64(0)
		for {
			select {
			case <-g.stop:
				return
			case <-t.C:
			}
			r := g.region.Load().(string)
			if r == "" {
				continue
			}
			seq++
			// 2,000,000/s of demand against a global 1,000,000/s: saturating.
			b, _ := usage.Encode(usage.Batch{Region: r, Enforcer: "test", Seq: seq,
				Deltas: []usage.Delta{{Rule: testRule, Key: testKey, Admitted: 75_000, Rejected: 25_000}}})
			ncs[r].Publish(usage.Subject(r), b)
		}
	}()
	t.Cleanup(func() { close(g.stop); <-g.done })
	return g
}

// sampler checks at every sample that the regions' stores together enforce
// at most the whole limit for testKey.
type sampler struct {
	samples, violations atomic.Int64
	worst               atomic.Int64
	stop, done          chan struct{}
}

func startSampler(t *testing.T, s *stack, units int64) *sampler {
	sm := &sampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(sm.done)
		for {
			select {
			case <-sm.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			sum := s.probe.sum(testKey)
			sm.samples.Add(1)
			if sum > units {
				sm.violations.Add(1)
			}
			if sum > sm.worst.Load() {
				sm.worst.Store(sum)
			}
		}
	}()
	t.Cleanup(func() { sm.finish() })
	return sm
}

func (sm *sampler) finish() {
	select {
	case <-sm.stop:
	default:
		close(sm.stop)
	}
	<-sm.done
}

func (s *stack) enforced(n, key string) int64 { return s.probe.enforced(n, key) }

// floorsOf returns every region's floor units for rule.
func floorsOf(spec Spec) map[string]int64 {
	floors, _ := ledger.Split(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	out := map[string]int64{}
	for i, r := range spec.Regions {
		out[r.Name] = floors[i]
	}
	return out
}

// memProbe reads memStores under the world lock: a sample is one instant.
type memProbe struct {
	s      *stack
	floors map[string]int64
}

func (p memProbe) enforced(n, key string) int64 {
	p.s.world.mu.Lock()
	defer p.s.world.mu.Unlock()
	return p.s.regions[n].mem.enforcedLocked(testRule, key, p.floors[n])
}

func (p memProbe) sum(key string) int64 {
	p.s.world.mu.Lock()
	defer p.s.world.mu.Unlock()
	var sum int64
	for _, n := range p.s.names {
		sum += p.s.regions[n].mem.enforcedLocked(testRule, key, p.floors[n])
	}
	return sum
}

func TestAgentsWithContractStore(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	runScenario(t, contractStack(t))
}

// contractStack is a stack of agents on the in-memory contract store, with
// its probe.
func contractStack(t *testing.T) *stack {
	w := &world{}
	s := newStack(t, func(n string) (Store, *memStore) {
		m := newMemStore(w, n)
		return m, m
	})
	s.world = w
	s.probe = memProbe{s: s, floors: floorsOf(s.regions["a"].agent.specOf(globalRule()))}
	return s
}

// TestAgentsReceiveByWindows is TestAgentsWithContractStore with every
// peer report merged one key at a time (receiveWindow 1): each window reads
// as a part of a report split by its sender, and the scenario (shares
// following demand, bad input dropped, a reclaim) holds alike.
func TestAgentsReceiveByWindows(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	// Restored by the first cleanup registered, so the last to run: after
	// the stack's have stopped the agents.
	old := receiveWindow
	t.Cleanup(func() { receiveWindow = old })
	receiveWindow = 1
	runScenario(t, contractStack(t))
}

// runScenario puts a global rule, moves demand from a to b to c, injects
// bad reports, stops c and waits for the reclaim, while a sampler checks
// that the regions never enforce more than the whole limit together.
func runScenario(t *testing.T, s *stack) {
	rule := globalRule()
	s.putRule(t, rule)
	spec := s.regions["a"].agent.specOf(rule)
	lc := spec.ledgerConfig(ledger.DefaultConfig())
	floors, initial := ledger.Split(lc, spec.Regions)
	U := lc.Units
	for i, n := range s.names {
		testutil.WaitFor(t, 20*time.Second, "incarnation of "+n, func() bool { return s.regions[n].agent.Incarnation(testRule) > 0 })
		base := floors[i] + initial[i]
		testutil.WaitFor(t, 20*time.Second, "marker of "+n, func() bool { return s.enforced(n, "rl:{probe}:orders") == base })
	}
	sm := startSampler(t, s, U)
	load := startLoad(t, s)
	tStart := time.Now()
	b0 := metricValue(s.regions["a"].agent.m.bytes.WithLabelValues("sent"))
	n0 := metricValue(s.regions["a"].agent.m.reports.WithLabelValues("sent"))

	// Demand in a: a's share grows well above its initial part.
	load.region.Store("a")
	high := initial[0] + floors[0] + (U-initial[0]-floors[0])/2
	testutil.WaitFor(t, 30*time.Second, "a's enforced share to grow", func() bool {
		return s.enforced("a", testKey) > high
	})
	t.Logf("demand in a: enforced a=%d b=%d c=%d", s.enforced("a", testKey), s.enforced("b", testKey), s.enforced("c", testKey))

	// Demand moves to b: shares follow.
	t0 := time.Now()
	load.region.Store("b")
	testutil.WaitFor(t, 30*time.Second, "b's enforced share to grow and a's to shrink", func() bool {
		return s.enforced("b", testKey) > high && s.enforced("a", testKey) < initial[0]+floors[0]
	})
	t.Logf("demand moved to b: converged in %v: enforced a=%d b=%d c=%d", time.Since(t0).Round(time.Millisecond),
		s.enforced("a", testKey), s.enforced("b", testKey), s.enforced("c", testKey))
	if g := metricValue(s.regions["a"].agent.m.gifts); g < 1 {
		t.Errorf("a made no gifts: %v", g)
	}

	// Bad input: dropped, counted, harmless.
	s.badInput(t)

	// Demand moves to c, then c's agent stops: its marker lapses (store at
	// the floor) and the survivors reclaim what c held.
	load.region.Store("c")
	testutil.WaitFor(t, 30*time.Second, "c's enforced share to grow", func() bool {
		return s.enforced("c", testKey) > high
	})
	load.region.Store("")
	c := s.regions["c"]
	cHeld := s.enforced("c", testKey)
	beforeAB := s.regions["a"].agent.Shares(testRule)[testKey] + s.regions["b"].agent.Shares(testRule)[testKey]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := c.agent.Close(ctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	t1 := time.Now()
	testutil.WaitFor(t, 10*time.Second, "c's marker lease to lapse", func() bool {
		return s.enforced("c", "rl:{probe}:orders") == floors[2] && s.enforced("c", testKey) == floors[2]
	})
	t.Logf("c stopped: marker lapsed after %v (c held %d units)", time.Since(t1).Round(time.Millisecond), cHeld)
	testutil.WaitFor(t, 30*time.Second, "a and b to reclaim c's share", func() bool {
		sa, sb := s.regions["a"].agent.Shares(testRule)[testKey], s.regions["b"].agent.Shares(testRule)[testKey]
		return sa+sb >= U-floors[2]-lc.Hysteresis && sa+sb > beforeAB
	})
	t.Logf("reclaimed after %v: a=%d b=%d (before %d)", time.Since(t1).Round(time.Millisecond),
		s.regions["a"].agent.Shares(testRule)[testKey], s.regions["b"].agent.Shares(testRule)[testKey], beforeAB)
	testutil.WaitFor(t, 10*time.Second, "reclaims_total", func() bool {
		return metricValue(s.regions["a"].agent.m.reclaims) >= 1 && metricValue(s.regions["b"].agent.m.reclaims) >= 1
	})

	el := time.Since(tStart).Seconds()
	bytesSent := metricValue(s.regions["a"].agent.m.bytes.WithLabelValues("sent")) - b0
	msgs := metricValue(s.regions["a"].agent.m.reports.WithLabelValues("sent")) - n0
	t.Logf("a sent %.0f messages, %.0f bytes in %.1fs: %.0f bytes/s for one active key (%.1f bytes/message)", msgs, bytesSent, el, bytesSent/el, bytesSent/max(msgs, 1))
	sm.finish()
	t.Logf("invariant: %d samples, worst sum %d of %d units", sm.samples.Load(), sm.worst.Load(), U)
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
	if sm.samples.Load() < 100 {
		t.Fatalf("only %d samples", sm.samples.Load())
	}
}

// badInput publishes a malformed message, a report from an unknown region
// and a report whose counter went backwards, and checks each is counted.
func (s *stack) badInput(t *testing.T) {
	t.Helper()
	b := s.regions["b"]
	nc := s.cluster["a"].Connect(t)
	// Capture a report of a that carries a gift to b.
	var mu sync.Mutex
	var captured *wire.Message
	sub, err := nc.Subscribe(ReportSubject("a"), func(m *nats.Msg) {
		d, err := testVerifier(t).Open("a", m.Data, listsOf(t, s.names...))
		if err != nil {
			return
		}
		for _, rr := range d.Rules {
			for _, k := range rr.Report.Keys {
				for _, g := range k.Gave {
					if g.Region == "b" && g.Units > 0 {
						mu.Lock()
						if captured == nil {
							captured = &d
						}
						mu.Unlock()
					}
				}
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "a report of a with a gift to b", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return captured != nil
	})
	sub.Unsubscribe()
	counter := func(reason string) float64 {
		return metricValue(b.agent.m.rejected.WithLabelValues(reason))
	}
	// Wait for b's interest in the forged subjects to reach a's server.
	s.cluster["a"].WaitForGatewayInterest(t, "b", ReportSubject("zz"))

	m0, s0 := counter(ReasonMalformed), counter(ReasonUnsigned)
	nc.Publish(ReportSubject("a"), []byte{0xB2, 0xff, 0xff})
	nc.Publish(ReportSubject("a"), []byte("garbage"))
	testutil.WaitFor(t, 10*time.Second, "malformed and unsigned reports counted", func() bool {
		return counter(ReasonMalformed) >= m0+1 && counter(ReasonUnsigned) >= s0+1
	})

	// The reports below are signed with a's key, as if a's agent sent them
	// (a leaked key or a bug): the ledger's own checks refuse them. A
	// region outside the rule can only be named in format 2 (format 3
	// names the rule's regions by index); in format 3, a report read
	// against another list of the rule's regions is refused whole.
	r0 := counter(ReasonRegions)
	wider := wire.Message{From: "a"}
	zz, err := wire.NewRegions(append([]string{"zz"}, s.names...))
	if err != nil {
		t.Fatal(err)
	}
	for _, rr := range captured.Rules {
		rr.Report.Seq += 400_000
		rr.Regions = zz
		wider.Rules = append(wider.Rules, rr)
	}
	nc.Publish(ReportSubject("a"), testSeal(t, wider))
	testutil.WaitFor(t, 10*time.Second, "report with another region list counted", func() bool { return counter(ReasonRegions) >= r0+1 })

	u0 := counter(ReasonUnknownReg)
	forged := wire.Message{From: "a", Version: 2}
	for _, rr := range captured.Rules {
		rr.Report.Seq += 500_000
		rr.Report.Acks = append(slices.Clone(rr.Report.Acks), ledger.Ack{Region: "zz", Inc: 1, Seq: 1})
		forged.Rules = append(forged.Rules, rr)
	}
	nc.Publish(ReportSubject("a"), testSeal(t, forged))
	testutil.WaitFor(t, 10*time.Second, "unknown-region report counted", func() bool { return counter(ReasonUnknownReg) >= u0+1 })

	k0 := counter(ReasonBackwards)
	before := b.agent.Shares(testRule)[testKey]
	back := wire.Message{From: "a"}
	for _, rr := range captured.Rules {
		// Every counter back to 0, so that b and c both refuse it: a report
		// with a far higher sequence that one of them accepted would make
		// it drop a's real reports from then on as older (see freshness).
		rr.Report.Seq += 1_000_000
		var keys []ledger.KeyReport
		for _, k := range rr.Report.Keys {
			zero := func(cs []ledger.Counter) (out []ledger.Counter) {
				for _, c := range cs {
					c.Units = 0
					out = append(out, c)
				}
				return out
			}
			k.Gave, k.Applied = zero(k.Gave), zero(k.Applied)
			keys = append(keys, k)
		}
		rr.Report.Keys = keys
		back.Rules = append(back.Rules, rr)
	}
	nc.Publish(ReportSubject("a"), testSeal(t, back))
	testutil.WaitFor(t, 10*time.Second, "backwards report counted", func() bool { return counter(ReasonBackwards) >= k0+1 })
	cBack := func() float64 { return metricValue(s.regions["c"].agent.m.rejected.WithLabelValues(ReasonBackwards)) }
	testutil.WaitFor(t, 10*time.Second, "c refusing the backwards report too", func() bool { return cBack() >= 1 })
	if after := b.agent.Shares(testRule)[testKey]; after < before {
		t.Errorf("b's share dropped from %d to %d after a rejected report", before, after)
	}
	t.Logf("bad input rejected: malformed=%v region_list=%v unknown_region=%v backwards=%v", counter(ReasonMalformed), counter(ReasonRegions), counter(ReasonUnknownReg), counter(ReasonBackwards))
}

func TestEtcdRegistryConcurrentStarts(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	spec := Spec{Units: 1_000_000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 2}}}
	var wg sync.WaitGroup
	incs := make(chan uint64, 20)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, used, err := reg.Start(context.Background(), "r1", spec, "a")
			if err != nil {
				t.Error(err)
				return
			}
			if !used.equal(spec) {
				t.Errorf("spec %+v", used)
			}
			incs <- st.Inc
		}()
	}
	wg.Wait()
	close(incs)
	seen := map[uint64]bool{}
	for inc := range incs {
		if seen[inc] {
			t.Fatalf("incarnation %d allocated twice", inc)
		}
		seen[inc] = true
	}
	for i := uint64(1); i <= 20; i++ {
		if !seen[i] {
			t.Fatalf("incarnations not 1..20: %v", seen)
		}
	}
	// A second spec does not replace the first.
	other := spec
	other.MinShare = 0.5
	if _, used, err := reg.Start(context.Background(), "r1", other, "b"); err != nil || !used.equal(spec) {
		t.Fatalf("start with another spec: %v %+v", err, used)
	}
	// Contributions complete a record that Records then shows.
	if _, err := reg.Contribute(context.Background(), "r1", ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 20},
		From: ledger.Incarnation{Region: "b", Inc: 1}, Q: []ledger.KeyUnits{{Key: "k", Units: 5}}}); err != nil {
		t.Fatal(err)
	}
	recs, err := reg.Records(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	rr := recs["r1"]
	done, paid := false, false
	for _, rec := range rr.Records {
		done = done || rec.Of == ledger.Incarnation{Region: "a", Inc: 20} && rec.Complete
		paid = paid || rec.Of == ledger.Incarnation{Region: "b", Inc: 1} && rec.Paid != nil
	}
	if !done || !paid || rr.Revision == 0 {
		t.Fatalf("records (want a/20 reclaimed, b/1 paid): %+v", rr)
	}
	if _, err := reg.Contribute(context.Background(), "nope", ledger.Contribution{}); err == nil {
		t.Fatal("contribution to a rule without registry accepted")
	}
	// A new incarnation's Close is recorded and shows in its record.
	if err := reg.Close(context.Background(), "r1", ledger.Incarnation{Region: "b", Inc: 1}); err != nil {
		t.Fatal(err)
	}
	recs, err = reg.Records(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	closer := false
	for _, rec := range recs["r1"].Records {
		closer = closer || rec.Of == ledger.Incarnation{Region: "b", Inc: 1} && rec.Closer
	}
	if !closer {
		t.Fatalf("Close not recorded: %+v", recs["r1"])
	}
	if err := reg.Close(context.Background(), "r1", ledger.Incarnation{Region: "b", Inc: 7}); err == nil {
		t.Fatal("Close by an incarnation the registry never allocated accepted")
	}
}

func TestAllocatorSumsToPool(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Region = "a"
	lc := cfg.LedgerConfig()
	for _, tc := range []struct {
		pool  int64
		wants []ledger.Want
	}{
		{900_000, []ledger.Want{{Weight: 1, Demand: 0}, {Weight: 1, Demand: 0}, {Weight: 1, Demand: 0}}},
		{900_000, []ledger.Want{{Weight: 1, Demand: 2_000_000}, {Weight: 1, Demand: 0}, {Weight: 2, Demand: 10}}},
		{7, []ledger.Want{{Weight: 1, Demand: 5}, {Weight: 3, Demand: 5}}},
	} {
		t.Run(fmt.Sprint(tc.pool, tc.wants), func(t *testing.T) {
			got := lc.Allocate(tc.pool, tc.wants)
			var sum int64
			for _, x := range got {
				if x < 0 {
					t.Fatalf("negative target %v", got)
				}
				sum += x
			}
			if sum != tc.pool || len(got) != len(tc.wants) {
				t.Fatalf("targets %v sum %d, want %d", got, sum, tc.pool)
			}
		})
	}
}

// metricValue reads a counter or gauge.
func metricValue(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return m.Gauge.GetValue()
}

// redisProbe reads what each region's real Redis enforces with the
// enforcer's own script: a check of cost above the capacity is rejected,
// consumes nothing and reports the enforced capacity, which for
// globalRule (capacity 10^6 tokens, 10^6 units) is the units.
//
// Three servers cannot be read at one instant. sum reads a, b, c and then
// c, b, a and takes each region's lower reading: a gift lowers the giver
// before it raises the receiver, so a plain sequential read that sees the
// giver before its lowering and the receiver after its raise would count
// the gift twice; with both orders, one of the two readings of the pair
// falls on the safe side.
type redisProbe struct {
	s      *stack
	stores map[string]*redisstore.Store
	floors map[string]int64
}

func (p redisProbe) enforced(n, key string) int64 {
	r := globalRule()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, res, err := p.stores[n].Check(ctx, redisstore.MaxCost, []redisstore.Bucket{{Key: key, Algorithm: rules.TokenBucket,
		Capacity: r.Capacity * 1000, Rate: int64(r.RefillPerSecond * 1000),
		Global: &redisstore.Global{Rule: testRule, Units: 1_000_000, Floor: p.floors[n]}}})
	if err != nil || len(res) != 1 {
		return -1
	}
	return res[0].Limit
}

func (p redisProbe) sum(key string) int64 {
	low := map[string]int64{}
	names := p.s.names
	for i := range 2 * len(names) {
		var n string
		if i < len(names) {
			n = names[i]
		} else {
			n = names[2*len(names)-1-i]
		}
		v := p.enforced(n, key)
		if v < 0 {
			return 0 // a failed read: no sample
		}
		if old, ok := low[n]; !ok || v < old {
			low[n] = v
		}
	}
	var sum int64
	for _, v := range low {
		sum += v
	}
	return sum
}

func TestAgentsWithRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	// held records get a short Hold, 12 s (at least 4 x (1 s + 100 ms +
	// 200 ms)), refreshed every 6 s: a refresh that fails (a 200 ms
	// timeout on a loaded machine) is retried for 6 s before the record
	// would expire
	s, stores, servers := redisStack(t, func(c *Config) { c.RecordHold = 12 * time.Second })
	floors := floorsOf(s.regions["a"].agent.specOf(globalRule()))
	s.probe = redisProbe{s: s, stores: stores, floors: floors}
	runScenario(t, s)
	checkKeysBounded(t, s, servers, recordHold(s.regions["a"].agent.cfg))

	// a's Redis restarts empty: until a's agent has re-asserted its shares
	// and re-created its marker (new run id), a enforces its floor; then
	// its share comes back.
	want := s.regions["a"].agent.Shares(testRule)[testKey]
	if want <= floors["a"] {
		t.Fatalf("a holds only its floor (%d) before the restart", want)
	}
	// reasserted runs fault on a's Redis and waits until a enforces its
	// share again, the regions' sum never above the limit meanwhile.
	reasserted := func(what string, fault func()) {
		t.Helper()
		sm := startSampler(t, s, 1_000_000)
		fault()
		t0 := time.Now()
		testutil.WaitFor(t, 20*time.Second, "a's share re-asserted after "+what, func() bool {
			return s.enforced("a", testKey) == s.regions["a"].agent.Shares(testRule)[testKey] && s.enforced("a", testKey) > floors["a"]
		})
		t.Logf("%s: a's share %d re-asserted after %v", what, s.enforced("a", testKey), time.Since(t0).Round(time.Millisecond))
		sm.finish()
		if v := sm.violations.Load(); v > 0 {
			t.Fatalf("after %s the sum exceeded the limit in %d of %d samples (worst %d)", what, v, sm.samples.Load(), sm.worst.Load())
		}
	}
	reasserted("a Redis restart", func() { servers["a"].Restart(t) })

	// a's Redis loses its data without a restart (FLUSHALL: the run id
	// stays the same): the agent's next marker renewal finds no marker,
	// and the ledger re-asserts every share and re-creates the marker as
	// after a restart. Before, the region stayed at its floor for good.
	admin := redis.NewClient(&redis.Options{Addr: servers["a"].Addr})
	t.Cleanup(func() { admin.Close() })
	reasserted("FLUSHALL", func() {
		if err := admin.FlushAll(context.Background()).Err(); err != nil {
			t.Fatal(err)
		}
	})
	if n := metricValue(s.regions["a"].agent.m.storeResets.WithLabelValues(ResetMarkerLost)); n < 1 {
		t.Errorf("apportion_sync_store_resets_total{cause=marker_lost} %v after FLUSHALL, want >= 1", n)
	}
}

// checkKeysBounded lists every key of the regions' Redis servers (SCAN,
// PTTL): each must have a TTL but the rule's marker (one per rule). And
// a's held record of testKey keeps its Hold: the agent writes it again
// (its PTTL rises) before it runs out.
func checkKeysBounded(t *testing.T, s *stack, servers map[string]*testutil.Redis, hold time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for n, srv := range servers {
		rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
		defer rc.Close()
		keys, err := rc.Keys(ctx, "*").Result() // a test server: a few keys
		if err != nil {
			t.Fatal(err)
		}
		markers := 0
		for _, k := range keys {
			d, err := rc.PTTL(ctx, k).Result()
			switch {
			case err != nil:
				t.Fatal(err)
			case k == redisstore.MarkerKey(testRule):
				markers++
			case d == -2: // expired since KEYS
			case d <= 0:
				t.Errorf("region %s: key %s has no TTL (PTTL %v)", n, k, d)
			}
		}
		if n != "c" && markers != 1 { // c's agent stopped; its marker stays (bounded: one per rule)
			t.Errorf("region %s: %d marker keys, want 1", n, markers)
		}
		t.Logf("region %s: %d keys, each with a TTL but %d marker", n, len(keys), markers)
	}
	rc := redis.NewClient(&redis.Options{Addr: servers["a"].Addr})
	defer rc.Close()
	first := rc.PTTL(ctx, testKey).Val()
	if first <= 0 || first > hold {
		t.Fatalf("a's record of %s: PTTL %v, want within its Hold %v", testKey, first, hold)
	}
	low := first // the PTTL falls until a refresh sets it back to the Hold
	inc := s.regions["a"].agent.Incarnation(testRule)
	testutil.WaitFor(t, 3*hold, "a's held record refreshed", func() bool {
		d := rc.PTTL(ctx, testKey).Val()
		if d <= 0 {
			t.Fatalf("a's held record of %s expired (PTTL %v; a's incarnation %d, now %d)", testKey, d, inc, s.regions["a"].agent.Incarnation(testRule))
		}
		low = min(low, d)
		return d > low+hold/8
	})
}

// TestAgentsWithRedisCluster runs the scenario with region a's store on a
// Redis Cluster of 3 masters (its marker copied to every slot by the
// store), b and c on standalone Redis: the sum of the enforced shares stays
// within the limit and the shares converge as on standalone Redis.
func TestAgentsWithRedisCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s, stores, _ := clusterStack(t)
	s.probe = redisProbe{s: s, stores: stores, floors: floorsOf(s.regions["a"].agent.specOf(globalRule()))}
	runScenario(t, s)
}

// clusterStack is regions a, b and c with a's store on a Redis Cluster of
// 3 masters and b's and c's on standalone Redis; it returns the stack,
// each region's store and its Redis client.
func clusterStack(t *testing.T) (*stack, map[string]*redisstore.Store, map[string]redis.UniversalClient) {
	stores := map[string]*redisstore.Store{}
	clients := map[string]redis.UniversalClient{}
	// A Cluster renews a marker by writing its 16384 slot copies: on this
	// 2-core machine under a full test run that takes up to a few seconds,
	// longer than the 1 s lease of the other tests (docs/operations.md:
	// the lease must exceed the fan-out on a Cluster).
	s := newStackOf(t, []string{"a", "b", "c"}, func(n string) (Store, *memStore) {
		var rc redis.UniversalClient
		if n == "a" {
			c := testutil.StartCluster(t, 3, false)
			rc = redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
		} else {
			r := testutil.StartRedis(t)
			rc = redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
		}
		clients[n] = rc
		return storeOn(t, rc, stores, n), nil
	}, func(c *Config) { c.Lease = 5 * time.Second })
	return s, stores, clients
}

// storeOn returns a Store on rc as region n's (in stores), both closed when
// the test ends.
func storeOn(t *testing.T, rc redis.UniversalClient, stores map[string]*redisstore.Store, n string) *redisstore.Store {
	t.Helper()
	t.Cleanup(func() { rc.Close() })
	st, err := redisstore.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	stores[n] = st
	return st
}
