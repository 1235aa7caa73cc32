package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/sync/ledger"
)

// etcdDefaultMaxRequestBytes is etcd's default --max-request-bytes, which
// the embedded test server keeps.
const etcdDefaultMaxRequestBytes = 3 << 19 // 1.5 MiB

// twoRegions is the spec of the two-region rules of these tests.
var twoRegions = Spec{Units: 1_000_000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}}}

// startLives starts the incarnations a/1, b/1 and a/2 of rule (a/1 then
// ended by a/2), so that contributions to a/1's reclaim are taken.
func startLives(tb testing.TB, ctx context.Context, r *EtcdRegistry, rule string, spec Spec) {
	tb.Helper()
	for _, x := range []string{"a", "b", "a"} {
		if _, _, err := r.Start(ctx, rule, spec, x); err != nil {
			tb.Fatal(err)
		}
	}
}

// manyKeys returns n keys with units from f.
func manyKeys(n int, prefix string, f func(i int) int64) []ledger.KeyUnits {
	q := make([]ledger.KeyUnits, n)
	for i := range q {
		q[i] = ledger.KeyUnits{Key: fmt.Sprintf("%s-%07d", prefix, i), Units: f(i)}
	}
	return q
}

// chunkState returns, for rule's document in etcd, its ModRevision, the
// chunks it references and every chunk key under the rule's chunk prefix
// with its ModRevision.
func chunkState(t *testing.T, ec *clientv3.Client, r *EtcdRegistry, rule string) (int64, map[string]bool, map[string]int64) {
	t.Helper()
	ctx := context.Background()
	doc, err := ec.Get(ctx, r.Key(rule))
	if err != nil || len(doc.Kvs) == 0 {
		t.Fatalf("document of %q: %v %v", rule, err, doc)
	}
	p, err := parseDoc(doc.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	refs := map[string]bool{}
	for _, c := range p.refs() {
		refs[r.chunkDir(rule)+c.Hash] = true
	}
	all, err := ec.Get(ctx, r.chunkDir(rule), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]int64{}
	for _, kv := range all.Kvs {
		if chunkName(strings.TrimPrefix(string(kv.Key), r.chunkDir(rule))) != "" {
			keys[string(kv.Key)] = kv.ModRevision
		}
	}
	return doc.Kvs[0].ModRevision, refs, keys
}

// checkChunksExact fails unless the chunks under rule's prefix are exactly
// those its document references.
func checkChunksExact(t *testing.T, ec *clientv3.Client, r *EtcdRegistry, rule string) (map[string]bool, map[string]int64) {
	t.Helper()
	_, refs, keys := chunkState(t, ec, r, rule)
	for k := range refs {
		if _, ok := keys[k]; !ok {
			t.Errorf("referenced chunk %s missing", k)
		}
	}
	for k := range keys {
		if !refs[k] {
			t.Errorf("chunk %s referenced by nothing left behind", k)
		}
	}
	return refs, keys
}

// TestRegistryChunksLargeRoundTrip: a registry whose lists hold 200,000 keys
// each (two contributions, the completed record, two payments, one kept)
// goes through an etcd with the default request limit and reads back equal
// to the same operations on an in-memory ledger.Registry; the previous
// version's single document is refused by that etcd; a later write that
// changes no list (Close) puts no chunk again.
func TestRegistryChunksLargeRoundTrip(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	const n = 200_000
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	spec := Spec{Units: 1_000_000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 2}, {Name: "c", Weight: 1}}}
	mem, err := ledger.NewRegistry(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	if err != nil {
		t.Fatal(err)
	}
	for _, region := range []string{"a", "b", "c", "a"} {
		want, err := mem.Start(region)
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := reg.Start(ctx, "r", spec, region)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("Start(%s) = %+v, %v; want %+v", region, got, err, want)
		}
	}
	a1 := ledger.Incarnation{Region: "a", Inc: 1}
	contribs := []ledger.Contribution{
		{Of: a1, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: manyKeys(n, "k", func(i int) int64 { return int64(i%97 + 1) })},
		{Of: a1, From: ledger.Incarnation{Region: "c", Inc: 1}, Q: manyKeys(n, "k", func(i int) int64 { return -int64(i%13 + 1) })},
	}
	for i, c := range contribs {
		want, err := mem.Contribute(c)
		if err != nil {
			t.Fatal(err)
		}
		got, err := reg.Contribute(ctx, "r", c)
		if err != nil {
			t.Fatalf("contribution %d: %v", i, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("contribution %d: record differs from the in-memory registry's", i)
		}
		checkChunksExact(t, ec, reg, "r")
	}
	if !mem.Record(a1).Complete {
		t.Fatal("setup: the reclaim of a/1 did not complete")
	}
	// The previous version's document: above the limit, and refused.
	old, err := json.Marshal(registryDoc{Spec: spec, State: mem.State()})
	if err != nil {
		t.Fatal(err)
	}
	if len(old) <= etcdDefaultMaxRequestBytes {
		t.Fatalf("the single document is only %d bytes: the test does not exercise the limit", len(old))
	}
	if _, err := ec.Put(ctx, "/old/registry/r", string(old)); err == nil {
		t.Fatalf("etcd accepted the single document of %d bytes", len(old))
	} else {
		t.Logf("single document: %d bytes, refused: %v", len(old), err)
	}
	doc, err := ec.Get(ctx, reg.Key("r"))
	if err != nil {
		t.Fatal(err)
	}
	refs, keys := checkChunksExact(t, ec, reg, "r")
	var chunkBytes int64
	for k := range keys {
		g, err := ec.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if sz := len(g.Kvs[0].Value); sz > defaultChunkBytes {
			t.Errorf("chunk %s is %d bytes", k, sz)
		}
		chunkBytes += int64(len(g.Kvs[0].Value))
	}
	p, err := parseDoc(doc.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("chunked: document %d bytes, %d lists in %d chunks, %d bytes in chunks", len(doc.Kvs[0].Value), len(p.lists), len(refs), chunkBytes)
	if got := reg.stats.docBytes.Load(); got != int64(len(doc.Kvs[0].Value)) || reg.stats.chunkBytes.Load() != chunkBytes {
		t.Errorf("stats: document %d bytes, chunks %d (want %d, %d)", got, reg.stats.chunkBytes.Load(), len(doc.Kvs[0].Value), chunkBytes)
	}
	if len(doc.Kvs[0].Value) > 64<<10 {
		t.Errorf("document %d bytes: not independent of the keys", len(doc.Kvs[0].Value))
	}
	// A fresh registry (no cache) reads the same records.
	recs, err := NewEtcdRegistry(ec, "", ledger.DefaultConfig()).Records(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(recs["r"].Records, mem.Records()) {
		t.Fatal("records read back differ from the in-memory registry's")
	}
	// A write that changes no list (Close) puts no chunk and leaves
	// the others in place.
	if err := reg.Close(ctx, "r", ledger.Incarnation{Region: "b", Inc: 1}); err != nil {
		t.Fatal(err)
	}
	if err := mem.Close(ledger.Incarnation{Region: "b", Inc: 1}); err != nil {
		t.Fatal(err)
	}
	_, keys2 := checkChunksExact(t, ec, reg, "r")
	if !reflect.DeepEqual(keys, keys2) {
		t.Error("a write that changed no list changed the chunks")
	}
	recs, err = reg.Records(ctx)
	if err != nil || !reflect.DeepEqual(recs["r"].Records, mem.Records()) {
		t.Fatalf("records after Close differ: %v", err)
	}
}

// TestRegistryChunksConcurrent: writers on one rule with large
// contributions (Contribute, Close) and Starts, all at once through
// separate registries (separate agents), lose no update, and leave no
// unreferenced chunk behind.
func TestRegistryChunksConcurrent(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	newReg := func() *EtcdRegistry {
		r := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
		r.format = chunkFormat{chunkBytes: 16 << 10, inlineBytes: 32 << 10, listInline: 1 << 10}
		return r
	}
	spec := Spec{Units: 1_000_000, MinShare: 0.1}
	survivors := []string{"b", "c", "d", "e"}
	for _, x := range append([]string{"a", "f"}, survivors...) {
		spec.Regions = append(spec.Regions, ledger.RegionSpec{Name: x, Weight: 1})
	}
	slices.SortFunc(spec.Regions, func(x, y ledger.RegionSpec) int { return strings.Compare(x.Name, y.Name) })
	setup := newReg()
	for _, x := range append([]string{"a"}, append(survivors, "a")...) {
		if _, _, err := setup.Start(ctx, "r", spec, x); err != nil {
			t.Fatal(err)
		}
	}
	a1 := ledger.Incarnation{Region: "a", Inc: 1}
	var wg sync.WaitGroup
	starts := make(chan uint64, 10)
	for i, x := range survivors {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, me := newReg(), ledger.Incarnation{Region: x, Inc: 1}
			if err := r.Close(ctx, "r", me); err != nil {
				t.Error(err)
				return
			}
			q := manyKeys(5_000, x, func(j int) int64 { return int64(i*7 + j%5 + 1) })
			if _, err := r.Contribute(ctx, "r", ledger.Contribution{Of: a1, From: me, Q: q}); err != nil {
				t.Error(err)
				return
			}
			if err := r.Close(ctx, "r", me); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := newReg()
		for range 10 {
			st, _, err := r.Start(ctx, "r", spec, "f")
			if err != nil {
				t.Error(err)
				return
			}
			starts <- st.Inc
		}
	}()
	wg.Wait()
	close(starts)
	var incs []uint64
	for inc := range starts {
		incs = append(incs, inc)
	}
	if !slices.Equal(incs, []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}) {
		t.Errorf("f's incarnations %v, want 1..10 once each", incs)
	}
	recs, err := newReg().Records(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var rec *ledger.Record
	closers := 0
	for i, x := range recs["r"].Records {
		if x.Of == a1 {
			rec = &recs["r"].Records[i]
		}
		if x.Closer && x.Of.Inc == 1 && slices.Contains(survivors, x.Of.Region) {
			closers++
		}
	}
	// A lost contribution leaves the reclaim of a/1 incomplete.
	if rec == nil || !rec.Complete || len(rec.Keys) < 4*5_000 {
		t.Fatalf("the reclaim of a/1 is not complete with every survivor's keys: %+v", rec)
	}
	if closers != len(survivors) {
		t.Errorf("%d Close records of %d", closers, len(survivors))
	}
	refs, _ := checkChunksExact(t, ec, setup, "r")
	if len(refs) < 10 {
		t.Errorf("only %d chunks referenced: the test does not exercise chunks", len(refs))
	}
}

// TestRegistryChunkDeletedBeforeSwap: a chunk deleted between a write's
// chunk puts and its compare-and-swap, by another agent's collection or by
// hand, makes the swap fail and the write retry; the document it commits
// references only chunks that exist. With more new chunks than the swap
// checks one by one, another agent's collection still fails it (gcKey).
func TestRegistryChunkDeletedBeforeSwap(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	spec := twoRegions
	for _, tc := range []struct {
		name      string
		chunk     int // chunk size
		byHand    bool
		minChunks int // new chunks at least
	}{
		{"collection", 16 << 10, false, 2},
		{"by hand", 16 << 10, true, 2},
		{"collection, unguarded chunks", 512, false, guardedChunks + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rule := strings.ReplaceAll(tc.name, " ", "-")
			rule = strings.ReplaceAll(rule, ",", "")
			format := chunkFormat{chunkBytes: tc.chunk, inlineBytes: 1 << 10, listInline: 64}
			w := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
			w.format = format
			other := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
			other.format = format
			startLives(t, ctx, w, rule, spec)
			calls, deleted := 0, 0
			w.beforeCAS = func(rule string) {
				calls++
				if calls > 1 {
					return
				}
				if !tc.byHand {
					n, err := other.gc(ctx, rule)
					if err != nil {
						t.Error(err)
					}
					deleted += n
					return
				}
				_, refs, keys := chunkState(t, ec, w, rule)
				for k := range keys {
					if !refs[k] {
						if _, err := ec.Delete(ctx, k); err != nil {
							t.Error(err)
						}
						deleted++
					}
				}
			}
			q := manyKeys(2_000, "k", func(i int) int64 { return int64(i%7 + 1) })
			if _, err := w.Contribute(ctx, rule, ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 1}, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: q}); err != nil {
				t.Fatal(err)
			}
			if deleted < tc.minChunks || calls < 2 {
				t.Fatalf("%d chunks deleted before the swap (want %d or more), %d attempts: the swap did not retry", deleted, tc.minChunks, calls)
			}
			checkChunksExact(t, ec, w, rule)
			recs, err := NewEtcdRegistry(ec, "", ledger.DefaultConfig()).Records(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if rr, ok := recs[rule]; !ok || len(rr.Records) == 0 {
				t.Fatalf("the document does not decode after the write: %+v", recs)
			}
		})
	}
}

// TestRegistryChunkCorrupt: a chunk whose content does not match its
// reference, or that is missing, fails every change of the rule with an
// error naming the chunk's key, writes nothing, and deletes nothing: once
// the chunk is back, the registry is whole.
func TestRegistryChunkCorrupt(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	reg.format = chunkFormat{chunkBytes: 16 << 10, inlineBytes: 1 << 10, listInline: 64}
	spec := twoRegions
	startLives(t, ctx, reg, "r", spec)
	q := manyKeys(3_000, "k", func(i int) int64 { return int64(i%7 + 1) })
	if _, err := reg.Contribute(ctx, "r", ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 1}, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: q}); err != nil {
		t.Fatal(err)
	}
	want, err := NewEtcdRegistry(ec, "", ledger.DefaultConfig()).Records(ctx)
	if err != nil || len(want["r"].Records) == 0 {
		t.Fatalf("records: %v %+v", err, want)
	}
	rev0, _, keys := chunkState(t, ec, reg, "r")
	victim := slices.Sorted(func(yield func(string) bool) {
		for k := range keys {
			if !yield(k) {
				return
			}
		}
	})[0]
	g, err := ec.Get(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	good := g.Kvs[0].Value
	for _, tc := range []struct {
		name  string
		spoil func() error
		want  string
	}{
		{"hash mismatch", func() error {
			bad := append([]byte(nil), good...)
			bad[0] ^= 1
			_, err := ec.Put(ctx, victim, string(bad))
			return err
		}, "does not match"},
		{"missing", func() error { _, err := ec.Delete(ctx, victim); return err }, "missing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.spoil(); err != nil {
				t.Fatal(err)
			}
			// A fresh registry: no cached copy of the good chunk.
			fresh := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
			err := fresh.Close(ctx, "r", ledger.Incarnation{Region: "b", Inc: 1})
			if err == nil || !errors.Is(err, ErrRegistry) || !strings.Contains(err.Error(), victim) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("change with a spoilt chunk: %v (want ErrRegistry naming %s, %q)", err, victim, tc.want)
			}
			if recs, err := fresh.Records(ctx); err != nil || len(recs["r"].Records) != 0 {
				t.Fatalf("Records with a spoilt chunk: %v %+v (want the document left out)", err, recs["r"])
			}
			rev, _, after := chunkState(t, ec, reg, "r")
			if rev != rev0 || len(after) < len(keys)-1 {
				t.Fatalf("a failed change wrote: document revision %d (was %d), %d chunks (were %d)", rev, rev0, len(after), len(keys))
			}
			if _, err := ec.Put(ctx, victim, string(good)); err != nil {
				t.Fatal(err)
			}
			got, err := NewEtcdRegistry(ec, "", ledger.DefaultConfig()).Records(ctx)
			if err != nil || !reflect.DeepEqual(got["r"].Records, want["r"].Records) {
				t.Fatalf("registry not whole once the chunk is back: %v", err)
			}
		})
	}
}

// TestRegistryPreviousVersion: a document of the previous version's form
// (every list inline) is read and changed, and stays in that form while
// small, so agents of both versions share it; a chunked document is
// refused by the previous version's decoding (it would otherwise read
// empty lists and write them back).
func TestRegistryPreviousVersion(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	spec := twoRegions
	mem, err := ledger.NewRegistry(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	if err != nil {
		t.Fatal(err)
	}
	mem.Start("a")
	mem.Start("b")
	mem.Start("a")
	old, err := json.Marshal(registryDoc{Spec: spec, State: mem.State()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ec.Put(ctx, reg.Key("r"), string(old)); err != nil {
		t.Fatal(err)
	}
	c := ledger.Contribution{Of: ledger.Incarnation{Region: "a", Inc: 1}, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: manyKeys(100, "k", func(int) int64 { return 3 })}
	if _, err := reg.Contribute(ctx, "r", c); err != nil {
		t.Fatal(err)
	}
	if _, err := mem.Contribute(c); err != nil {
		t.Fatal(err)
	}
	// The previous version's decoding, as it was.
	prevDecode := func(b []byte) (ledger.RegistryState, error) {
		var doc registryDoc
		if err := json.Unmarshal(b, &doc); err != nil {
			return ledger.RegistryState{}, err
		}
		r, err := ledger.RestoreRegistry(doc.Spec.ledgerConfig(ledger.DefaultConfig()), doc.Spec.Regions, doc.State)
		if err != nil {
			return ledger.RegistryState{}, err
		}
		return r.State(), nil
	}
	g, err := ec.Get(ctx, reg.Key("r"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := prevDecode(g.Kvs[0].Value)
	if err != nil || !reflect.DeepEqual(st, mem.State()) {
		t.Fatalf("the previous version does not read a small document written now: %v", err)
	}
	// A large one is chunked, and refused by the previous version.
	big := ledger.Contribution{Of: ledger.Incarnation{Region: "b", Inc: 1}, From: ledger.Incarnation{Region: "a", Inc: 2}, Q: manyKeys(20_000, "k", func(int) int64 { return 2 })}
	if _, err := reg.Contribute(ctx, "r", big); err != nil {
		t.Fatal(err)
	}
	if g, err = ec.Get(ctx, reg.Key("r")); err != nil {
		t.Fatal(err)
	}
	if p, err := parseDoc(g.Kvs[0].Value); err != nil || len(p.lists) == 0 {
		t.Fatalf("a document with 20,000 keys is not chunked: %v", err)
	}
	if _, err := prevDecode(g.Kvs[0].Value); err == nil || !strings.Contains(err.Error(), "state") {
		t.Fatalf("the previous version reads a chunked document (error %v)", err)
	}
}

// BenchmarkRegistry1MKeys: one reclaim of a rule with 1,000,000 active keys
// through a real etcd (default limits): a/1 reclaimed by the contributions
// of b/1 and c/1, each of every key; then a fresh registry's Records. It
// reports the seconds of each contribution (the second completes the
// reclaim: record, payments, kept) and of the Records, the document's and
// the chunks' bytes.
//
//	go test -run '^$' -bench Registry1MKeys -benchtime 1x -v ./sync/agent/
func BenchmarkRegistry1MKeys(b *testing.B) {
	const n = 1_000_000
	ctx := context.Background()
	ec := testutil.StartEtcd(b).Client(b)
	spec := Spec{Units: 1_000_000, MinShare: 0.1, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 2}, {Name: "c", Weight: 1}}}
	qb := manyKeys(n, "k", func(i int) int64 { return int64(i%97 + 1) })
	qc := manyKeys(n, "k", func(i int) int64 { return -int64(i%13 + 1) })
	for i := 0; i < b.N; i++ {
		rule := fmt.Sprintf("r%d", i)
		reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
		for _, x := range []string{"a", "b", "c", "a"} {
			if _, _, err := reg.Start(ctx, rule, spec, x); err != nil {
				b.Fatal(err)
			}
		}
		a1 := ledger.Incarnation{Region: "a", Inc: 1}
		for j, c := range []ledger.Contribution{{Of: a1, From: ledger.Incarnation{Region: "b", Inc: 1}, Q: qb}, {Of: a1, From: ledger.Incarnation{Region: "c", Inc: 1}, Q: qc}} {
			t0 := time.Now()
			rec, err := reg.Contribute(ctx, rule, c)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(time.Since(t0).Seconds(), fmt.Sprintf("s/contribution%d", j+1))
			if j == 1 && !rec.Complete {
				b.Fatal("the reclaim did not complete")
			}
		}
		t0 := time.Now()
		recs, err := NewEtcdRegistry(ec, "", ledger.DefaultConfig()).Records(ctx)
		if err != nil || len(recs[rule].Records) == 0 {
			b.Fatalf("records: %v", err)
		}
		b.ReportMetric(time.Since(t0).Seconds(), "s/records")
		doc, err := ec.Get(ctx, reg.Key(rule))
		if err != nil {
			b.Fatal(err)
		}
		all, err := ec.Get(ctx, reg.chunkDir(rule), clientv3.WithPrefix())
		if err != nil {
			b.Fatal(err)
		}
		var cb, nc int
		for _, kv := range all.Kvs {
			if chunkName(strings.TrimPrefix(string(kv.Key), reg.chunkDir(rule))) != "" {
				cb += len(kv.Value)
				nc++
			}
		}
		b.ReportMetric(float64(len(doc.Kvs[0].Value)), "doc-bytes")
		b.ReportMetric(float64(cb), "chunk-bytes")
		b.ReportMetric(float64(nc), "chunks")
	}
}

// TestRegistryDocumentUnreadable: a registry document that does not decode
// (truncated, edited by hand) fails the rule's starts with an error naming
// its etcd key and the recovery, not only the rule (an explorer: `rule
// "g": agent: registry: document: unexpected end of JSON input`).
func TestRegistryDocumentUnreadable(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	startLives(t, ctx, reg, "r", twoRegions)
	g, err := ec.Get(ctx, reg.Key("r"))
	if err != nil || len(g.Kvs) == 0 {
		t.Fatalf("the document: %v", err)
	}
	if _, err := ec.Put(ctx, reg.Key("r"), string(g.Kvs[0].Value[:len(g.Kvs[0].Value)/2])); err != nil {
		t.Fatal(err)
	}
	_, _, err = reg.Start(ctx, "r", twoRegions, "a")
	if err == nil || !strings.Contains(err.Error(), reg.Key("r")) || !strings.Contains(err.Error(), "new id") {
		t.Fatalf("start over a truncated document: %v, want an error naming %s and the recovery", err, reg.Key("r"))
	}
}
