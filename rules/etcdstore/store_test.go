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
	clientv3 "go.etcd.io/etcd/client/v3"
)

// testRule returns a valid token-bucket rule.
func testRule(id string, capacity int64) rules.Rule {
	return rules.Rule{
		ID:              id,
		Match:           map[string]string{"resource": "POST /orders"},
		Algorithm:       rules.TokenBucket,
		Capacity:        capacity,
		RefillPerSecond: 5,
	}
}

func normalized(r rules.Rule) rules.Rule {
	r.Normalize()
	return r
}

func newStore(t *testing.T) (*Store, *clientv3.Client, *testutil.Etcd) {
	t.Helper()
	e := testutil.StartEtcd(t)
	c := e.Client(t)
	s, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	return s, c, e
}

// rawKeys returns every key/value under the default prefix.
func rawKeys(t *testing.T, c *clientv3.Client) map[string]string {
	t.Helper()
	resp, err := c.Get(context.Background(), DefaultPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = string(kv.Value)
	}
	return out
}

func TestStoreOptimisticConcurrency(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()

	rev1, err := s.Put(ctx, testRule("a", 10), MustNotExist)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	got, rev, err := s.Get(ctx, "a")
	if err != nil || rev != rev1 {
		t.Fatalf("get: rev %d err %v, want rev %d", rev, err, rev1)
	}
	if want := normalized(testRule("a", 10)); !reflect.DeepEqual(got, want) {
		t.Fatalf("get: %+v, want %+v", got, want)
	}
	// The stored document is the canonical encoding of the normalized rule.
	doc, _ := Encode(normalized(testRule("a", 10)))
	if raw := rawKeys(t, c)[DefaultPrefix+"a"]; raw != string(doc) {
		t.Fatalf("stored %s, want canonical %s", raw, doc)
	}

	if _, err := s.Put(ctx, testRule("a", 11), MustNotExist); !errors.Is(err, ErrConflict) {
		t.Fatalf("create over existing: %v, want ErrConflict", err)
	}
	rev2, err := s.Put(ctx, testRule("a", 12), rev1)
	if err != nil || rev2 <= rev1 {
		t.Fatalf("put at current revision: rev %d err %v", rev2, err)
	}
	if _, err := s.Put(ctx, testRule("a", 13), rev1); !errors.Is(err, ErrConflict) {
		t.Fatalf("put at stale revision: %v, want ErrConflict", err)
	}
	if err := s.Delete(ctx, "a", rev1); !errors.Is(err, ErrConflict) {
		t.Fatalf("delete at stale revision: %v, want ErrConflict", err)
	}
	if got, _, _ := s.Get(ctx, "a"); got.Capacity != 12 {
		t.Fatalf("after refused writes capacity = %d, want 12", got.Capacity)
	}
	if err := s.Delete(ctx, "a", rev2); err != nil {
		t.Fatalf("delete at current revision: %v", err)
	}
	if _, _, err := s.Get(ctx, "a"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("get deleted: %v, want ErrNotFound", err)
	}
	if err := s.Delete(ctx, "a", Unconditional); !errors.Is(err, ErrNotFound) {
		t.Fatalf("delete missing: %v, want ErrNotFound", err)
	}
	if err := s.Delete(ctx, "a", rev2); !errors.Is(err, ErrNotFound) {
		t.Fatalf("conditional delete missing: %v, want ErrNotFound", err)
	}
	if _, err := s.Put(ctx, testRule("b", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("c", 1), Unconditional); err != nil {
		t.Fatal(err)
	}
	list, rev, err := s.List(ctx)
	if err != nil || len(list) != 2 || list[0].ID != "b" || list[1].ID != "c" || rev == 0 {
		t.Fatalf("list = %v rev %d err %v", list, rev, err)
	}
}

func TestStoreRefusesInvalidRules(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("keep", 10), Unconditional); err != nil {
		t.Fatal(err)
	}
	before := rawKeys(t, c)
	for _, tc := range []struct {
		name  string
		rule  rules.Rule
		field string
	}{
		{"negative capacity", testRule("keep", -1), "capacity"},
		{"no id", testRule("", 10), "id"},
		{"slash in id", testRule("a/b", 10), "id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.Put(ctx, tc.rule, Unconditional)
			var fe *rules.FieldError
			if !errors.As(err, &fe) || fe.Field != tc.field {
				t.Fatalf("err = %v, want a FieldError naming %q", err, tc.field)
			}
			if after := rawKeys(t, c); !reflect.DeepEqual(after, before) {
				t.Fatalf("store changed: %v -> %v", before, after)
			}
		})
	}
}

// A stored global rule's split (regions, weights, min_share) cannot change:
// the put is refused naming the field and the stored rule stays; its rate
// and capacity can change.
func TestStoreRefusesChangingAGlobalSplit(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	g := testRule("g", 100)
	g.Scope, g.Regions, g.MinShare = rules.Global, map[string]float64{"a": 1, "b": 1}, 0.1
	if _, err := s.Put(ctx, g, Unconditional); err != nil {
		t.Fatal(err)
	}
	before := rawKeys(t, c)
	weights := g.Clone()
	weights.Regions = map[string]float64{"a": 2, "b": 1}
	floor := g.Clone()
	floor.MinShare = 0.2
	for _, tc := range []struct {
		name  string
		rule  rules.Rule
		field string
	}{{"weights", weights, "regions"}, {"min_share", floor, "min_share"}} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.Put(ctx, tc.rule, Unconditional)
			var fe *rules.FieldError
			if !errors.As(err, &fe) || fe.Field != tc.field || !strings.Contains(err.Error(), "new rule id") {
				t.Fatalf("err = %v, want a FieldError naming %q", err, tc.field)
			}
			if after := rawKeys(t, c); !reflect.DeepEqual(after, before) {
				t.Fatalf("store changed: %v -> %v", before, after)
			}
		})
	}
	faster := g.Clone()
	faster.Capacity = 500
	if _, err := s.Put(ctx, faster, Unconditional); err != nil {
		t.Fatalf("changing a global rule's capacity: %v", err)
	}
	if got, _, err := s.Get(ctx, "g"); err != nil || got.Capacity != 500 {
		t.Fatalf("after the capacity change: %+v %v", got, err)
	}
}

// A global rule in which a region could never hold a whole token
// (rules.Rule.CheckFloors) is refused naming min_share, new or as a change
// of a stored rule's capacity, and nothing is written.
func TestStoreRefusesStrandedFloors(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	g := testRule("g", 1)
	g.Scope, g.Regions, g.MinShare = rules.Global, map[string]float64{"a": 1, "b": 1}, 0.1
	var fe *rules.FieldError
	if _, err := s.Put(ctx, g, Unconditional); !errors.As(err, &fe) || fe.Field != "min_share" {
		t.Fatalf("err = %v, want a FieldError naming min_share", err)
	}
	if keys := rawKeys(t, c); len(keys) != 0 {
		t.Fatalf("a refused rule wrote %v", keys)
	}
	g.Capacity = 10
	if _, err := s.Put(ctx, g, Unconditional); err != nil {
		t.Fatal(err)
	}
	before := rawKeys(t, c)
	g.Capacity = 1
	if _, err := s.Put(ctx, g, Unconditional); !errors.As(err, &fe) || fe.Field != "min_share" {
		t.Fatalf("capacity 10 -> 1: err = %v, want a FieldError naming min_share", err)
	}
	if after := rawKeys(t, c); !reflect.DeepEqual(after, before) {
		t.Fatalf("store changed: %v -> %v", before, after)
	}
}

func TestStoreInvalidDocumentInEtcd(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := c.Put(ctx, DefaultPrefix+"bad", `{"id":"bad","algorithm":"token_bucket","capacity":-5,"refill_per_second":1}`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, testRule("good", 3), Unconditional); err != nil {
		t.Fatal(err)
	}
	_, _, err := s.Get(ctx, "bad")
	var fe *rules.FieldError
	if !errors.Is(err, ErrInvalidDocument) || !errors.As(err, &fe) || fe.Field != "capacity" {
		t.Fatalf("get bad doc: %v, want ErrInvalidDocument naming capacity", err)
	}
	list, _, err := s.List(ctx)
	if err != nil || len(list) != 1 || list[0].ID != "good" {
		t.Fatalf("list = %v, %v; want only the valid rule", list, err)
	}
	// An operator repairs the document with a normal Put.
	if _, err := s.Put(ctx, testRule("bad", 5), Unconditional); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Get(ctx, "bad"); err != nil {
		t.Fatalf("after repair: %v", err)
	}
}

// collector records the sets a Watcher delivers.
type collector struct {
	mu   sync.Mutex
	sets [][]rules.Rule
}

func (c *collector) update(rs []rules.Rule) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sets = append(c.sets, rs)
}

func (c *collector) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.sets)
}

func (c *collector) last() []rules.Rule {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.sets) == 0 {
		return nil
	}
	return c.sets[len(c.sets)-1]
}

// runWatcher runs w until the test ends and checks that Run returns.
func runWatcher(t testing.TB, w *Watcher) *collector {
	t.Helper()
	col := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, col.update) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Run returned %v, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Run did not return within 10s of cancel")
		}
	})
	return col
}

func ids(rs []rules.Rule) string {
	s := ""
	for _, r := range rs {
		s += fmt.Sprintf("%s:%d ", r.ID, r.Capacity)
	}
	return s
}

// waitSet waits until the last delivered set equals want (ids and capacities).
func waitSet(t *testing.T, col *collector, want []rules.Rule, what string) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, what+": want "+ids(want), func() bool {
		return reflect.DeepEqual(col.last(), want)
	})
}

func waitLikeStore(t *testing.T, s *Store, col *collector, what string) {
	t.Helper()
	want, _, err := s.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	waitSet(t, col, want, what)
}

// ListAll returns the documents that are not valid rules beside the valid
// rules, whatever is wrong with them (not JSON, empty, truncated, a wrong
// field, another id), each with its revision and error; List leaves them out.
func TestStoreListAllReturnsInvalidDocuments(t *testing.T) {
	s, c, _ := newStore(t)
	ctx := context.Background()
	if _, err := s.Put(ctx, testRule("good", 3), Unconditional); err != nil {
		t.Fatal(err)
	}
	bad := map[string]struct{ doc, field, inText string }{
		"badcap":   {`{"id":"badcap","algorithm":"token_bucket","capacity":-1,"refill_per_second":1}`, "capacity", "capacity"},
		"empty":    {``, "", "empty document"},
		"notjson":  {`not json at all`, "", "invalid JSON"},
		"other":    {`{"id":"good","algorithm":"token_bucket","capacity":1,"refill_per_second":1}`, "id", "does not match"},
		"truncate": {`{"id":"truncate"`, "", "unexpected end"},
	}
	for id, b := range bad {
		if _, err := c.Put(ctx, DefaultPrefix+id, b.doc); err != nil {
			t.Fatal(err)
		}
	}
	rs, invalid, rev, err := s.ListAll(ctx)
	if err != nil || len(rs) != 1 || rs[0].ID != "good" || rev == 0 {
		t.Fatalf("ListAll rules = %v rev %d err %v", rs, rev, err)
	}
	if len(invalid) != len(bad) {
		t.Fatalf("ListAll invalid = %+v, want %d", invalid, len(bad))
	}
	for i, d := range invalid {
		want := bad[d.ID]
		if i > 0 && invalid[i-1].ID >= d.ID || d.Revision == 0 || d.Field != want.field || !strings.Contains(d.Error, want.inText) {
			t.Errorf("invalid[%d] = %+v, want field %q and an error containing %q, in id order", i, d, want.field, want.inText)
		}
		// Get explains the same document as invalid.
		if _, _, err := s.Get(ctx, d.ID); !errors.Is(err, ErrInvalidDocument) {
			t.Errorf("Get(%q) = %v, want ErrInvalidDocument", d.ID, err)
		}
	}
	if list, _, err := s.List(ctx); err != nil || len(list) != 1 {
		t.Fatalf("List = %v %v, want the valid rule only", list, err)
	}
}
