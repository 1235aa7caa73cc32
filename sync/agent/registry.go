package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultRegistryPrefix is where EtcdRegistry keeps one document per global
// rule. It is the rule store's (etcdstore), which reads the documents to
// refuse a rule whose split differs from the one registered for its id.
const DefaultRegistryPrefix = etcdstore.DefaultRegistryPrefix

// ErrRegistry is wrapped by registry errors other than etcd's own.
var ErrRegistry = errors.New("agent: registry")

// Spec is what a rule's ledgers must agree on in every region: the number
// of units and the floors and initial parts (MinShare and the regions'
// weights). The first agent to create a rule's registry document fixes it;
// every agent builds its ledger from the document's Spec (see the package
// doc on rule changes).
type Spec struct {
	Units    int64               `json:"units"`
	MinShare float64             `json:"min_share"`
	Regions  []ledger.RegionSpec `json:"regions"`
	// Quantum is the units of one whole token of the rule's capacity or
	// limit (ledger.QuantumOf; 0: none, and in documents from before it)
	// as the agent that last wrote the document knew it: each write
	// records the one of the rule the writing agent has now
	// (EtcdRegistry.setLimit), so a capacity changed since the document
	// was made counts from the next write on. The registry pays reclaims
	// out in whole tokens with it. Advisory: any payout sums to what is
	// freed, so it is not part of what the ledgers must agree on (equal),
	// and a Quantum a change behind only makes a payout round to the old
	// token (the ledgers' gifts then move it to whole tokens of the new).
	Quantum int64 `json:"quantum,omitempty"`
}

// equal reports whether s and o agree on what the ledgers must share:
// Units, MinShare and the regions (Quantum aside).
func (s Spec) equal(o Spec) bool {
	return s.Units == o.Units && s.MinShare == o.MinShare && slices.Equal(s.Regions, o.Regions)
}

// validate checks a spec read from etcd as the agent would have made it:
// units within the store's range, regions named once in name order
// (ledger.Regions) with finite positive weights of a finite sum.
func (s Spec) validate() error {
	if s.Units <= 0 || s.Units > redisstore.MaxUnits {
		return fmt.Errorf("spec: units %d outside (0, %d]", s.Units, redisstore.MaxUnits)
	}
	if s.Quantum < 0 || s.Quantum > s.Units {
		return fmt.Errorf("spec: quantum %d outside [0, units %d]", s.Quantum, s.Units)
	}
	var sum float64
	for i, x := range s.Regions {
		if i > 0 && s.Regions[i-1].Name >= x.Name {
			return fmt.Errorf("spec: regions not in name order or repeated at %q", x.Name)
		}
		if !(x.Weight > 0) || math.IsInf(x.Weight, 0) {
			return fmt.Errorf("spec: region %q: weight %v is not a finite number above 0", x.Name, x.Weight)
		}
		sum += x.Weight
	}
	if math.IsInf(sum, 0) {
		return errors.New("spec: the weights' sum is not finite")
	}
	return nil
}

// validLives checks that each region's incarnations appear in increasing
// order, as Start appends them, below the largest number: Start gives the
// next after the region's last, and a number given out twice (or 0, after
// wrapping) would make peers take the new life for an old one.
func validLives(st ledger.RegistryState) error {
	last := map[string]uint64{}
	for _, l := range st.Lives {
		if l.Inc <= last[l.Region] || l.Inc == math.MaxUint64 {
			return fmt.Errorf("state: incarnation %s/%d out of order (after %d) or too large", l.Region, l.Inc, last[l.Region])
		}
		last[l.Region] = l.Inc
	}
	return nil
}

// ledgerConfig returns base with the spec's Units, MinShare and Quantum.
func (s Spec) ledgerConfig(base ledger.Config) ledger.Config {
	base.Units, base.MinShare, base.Quantum = s.Units, s.MinShare, s.Quantum
	return base
}

// Registry is the reclaim registry as the agent uses it: one ledger.Registry
// per global rule, every change atomic (EtcdRegistry: compare-and-swap).
type Registry interface {
	// Start allocates region's next incarnation for rule, creating the rule's
	// registry with spec if it has none; it returns the spec in force.
	Start(ctx context.Context, rule string, spec Spec, region string) (ledger.Start, Spec, error)
	// Contribute adds c to rule's registry and returns the record of c.Of.
	Contribute(ctx context.Context, rule string, c ledger.Contribution) (ledger.Record, error)
	// Close records that by's store marker is confirmed: every earlier
	// incarnation of its region is at its floor for good.
	Close(ctx context.Context, rule string, by ledger.Incarnation) error
	// Records returns, per rule with a registry, a revision that changes
	// whenever the rule's registry does, and every reclaim record in it.
	Records(ctx context.Context) (map[string]RuleRecords, error)
}

// RuleRecords is one rule's registry as Records sees it.
type RuleRecords = driver.RuleRecords

// registryDoc is the JSON document of one rule's registry.
type registryDoc struct {
	Spec  Spec                 `json:"spec"`
	State ledger.RegistryState `json:"state"`
}

// EtcdRegistry keeps each rule's ledger.Registry as one JSON document under
// a prefix and changes it with a compare-and-swap loop on the key's
// ModRevision, so concurrent agents never lose an update. A document with
// large per-key lists keeps them in content-addressed chunks under the
// chunk prefix (chunks.go, and the package doc, "Registry chunks").
type EtcdRegistry struct {
	kv     clientv3.KV
	prefix string
	base   ledger.Config
	shard  Shard // the layout every change checks (LayoutKey), and whose groups Records returns
	format chunkFormat
	cache  *chunkCache
	recs   *recordCache
	stats  *registryStats
	// beforeCAS, when set (tests), runs between a write's chunk puts and
	// its compare-and-swap.
	beforeCAS func(rule string)
	limits    *ruleLimits
}

// ruleLimits is each rule's limit in whole tokens as the agent's rule set
// has it now (EtcdRegistry.setLimit; absent: not known).
type ruleLimits struct {
	mu sync.Mutex
	m  map[string]int64
}

// setLimit records rule's limit in whole tokens (a token bucket's
// capacity, a window's limit; 0: forget the rule): every later write of
// the rule's document records the Quantum of it in the Spec (the
// document's is the one of the capacity when it was made, or when an
// agent last wrote it) and pays reclaims out in its whole tokens. The
// Quantum is advisory (any payout sums to what was freed), so agents that
// disagree for a moment, each writing its own, change no total.
func (r *EtcdRegistry) setLimit(rule string, tokens int64) {
	r.limits.mu.Lock()
	defer r.limits.mu.Unlock()
	if tokens <= 0 {
		delete(r.limits.m, rule)
		return
	}
	r.limits.m[rule] = tokens
}

// followLimit sets the Quantum of cur and reg (rule's document, read or
// new) to that of rule's limit as setLimit last recorded it, if any.
func (r *EtcdRegistry) followLimit(rule string, cur *Spec, reg *ledger.Registry) {
	r.limits.mu.Lock()
	tokens, ok := r.limits.m[rule]
	r.limits.mu.Unlock()
	if !ok {
		return
	}
	if q := ledger.QuantumOf(cur.Units, float64(tokens)); q != cur.Quantum {
		cur.Quantum = q
		reg.SetQuantum(q)
	}
}

// registryStats is what an EtcdRegistry last wrote (the agent's
// apportion_sync_registry_*_bytes gauges).
type registryStats struct {
	docBytes, chunkBytes atomic.Int64
}

// recordCache keeps, per registry document, the records of the revision
// Records last decoded, so that a poll decodes only documents that changed.
type recordCache struct {
	mu      sync.Mutex
	m       map[string]RuleRecords
	witness map[string]int64 // the witness keys' revisions, by region (witness.go)
}

// NewEtcdRegistry returns a registry over kv under prefix (default
// DefaultRegistryPrefix when empty). base supplies the ledger settings the
// registry validates with (Units and MinShare come from each rule's Spec).
func NewEtcdRegistry(kv clientv3.KV, prefix string, base ledger.Config) *EtcdRegistry {
	if prefix == "" {
		prefix = DefaultRegistryPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	return &EtcdRegistry{kv: kv, prefix: prefix, base: base, format: defaultChunkFormat,
		cache: newChunkCache(defaultCacheBytes), recs: &recordCache{m: map[string]RuleRecords{}}, stats: &registryStats{},
		limits: &ruleLimits{m: map[string]int64{}}}
}

// forShard returns r checking sh's layout and reading sh's groups.
func (r *EtcdRegistry) forShard(sh Shard) *EtcdRegistry {
	c := *r
	c.shard = sh
	c.recs = &recordCache{m: map[string]RuleRecords{}}
	c.stats = &registryStats{}
	return &c
}

// Key returns the etcd key of rule's registry document.
func (r *EtcdRegistry) Key(rule string) string { return r.prefix + rule }

// ChunkPrefix returns the prefix under which r keeps chunks: the registry
// prefix with ".chunks/" in place of its final "/", so outside it (the
// default: /ratelimit/registry.chunks/). An agent writes there too.
func (r *EtcdRegistry) ChunkPrefix() string { return strings.TrimSuffix(r.prefix, "/") + ".chunks/" }

// chunkDir returns the prefix of rule's chunks; a chunk's key is chunkDir
// and its hex SHA-256.
func (r *EtcdRegistry) chunkDir(rule string) string { return r.ChunkPrefix() + rule + "/" }

// gcKey returns the key every chunk collection of rule changes (see gc).
func (r *EtcdRegistry) gcKey(rule string) string { return r.ChunkPrefix() + rule + "/gc" }

// decodeState checks a parsed document's spec and state and restores its
// registry.
func (r *EtcdRegistry) decodeState(sp Spec, st ledger.RegistryState) (*ledger.Registry, error) {
	if err := sp.validate(); err != nil {
		return nil, fmt.Errorf("%w: document: %v", ErrRegistry, err)
	}
	if err := validLives(st); err != nil {
		return nil, fmt.Errorf("%w: document: %v", ErrRegistry, err)
	}
	reg, err := ledger.RestoreRegistry(sp.ledgerConfig(r.base), sp.Regions, st)
	if err != nil {
		return nil, fmt.Errorf("%w: document: %w", ErrRegistry, err)
	}
	return reg, nil
}

// decode restores a document, reading its chunks with fetch (hash ->
// content, each verified here: what comes from etcd is not trusted).
func (r *EtcdRegistry) decode(b []byte, fetch func(chunkRef) ([]byte, error)) (*ledger.Registry, Spec, *parsedDoc, error) {
	p, err := parseDoc(b)
	if err != nil {
		return nil, Spec{}, nil, err
	}
	chunks := map[string][]byte{}
	for _, c := range p.refs() {
		if fetch == nil {
			return nil, Spec{}, nil, fmt.Errorf("%w: document: chunk %s: no chunk source", ErrRegistry, c.Hash)
		}
		if chunks[c.Hash], err = fetch(c); err != nil {
			return nil, Spec{}, nil, err
		}
	}
	st, err := p.assemble(chunks)
	if err != nil {
		return nil, Spec{}, nil, err
	}
	reg, err := r.decodeState(p.spec, st)
	if err != nil {
		return nil, Spec{}, nil, err
	}
	return reg, p.spec, p, nil
}

// fetcher returns the chunk source of rule's document as of etcd revision
// rev: the cache, else a read at rev (the chunks the document referenced
// then exist at rev, however it changed since), verified and cached.
func (r *EtcdRegistry) fetcher(ctx context.Context, rule string, rev int64) func(chunkRef) ([]byte, error) {
	return func(c chunkRef) ([]byte, error) {
		if b, ok := r.cache.get(c.Hash); ok && len(b) == c.Len {
			return b, nil
		}
		key := r.chunkDir(rule) + c.Hash
		resp, err := r.kv.Get(ctx, key, clientv3.WithRev(rev))
		if err != nil {
			return nil, err
		}
		if len(resp.Kvs) == 0 {
			return nil, fmt.Errorf("%w: chunk %s: %w (the document references it, etcd has no such key at revision %d)", ErrRegistry, key, errMissingChunk, rev)
		}
		b := resp.Kvs[0].Value
		if err := verifyChunk(key, c, b); err != nil {
			return nil, err
		}
		r.cache.put(c.Hash, b)
		return b, nil
	}
}

// layoutGuard checks the layout read in lay (a range read of LayoutKey)
// against r's shard (checkLayout) and returns the comparison that holds
// while that layout document is unchanged (none: ModRevision 0).
func (r *EtcdRegistry) layoutGuard(lay *etcdserverpb.RangeResponse) (clientv3.Cmp, error) {
	var doc []byte
	var rev int64
	if len(lay.Kvs) > 0 {
		doc, rev = lay.Kvs[0].Value, lay.Kvs[0].ModRevision
	}
	return clientv3.Compare(clientv3.ModRevision(LayoutKey), "=", rev), r.shard.checkLayout(doc)
}

// maxTxnOps is etcd's default limit on the comparisons, and on the
// operations, of one transaction (--max-txn-ops).
const maxTxnOps = 128

// guardedChunks is how many newly referenced chunks a compare-and-swap
// checks one by one (CreateRevision > 0), within maxTxnOps with the
// document's, the layout's and gcKey's comparisons; a write with more (a
// rule of several hundred thousand keys) relies on gcKey alone.
const guardedChunks = maxTxnOps - 8

// update runs fn on rule's registry (created with spec when absent, if spec
// is not nil) and writes it back if the document did not change meanwhile,
// retrying otherwise.
//
// Chunks: every chunk the current document references exists. A write puts
// the chunks its document references and the one it replaces does not,
// each in its own request, before the compare-and-swap; the swap also
// compares gcKey's ModRevision with the one read before those puts (every
// chunk collection changes gcKey, so a collection that may have deleted one
// of them fails the swap, which then retries and puts them again) and, for
// up to guardedChunks new chunks, that each exists (a chunk deleted by hand
// fails it too). After a successful swap, the chunks nothing references any
// more (those of the replaced document, and any a failed or crashed writer
// left) are collected (gc).
func (r *EtcdRegistry) update(ctx context.Context, rule string, spec *Spec, fn func(*ledger.Registry, Spec) error) error {
	key, gk := r.Key(rule), r.gcKey(rule)
	for {
		// The document, the layout and gcKey in one read; the write below
		// compares all three, so no incarnation starts in a layout that is
		// not this agent's (see the package doc, "Shards").
		tr, err := r.kv.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(LayoutKey), clientv3.OpGet(gk)).Commit()
		if err != nil {
			return err
		}
		resp := tr.Responses[0].GetResponseRange()
		layCmp, err := r.layoutGuard(tr.Responses[1].GetResponseRange())
		if err != nil {
			return err
		}
		var gcRev int64
		if g := tr.Responses[2].GetResponseRange(); len(g.Kvs) > 0 {
			gcRev = g.Kvs[0].ModRevision
		}
		var reg *ledger.Registry
		var cur Spec
		var cmp clientv3.Cmp
		had := map[string]bool{}
		if len(resp.Kvs) == 0 {
			if spec == nil {
				return fmt.Errorf("%w: rule %q has no registry", ErrRegistry, rule)
			}
			cur = *spec
			if reg, err = ledger.NewRegistry(cur.ledgerConfig(r.base), cur.Regions); err != nil {
				return fmt.Errorf("%w: %w", ErrRegistry, err)
			}
			cmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
		} else {
			var p *parsedDoc
			reg, cur, p, err = r.decode(resp.Kvs[0].Value, r.fetcher(ctx, rule, tr.Header.Revision))
			if errors.Is(err, rpctypes.ErrCompacted) {
				continue // the document changed since, and its revision is gone
			}
			if err != nil {
				return fmt.Errorf("rule %q: registry document %s (unreadable: put the rule again under a new id, docs/operations.md#etcd-lost-or-restored): %w", rule, key, err)
			}
			for _, c := range p.refs() {
				had[c.Hash] = true
			}
			cmp = clientv3.Compare(clientv3.ModRevision(key), "=", resp.Kvs[0].ModRevision)
		}
		r.followLimit(rule, &cur, reg)
		if err := fn(reg, cur); err != nil {
			return err
		}
		b, chunks, err := r.format.encodeDoc(cur, reg.State())
		if err != nil {
			return fmt.Errorf("rule %q: %w", rule, err)
		}
		cmps := []clientv3.Cmp{cmp, layCmp, clientv3.Compare(clientv3.ModRevision(gk), "=", gcRev)}
		var fresh []string
		for h := range chunks {
			if !had[h] {
				fresh = append(fresh, h)
			}
		}
		slices.Sort(fresh)
		for _, h := range fresh {
			if _, err := r.kv.Put(ctx, r.chunkDir(rule)+h, string(chunks[h])); err != nil {
				return err
			}
		}
		if len(fresh) <= guardedChunks {
			for _, h := range fresh {
				cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(r.chunkDir(rule)+h), ">", 0))
			}
		}
		if r.beforeCAS != nil {
			r.beforeCAS(rule)
		}
		tr, err = r.kv.Txn(ctx).If(cmps...).Then(clientv3.OpPut(key, string(b))).Commit()
		if err != nil {
			return err
		}
		if tr.Succeeded {
			// After every write (one keys-only read when there is nothing
			// to collect), so that what a crashed writer left is collected
			// even if the document no longer has chunks. Best effort: what
			// is left is collected after a later write.
			_, _ = r.gc(ctx, rule)
			var cb int
			for _, c := range chunks {
				cb += len(c)
			}
			r.stats.docBytes.Store(int64(len(b)))
			r.stats.chunkBytes.Store(int64(cb))
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// gcBatch is how many chunks one collecting transaction deletes (etcd
// counts the gcKey put too against maxTxnOps).
const gcBatch = maxTxnOps - 8

// gc deletes rule's chunks its current document does not reference: in
// transactions of at most gcBatch deletes, each comparing the document's
// ModRevision (a document that changed may reference them now) and gcKey's
// (another collection ran) with those read, and changing gcKey, which fails
// the swap of any writer that read gcKey before: one whose chunks this
// deletes puts them again. It stops when the document changed (its writer
// collects after it) and returns how many chunks it deleted.
func (r *EtcdRegistry) gc(ctx context.Context, rule string) (int, error) {
	key, gk, dir := r.Key(rule), r.gcKey(rule), r.chunkDir(rule)
	deleted := 0
	for attempt := 0; attempt < 8; attempt++ {
		tr, err := r.kv.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(gk), clientv3.OpGet(dir, clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
		if err != nil {
			return deleted, err
		}
		doc := tr.Responses[0].GetResponseRange()
		if len(doc.Kvs) == 0 {
			return deleted, nil
		}
		p, err := parseDoc(doc.Kvs[0].Value)
		if err != nil {
			return deleted, fmt.Errorf("rule %q: %w", rule, err) // collect nothing a document we cannot read might reference
		}
		ref := map[string]bool{}
		for _, c := range p.refs() {
			ref[c.Hash] = true
		}
		var garbage []string
		for _, kv := range tr.Responses[2].GetResponseRange().Kvs {
			if h := chunkName(strings.TrimPrefix(string(kv.Key), dir)); h != "" && !ref[h] {
				garbage = append(garbage, string(kv.Key))
			}
		}
		if len(garbage) == 0 {
			return deleted, nil
		}
		docCmp := clientv3.Compare(clientv3.ModRevision(key), "=", doc.Kvs[0].ModRevision)
		var gcRev int64
		if g := tr.Responses[1].GetResponseRange(); len(g.Kvs) > 0 {
			gcRev = g.Kvs[0].ModRevision
		}
		raced := false
		for len(garbage) > 0 {
			n := min(len(garbage), gcBatch)
			ops := []clientv3.Op{clientv3.OpPut(gk, "")}
			for _, k := range garbage[:n] {
				ops = append(ops, clientv3.OpDelete(k))
			}
			dr, err := r.kv.Txn(ctx).If(docCmp, clientv3.Compare(clientv3.ModRevision(gk), "=", gcRev)).Then(ops...).Commit()
			if err != nil {
				return deleted, err
			}
			if !dr.Succeeded {
				raced = true
				break
			}
			deleted += n
			gcRev = dr.Header.Revision
			garbage = garbage[n:]
		}
		if !raced {
			return deleted, nil
		}
	}
	return deleted, nil
}

// Start implements Registry.
func (r *EtcdRegistry) Start(ctx context.Context, rule string, spec Spec, region string) (ledger.Start, Spec, error) {
	var st ledger.Start
	var used Spec
	err := r.update(ctx, rule, &spec, func(reg *ledger.Registry, cur Spec) error {
		var err error
		st, err = reg.Start(region)
		used = cur
		return err
	})
	return st, used, err
}

// Contribute implements Registry.
func (r *EtcdRegistry) Contribute(ctx context.Context, rule string, c ledger.Contribution) (ledger.Record, error) {
	var rec ledger.Record
	err := r.update(ctx, rule, nil, func(reg *ledger.Registry, _ Spec) error {
		var err error
		rec, err = reg.Contribute(c)
		return err
	})
	return rec, err
}

// Close implements Registry.
func (r *EtcdRegistry) Close(ctx context.Context, rule string, by ledger.Incarnation) error {
	return r.update(ctx, rule, nil, func(reg *ledger.Registry, _ Spec) error {
		return reg.Close(by)
	})
}

// Records implements Registry with one range read of the prefix (and of
// LayoutKey: another layout than the agent's is ErrLayout, and of the
// witness keys, kept for readWitness). Documents that
// do not decode (a missing or corrupt chunk included), and those of other
// shards' groups, are left out. A document whose ModRevision did not change
// since the last call is not decoded again; one that did reads only the
// chunks not in the cache, as of the range read's revision.
func (r *EtcdRegistry) Records(ctx context.Context) (map[string]RuleRecords, error) {
	tr, err := r.kv.Txn(ctx).Then(clientv3.OpGet(r.prefix, clientv3.WithPrefix()), clientv3.OpGet(LayoutKey),
		clientv3.OpGet(r.WitnessPrefix(), clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
	if err != nil {
		return nil, err
	}
	resp := tr.Responses[0].GetResponseRange()
	if _, err := r.layoutGuard(tr.Responses[1].GetResponseRange()); err != nil {
		return nil, err
	}
	witness := r.witnessRevs(tr.Responses[2].GetResponseRange().Kvs)
	r.recs.mu.Lock()
	r.recs.witness = witness
	r.recs.mu.Unlock()
	r.recs.mu.Lock()
	prev := r.recs.m
	r.recs.mu.Unlock()
	out := make(map[string]RuleRecords, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), r.prefix)
		if !r.shard.ownGroup(id) {
			continue
		}
		if old, ok := prev[id]; ok && old.Revision == kv.ModRevision {
			out[id] = old
			continue
		}
		reg, _, _, err := r.decode(kv.Value, r.fetcher(ctx, id, tr.Header.Revision))
		if err != nil {
			if errors.Is(err, ErrRegistry) {
				continue
			}
			return nil, err // etcd's (compacted: the next poll reads again)
		}
		out[id] = RuleRecords{Revision: kv.ModRevision, Records: reg.Records()}
	}
	r.recs.mu.Lock()
	r.recs.m = out
	r.recs.mu.Unlock()
	return out, nil
}
