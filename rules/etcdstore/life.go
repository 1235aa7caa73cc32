package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/apportion/apportion/rules"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// This file holds what the Watcher and the Store share to decide whether a
// stored rule document is valid: the same decision in every process, so
// that enforcers started at different times enforce the same version.
//
// A key's life is its versions since it was last created (one
// CreateRevision); a deletion ends it. A global rule's algorithm, and a
// global window rule's window, are those of the first valid global version
// of its key's life (its baseline): a later version of the same life that
// changes them is invalid (globalChange), and so is a global version whose
// split differs from the sync agents' registered one (registryMismatch).

// errRegistryRead: the registry document a global rule is checked against
// could not be read (etcd unreachable): nothing is decided, the last set
// stays, and the watcher tries again.
var errRegistryRead = errors.New("etcdstore: reading the sync agents' registry document")

// errHistoryRead: a key's history, needed to decide whether its stored
// version is valid, could not be read: nothing is decided.
var errHistoryRead = errors.New("etcdstore: reading a rule's history")

// validate decodes a stored document as decode does, but returns the
// document's own error (parseDoc's), and, for a global rule, checks its
// split against the sync agents' registry document of its id
// (registryMismatch): a document written by hand with another split than
// the registered one is invalid, so that an enforcer's floors stay those
// the agents' ledgers start from (else the regions' shares could add up
// to more than the limit). No registry document: no agent has started a
// ledger for the id, and the rule's split is the one they will take; one
// that no agent can read: the rule stands as stored (below). A registry
// document that etcd does not deliver returns an error wrapping
// errRegistryRead.
func validate(ctx context.Context, reg *registryReader, id string, doc []byte) (rules.Rule, error) {
	r, err := parseDoc(id, doc)
	if err != nil || r.Scope != rules.Global {
		return r, err
	}
	regDoc, err := reg.get(ctx, id)
	if err != nil {
		return rules.Rule{}, err
	}
	if regDoc == nil {
		return r, nil
	}
	if _, _, err := registeredSplit(regDoc); err != nil {
		// A registry document no agent can read (written by hand, or
		// damaged): the agents cannot coordinate the id, so each region
		// runs on the static floors of the rule as stored, the same in
		// every process. Skipping the rule would leave an enforcer
		// started now enforcing nothing for it (Put still refuses a rule
		// under such an id).
		return r, nil
	}
	if err := registryMismatch(r, reg.prefix+id, regDoc); err != nil {
		return rules.Rule{}, err
	}
	return r, nil
}

// invalidDoc wraps a document's own error as decode does.
func invalidDoc(id string, err error) error {
	return fmt.Errorf("%w: key %q: %w", ErrInvalidDocument, id, err)
}

// lifeView is what the versions of a key's life say of its current (last)
// version.
type lifeView struct {
	// base is the life's first valid global version (among the versions
	// compaction left), nil if none.
	base *rules.Rule
	// cur is the current version, valid if err is nil; err is the
	// document's own error (not wrapped in ErrInvalidDocument).
	cur rules.Rule
	err error
	// good is the last valid version compatible with base (the current
	// one if it is valid), goodRev its ModRevision; nil if none.
	good    *rules.Rule
	goodRev int64
}

// judge validates the versions of one life of key id, oldest first (as
// lifeHistory returns them; the last is the current one). Only an error
// wrapping errRegistryRead is returned.
func judge(ctx context.Context, reg *registryReader, id string, versions []*mvccpb.KeyValue) (lifeView, error) {
	var v lifeView
	for i, kv := range versions {
		r, err := validate(ctx, reg, id, kv.Value)
		if errors.Is(err, errRegistryRead) {
			return lifeView{}, err
		}
		if err == nil && r.Scope == rules.Global {
			if v.base == nil {
				v.base = &r
			} else {
				err = globalChange(*v.base, r)
			}
		}
		if err == nil {
			v.good, v.goodRev = &r, kv.ModRevision
		}
		if i == len(versions)-1 {
			v.cur, v.err = r, err
		}
	}
	return v, nil
}

// lifeHistory returns the versions of kv's key in its current life (since
// kv.CreateRevision) up to kv itself, oldest first, in O(1) round trips:
// one watch of exactly that key from the life's creation, read until kv's
// ModRevision. Where compaction removed the start of the life, the first
// version returned is the key as of the compaction revision (a read at
// that revision), followed by the events after it. kv must be the key as
// read (a version of its current life).
func lifeHistory(ctx context.Context, c *clientv3.Client, timeout time.Duration, kv *mvccpb.KeyValue) ([]*mvccpb.KeyValue, error) {
	if kv.Version <= 1 || kv.CreateRevision >= kv.ModRevision {
		return []*mvccpb.KeyValue{kv}, nil // the life's only version
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	key := string(kv.Key)
	fail := func(err error) ([]*mvccpb.KeyValue, error) {
		return nil, fmt.Errorf("%w %q (revisions %d to %d): %w", errHistoryRead, key, kv.CreateRevision, kv.ModRevision, err)
	}
	var out []*mvccpb.KeyValue
	from := kv.CreateRevision
	// Each round is one watch; a compaction moving on meanwhile makes
	// another (bounded: each starts later in the life).
	for range 8 {
		done, compacted, err := watchLife(ctx, c, key, from, kv, &out)
		if err != nil {
			return fail(err)
		}
		if done {
			return out, nil
		}
		// The start of what we need is compacted: the key as of the
		// compaction revision, then the events after it.
		out = out[:0]
		resp, err := c.Get(ctx, key, clientv3.WithRev(compacted))
		switch {
		case err != nil && ctx.Err() != nil:
			return fail(err)
		case err != nil:
			from = compacted + 1 // compacted further: the next watch says where to
			continue
		}
		if len(resp.Kvs) == 1 && resp.Kvs[0].CreateRevision == kv.CreateRevision {
			if resp.Kvs[0].ModRevision == kv.ModRevision {
				return []*mvccpb.KeyValue{kv}, nil
			}
			out = append(out, resp.Kvs[0])
		}
		from = compacted + 1
	}
	return fail(errors.New("compacted faster than it could be read"))
}

// watchLife appends to out the PUT events of key from revision from up to
// kv's ModRevision; it reports whether it got there, or else the
// compaction revision the watch answered.
func watchLife(ctx context.Context, c *clientv3.Client, key string, from int64, kv *mvccpb.KeyValue, out *[]*mvccpb.KeyValue) (bool, int64, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for resp := range c.Watch(wctx, key, clientv3.WithRev(from)) {
		if resp.CompactRevision != 0 {
			return false, resp.CompactRevision, nil
		}
		if err := resp.Err(); err != nil {
			return false, 0, err
		}
		for _, ev := range resp.Events {
			if ev.Kv.ModRevision > kv.ModRevision {
				return false, 0, fmt.Errorf("no version at revision %d", kv.ModRevision)
			}
			if ev.Type == mvccpb.DELETE || ev.Kv.CreateRevision != kv.CreateRevision {
				*out = (*out)[:0] // not this life (cannot happen for kv as read)
				continue
			}
			*out = append(*out, ev.Kv)
			if ev.Kv.ModRevision == kv.ModRevision {
				return true, 0, nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return false, 0, err
	}
	return false, 0, errors.New("watch closed")
}

// historyParallel is how many key histories lifeHistories reads at once.
const historyParallel = 8

// lifeHistories reads the life histories of kvs (lifeHistory), a few at a
// time, keyed by key; a key whose history could not be read is in failed
// instead, with why (one key's history never holds up the others').
func lifeHistories(ctx context.Context, c *clientv3.Client, timeout time.Duration, kvs []*mvccpb.KeyValue) (hist map[string][]*mvccpb.KeyValue, failed map[string]error) {
	hist = make(map[string][]*mvccpb.KeyValue, len(kvs))
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	sem := make(chan struct{}, historyParallel)
	for _, kv := range kvs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			h, err := lifeHistory(ctx, c, timeout, kv)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if failed == nil {
					failed = map[string]error{}
				}
				failed[string(kv.Key)] = err
				return
			}
			hist[string(kv.Key)] = h
		})
	}
	wg.Wait()
	return hist, failed
}

// firstFailure is one of failed's errors (the least key's), or nil.
func firstFailure(failed map[string]error) error {
	if len(failed) == 0 {
		return nil
	}
	return failed[slices.Min(slices.Collect(maps.Keys(failed)))]
}

// registryReader reads the sync agents' registry documents for validate,
// each once: prefetch reads many in few round trips, get reads one it does
// not hold yet.
type registryReader struct {
	c       *clientv3.Client
	prefix  string
	timeout time.Duration
	docs    map[string][]byte // rule id -> document; nil value: none
}

func newRegistryReader(c *clientv3.Client, cfg *config) *registryReader {
	return &registryReader{c: c, prefix: cfg.registryPrefix, timeout: cfg.requestTimeout, docs: map[string][]byte{}}
}

// registryBatch is how many documents one prefetch transaction reads
// (etcd's default limit on a transaction's operations is 128).
const registryBatch = 64

func (g *registryReader) prefetch(ctx context.Context, ids []string) error {
	for len(ids) > 0 {
		n := min(len(ids), registryBatch)
		ops := make([]clientv3.Op, n)
		for i, id := range ids[:n] {
			ops[i] = clientv3.OpGet(g.prefix + id)
		}
		rctx, cancel := context.WithTimeout(ctx, g.timeout)
		resp, err := g.c.Txn(rctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("%w %s...: %w", errRegistryRead, g.prefix, err)
		}
		for i, id := range ids[:n] {
			g.docs[id] = nil
			if kvs := resp.Responses[i].GetResponseRange().GetKvs(); len(kvs) > 0 {
				g.docs[id] = kvs[0].Value
			}
		}
		ids = ids[n:]
	}
	return nil
}

// get returns id's registry document (nil: none), reading it unless held.
func (g *registryReader) get(ctx context.Context, id string) ([]byte, error) {
	if doc, ok := g.docs[id]; ok {
		return doc, nil
	}
	if err := g.prefetch(ctx, []string{id}); err != nil {
		return nil, err
	}
	return g.docs[id], nil
}

// globalIDs returns the ids of the documents among kvs that decode as
// global rules, and those of them whose life has more than one version
// (needing their history to be judged).
func globalIDs(prefix string, kvs []*mvccpb.KeyValue) (ids []string, multi []*mvccpb.KeyValue) {
	for _, kv := range kvs {
		id := kv2id(prefix, kv)
		if r, err := parseDoc(id, kv.Value); err == nil && r.Scope == rules.Global {
			ids = append(ids, id)
			if kv.Version > 1 {
				multi = append(multi, kv)
			}
		}
	}
	return ids, multi
}

func kv2id(prefix string, kv *mvccpb.KeyValue) string {
	return strings.TrimPrefix(string(kv.Key), prefix)
}
