package redisstore

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/launch"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

func TestHashSlot(t *testing.T) {
	// Figures from the Redis Cluster specification and redis-cli CLUSTER KEYSLOT.
	for key, want := range map[string]int{"123456789": 12739, "foo": 12182, "{user1000}.following": 3443,
		"{user1000}.followers": 3443, "foo{}{bar}": 8363, "foo{{bar}}zap": 4015, "foo{bar}{zap}": 5061} {
		if got := HashSlot(key); got != want {
			t.Errorf("HashSlot(%q) = %d, want %d", key, got, want)
		}
	}
	tags := slotTags()
	for s, tag := range tags {
		if HashSlot(tag) != s || HashSlot(slotMarkerKey("r", s)) != s {
			t.Fatalf("slot %d: tag %q hashes to %d", s, tag, HashSlot(tag))
		}
	}
	k := Key("user:42", "orders")
	if HashSlot(ClusterMarkerKey("orders", k)) != HashSlot(k) {
		t.Fatal("a key's marker copy is in another slot")
	}
}

// clusterEnv is a Store on a 3-master, 3-replica Redis Cluster.
type clusterEnv struct {
	c      *launch.Cluster
	client *redis.ClusterClient
	store  *Store
}

func newClusterEnv(t *testing.T) *clusterEnv {
	t.Helper()
	redis.SetLogger(quietLogger{}) // a killed master makes go-redis log every failed dial
	c := testutil.StartCluster(t, 3, true)
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DialTimeout: 300 * time.Millisecond,
		ReadTimeout: time.Second, WriteTimeout: time.Second, MaxRetries: -1, MaxRedirects: 8, PoolSize: 16})
	t.Cleanup(func() { client.Close() })
	s, err := New(client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return &clusterEnv{c: c, client: client, store: s}
}

// master returns the index of the master serving key, as the live masters
// see it (CLUSTER SLOTS; all must agree).
func (e *clusterEnv) master(t *testing.T, key string) int {
	t.Helper()
	slot := HashSlot(key)
	var last string
	for try := 0; try < 50; try++ {
		owners := map[int]bool{}
		for _, m := range e.c.Masters {
			if m.PID() == 0 {
				continue
			}
			c := redis.NewClient(&redis.Options{Addr: m.Addr, MaxRetries: -1, PoolSize: 1})
			slots, err := c.ClusterSlots(ctxT(t)).Result()
			c.Close()
			if err != nil {
				last = err.Error()
				continue
			}
			for _, r := range slots {
				if r.Start <= slot && slot <= r.End && len(r.Nodes) > 0 {
					for i, mm := range e.c.Masters {
						if mm.Addr == r.Nodes[0].Addr {
							owners[i] = true
						}
					}
				}
			}
		}
		if len(owners) == 1 {
			for i := range owners {
				return i
			}
		}
		last = fmt.Sprintf("owners %v", owners)
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("no one master serves %s (slot %d): %s", key, slot, last)
	return -1
}

// TestClusterAlgorithms checks every algorithm, one request's buckets
// together, on keys spread over the three masters.
func TestClusterAlgorithms(t *testing.T) {
	e := newClusterEnv(t)
	ctx := ctxT(t)
	if err := e.store.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	masters := map[int]bool{}
	for c := 0; c < 12; c++ {
		tag := fmt.Sprintf("client-%d", c)
		bs := []Bucket{
			{Key: Key(tag, "tb"), Algorithm: rules.TokenBucket, Capacity: 3000, Rate: 1},
			{Key: Key(tag, "lb"), Algorithm: rules.LeakyBucket, Capacity: 3000, Rate: 1},
			window(Key(tag, "fw"), rules.FixedWindow, 3, time.Hour),
			window(Key(tag, "sw"), rules.SlidingWindow, 3, time.Hour),
			window(Key(tag, "sl"), rules.SlidingLog, 3, time.Hour),
		}
		m := e.master(t, bs[0].Key)
		masters[m] = true
		// Its failure domain is its master's (lane.go).
		if d := e.store.Domain(bs[0].Key); d == 0 || e.store.DomainName(d) != e.c.Masters[m].Addr {
			t.Fatalf("%s: domain %d (%q), want master %d's (%s)", tag, d, e.store.DomainName(d), m, e.c.Masters[m].Addr)
		}
		for i := 0; i < 4; i++ {
			ok, res, err := e.store.Check(ctx, 1, bs)
			if err != nil {
				t.Fatal(err)
			}
			if ok != (i < 3) {
				t.Fatalf("%s request %d: allowed %v, want %v (%+v)", tag, i, ok, i < 3, res)
			}
		}
		for _, b := range bs {
			if n := e.client.Exists(ctx, b.Key).Val(); n != 1 {
				t.Fatalf("%s not written", b.Key)
			}
		}
	}
	if len(masters) != 3 {
		t.Fatalf("12 clients on %d masters, want all 3", len(masters))
	}
	if !e.store.Partitioned() {
		t.Fatal("a Cluster store is not partitioned")
	}
}

// TestClusterGlobal checks markers and share records on a Cluster: the run
// id, a marker Create on every slot's copy, the default units, records, and
// that a renewal is fanned out at most every FanoutEvery.
func TestClusterGlobal(t *testing.T) {
	e := newClusterEnv(t)
	ctx := ctxT(t)
	run, err := e.store.RunID(ctx)
	if err != nil || !strings.HasPrefix(run, "cluster-") {
		t.Fatalf("RunID = %q, %v", run, err)
	}
	if again, _ := e.store.RunID(ctx); again != run {
		t.Fatalf("RunID changed from %s to %s with nothing changed", run, again)
	}
	const rule = "g"
	g := &Global{Rule: rule, Units: 1000, Floor: 100}
	gb := func(tag string) Bucket {
		return Bucket{Key: Key(tag, rule), Algorithm: rules.TokenBucket, Capacity: 1_000_000, Rate: 1, Global: g}
	}
	// No marker: the floor.
	_, res, err := e.store.Check(ctx, 1, []Bucket{gb("a")})
	if err != nil || res[0].Limit != 100 {
		t.Fatalf("no marker: limit %+v %v, want the floor 100", res, err)
	}
	t0 := time.Now()
	v, err := e.store.WriteMarker(ctx, rule, Marker{Inc: 1, Seq: 1, Units: 300, Lease: 10 * time.Second, Create: true, RunID: run})
	t.Logf("marker create on %d copies took %v; %s", Slots, time.Since(t0), evalshaCost(t, e.c.Masters[0].Addr))
	if err != nil || v != (Version{1, 1}) {
		t.Fatalf("create: %v %v", v, err)
	}
	total := int64(0)
	for _, m := range e.c.Masters {
		keys, err := launch.NodeCommand(ctx, m.Addr, "KEYS", "rl:marker:*")
		if err != nil {
			t.Fatal(err)
		}
		total += int64(len(keys.([]any)))
	}
	if total != Slots {
		t.Fatalf("%d marker copies on the masters, want %d", total, Slots)
	}
	for c := 0; c < 20; c++ {
		_, res, err := e.store.Check(ctx, 1, []Bucket{gb(fmt.Sprint("c", c))})
		if err != nil || res[0].Limit != 300 {
			t.Fatalf("client %d: %+v %v, want the default 300", c, res, err)
		}
	}
	recs := []ShareRecord{}
	for c := 0; c < 20; c++ {
		recs = append(recs, ShareRecord{Key: gb(fmt.Sprint("c", c)).Key, Inc: 1, Seq: uint64(2 + c), Units: int64(10 * c),
			Capacity: 1_000_000, Rate: 1, Total: 1000, Floor: 100})
	}
	vs, err := e.store.WriteShares(ctx, rule, recs)
	if err != nil {
		t.Fatal(err)
	}
	for c, v := range vs {
		if v != recs[c].versionOf() {
			t.Fatalf("record %d: held %v", c, v)
		}
		_, res, err := e.store.Check(ctx, 1, []Bucket{gb(fmt.Sprint("c", c))})
		if err != nil || res[0].Limit != int64(10*c) {
			t.Fatalf("client %d: %+v %v, want its record %d", c, res, err, 10*c)
		}
	}
	// A renewal soon after: not fanned out; the copies keep version (1, 1).
	if v, err := e.store.WriteMarker(ctx, rule, Marker{Inc: 1, Seq: 30, Units: 300, Lease: 10 * time.Second}); err != nil || v != (Version{1, 1}) {
		t.Fatalf("early renewal: %v %v, want the held (1, 1)", v, err)
	}
	// A change of the default units is.
	if v, err := e.store.WriteMarker(ctx, rule, Marker{Inc: 1, Seq: 31, Units: 200, Lease: 10 * time.Second}); err != nil || v != (Version{1, 31}) {
		t.Fatalf("renewal with new units: %v %v", v, err)
	}
	if _, res, _ := e.store.Check(ctx, 1, []Bucket{gb("fresh")}); res[0].Limit != 200 {
		t.Fatalf("new default: %+v", res)
	}
	// A Create naming a run id the store never read applies nowhere.
	if v, err := e.store.WriteMarker(ctx, rule, Marker{Inc: 2, Seq: 1, Units: 300, Lease: time.Second, Create: true, RunID: "cluster-0"}); err != nil || v != (Version{}) {
		t.Fatalf("create for an unknown run: %v %v", v, err)
	}
}

// clusterDriver plays the sync agent against one region's Cluster store:
// it moves each key's share record between hi and lo (a gift and its
// return, lower first: a lowering is in force once the store confirms it),
// renews the marker, and on a run id change re-asserts every record and
// re-creates the marker, as the ledger does after StoreReset. bound[k] is
// the most key k may enforce now: the highest units written and not yet
// superseded by a confirmed lower one.
type clusterDriver struct {
	s        *Store
	rule     string
	keys     []string
	mu       sync.Mutex
	bound    map[string]int64
	units    map[string]int64
	seq      uint64
	run      string
	resets   atomic.Int64
	errs     atomic.Int64
	lastErr  atomic.Value // the latest store error, for the failure message
	creates  atomic.Int64
	lastLim  sync.Map // key -> int64, the latest limit a check saw
	hold     sync.Map // keys whose share the toggler leaves alone
	paused   atomic.Bool
	floor    int64
	hi, lo   int64
	lease    time.Duration
	total    int64
	capacity int64
}

func (d *clusterDriver) nextSeq() uint64 { d.mu.Lock(); defer d.mu.Unlock(); d.seq++; return d.seq }

func (d *clusterDriver) write(ctx context.Context, key string, u int64) bool {
	d.mu.Lock()
	if u > d.bound[key] {
		d.bound[key] = u // a raise counts from the moment it is issued
	}
	d.mu.Unlock()
	seq := d.nextSeq()
	vs, err := d.s.WriteShares(ctx, d.rule, []ShareRecord{{Key: key, Inc: 1, Seq: seq, Units: u, Capacity: d.capacity,
		Rate: 1000, Total: d.total, Floor: d.floor}})
	if err != nil || vs[0].Less(Version{1, seq}) {
		d.errs.Add(1)
		return false
	}
	d.mu.Lock()
	d.bound[key], d.units[key] = u, u
	d.mu.Unlock()
	return true
}

func (d *clusterDriver) marker(ctx context.Context) {
	run, err := d.s.RunID(ctx)
	if err != nil {
		d.errs.Add(1)
		d.lastErr.Store(err.Error())
		return
	}
	create := run != d.run
	if create && d.run != "" {
		d.resets.Add(1)
		// StoreReset: re-assert every record before the marker.
		for _, k := range d.keys {
			d.mu.Lock()
			u := d.units[k]
			d.mu.Unlock()
			if !d.write(ctx, k, u) {
				return
			}
		}
	}
	v, err := d.s.WriteMarker(ctx, d.rule, Marker{Inc: 1, Seq: d.nextSeq(), Units: d.lo, Lease: d.lease, Create: create, RunID: run})
	if err != nil {
		d.errs.Add(1)
		d.lastErr.Store(err.Error())
		return
	}
	if create && v.Inc == 1 && v.Seq > 0 {
		d.run = run
		d.creates.Add(1)
	}
}

// TestClusterFaults runs a region's global rule on the Cluster under load
// while a slot migrates and then a master fails over (killed; its replica
// is promoted), and checks that no check ever enforces more than the
// key's bound: a promoted replica may lack the last writes (a lowering
// among them), but its marker copies carry the old master's run id, so its
// slots enforce the floor until the records are re-asserted and the marker
// re-created under the new run id.
func TestClusterFaults(t *testing.T) {
	e := newClusterEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	d := &clusterDriver{s: e.store, rule: "gf", bound: map[string]int64{}, units: map[string]int64{},
		floor: 50, hi: 600, lo: 200, total: 1000, capacity: 1_000_000,
		// A lease that outlasts the failover: the run id, not the lease, must floor the stale records.
		lease: 30 * time.Second}
	for c := 0; len(d.keys) < 12; c++ {
		d.keys = append(d.keys, Key(fmt.Sprint("user:", c), d.rule))
	}
	for _, k := range d.keys {
		d.bound[k] = d.lo // the marker's default
	}
	for i := 0; i < 5 && d.creates.Load() == 0; i++ {
		d.marker(ctx) // a fresh cluster may still be settling its slot map
	}
	if d.creates.Load() != 1 {
		t.Fatalf("first marker create failed (%d errors, the last: %v)", d.errs.Load(), d.lastErr.Load())
	}
	for _, k := range d.keys {
		d.write(ctx, k, d.lo)
	}
	g := &Global{Rule: d.rule, Units: d.total, Floor: d.floor}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var checks, failed, violations atomic.Int64
	var firstViolation atomic.Value
	// Load: checks of every key.
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := d.keys[i%len(d.keys)]
				d.mu.Lock()
				b0 := d.bound[k]
				d.mu.Unlock()
				cctx, cancel := context.WithTimeout(ctx, time.Second)
				_, res, err := e.store.Check(cctx, 1, []Bucket{{Key: k, Algorithm: rules.TokenBucket, Capacity: d.capacity, Rate: 1000, Global: g}})
				cancel()
				d.mu.Lock()
				b1 := d.bound[k]
				d.mu.Unlock()
				checks.Add(1)
				if err != nil {
					failed.Add(1)
					time.Sleep(10 * time.Millisecond)
					continue
				}
				d.lastLim.Store(k, res[0].Limit)
				// Capacity 1000 tokens in 1000 units: the limit in tokens is the units.
				if lim := res[0].Limit; lim > max(b0, b1) {
					violations.Add(1)
					firstViolation.CompareAndSwap(nil, fmt.Sprintf("%s enforced %d units, bound %d", k, lim, max(b0, b1)))
				}
			}
		}()
	}
	// The agent: marker every 100 ms, a gift or its return every 20 ms.
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			if d.paused.Load() {
				continue
			}
			if i%5 == 0 {
				d.marker(ctx)
			}
			k := d.keys[i%len(d.keys)]
			if _, held := d.hold.Load(k); held {
				continue
			}
			d.mu.Lock()
			u := d.units[k]
			d.mu.Unlock()
			if u == d.hi {
				u = d.lo
			} else {
				u = d.hi
			}
			d.write(ctx, k, u)
		}
	}()
	// recovered waits until a check of key enforces more than the floor
	// again: its slot has its records and marker back.
	recovered := func(key, what string) {
		t.Helper()
		d.lastLim.Delete(key)
		testutil.WaitFor(t, 20*time.Second, what, func() bool {
			v, ok := d.lastLim.Load(key)
			return ok && v.(int64) > d.floor
		})
	}
	recovered(d.keys[0], "records in force before the faults")

	// A slot migration under load: the slot of keys[0] and its marker copies.
	k0 := d.keys[0]
	src := e.master(t, k0)
	dst := (src + 1) % 3
	resets := d.resets.Load()
	if err := e.c.MigrateSlot(ctx, HashSlot(k0), e.c.Masters[src], e.c.Masters[dst]); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the migration seen as a store reset", func() bool { return d.resets.Load() > resets })
	if got := e.master(t, k0); got != dst {
		t.Fatalf("%s on master %d after the migration, want %d", k0, got, dst)
	}
	recovered(k0, "records in force after the migration")

	// A master failover under load that loses acknowledged writes: the
	// replica of keys[1]'s master is stopped (SIGSTOP) and the master is made
	// to hold more for it than the kernel buffers take, so that a lowering
	// of keys[1] the master confirms never reaches the replica; then the
	// master is killed and the replica resumed and promoted.
	k1 := d.keys[1]
	victim := e.master(t, k1)
	d.hold.Store(k1, true)
	d.mu.Lock()
	held := d.units[k1]
	d.mu.Unlock()
	if held != d.hi && !d.write(ctx, k1, d.hi) {
		t.Fatal("cannot raise the held key")
	}
	if n, err := launch.NodeCommand(ctx, e.c.Masters[victim].Addr, "WAIT", 1, 2000); err != nil || n != int64(1) {
		t.Fatalf("WAIT for the replica: %v %v", n, err)
	}
	replica := e.c.Replicas[victim]
	if err := syscall.Kill(replica.PID(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	tag := k1[strings.Index(k1, "{")+1 : strings.Index(k1, "}")]
	junk := strings.Repeat("x", 1<<20)
	for i := 0; i < 24; i++ {
		if err := e.client.Set(ctx, fmt.Sprintf("junk:%d:{%s}", i, tag), junk, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if !d.write(ctx, k1, d.lo) {
		t.Fatal("the lowering was not confirmed")
	}
	resets = d.resets.Load()
	// The agent pauses through the failover, so that checks reach the
	// promoted replica before any re-assertion: the enforcer's client may
	// well find the new master before the agent does.
	d.paused.Store(true)
	killed := time.Now()
	e.c.Masters[victim].Stop()
	if err := syscall.Kill(replica.PID(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "the replica promoted", func() bool {
		v, err := launch.NodeCommand(ctx, replica.Addr, "INFO", "replication")
		return err == nil && strings.Contains(fmt.Sprint(v), "role:master")
	})
	promoted := time.Since(killed)
	// The promoted replica lacks the lowering: its record says hi.
	raw, err := launch.NodeCommand(ctx, replica.Addr, "GET", k1)
	if err != nil {
		logs, _ := filepath.Glob(filepath.Join(replica.Dir, "*.log"))
		for _, l := range logs {
			b, _ := os.ReadFile(l)
			t.Logf("%s:\n%s", l, b)
		}
		t.Fatal(err)
	}
	if u := decodeState(t, rules.TokenBucket, raw.(string))["u"] / 2; u != d.hi {
		t.Fatalf("the promoted replica holds %d units for %s, want the lost-write %d (the test did not lose the lowering)", u, k1, d.hi)
	}
	e.client.ReloadState(ctx)
	var limit int64
	var lastErr error
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last check error on the promoted replica: %v", lastErr)
		}
	})
	testutil.WaitFor(t, 10*time.Second, "a check answered by the promoted replica", func() bool {
		_, res, err := e.store.Check(ctx, 1, []Bucket{{Key: k1, Algorithm: rules.TokenBucket, Capacity: d.capacity, Rate: 1000, Global: g}})
		if lastErr = err; err != nil {
			return false
		}
		limit = res[0].Limit
		return true
	})
	if limit != d.floor {
		t.Errorf("the promoted replica enforces %d units for %s, want the floor %d until the records are re-asserted", limit, k1, d.floor)
	}
	d.paused.Store(false)
	testutil.WaitFor(t, 20*time.Second, "the failover seen as a store reset", func() bool { return d.resets.Load() > resets })
	reset := time.Since(killed)
	recovered(k1, "records in force after the failover")
	t.Logf("failover: replica promoted %v, store reset seen %v, records in force %v after the kill", promoted, reset, time.Since(killed))
	close(stop)
	wg.Wait()
	t.Logf("%d checks, %d failed (during the faults), %d store resets, %d marker creates, %d write errors",
		checks.Load(), failed.Load(), d.resets.Load(), d.creates.Load(), d.errs.Load())
	if violations.Load() > 0 {
		t.Fatalf("%d checks enforced more than the bound; first: %v", violations.Load(), firstViolation.Load())
	}
	if checks.Load()-failed.Load() < 100 {
		t.Fatalf("only %d of %d checks answered", checks.Load()-failed.Load(), checks.Load())
	}
}

type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// evalshaCost reads the Redis CPU time per EVALSHA on the node at addr
// (INFO commandstats).
func evalshaCost(t *testing.T, addr string) string {
	v, err := launch.NodeCommand(ctxT(t), addr, "INFO", "commandstats")
	if err != nil {
		return err.Error()
	}
	for _, line := range strings.Split(fmt.Sprint(v), "\n") {
		if strings.HasPrefix(line, "cmdstat_evalsha:") {
			return strings.TrimSpace(line)
		}
	}
	return "no evalsha stats"
}
