package etcdstore

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

func fastWatcher(t testing.TB, c *clientv3.Client, opts ...Option) *Watcher {
	t.Helper()
	opts = append([]Option{WithBackoff(20*time.Millisecond, 200*time.Millisecond), WithRequestTimeout(time.Second)}, opts...)
	w, err := NewWatcher(c, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWatcherLiveChanges(t *testing.T) {
	testutil.CheckGoroutines(t)
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	col := runWatcher(t, fastWatcher(t, c))
	waitLikeStore(t, s, col, "first snapshot")

	if _, err := s.Put(ctx, testRule("b", 2), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "rule added")
	if _, err := s.Put(ctx, testRule("a", 7), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "rule changed")
	if err := s.Delete(ctx, "a", Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("b", 2))}, "rule deleted")
	// Keys outside the prefix are not rules.
	n := col.count()
	if _, err := c.Put(ctx, "/ratelimit/other", "x"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("c", 3), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "rule added after a foreign key")
	if got := col.count(); got != n+1 {
		t.Fatalf("%d updates after one rule change, want 1", got-n)
	}
}

func TestWatcherSkipsInvalidDocumentKeepsLastGood(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 10), Unconditional); err != nil {
		t.Fatal(err)
	}
	ctr := prometheus.NewCounter(prometheus.CounterOpts{Name: "invalid_rule_documents_total"})
	w := fastWatcher(t, c, WithInvalidCounter(ctr))
	col := runWatcher(t, w)
	good := []rules.Rule{normalized(testRule("a", 10))}
	waitSet(t, col, good, "first snapshot")

	// A hand-written bad version of "a", and a bad new rule "z".
	for key, doc := range map[string]string{
		"a": `{"id":"a","algorithm":"token_bucket","capacity":-1,"refill_per_second":5}`,
		"z": `{"id":"z","algorithm":"token_bucket","capacity":1,"refill_per_second":1,"bogus":true}`,
	} {
		if _, err := c.Put(ctx, DefaultPrefix+key, doc); err != nil {
			t.Fatal(err)
		}
	}
	cur, err := c.Get(ctx, "anything")
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "watcher to pass the bad documents", func() bool {
		return w.Revision() >= cur.Header.Revision
	})
	if got := w.InvalidDocuments(); got != 2 {
		t.Fatalf("InvalidDocuments = %d, want 2", got)
	}
	if got := counterValue(t, ctr); got != 2 {
		t.Fatalf("counter = %d, want 2", got)
	}
	if got := col.last(); fmt.Sprint(got) != fmt.Sprint(good) {
		t.Fatalf("set = %v, want the last good version %v", ids(got), ids(good))
	}

	// A fresh watcher meeting the bad docs in its snapshot counts them too,
	// and serves the last good version from etcd's history, as the first
	// watcher does; "z" never had one.
	w2 := fastWatcher(t, c)
	col2 := runWatcher(t, w2)
	waitSet(t, col2, good, "snapshot with only bad docs")
	if got := w2.InvalidDocuments(); got != 2 {
		t.Fatalf("second watcher InvalidDocuments = %d, want 2", got)
	}
	// Two bad versions in a row: still the good one before them.
	if _, err := c.Put(ctx, DefaultPrefix+"a", `not json`); err != nil {
		t.Fatal(err)
	}
	waitSet(t, runWatcher(t, fastWatcher(t, c)), good, "snapshot after two bad versions")
	// Deleted and created again, invalid: the deleted rule does not come back.
	if _, err := c.Delete(ctx, DefaultPrefix+"a"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultPrefix+"a", `{"id":"a","capacity":-1}`); err != nil {
		t.Fatal(err)
	}
	waitSet(t, runWatcher(t, fastWatcher(t, c)), []rules.Rule{}, "snapshot after delete and a bad create")

	// Repairing the document delivers it.
	if _, err := s.Put(ctx, testRule("a", 11), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("a", 11))}, "repaired rule")
	if got := w.InvalidDocuments(); got != 4 {
		t.Fatalf("InvalidDocuments after repair = %d, want 4 (two bad versions of a since)", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) int {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return int(m.GetCounter().GetValue())
}

func TestWatcherRecoversFromCompaction(t *testing.T) {
	testutil.CheckGoroutines(t)
	s, c, _ := newStore(t)
	ctx := context.Background()
	for i := range 5 {
		if _, err := s.Put(ctx, testRule(fmt.Sprintf("r%d", i), 1), Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	w := fastWatcher(t, c)
	snapshots := 0
	hooked := make(chan struct{})
	// After the first snapshot and before the watch starts, change the rules
	// and compact past the snapshot's revision: the watch from snapshot+1
	// must fail with ErrCompacted and the watcher must reload.
	w.afterSnapshot = func() {
		snapshots++
		if snapshots > 1 {
			return
		}
		if err := s.Delete(ctx, "r0", Unconditional); err != nil {
			t.Error(err)
		}
		if _, err := s.Put(ctx, testRule("r1", 99), Unconditional); err != nil {
			t.Error(err)
		}
		if _, err := s.Put(ctx, testRule("new", 4), Unconditional); err != nil {
			t.Error(err)
		}
		resp, err := c.Get(ctx, "x")
		if err != nil {
			t.Error(err)
			return
		}
		if _, err := c.Compact(ctx, resp.Header.Revision); err != nil {
			t.Error(err)
		}
		close(hooked)
	}
	col := runWatcher(t, w)
	<-hooked
	waitLikeStore(t, s, col, "rules after compaction")
	if w.Revision() == 0 {
		t.Fatal("no revision recorded")
	}
	// And it keeps watching after the reload.
	if _, err := s.Put(ctx, testRule("after", 5), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "rule added after the reload")
	if snapshots != 2 {
		// Read after the waits above: the hook runs on the Run goroutine, and
		// the delivered update it precedes is synchronised through col.
		t.Fatalf("snapshots = %d, want 2 (the first and the reload)", snapshots)
	}
}

func TestWatcherSurvivesEtcdRestart(t *testing.T) {
	s, c, e := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	col := runWatcher(t, fastWatcher(t, c))
	waitLikeStore(t, s, col, "first snapshot")
	before := col.count()

	e.Stop()
	// While etcd is down the watcher delivers nothing (the set stays).
	rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := c.Get(rctx, "x")
	cancel()
	if err == nil {
		t.Fatal("etcd still answers after Stop")
	}
	if got := col.count(); got != before {
		t.Fatalf("updates while etcd is down: %d", got-before)
	}
	e.Restart(t)

	if _, err := s.Put(ctx, testRule("b", 2), Unconditional); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "a", Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("b", 2))}, "changes made after restart")
}

func TestWatcherServesCacheWhileEtcdDown(t *testing.T) {
	s, c, e := newStore(t)
	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		if _, err := s.Put(ctx, testRule(id, 3), Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	cache := filepath.Join(t.TempDir(), "rules-cache.json")

	// First enforcer: fills the cache, then goes away.
	{
		w := fastWatcher(t, c, WithCacheFile(cache))
		col := &collector{}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- w.Run(rctx, col.update) }()
		waitLikeStore(t, s, col, "first snapshot")
		cancel()
		<-done
	}
	want, _, _ := s.List(ctx)
	e.Stop()

	// Second enforcer starts while etcd is down: it serves the cache.
	c2 := e.Client(t)
	w := fastWatcher(t, c2, WithCacheFile(cache), WithRequestTimeout(200*time.Millisecond))
	col := runWatcher(t, w)
	waitSet(t, col, want, "cached rules while etcd is down")

	// etcd comes back with a change: the watcher picks it up.
	e.Restart(t)
	if _, err := s.Put(ctx, testRule("c", 4), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "live rules after etcd returns")
	// And the cache is rewritten with them (just after the delivery).
	all, _, _ := s.List(ctx)
	testutil.WaitFor(t, 10*time.Second, "cache file with "+ids(all), func() bool {
		cached, _, err := readCache(cache)
		return err == nil && ids(cached) == ids(all)
	})
}

// putRules writes n rules in transactions of 100.
func putRules(tb testing.TB, c *clientv3.Client, n int) {
	tb.Helper()
	for start := 0; start < n; start += 100 {
		var ops []clientv3.Op
		for i := start; i < min(start+100, n); i++ {
			r := normalized(testRule(fmt.Sprintf("rule-%04d", i), int64(i+1)))
			doc, err := Encode(r)
			if err != nil {
				tb.Fatal(err)
			}
			ops = append(ops, clientv3.OpPut(DefaultPrefix+r.ID, string(doc)))
		}
		if _, err := c.Txn(context.Background()).Then(ops...).Commit(); err != nil {
			tb.Fatal(err)
		}
	}
}

func TestWatcherLoads1000Rules(t *testing.T) {
	s, c, _ := newStore(t)
	putRules(t, c, 1000)
	start := time.Now()
	col := runWatcher(t, fastWatcher(t, c))
	testutil.WaitFor(t, 30*time.Second, "1000 rules", func() bool { return len(col.last()) == 1000 })
	t.Logf("first delivery of 1000 rules after %v", time.Since(start))
	waitLikeStore(t, s, col, "1000 rules equal to the store")
	// A change to one of 1000 rules arrives as one update with the full set.
	if _, err := s.Put(context.Background(), testRule("rule-0500", 7), Unconditional); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "rule-0500 change", func() bool {
		l := col.last()
		return len(l) == 1000 && l[500].Capacity == 7
	})
}

// BenchmarkWatcherSnapshot1000 measures Run's start-up with 1000 rules: one
// snapshot read, 1000 strict decodes and validations, one delivery.
func BenchmarkWatcherSnapshot1000(b *testing.B) {
	e := testutil.StartEtcd(b)
	c := e.Client(b)
	putRules(b, c, 1000)
	w, err := NewWatcher(c)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		ctx, cancel := context.WithCancel(context.Background())
		got := make(chan int, 1)
		done := make(chan struct{})
		go func() {
			defer close(done)
			w.Run(ctx, func(rs []rules.Rule) {
				select {
				case got <- len(rs):
				default:
				}
			})
		}()
		if n := <-got; n != 1000 {
			b.Fatalf("delivered %d rules", n)
		}
		cancel()
		<-done
	}
}

// Changes that come faster than the deliver gap are delivered together:
// 60 rule writes, one after another, reach the consumer as far fewer rule
// sets (at most one per gap after the first, plus the snapshot), the last
// of them the stored set; a change alone afterwards is delivered at once.
func TestWatcherCoalescesRapidChanges(t *testing.T) {
	testutil.CheckGoroutines(t)
	s, c, _ := newStore(t)
	ctx := context.Background()
	gap := 200 * time.Millisecond
	col := runWatcher(t, fastWatcher(t, c, WithDeliverGap(gap)))
	testutil.WaitFor(t, 20*time.Second, "the first (empty) snapshot", func() bool { return col.count() == 1 })
	start := time.Now()
	for i := range 60 {
		if _, err := s.Put(ctx, testRule(fmt.Sprintf("r%02d", i), int64(i+1)), Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	waitLikeStore(t, s, col, "60 rules written")
	took := time.Since(start)
	sets := col.count() - 1
	if most := int(took/gap) + 2; sets > most {
		t.Fatalf("%d rule sets delivered for 60 writes in %v, want at most %d (one per %v gap)", sets, took.Round(time.Millisecond), most, gap)
	}
	t.Logf("60 writes in %v: %d rule sets delivered", took.Round(time.Millisecond), sets)

	time.Sleep(gap) // the gap since the last delivery: the length of the test's interval, not a wait for an event
	n := col.count()
	t0 := time.Now()
	if _, err := s.Put(ctx, testRule("alone", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitLikeStore(t, s, col, "a change alone")
	if col.count() != n+1 {
		t.Fatalf("%d rule sets for one change, want 1", col.count()-n)
	}
	t.Logf("a change alone delivered %v after its write", time.Since(t0).Round(time.Millisecond))
}

// TestWatcherLoadsOverASlowLink: every request to etcd takes 60% of the
// request timeout (an etcd far away). The first load reads the rules and
// then the global rules' registry documents: two requests, each within
// its timeout, together not. With one deadline for the whole load, the
// watcher never loaded (an explorer: a sync agent restarted with etcd
// 1.3 s away each way sat at its floor for the 35 s the latency lasted);
// each request now has its own.
func TestWatcherLoadsOverASlowLink(t *testing.T) {
	s, _, e := newStore(t)
	ctx := context.Background()
	g := rules.Rule{ID: "g", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global,
		Regions: map[string]float64{"a": 1, "b": 1}, MinShare: 0.1}
	if _, err := s.Put(ctx, g, Unconditional); err != nil {
		t.Fatal(err)
	}
	const timeout, delay = 500 * time.Millisecond, 300 * time.Millisecond
	slow, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			select {
			case <-time.After(delay):
			case <-ctx.Done():
				return ctx.Err()
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		})}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { slow.Close() })
	col := runWatcher(t, fastWatcher(t, slow, WithRequestTimeout(timeout)))
	waitSet(t, col, []rules.Rule{normalized(g)}, "the first load over the slow link")
}
