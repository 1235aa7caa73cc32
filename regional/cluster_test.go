package regional

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/launch"
	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
)

// clusterEnf is an enforcer on a Redis Cluster of 3 masters and 3 replicas,
// its nodes configured as deploy/redis-cluster/redis.conf
// (cluster-require-full-coverage no) and its client as ratelimitd's (no
// retries, a round trip abandoned at its deadline, an Activity).
type clusterEnf struct {
	c      *launch.Cluster
	client *redis.ClusterClient
	store  *redisstore.Store
	enf    *Enforcer
}

func newClusterEnf(t *testing.T, cfg Config, rs []rules.Rule) *clusterEnf {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: starts a Redis Cluster")
	}
	redis.SetLogger(quietRedisLog{}) // a killed master makes go-redis log every failed dial
	c := testutil.StartCluster(t, 3, true)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, n := range c.Nodes() {
		if _, err := launch.NodeCommand(ctx, n.Addr, "CONFIG", "SET", "cluster-require-full-coverage", "no"); err != nil {
			t.Fatal(err)
		}
	}
	act := redisstore.NewActivity()
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DialTimeout: 200 * time.Millisecond,
		ReadTimeout: time.Second, WriteTimeout: time.Second, MaxRetries: -1, ContextTimeoutEnabled: true, DialerRetries: 1,
		PoolSize: 32, Dialer: act.Dialer(redis.NewDialer(&redis.Options{DialTimeout: 200 * time.Millisecond}))})
	t.Cleanup(func() { client.Close() })
	st, err := redisstore.New(client, redisstore.WithActivity(act))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := st.Warm(ctx); err != nil {
		t.Fatal(err)
	}
	cfg.Region, cfg.Logger = "us-east", quietLogger()
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	for i := range rs {
		rs[i].Normalize()
		if err := rs[i].Validate(); err != nil {
			t.Fatal(err)
		}
	}
	if err := enf.SetRules(rs); err != nil {
		t.Fatal(err)
	}
	return &clusterEnf{c: c, client: client, store: st, enf: enf}
}

type quietRedisLog struct{}

func (quietRedisLog) Printf(context.Context, string, ...any) {}

// masterOf is the index in c.Masters of the master serving key now.
func (ce *clusterEnf) masterOf(t *testing.T, key string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m, err := ce.client.MasterForKey(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range ce.c.Masters {
		if r.Addr == m.Options().Addr {
			return i
		}
	}
	t.Fatalf("%s is on %s, not a master the test started", key, m.Options().Addr)
	return -1
}

// tally counts checks by how they were answered.
type tally struct{ redis, failPolicy, shed, errs atomic.Int64 }

func (c *tally) add(resp Response, err error) {
	switch {
	case err != nil:
		c.errs.Add(1)
	case resp.Shed:
		c.shed.Add(1)
	case resp.FailOpen:
		c.failPolicy.Add(1)
	default:
		c.redis.Add(1)
	}
}

func (c *tally) String() string {
	return fmt.Sprintf("%d from Redis, %d by the failure policy, %d shed, %d errors", c.redis.Load(), c.failPolicy.Load(), c.shed.Load(), c.errs.Load())
}

// A Redis Cluster master that fails sends the checks of its own keys to
// the failure policy, and only those: the checks of the other masters'
// keys are answered by Redis throughout, alone or in a CheckBatch with the
// failing master's. Three faults, one after the other, under load:
//
//   - master 0 stopped (SIGSTOP) for 1.2 s, no failover: its checks time
//     out and fail open, and go to Redis again at once when it resumes;
//   - master 1 killed (SIGKILL): its checks fail open until its replica is
//     promoted, and go to the promoted replica within a second of that;
//   - a slot of master 2 left half migrated with one key of a request
//     moved: that request (TRYAGAIN) alone fails open, a key of the slot
//     still in place and a new one (ASK) are answered by Redis, and master
//     2's breaker stays closed.
//
// Before breakers per master (one breaker for the whole Cluster, pipelines
// mixing masters), the first fault opened the one breaker and every check
// failed open.
func TestClusterMasterFailureFailsOnlyItsKeys(t *testing.T) {
	// The killed master's breaker stays open with no check to probe it
	// (its slots moved to the promoted replica) until it ages out of the
	// count: 1 s here, so that step 3 can wait for it.
	defer func(d time.Duration) { idleGuard = d }(idleGuard)
	idleGuard = time.Second
	cfg := DefaultConfig()
	cfg.Timeout = 50 * time.Millisecond
	cfg.BreakerOpen = 500 * time.Millisecond
	r := tokenBucket("r", 1000000, 1000000)
	r.Match = map[string]string{"resource": "a"}
	m1 := tokenBucket("m1", 1000000, 1000000)
	m1.Match = map[string]string{"resource": "mig"}
	m2 := tokenBucket("m2", 1000000, 1000000)
	m2.Match = map[string]string{"resource": "mig"}
	ce := newClusterEnf(t, cfg, []rules.Rule{r, m1, m2})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// No failover while master 0 is stopped: a long node timeout for now.
	for _, n := range ce.c.Nodes() {
		if _, err := launch.NodeCommand(ctx, n.Addr, "CONFIG", "SET", "cluster-node-timeout", "5000"); err != nil {
			t.Fatal(err)
		}
	}

	// 8 client keys per master, and the slot to migrate: one of master 2's
	// that none of them is in.
	keys := make([][]string, 3)
	slots := map[int]bool{}
	for i := 0; len(keys[0]) < 8 || len(keys[1]) < 8 || len(keys[2]) < 8; i++ {
		k := fmt.Sprintf("user:%d", i)
		if m := ce.masterOf(t, redisstore.Key(k, "r")); len(keys[m]) < 8 {
			keys[m] = append(keys[m], k)
			slots[redisstore.HashSlot(redisstore.Key(k, "r"))] = true
		}
	}
	var migKeys []string // three client keys in one slot of master 2
	for i := 0; len(migKeys) < 3; i++ {
		k := fmt.Sprintf("mig:%d", i)
		slot := redisstore.HashSlot(redisstore.Key(k, "r"))
		switch {
		case slots[slot]:
		case len(migKeys) == 0:
			if ce.masterOf(t, redisstore.Key(k, "r")) == 2 {
				migKeys = append(migKeys, k)
			}
		case slot == redisstore.HashSlot(redisstore.Key(migKeys[0], "r")):
			migKeys = append(migKeys, k)
		}
	}
	migSlot := redisstore.HashSlot(redisstore.Key(migKeys[0], "r"))

	// The load: three workers per master checking its keys one by one,
	// and a worker sending CheckBatches of one key of each master. phase
	// (0: none) names the master at fault, set a moment before the fault
	// (checks under way then end first); counts[phase][master] tallies,
	// by the phase at the start of the check.
	var phase atomic.Int32
	var counts [5][3]tally
	stop := make(chan struct{})
	var wg sync.WaitGroup
	check := func(m int, k string) {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		p := phase.Load()
		resp, err := ce.enf.Check(cctx, Request{ClientKey: k, Resource: "a"})
		counts[p][m].add(resp, err)
	}
	for w := range 9 {
		m := w % 3
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				check(m, keys[m][i%len(keys[m])])
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	var batchCounts [5][3]tally
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			reqs := make([]Request, 3)
			for m := range 3 {
				reqs[m] = Request{ClientKey: keys[m][i%len(keys[m])], Resource: "a"}
			}
			cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
			p := phase.Load()
			resps, err := ce.enf.CheckBatch(cctx, reqs)
			ccancel()
			for m := range 3 {
				var resp Response
				if err == nil {
					resp = resps[m]
				}
				batchCounts[p][m].add(resp, err)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	// Breakers open at once, at most, per phase.
	var mostOpen [5]atomic.Int32
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			_, open := ce.enf.breakerSummary()
			p := phase.Load()
			if int32(open) > mostOpen[p].Load() {
				mostOpen[p].Store(int32(open))
			}
		}
	}()
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()
	// firstRedis waits until the checks of master m's keys are answered by
	// Redis again, and returns when.
	firstRedis := func(m int, what string) time.Duration {
		t.Helper()
		p := phase.Load()
		start := time.Now()
		n := counts[p][m].redis.Load()
		testutil.WaitFor(t, 20*time.Second, what, func() bool { return counts[p][m].redis.Load() >= n+20 })
		return time.Since(start)
	}
	time.Sleep(500 * time.Millisecond)

	// 1. Master 0 stopped for 1.2 s.
	phase.Store(1)
	time.Sleep(100 * time.Millisecond)
	pid := ce.c.Masters[0].PID()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1200 * time.Millisecond)
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed := firstRedis(0, "master 0's checks answered by Redis after it resumed")
	time.Sleep(300 * time.Millisecond)

	// 2. Master 1 killed; its replica is promoted.
	for _, n := range ce.c.Nodes() {
		if _, err := launch.NodeCommand(ctx, n.Addr, "CONFIG", "SET", "cluster-node-timeout", "1000"); err != nil {
			t.Fatal(err)
		}
	}
	phase.Store(2)
	time.Sleep(100 * time.Millisecond)
	killed := time.Now()
	ce.c.Masters[1].Stop()
	replica := ce.c.Replicas[1]
	testutil.WaitFor(t, 20*time.Second, "master 1's replica promoted", func() bool {
		v, err := launch.NodeCommand(ctx, replica.Addr, "INFO", "replication")
		return err == nil && strings.Contains(fmt.Sprint(v), "role:master")
	})
	promoted := time.Since(killed)
	failedOver := firstRedis(1, "master 1's checks answered by the promoted replica")
	time.Sleep(300 * time.Millisecond)

	// Before step 3, the killed master's breaker out of the count (it
	// counted in step 3 when the CI host reached it sooner than idleGuard).
	testutil.WaitFor(t, 10*time.Second, "the killed master's breaker to age out", func() bool {
		_, open := ce.enf.breakerSummary()
		return open == 0
	})

	// 3. A slot of master 2 half migrated to master 0, one key of a
	// request moved: migKeys[0] checked with resource "mig" (two keys)
	// gets TRYAGAIN; migKeys[1]'s key stays, migKeys[2]'s is new (ASK).
	for _, k := range migKeys[:2] {
		for _, res := range []string{"mig", "a"} {
			if resp, err := ce.enf.Check(ctx, Request{ClientKey: k, Resource: res}); err != nil || resp.FailOpen {
				t.Fatalf("check %s %s before the migration: %+v %v", k, res, resp, err)
			}
		}
	}
	src, dst := ce.c.Masters[2], ce.c.Masters[0]
	id := func(r *launch.Redis) string {
		v, err := launch.NodeCommand(ctx, r.Addr, "CLUSTER", "MYID")
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(v)
	}
	if _, err := launch.NodeCommand(ctx, dst.Addr, "CLUSTER", "SETSLOT", migSlot, "IMPORTING", id(src)); err != nil {
		t.Fatal(err)
	}
	if _, err := launch.NodeCommand(ctx, src.Addr, "CLUSTER", "SETSLOT", migSlot, "MIGRATING", id(dst)); err != nil {
		t.Fatal(err)
	}
	if _, err := launch.NodeCommand(ctx, src.Addr, "MIGRATE", "127.0.0.1", dst.Port, redisstore.Key(migKeys[0], "m1"), 0, 5000); err != nil {
		t.Fatal(err)
	}
	phase.Store(3)
	var split, kept, fresh tally
	var migBatch [3]tally
	for i := 0; i < 100; i++ {
		split.add(ce.enf.Check(ctx, Request{ClientKey: migKeys[0], Resource: "mig"}))
		kept.add(ce.enf.Check(ctx, Request{ClientKey: migKeys[1], Resource: "a"}))
		fresh.add(ce.enf.Check(ctx, Request{ClientKey: migKeys[2], Resource: "a"}))
		// Together, in one multi-call script call of their slot.
		resps, err := ce.enf.CheckBatch(ctx, []Request{{ClientKey: migKeys[0], Resource: "mig"},
			{ClientKey: migKeys[1], Resource: "a"}, {ClientKey: migKeys[2], Resource: "a"}})
		for j := range migBatch {
			var resp Response
			if err == nil {
				resp = resps[j]
			}
			migBatch[j].add(resp, err)
		}
	}
	guard2 := ce.enf.guardFor(ce.store.Domain(redisstore.Key(keys[2][0], "r")))
	breaker2 := guard2.breaker.State().String()
	time.Sleep(200 * time.Millisecond)
	phase.Store(4)
	close(stop)
	wg.Wait()

	names := []string{"no fault", "master 0 stopped", "master 1 killed", "slot of master 2 half migrated", "after"}
	for p := range names {
		t.Logf("%s (at most %d breakers open):", names[p], mostOpen[p].Load())
		for m := range 3 {
			t.Logf("  master %d's keys: %v; in batches: %v", m, &counts[p][m], &batchCounts[p][m])
		}
	}
	t.Logf("master 0 stopped 1.2 s: its checks answered by Redis again %v after it resumed", resumed.Round(time.Millisecond))
	t.Logf("master 1 killed: replica promoted after %v, its checks answered by Redis again %v after that", promoted.Round(time.Millisecond), failedOver.Round(time.Millisecond))
	t.Logf("half-migrated slot %d: split request %v; key in place %v; new key %v; in batches %v / %v / %v; master 2's breaker %s",
		migSlot, &split, &kept, &fresh, &migBatch[0], &migBatch[1], &migBatch[2], breaker2)

	// The checks of the masters not at fault: every one answered by Redis.
	for p := range names {
		for m := range 3 {
			if p == m+1 {
				continue
			}
			for _, c := range []*tally{&counts[p][m], &batchCounts[p][m]} {
				if c.failPolicy.Load()+c.shed.Load()+c.errs.Load() > 0 {
					t.Errorf("%s: master %d's keys: %v, want all from Redis", names[p], m, c)
				}
			}
		}
	}
	// The master at fault: the failure policy answered its keys, and
	// only its breaker opened.
	for p := 1; p <= 2; p++ {
		if c := &counts[p][p-1]; c.failPolicy.Load() == 0 || c.shed.Load()+c.errs.Load() > 0 {
			t.Errorf("%s: its keys %v, want the failure policy's answers (none shed)", names[p], c)
		}
		if n := mostOpen[p].Load(); n != 1 {
			t.Errorf("%s: at most %d breakers open, want 1", names[p], n)
		}
	}
	if mostOpen[0].Load()+mostOpen[3].Load() != 0 {
		t.Errorf("breakers open with no master at fault: %d, %d", mostOpen[0].Load(), mostOpen[3].Load())
	}
	if resumed > time.Second {
		t.Errorf("master 0's checks answered by Redis %v after it resumed, want within 1 s", resumed)
	}
	if failedOver > 2*time.Second {
		t.Errorf("master 1's checks answered by the promoted replica %v after the promotion, want within 2 s", failedOver)
	}
	// The half-migrated slot: only the split request fails open.
	if split.failPolicy.Load() != 100 || migBatch[0].failPolicy.Load() != 100 {
		t.Errorf("the request whose keys are split: %v, in batches %v; want the failure policy's answers", &split, &migBatch[0])
	}
	for _, c := range []*tally{&kept, &fresh, &migBatch[1], &migBatch[2]} {
		if c.redis.Load() != 100 {
			t.Errorf("a key of the half-migrated slot that is in one place: %v, want all from Redis", c)
		}
	}
	if breaker2 != "closed" {
		t.Errorf("master 2's breaker %s with one slot half migrated, want closed", breaker2)
	}
}
