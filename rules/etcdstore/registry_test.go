package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/rules"
)

// globalRule returns a valid global token-bucket rule with the given split.
func globalRule(id string, regions map[string]float64, minShare float64) rules.Rule {
	r := testRule(id, 100)
	r.Scope, r.Regions, r.MinShare = rules.Global, regions, minShare
	return r
}

// registryDoc is a registry document as sync/agent's EtcdRegistry writes it
// (registryDoc{Spec, State}; ledger.RegionSpec has no JSON tags, so its
// fields are "Name" and "Weight"), for the split of regions and minShare.
func registryDoc(regions map[string]float64, minShare float64) string {
	var parts []string
	for _, n := range []string{"a", "b", "c", "d"} {
		if w, ok := regions[n]; ok {
			parts = append(parts, fmt.Sprintf(`{"Name":%q,"Weight":%v}`, n, w))
		}
	}
	return fmt.Sprintf(`{"spec":{"units":1000000,"min_share":%v,"regions":[%s],"quantum":10000},"state":{"lives":[{"region":"a","inc":1}]}}`,
		minShare, strings.Join(parts, ","))
}

// A global rule deleted and re-created under the same id, or whose stored
// document was overwritten by hand, is refused naming regions or min_share
// when the sync agents' registry document of the id holds another split:
// they keep it and would build the new rule's ledgers from it. The same
// split is accepted.
func TestStoreRefusesASplitTheAgentsRegistered(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); err != nil {
		t.Fatal(err)
	}
	// The agents registered the rule's split.
	if _, err := c.Put(ctx, DefaultRegistryPrefix+"g", registryDoc(ab, 0.1)); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "g", Unconditional); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		rule  rules.Rule
		field string
	}{
		{"a new region", globalRule("g", map[string]float64{"a": 1, "c": 1}, 0.1), "regions"},
		{"a region more", globalRule("g", map[string]float64{"a": 1, "b": 1, "c": 1}, 0.1), "regions"},
		{"weights", globalRule("g", map[string]float64{"a": 2, "b": 1}, 0.1), "regions"},
		{"min_share", globalRule("g", ab, 0.2), "min_share"},
		{"no floor", globalRule("g", ab, 0), "min_share"},
	} {
		for _, ifMatch := range []int64{Unconditional, MustNotExist} {
			t.Run(fmt.Sprintf("%s/ifMatch=%d", tc.name, ifMatch), func(t *testing.T) {
				_, err := s.Put(ctx, tc.rule, ifMatch)
				var fe *rules.FieldError
				if !errors.As(err, &fe) || fe.Field != tc.field || fe.RuleID != "g" ||
					!strings.Contains(err.Error(), "still registered by the sync agents") || !strings.Contains(err.Error(), "new rule id") ||
					!strings.Contains(err.Error(), DefaultRegistryPrefix+"g") {
					t.Fatalf("err = %v, want a FieldError naming %q that says the split is registered and to use a new rule id", err, tc.field)
				}
				if keys := rawKeys(t, c); len(keys) != 0 {
					t.Fatalf("a refused put wrote %v", keys)
				}
			})
		}
	}
	// Second path: the stored document is garbage (so there is no stored
	// split to compare), and the registry still refuses another split.
	if _, err := c.Put(ctx, DefaultPrefix+"g", `{"id":"g"`); err != nil {
		t.Fatal(err)
	}
	before := rawKeys(t, c)
	var fe *rules.FieldError
	if _, err := s.Put(ctx, globalRule("g", map[string]float64{"a": 1, "c": 1}, 0.1), Unconditional); !errors.As(err, &fe) || fe.Field != "regions" {
		t.Fatalf("over a garbage document: err = %v, want a FieldError naming regions", err)
	}
	if after := rawKeys(t, c); !reflect.DeepEqual(after, before) {
		t.Fatalf("store changed: %v -> %v", before, after)
	}
	// The registered split is accepted, over the garbage and re-created.
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); err != nil {
		t.Fatalf("the registered split over a garbage document: %v", err)
	}
	if err := s.Delete(ctx, "g", Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, globalRule("g", map[string]float64{"b": 1, "a": 1}, 0.1), MustNotExist); err != nil {
		t.Fatalf("re-created with the registered split: %v", err)
	}
	// A rule under a new id is not held to another id's split; a regional
	// rule has no split.
	if _, err := s.Put(ctx, globalRule("g2", map[string]float64{"a": 1, "c": 1}, 0.2), Unconditional); err != nil {
		t.Fatalf("a new id: %v", err)
	}
	if err := s.Delete(ctx, "g", Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("g", 5), Unconditional); err != nil {
		t.Fatalf("a regional rule under a registered id: %v", err)
	}
}

// A registry document that cannot be read is refused naming the id: no
// agent can coordinate a global rule under it.
func TestStoreRefusesAnUnreadableRegistryDocument(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	for _, doc := range []string{`not json`, `{"spec":{}}`, `{"state":{}}`} {
		if _, err := c.Put(ctx, DefaultRegistryPrefix+"g", doc); err != nil {
			t.Fatal(err)
		}
		_, err := s.Put(ctx, globalRule("g", map[string]float64{"a": 1}, 0), Unconditional)
		var fe *rules.FieldError
		if !errors.As(err, &fe) || fe.Field != "id" || !strings.Contains(err.Error(), "cannot be read") || !strings.Contains(err.Error(), "new rule id") {
			t.Fatalf("registry %s: err = %v, want a FieldError naming id", doc, err)
		}
	}
	if keys := rawKeys(t, c); len(keys) != 0 {
		t.Fatalf("a refused put wrote %v", keys)
	}
}

// A registry document no agent can read (written by hand, damaged) does
// not make the enforcers skip the global rule of its id: each region runs
// on the rule's static floors as stored. Before, a watcher started after
// the damage judged every version of the rule invalid and enforced nothing
// for it, while running ones kept it (an explorer's fresh ratelimitd
// answered limit 0, rule "", for a rule its peers enforced).
func TestUnreadableRegistryDocumentKeepsTheRuleEnforced(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	good := globalRule("g", ab, 0.1)
	if _, err := s.Put(ctx, good, Unconditional); err != nil {
		t.Fatal(err)
	}
	good.Capacity++
	if _, err := s.Put(ctx, good, Unconditional); err != nil { // a second version: judged with its history
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultRegistryPrefix+"g", "garbage"); err != nil {
		t.Fatal(err)
	}
	want := []rules.Rule{normalized(good)}
	waitSet(t, runWatcher(t, fastWatcher(t, c)), want, "a watcher started after the registry document was damaged")
	if rs, bad, _, err := s.ListAll(ctx); err != nil || len(bad) != 0 || len(rs) != 1 {
		t.Fatalf("ListAll: %v, invalid %v, %v; want the rule, as the enforcers see it", ids(rs), bad, err)
	}
}

// WithRegistryPrefix: the store reads the registry where the agents keep it
// (their --registry-prefix), and only there.
func TestStoreRegistryPrefix(t *testing.T) {
	_, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := New(c, WithRegistryPrefix("no-slash")); err == nil {
		t.Fatal("a registry prefix without a final / accepted")
	}
	if _, err := New(c, WithPrefix("/x/"), WithRegistryPrefix("/x/")); err == nil {
		t.Fatal("a registry prefix equal to the rules' accepted")
	}
	s, err := New(c, WithPrefix("/team-a/rules/"), WithRegistryPrefix("/team-a/registry/"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, "/team-a/registry/g", registryDoc(map[string]float64{"a": 1, "b": 1}, 0)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultRegistryPrefix+"h", registryDoc(map[string]float64{"a": 1, "b": 1}, 0)); err != nil {
		t.Fatal(err)
	}
	var fe *rules.FieldError
	if _, err := s.Put(ctx, globalRule("g", map[string]float64{"a": 1}, 0), Unconditional); !errors.As(err, &fe) || fe.Field != "regions" ||
		!strings.Contains(err.Error(), "/team-a/registry/g") {
		t.Fatalf("err = %v, want a FieldError naming regions and /team-a/registry/g", err)
	}
	if _, err := s.Put(ctx, globalRule("h", map[string]float64{"a": 1}, 0), Unconditional); err != nil {
		t.Fatalf("a document under another registry prefix was read: %v", err)
	}
}

// The put is conditional on the registry document as read: an agent that
// registers another split between the store's check and its write makes the
// put check again and refuse; a registry write that keeps the split (a
// reclaim, a new incarnation) only makes it check again and store, even on
// the caller's precondition.
func TestStorePutRechecksWhenTheRegistryChanges(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	race := func(doc string) {
		done := false
		s.beforeWrite = func(id string) {
			if !done {
				done = true
				if _, err := c.Put(ctx, DefaultRegistryPrefix+id, doc); err != nil {
					t.Error(err)
				}
			}
		}
	}
	t.Cleanup(func() { s.beforeWrite = nil })

	race(registryDoc(map[string]float64{"a": 1, "c": 1}, 0.1))
	var fe *rules.FieldError
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); !errors.As(err, &fe) || fe.Field != "regions" {
		t.Fatalf("registered meanwhile with another split: err = %v, want a FieldError naming regions", err)
	}
	if keys := rawKeys(t, c); len(keys) != 0 {
		t.Fatalf("stored %v", keys)
	}

	if _, err := c.Put(ctx, DefaultRegistryPrefix+"h", registryDoc(ab, 0.1)); err != nil {
		t.Fatal(err)
	}
	race(registryDoc(ab, 0.1)) // the same split, another state
	rev, err := s.Put(ctx, globalRule("h", ab, 0.1), MustNotExist)
	if err != nil {
		t.Fatalf("create while the registry changed its state: %v", err)
	}
	race(registryDoc(ab, 0.1))
	next := globalRule("h", ab, 0.1)
	next.Capacity = 200
	if _, err := s.Put(ctx, next, rev); err != nil {
		t.Fatalf("update at the current revision while the registry changed its state: %v", err)
	}
	if got, _, err := s.Get(ctx, "h"); err != nil || got.Capacity != 200 {
		t.Fatalf("after the update: %+v %v", got, err)
	}
}

// A put without a precondition is not failed by a concurrent write of the
// same rule: the store reads, checks and writes again. Only the caller's own
// precondition surfaces as ErrConflict.
func TestStoreUnconditionalPutRetriesAConflict(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	other := globalRule("g", ab, 0.1)
	other.Capacity = 7
	otherDoc, _ := Encode(normalized(other))
	writes := 0
	s.beforeWrite = func(id string) {
		if writes < 3 { // another writer gets in first, three times
			writes++
			if _, err := c.Put(ctx, DefaultPrefix+id, string(otherDoc)); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(func() { s.beforeWrite = nil })
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); err != nil {
		t.Fatalf("unconditional put raced by another writer: %v", err)
	}
	if got, _, err := s.Get(ctx, "g"); err != nil || got.Capacity != 100 {
		t.Fatalf("stored %+v %v, want this put's capacity 100", got, err)
	}
	// The caller's precondition broken meanwhile: a conflict, not a retry.
	writes = 0
	_, rev, _ := s.Get(ctx, "g")
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), rev); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), fmt.Sprint(rev)) {
		t.Fatalf("conditional put raced: err = %v, want ErrConflict naming revision %d", err, rev)
	}
	writes = 0
	if err := s.Delete(ctx, "g", Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), MustNotExist); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("create raced: err = %v, want ErrConflict saying it exists", err)
	}
	// A rule that changes on every attempt: bounded, then ErrConflict.
	writes = -1 << 30
	if _, err := s.Put(ctx, globalRule("g", ab, 0.1), Unconditional); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "attempts") {
		t.Fatalf("a rule changing on every attempt: err = %v, want ErrConflict after the attempts", err)
	}
}

// Concurrent unconditional puts of the same global rules all succeed (the
// tester's 8 concurrent "rlctl rules put -f" of two global rules each).
func TestStoreConcurrentUnconditionalPuts(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	const writers = 8
	ab := map[string]float64{"a": 1, "b": 1}
	var wg sync.WaitGroup
	errs := make(chan error, writers*2)
	for w := range writers {
		wg.Go(func() {
			for _, id := range []string{"x-skew", "y-skew"} {
				r := globalRule(id, ab, 0.1)
				r.Capacity = int64(100 + w)
				if _, err := s.Put(ctx, r, Unconditional); err != nil {
					errs <- fmt.Errorf("writer %d: %w", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if keys := rawKeys(t, c); len(keys) != 2 {
		t.Fatalf("stored %v", keys)
	}
}

// A global rule written by hand into etcd with another split than the one
// the sync agents registered: the enforcers' watchers skip it as invalid
// (their floors must stay those the agents' ledgers start from, or the
// regions' shares could add up to more than the limit), a running watcher
// keeping the last good version and a new one reading it from etcd's
// history; and a put that gives the registered split back is accepted,
// whatever the stored document says.
func TestHandWrittenSplitIsSkipped(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	good := globalRule("g", ab, 0.1)
	if _, err := s.Put(ctx, good, Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultRegistryPrefix+"g", registryDoc(ab, 0.1)); err != nil {
		t.Fatal(err)
	}
	running := fastWatcher(t, c)
	col := runWatcher(t, running)
	want := []rules.Rule{normalized(good)}
	waitSet(t, col, want, "first snapshot")

	hand := globalRule("g", map[string]float64{"a": 4, "b": 1}, 0.3)
	doc, err := Encode(hand)
	if err != nil {
		t.Fatal(err)
	}
	put, err := c.Put(ctx, DefaultPrefix+"g", string(doc))
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "the watcher to pass the hand-written split", func() bool {
		return running.Revision() >= put.Header.Revision
	})
	if got := running.InvalidDocuments(); got != 1 {
		t.Fatalf("InvalidDocuments = %d, want 1 (the hand-written split)", got)
	}
	if got := col.last(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("running watcher: %v, want the registered split %v", ids(got), ids(want))
	}
	fresh := fastWatcher(t, c)
	waitSet(t, runWatcher(t, fresh), want, "a watcher started after the hand-written split")
	if got := fresh.InvalidDocuments(); got != 1 {
		t.Fatalf("fresh watcher InvalidDocuments = %d, want 1", got)
	}

	// The way back: the registered split, put over the hand-written one.
	if _, err := s.Put(ctx, good, Unconditional); err != nil {
		t.Fatalf("putting the registered split back over a hand-written one: %v", err)
	}
	good.Capacity = 150
	if _, err := s.Put(ctx, good, Unconditional); err != nil {
		t.Fatalf("a capacity change after: %v", err)
	}
	waitSet(t, col, []rules.Rule{normalized(good)}, "the repaired rule")
	// Without a registry document (no agent started a ledger yet) a
	// global rule's split is the stored one's.
	if _, err := s.Put(ctx, globalRule("h", ab, 0.1), Unconditional); err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(good), normalized(globalRule("h", ab, 0.1))}, "a global rule with no registry document")
}

// A global window rule's window cannot change under its id: the agents'
// reclaim wait is one window, computed when the rule's ledgers started.
// The store refuses the put naming window (its limit may change); a
// running watcher skips such a document written by hand.
func TestGlobalWindowCannotChange(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	g := rules.Rule{ID: "q", Algorithm: rules.FixedWindow, Limit: 100, Window: rules.Duration(time.Minute),
		Scope: rules.Global, Regions: map[string]float64{"a": 1, "b": 1}, MinShare: 0.1}
	if _, err := s.Put(ctx, g, Unconditional); err != nil {
		t.Fatal(err)
	}
	col := runWatcher(t, fastWatcher(t, c))
	waitSet(t, col, []rules.Rule{normalized(g)}, "first snapshot")
	longer := g.Clone()
	longer.Window = rules.Duration(time.Hour)
	var fe *rules.FieldError
	if _, err := s.Put(ctx, longer, Unconditional); !errors.As(err, &fe) || fe.Field != "window" || !strings.Contains(err.Error(), "new rule id") {
		t.Fatalf("a global window rule's window changed: err = %v, want a FieldError naming window", err)
	}
	more := g.Clone()
	more.Limit = 200
	if _, err := s.Put(ctx, more, Unconditional); err != nil {
		t.Fatalf("a global window rule's limit changed: %v", err)
	}
	waitSet(t, col, []rules.Rule{normalized(more)}, "the new limit")
	// Written by hand: skipped, the last good version stays.
	longer.Limit = 200
	doc, err := Encode(longer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultPrefix+"q", string(doc)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("other", 3), Unconditional); err != nil { // an event after it
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(testRule("other", 3)), normalized(more)}, "the hand-written window skipped")
	// A regional window rule's window may change.
	r := rules.Rule{ID: "rq", Algorithm: rules.FixedWindow, Limit: 10, Window: rules.Duration(time.Minute)}
	if _, err := s.Put(ctx, r, Unconditional); err != nil {
		t.Fatal(err)
	}
	r.Window = rules.Duration(time.Hour)
	if _, err := s.Put(ctx, r, Unconditional); err != nil {
		t.Fatalf("a regional window rule's window changed: %v", err)
	}
}

// A snapshot checks every global rule against its registry document, read
// in batches (registryBatch per round trip): 150 global rules, one written
// by hand with another split than its registered one, give the other 149.
func TestSnapshotChecksManyGlobalRules(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	ab := map[string]float64{"a": 1, "b": 1}
	var want []rules.Rule
	for i := range 150 {
		g := globalRule(fmt.Sprintf("g%03d", i), ab, 0.1)
		if _, err := s.Put(ctx, g, Unconditional); err != nil {
			t.Fatal(err)
		}
		split := ab
		if i == 77 {
			split = map[string]float64{"a": 1, "c": 1} // the agents registered another split
		} else {
			want = append(want, normalized(g))
		}
		if _, err := c.Put(ctx, DefaultRegistryPrefix+g.ID, registryDoc(split, 0.1)); err != nil {
			t.Fatal(err)
		}
	}
	w := fastWatcher(t, c)
	waitSet(t, runWatcher(t, w), want, "149 of 150 global rules")
	if got := w.InvalidDocuments(); got != 1 {
		t.Fatalf("InvalidDocuments = %d, want 1", got)
	}
}

// A global rule's algorithm cannot change under its id (token bucket to
// window and back, fixed to sliding window): the agents' ledgers reclaim
// by the old algorithm. The store refuses the put naming algorithm (not
// window: a token bucket has none); a running watcher skips such a
// document written by hand; a regional rule's algorithm may change.
func TestGlobalAlgorithmCannotChange(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	split := map[string]float64{"a": 1, "b": 1}
	tb := rules.Rule{ID: "g", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global, Regions: split, MinShare: 0.1}
	fw := rules.Rule{ID: "w", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second), Scope: rules.Global, Regions: split, MinShare: 0.1}
	for _, r := range []rules.Rule{tb, fw} {
		if _, err := s.Put(ctx, r, Unconditional); err != nil {
			t.Fatal(err)
		}
	}
	col := runWatcher(t, fastWatcher(t, c))
	waitSet(t, col, []rules.Rule{normalized(tb), normalized(fw)}, "first snapshot")
	toWindow := rules.Rule{ID: "g", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second), Scope: rules.Global, Regions: split, MinShare: 0.1}
	toBucket := rules.Rule{ID: "w", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5, Scope: rules.Global, Regions: split, MinShare: 0.1}
	toSliding := fw.Clone()
	toSliding.Algorithm = rules.SlidingWindow
	for _, r := range []rules.Rule{toWindow, toBucket, toSliding} {
		var fe *rules.FieldError
		_, err := s.Put(ctx, r, Unconditional)
		if !errors.As(err, &fe) || fe.Field != "algorithm" || !strings.Contains(err.Error(), "new rule id") {
			t.Fatalf("%s to %s: err = %v, want a FieldError naming algorithm", map[string]rules.Algorithm{"g": tb.Algorithm, "w": fw.Algorithm}[r.ID], r.Algorithm, err)
		}
	}
	// Written by hand: skipped, the last good version stays.
	doc, err := Encode(toWindow)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(ctx, DefaultPrefix+"g", string(doc)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("other", 3), Unconditional); err != nil { // an event after it
		t.Fatal(err)
	}
	waitSet(t, col, []rules.Rule{normalized(tb), normalized(testRule("other", 3)), normalized(fw)}, "the hand-written algorithm skipped")
	// A regional rule's algorithm may change (its keys start afresh).
	r := rules.Rule{ID: "r", Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 5}
	if _, err := s.Put(ctx, r, Unconditional); err != nil {
		t.Fatal(err)
	}
	r = rules.Rule{ID: "r", Algorithm: rules.FixedWindow, Limit: 5, Window: rules.Duration(time.Second)}
	if _, err := s.Put(ctx, r, Unconditional); err != nil {
		t.Fatalf("a regional rule's algorithm changed: %v", err)
	}
}
