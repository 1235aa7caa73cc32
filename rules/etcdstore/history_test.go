package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

const historyPrefix = "etcdstore: etcd's history changed ("

// currentRevision is etcd's revision now.
func currentRevision(t *testing.T, c *clientv3.Client) int64 {
	t.Helper()
	resp, err := c.Get(context.Background(), "/revision-probe")
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

// putRaw writes doc under the rule key id, as a hand-written document.
func putRaw(t *testing.T, c *clientv3.Client, id, doc string) int64 {
	t.Helper()
	resp, err := c.Put(context.Background(), DefaultPrefix+id, doc)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func encoded(t *testing.T, r rules.Rule) string {
	t.Helper()
	doc, err := Encode(normalized(r))
	if err != nil {
		t.Fatal(err)
	}
	return string(doc)
}

// An etcd restored to an older revision (the runbook's restore from a
// snapshot; here a fresh etcd, new data dir, on the same client URL): the
// client resumes the watch at the old revision + 1 without a word, so a
// Watcher kept the old rule set forever. Now the probe of the silent watch
// sees a revision below the one applied, logs it once and reloads: the set
// is exactly the new one, with no write past the old revision.
func TestWatcherFollowsAnEtcdRestoredToAnOlderRevision(t *testing.T) {
	s, c, e := newStore(t)
	ctx := context.Background()
	for _, r := range []rules.Rule{testRule("gone", 1), testRule("kept", 50)} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 30 { // a history longer than the restored one
		if _, err := s.Put(ctx, testRule("kept", int64(100+i)), Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Put(ctx, testRule("kept", 50), Unconditional); err != nil {
		t.Fatal(err)
	}
	log := &jsonLog{}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rule_revision"})
	w := fastWatcher(t, c, WithLogger(log.logger()), WithProbeInterval(200*time.Millisecond), WithRevisionGauge(g))
	col := runWatcher(t, w)
	waitLikeStore(t, s, col, "first snapshot")
	applied := currentRevision(t, c)
	testutil.WaitFor(t, 20*time.Second, "the watcher at the last revision", func() bool { return w.Revision() == applied })

	e.Stop()
	e.Dir = t.TempDir() // a fresh etcd: the history followed is gone
	e.Restart(t)
	for _, r := range []rules.Rule{testRule("kept", 7), testRule("new", 3)} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	if rev := currentRevision(t, c); rev >= applied {
		t.Fatalf("the restored etcd is at revision %d, not below the old %d", rev, applied)
	}
	want := []rules.Rule{normalized(testRule("kept", 7)), normalized(testRule("new", 3))}
	waitSet(t, col, want, "the restored etcd's rule set")
	if rev := currentRevision(t, c); rev >= applied {
		t.Fatalf("etcd went past the old revision (%d >= %d): the test proves nothing", rev, applied)
	}
	lines := log.records(t, historyPrefix)
	if len(lines) != 1 || lines[0]["level"] != "WARN" || !strings.Contains(lines[0]["msg"].(string), fmt.Sprintf("below applied %d", applied)) {
		t.Fatalf("history lines %v, want one WARN naming the applied revision %d", lines, applied)
	}
	if got, rev := gaugeValue(t, g), w.Revision(); rev >= applied || got != float64(rev) {
		t.Fatalf("revision gauge %v, Revision %d; want the restored etcd's revision, below %d", got, rev, applied)
	}
	// And it follows the restored etcd live.
	if err := s.Delete(ctx, "new", Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("kept", 7))}, "a change after the reload")
	time.Sleep(time.Second) // five probe intervals: no second reload
	if n := len(log.records(t, historyPrefix)); n != 1 {
		t.Fatalf("%d history lines, want 1", n)
	}
}

// A fresh Watcher finds the last good version of a rule after any number
// of invalid writes in a row (it read 16 versions back at most), in one
// read of the key's history.
func TestFreshWatcherFindsTheLastGoodVersionPastManyBadWrites(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 10), Unconditional); err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		putRaw(t, c, "a", fmt.Sprintf(`{"id":"a","algorithm":"token_bucket","capacity":-%d,"refill_per_second":5}`, i+1))
	}
	w := fastWatcher(t, c)
	waitSet(t, runWatcher(t, w), []rules.Rule{normalized(testRule("a", 10))}, "the good version before 40 bad ones")
	if got := w.InvalidDocuments(); got != 1 {
		t.Fatalf("InvalidDocuments = %d, want 1 (the current bad version)", got)
	}
}

// With the start of the life compacted away, the last good version still
// readable (the key as of the compaction revision, or after it) is served;
// none if none is.
func TestFreshWatcherLastGoodVersionAfterCompaction(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	bad := func(id string, n int) {
		for i := range n {
			putRaw(t, c, id, fmt.Sprintf(`{"id":%q,"capacity":-%d}`, id, i+1))
		}
	}
	// "a": good, bad, good (kept by the compaction), 40 bad.
	// "b": good, bad (the compaction falls among them), 40 bad.
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("b", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	bad("a", 3)
	bad("b", 3)
	if _, err := s.Put(ctx, testRule("a", 2), Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Compact(ctx, currentRevision(t, c)); err != nil {
		t.Fatal(err)
	}
	bad("a", 40)
	bad("b", 40)
	w := fastWatcher(t, c)
	waitSet(t, runWatcher(t, w), []rules.Rule{normalized(testRule("a", 2))}, "a's good version at the compaction, none of b")
	if got := w.InvalidDocuments(); got != 2 {
		t.Fatalf("InvalidDocuments = %d, want 2", got)
	}
}

// handChangedAlgorithms stores global rules "g" (token bucket) and "w"
// (fixed window) through the store, two versions each, then, by hand, a
// fixed-window "g" and a token-bucket "w" over them. It returns the good
// (second) versions, the hand-written ones and the revision of the last
// hand-written put; before the hand-written puts it calls before.
func handChangedAlgorithms(t *testing.T, s *Store, c *clientv3.Client, before func(good []rules.Rule)) (tb, fw, toWindow, toBucket rules.Rule, rev int64) {
	t.Helper()
	ctx := context.Background()
	split := map[string]float64{"a": 1, "b": 1}
	tb = rules.Rule{ID: "g", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global, Regions: split, MinShare: 0.1}
	fw = rules.Rule{ID: "w", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second), Scope: rules.Global, Regions: split, MinShare: 0.1}
	for _, r := range []rules.Rule{tb, fw} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	tb.Capacity, fw.Limit = 6, 6 // a second version of each life
	for _, r := range []rules.Rule{tb, fw} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	if before != nil {
		before([]rules.Rule{normalized(tb), normalized(fw)})
	}
	toWindow = rules.Rule{ID: "g", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second), Scope: rules.Global, Regions: split, MinShare: 0.1}
	toBucket = rules.Rule{ID: "w", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global, Regions: split, MinShare: 0.1}
	putRaw(t, c, "g", encoded(t, toWindow))
	rev = putRaw(t, c, "w", encoded(t, toBucket))
	return tb, fw, toWindow, toBucket, rev
}

// A global rule's algorithm changed in place by hand (token bucket to fixed
// window, and fixed window to token bucket): a running watcher skipped it,
// but one started after accepted it, so enforcers disagreed. Now the
// baseline is the first valid version of the key's life everywhere: every
// watcher serves the last good version.
func TestHandWrittenAlgorithmChangeIsSkippedEverywhere(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	var running *collector
	tb, fw, _, _, _ := handChangedAlgorithms(t, s, c, func(good []rules.Rule) {
		running = runWatcher(t, fastWatcher(t, c))
		waitSet(t, running, good, "first snapshot")
	})
	good := []rules.Rule{normalized(tb), normalized(fw)}
	fresh := fastWatcher(t, c)
	waitSet(t, runWatcher(t, fresh), good, "a watcher started after the hand-written algorithms")
	if got := fresh.InvalidDocuments(); got != 2 {
		t.Fatalf("fresh watcher InvalidDocuments = %d, want 2", got)
	}
	if _, err := s.Put(ctx, testRule("other", 3), Unconditional); err != nil { // an event after them
		t.Fatal(err)
	}
	good = []rules.Rule{normalized(tb), normalized(testRule("other", 3)), normalized(fw)}
	waitSet(t, running, good, "the running watcher skipping them")
	// The repair: the original algorithms, put back.
	tb.Capacity, fw.Limit = 8, 8
	for _, r := range []rules.Rule{tb, fw} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatalf("putting the original algorithm of %q back: %v", r.ID, err)
		}
	}
	good = []rules.Rule{normalized(tb), normalized(testRule("other", 3)), normalized(fw)}
	waitSet(t, running, good, "the repaired rules, running watcher")
	waitSet(t, runWatcher(t, fastWatcher(t, c)), good, "the repaired rules, new watcher")
}

// The store judges a hand-written algorithm change as the watchers do: Get
// and ListAll name the document (rlctl rules list), "rlctl rules put -f"
// of the original is accepted (it was refused as a change from the
// hand-written algorithm) and a third algorithm is refused as a change of
// the life's first one.
func TestStoreJudgesAlgorithmsByTheLifesFirstVersion(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	tb, fw, toWindow, _, rev := handChangedAlgorithms(t, s, c, nil)
	for id, change := range map[string]string{"g": "token_bucket to fixed_window", "w": "fixed_window to token_bucket"} {
		_, _, err := s.Get(ctx, id)
		var fe *rules.FieldError
		if !errors.Is(err, ErrInvalidDocument) || !errors.As(err, &fe) || fe.Field != "algorithm" || !strings.Contains(err.Error(), change) {
			t.Errorf("Get(%q) = %v, want ErrInvalidDocument naming algorithm (%s)", id, err, change)
		}
	}
	rs, invalid, _, err := s.ListAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 0 || len(invalid) != 2 || invalid[0].ID != "g" || invalid[1].ID != "w" ||
		invalid[0].Field != "algorithm" || invalid[1].Field != "algorithm" || invalid[0].Revision != rev-1 || invalid[1].Revision != rev {
		t.Fatalf("ListAll = %v, %+v; want g and w invalid naming algorithm", ids(rs), invalid)
	}
	sliding := toWindow.Clone()
	sliding.Algorithm = rules.SlidingWindow
	var fe *rules.FieldError
	if _, err := s.Put(ctx, sliding, Unconditional); !errors.As(err, &fe) || fe.Field != "algorithm" || !strings.Contains(err.Error(), "token_bucket to sliding_window") {
		t.Fatalf("a third algorithm: err = %v, want a FieldError naming algorithm, token_bucket to sliding_window", err)
	}
	for _, r := range []rules.Rule{tb, fw} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatalf("putting the original algorithm of %q back: %v", r.ID, err)
		}
	}
	rs, invalid, _, err = s.ListAll(ctx)
	if err != nil || len(invalid) != 0 || fmt.Sprint(rs) != fmt.Sprint([]rules.Rule{normalized(tb), normalized(fw)}) {
		t.Fatalf("ListAll after the repair: %v %+v %v", ids(rs), invalid, err)
	}
}

// A global rule deleted and re-created with another algorithm (through
// Put: a new life) while the watch was broken, with the history compacted:
// the reload compared the new life with the old life's version in memory
// and kept enforcing the deleted rule. Now a new life is not compared.
func TestReloadAcceptsANewLifeWithAnotherAlgorithm(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	split := map[string]float64{"a": 1, "b": 1}
	tb := rules.Rule{ID: "g", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global, Regions: split, MinShare: 0.1}
	fw := rules.Rule{ID: "g", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second), Scope: rules.Global, Regions: split, MinShare: 0.1}
	if _, err := s.Put(ctx, tb, Unconditional); err != nil {
		t.Fatal(err)
	}
	w := fastWatcher(t, c)
	hooked := make(chan struct{})
	snapshots := 0
	w.afterSnapshot = func() {
		snapshots++
		if snapshots > 1 {
			return
		}
		defer close(hooked)
		if err := s.Delete(ctx, "g", Unconditional); err != nil {
			t.Error(err)
			return
		}
		if _, err := s.Put(ctx, fw, MustNotExist); err != nil {
			t.Errorf("re-creating g with another algorithm: %v", err)
			return
		}
		if _, err := c.Compact(ctx, currentRevision(t, c)); err != nil {
			t.Error(err)
		}
	}
	col := runWatcher(t, w)
	<-hooked
	waitSet(t, col, []rules.Rule{normalized(fw)}, "the re-created rule after the reload")
	if got := w.InvalidDocuments(); got != 0 {
		t.Fatalf("InvalidDocuments = %d, want 0", got)
	}
	fw.Limit = 9
	if _, err := s.Put(ctx, fw, Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(fw)}, "a change of the new life")
}

// ListAll and Get report a global rule whose stored split differs from the
// one the sync agents registered, as the watchers skip it.
func TestListAllReportsARegistryMismatchedSplit(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, globalRule("h", ab, 0.1), Unconditional); err != nil {
		t.Fatal(err)
	}
	for id, split := range map[string]map[string]float64{"g": {"a": 1, "c": 1}, "h": ab} {
		if _, err := c.Put(ctx, DefaultRegistryPrefix+id, registryDoc(split, 0.1)); err != nil {
			t.Fatal(err)
		}
	}
	rs, invalid, _, err := s.ListAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 1 || rs[0].ID != "h" || len(invalid) != 1 || invalid[0].ID != "g" || invalid[0].Field != "regions" ||
		!strings.Contains(invalid[0].Error, "still registered by the sync agents") {
		t.Fatalf("ListAll = %v, %+v; want h valid and g invalid naming regions", ids(rs), invalid)
	}
	var fe *rules.FieldError
	if _, _, err := s.Get(ctx, "g"); !errors.Is(err, ErrInvalidDocument) || !errors.As(err, &fe) || fe.Field != "regions" {
		t.Fatalf("Get(g) = %v, want ErrInvalidDocument naming regions", err)
	}
	w := fastWatcher(t, c)
	waitSet(t, runWatcher(t, w), []rules.Rule{normalized(globalRule("h", ab, 0.1))}, "the watcher skipping g")
}

// WithRevisionGauge: the revision of the set in force, on every delivery
// (also from the cache file); a snapshot's delivery is logged with it.
func TestRevisionGauge(t *testing.T) {
	s, c, e := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(t.TempDir(), "cache.json")
	log := &jsonLog{}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rule_revision"})
	w := fastWatcher(t, c, WithRevisionGauge(g), WithLogger(log.logger()), WithCacheFile(cache))
	col := &collector{}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx, col.update) }()
	waitLikeStore(t, s, col, "first snapshot")
	first := currentRevision(t, c)
	if v := gaugeValue(t, g); v != float64(first) {
		t.Fatalf("gauge %v after the first snapshot, want %d", v, first)
	}
	loaded := log.records(t, "etcdstore: rule set loaded from etcd")
	if len(loaded) != 1 || loaded[0]["level"] != "INFO" || loaded[0]["revision"] != float64(first) || loaded[0]["rules"] != float64(1) {
		t.Fatalf("loaded lines %v, want one INFO with revision %d and 1 rule", loaded, first)
	}
	rev, err := s.Put(ctx, testRule("b", 2), Unconditional)
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, fmt.Sprintf("gauge at %d", rev), func() bool { return gaugeValue(t, g) == float64(rev) })
	testutil.WaitFor(t, 10*time.Second, "the cache file at "+fmt.Sprint(rev), func() bool {
		_, r, err := readCache(cache)
		return err == nil && r == rev
	})
	cancel()
	<-done

	// A watcher serving the cache file while etcd is down reports its revision.
	e.Stop()
	g2 := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rule_revision"})
	w2 := fastWatcher(t, c, WithRevisionGauge(g2), WithCacheFile(cache), WithRequestTimeout(200*time.Millisecond))
	col2 := runWatcher(t, w2)
	testutil.WaitFor(t, 20*time.Second, "the cached set", func() bool { return col2.count() > 0 })
	if v := gaugeValue(t, g2); v != float64(rev) {
		t.Fatalf("gauge %v serving the cache, want its revision %d", v, rev)
	}
	e.Restart(t)
}

// startOtherCluster starts, on the client URL endpoint (free again), an
// embedded etcd of another cluster (another cluster token: another cluster
// id) with its data in a new directory; it is stopped when the test ends.
func startOtherCluster(t *testing.T, endpoint string) {
	t.Helper()
	cu, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	var e *embed.Etcd
	testutil.WaitFor(t, 30*time.Second, "another etcd cluster on "+endpoint, func() bool {
		pu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))}
		cfg := embed.NewConfig()
		cfg.Name, cfg.Dir, cfg.InitialClusterToken = "other", t.TempDir(), "another-cluster"
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
		cfg.UnsafeNoFsync, cfg.TickMs, cfg.ElectionMs = true, 10, 100
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		e, err = embed.StartEtcd(cfg)
		return err == nil // the ports may not be free yet
	})
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		t.Fatal("the other etcd cluster was not ready within 30s")
	}
}

// etcd replaced by another cluster (another cluster id) at a higher
// revision: the resumed watch delivered the other cluster's events as if
// they followed the old history. Now a watch answer with another cluster
// id ends the watch (no probe needed: the probe interval is a minute) and
// the other cluster's rule set is loaded, exactly.
func TestWatcherReloadsOnAnotherClusterID(t *testing.T) {
	s, c, e := newStore(t)
	ctx := context.Background()
	for _, r := range []rules.Rule{testRule("gone", 1), testRule("kept", 50)} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	log := &jsonLog{}
	w := fastWatcher(t, c, WithLogger(log.logger()), WithProbeInterval(time.Minute))
	col := runWatcher(t, w)
	waitLikeStore(t, s, col, "first snapshot")
	applied := currentRevision(t, c)
	testutil.WaitFor(t, 20*time.Second, "the watcher at the last revision", func() bool { return w.Revision() == applied })

	e.Stop()
	startOtherCluster(t, e.Endpoint)
	for i := range int(applied) + 5 { // past the old revision, outside the rules
		if _, err := c.Put(ctx, fmt.Sprintf("/elsewhere/%d", i), "x"); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range []rules.Rule{testRule("kept", 7), testRule("new", 3)} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("kept", 7)), normalized(testRule("new", 3))}, "the other cluster's rule set")
	lines := log.records(t, historyPrefix)
	if len(lines) != 1 || lines[0]["level"] != "WARN" || !strings.Contains(lines[0]["msg"].(string), "(cluster id ") {
		t.Fatalf("history lines %v, want one WARN naming the cluster ids", lines)
	}
}

// WithInvalidGauge counts the documents stored now whose current version
// is invalid: 1 after a bad write (also for a watcher started after it), 0
// once it is fixed, 1 again for another, 0 after its delete. The counter
// of WithInvalidCounter only grows, so an alert on it resolved while the
// bad document was still stored (an explorer's report).
func TestInvalidGauge(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("a", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rule_invalid_now"})
	runWatcher(t, fastWatcher(t, c, WithInvalidGauge(g)))
	is := func(want float64, what string) {
		t.Helper()
		testutil.WaitFor(t, 20*time.Second, fmt.Sprintf("gauge %v %s", want, what), func() bool { return gaugeValue(t, g) == want })
	}
	is(0, "at first")
	if _, err := c.Put(ctx, DefaultPrefix+"a", `{"id":"a","algorithm":"token_bucket","capacity":-5,"refill_per_second":1}`); err != nil {
		t.Fatal(err)
	}
	is(1, "after a bad write")
	g2 := prometheus.NewGauge(prometheus.GaugeOpts{Name: "rule_invalid_now"})
	runWatcher(t, fastWatcher(t, c, WithInvalidGauge(g2)))
	testutil.WaitFor(t, 20*time.Second, "a watcher started after the bad write to count it", func() bool { return gaugeValue(t, g2) == 1 })
	if _, err := s.Put(ctx, testRule("a", 2), Unconditional); err != nil {
		t.Fatal(err)
	}
	is(0, "after the fix")
	if _, err := c.Put(ctx, DefaultPrefix+"b", `not json`); err != nil {
		t.Fatal(err)
	}
	is(1, "after another bad document")
	if _, err := c.Delete(ctx, DefaultPrefix+"b"); err != nil {
		t.Fatal(err)
	}
	is(0, "after its delete")
}
