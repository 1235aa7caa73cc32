package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/rules"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Log keys shared by the watcher's messages.
const (
	logKeyErr      = "err"
	logKeyKey      = "key"
	logKeyRevision = "revision"
	logKeyRules    = "rules"
	logKeyRetryIn  = "retry_in"
	logKeyPath     = "path"
	logKeyEnds     = "endpoints"
	logKeyDownFor  = "down_for"
)

// Watcher delivers the rule set stored under a prefix, live. It implements
// rules.Source. Run may be called once at a time; the rule state belongs to
// the goroutine that runs Run.
type Watcher struct {
	c   *clientv3.Client
	cfg config

	invalid  atomic.Uint64
	revision atomic.Int64

	// heard is when etcd last answered a snapshot or a watch (UnixNano),
	// not counting probes; watching is true while a watch is open.
	heard    atomic.Int64
	watching atomic.Bool
	// reach is whether etcd answers, for the log lines and the gauge of
	// losing it and getting it back.
	reachMu   sync.Mutex
	reach     reachState
	downSince time.Time

	// afterSnapshot, if set (tests only), runs after a snapshot is delivered
	// and before the watch starts.
	afterSnapshot func()
}

var _ rules.Source = (*Watcher)(nil)

// NewWatcher returns a Watcher over an etcd client owned by the caller.
func NewWatcher(c *clientv3.Client, opts ...Option) (*Watcher, error) {
	if c == nil {
		return nil, errors.New("etcdstore: nil etcd client")
	}
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	if cfg.registryPrefix == cfg.prefix {
		return nil, fmt.Errorf("etcdstore: the registry prefix %q is the rules' prefix", cfg.prefix)
	}
	return &Watcher{c: c, cfg: cfg}, nil
}

// InvalidDocuments is the number of invalid rule documents met so far (each
// stored version counted once).
func (w *Watcher) InvalidDocuments() uint64 { return w.invalid.Load() }

// Revision is the etcd revision of the last applied snapshot or watch
// response (0 before the first).
func (w *Watcher) Revision() int64 { return w.revision.Load() }

// reachState is what the Watcher knows of etcd.
type reachState int

const (
	reachUnknown reachState = iota // before the first snapshot's outcome
	reachUp
	reachDown
)

// state is the watcher's view; it belongs to the goroutine running Run.
type state struct {
	rules map[string]rules.Rule // last good version of every rule
	// badSeen remembers the ModRevision of the last invalid document seen per
	// key, so a reload does not count the same bad version twice.
	badSeen   map[string]int64
	delivered bool
	// rev is the revision of the set delivered last, fromCache whether it
	// came from the cache file.
	rev       int64
	fromCache bool
}

// Run delivers the rule set to update until ctx is done, then returns
// ctx.Err(). It calls update from this goroutine only, with a fresh slice
// sorted by id that the callee may keep. update is called with the first
// snapshot (or, if etcd cannot be reached and a cache file is configured,
// the cached set), then after every watch response that changes the set.
//
// While its watch is open and silent for the probe interval
// (WithProbeInterval), Run asks etcd whether it is still there: on losing
// it, it logs once "etcdstore: etcd unreachable; serving the last rule set
// (revision N) until it returns" (WARN), and on getting it back (also after
// failed snapshots) "etcdstore: etcd reachable again; following rule
// changes live" (INFO); both name the endpoints.
func (w *Watcher) Run(ctx context.Context, update func([]rules.Rule)) error {
	st := &state{rules: map[string]rules.Rule{}, badSeen: map[string]int64{}}
	mctx, stopMonitor := context.WithCancel(ctx)
	var monitor sync.WaitGroup
	monitor.Go(func() { w.monitor(mctx) })
	defer monitor.Wait()
	defer stopMonitor()
	// Connection errors repeat while etcd is down: one line per interval.
	lim := logsample.New(w.cfg.log, w.cfg.logEvery)
	backoff := w.cfg.minBackoff
	wait := func() error {
		t := time.NewTimer(backoff)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, w.cfg.maxBackoff)
		return nil
	}
	for {
		rev, err := w.snapshot(ctx, st, update)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			w.lost(err, false) // the line below says it
			msg := "etcdstore: cannot load rules from etcd; no rule set yet"
			switch {
			case st.delivered && st.fromCache:
				msg = fmt.Sprintf("etcdstore: cannot load rules from etcd; keeping the last rule set (revision %d, from the cache file)", st.rev)
			case st.delivered:
				msg = fmt.Sprintf("etcdstore: cannot load rules from etcd; keeping the last rule set (revision %d)", st.rev)
			}
			lim.Log(slog.LevelWarn, "snapshot", msg,
				logKeyEnds, w.endpoints(), logKeyErr, err, logKeyRetryIn, backoff.String())
			if !st.delivered && w.cfg.cacheFile != "" {
				w.deliverCache(st, update)
			}
			if err := wait(); err != nil {
				return err
			}
			continue
		}
		backoff = w.cfg.minBackoff
		if w.afterSnapshot != nil {
			w.afterSnapshot()
		}
		// Watch until the watch fails; resume from where it got to, or reload
		// the snapshot when the history we need is compacted.
		for {
			next, err := w.watch(ctx, st, rev, update)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if next > rev {
				rev = next
				backoff = w.cfg.minBackoff
			}
			if errors.Is(err, errCompacted) {
				w.cfg.log.Info("etcdstore: watch history compacted; reloading rules", logKeyRevision, rev, logKeyErr, err)
				break
			}
			lim.Log(slog.LevelWarn, "watch", "etcdstore: rule watch interrupted; keeping the last rule set",
				logKeyEnds, w.endpoints(), logKeyErr, err, logKeyRevision, rev, logKeyRetryIn, backoff.String())
			if err := wait(); err != nil {
				return err
			}
		}
	}
}

var errCompacted = errors.New("etcdstore: watch revision compacted")

// endpoints names the etcd client's endpoints for the log.
func (w *Watcher) endpoints() string { return strings.Join(w.c.Endpoints(), ",") }

// monitor probes etcd while the watch is open and has not heard from it
// for a probe interval (etcd's client resumes a broken watch silently),
// until ctx is done. Outside the watch the snapshot loop tells.
func (w *Watcher) monitor(ctx context.Context) {
	t := time.NewTicker(w.cfg.probeEvery)
	defer t.Stop()
	timeout := min(w.cfg.probeEvery, w.cfg.requestTimeout, 2*time.Second)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !w.watching.Load() || time.Since(time.Unix(0, w.heard.Load())) < w.cfg.probeEvery {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, timeout)
		_, err := w.c.Get(pctx, w.cfg.prefix, clientv3.WithCountOnly())
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			w.lost(err, true)
		default:
			w.reached()
		}
	}
}

// heardFrom records a snapshot or a watch response: no probe is needed
// within a probe interval of it.
func (w *Watcher) heardFrom() {
	w.heard.Store(time.Now().UnixNano())
	w.reached()
}

// reached records an answer from etcd, logging its return after a loss.
func (w *Watcher) reached() {
	w.reachMu.Lock()
	defer w.reachMu.Unlock()
	if w.reach == reachUp {
		return
	}
	if w.reach == reachDown {
		w.cfg.log.Info("etcdstore: etcd reachable again; following rule changes live",
			logKeyEnds, w.endpoints(), logKeyRevision, w.Revision(), logKeyDownFor, time.Since(w.downSince).Round(time.Millisecond).String())
	}
	w.reach = reachUp
	if w.cfg.reachable != nil {
		w.cfg.reachable.Set(1)
	}
}

// lost records that etcd did not answer; announce logs the loss if etcd
// was reachable until now (a failed snapshot logs its own line).
func (w *Watcher) lost(err error, announce bool) {
	w.reachMu.Lock()
	defer w.reachMu.Unlock()
	if w.reach == reachDown {
		return
	}
	if w.reach == reachUp && announce {
		rev := w.Revision()
		w.cfg.log.Warn(fmt.Sprintf("etcdstore: etcd unreachable; serving the last rule set (revision %d) until it returns", rev),
			logKeyEnds, w.endpoints(), logKeyRevision, rev, logKeyErr, err)
	}
	w.reach, w.downSince = reachDown, time.Now()
	if w.cfg.reachable != nil {
		w.cfg.reachable.Set(0)
	}
}

// snapshot loads every document under the prefix and delivers the resulting
// set. It returns the revision read at.
func (w *Watcher) snapshot(ctx context.Context, st *state, update func([]rules.Rule)) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, w.cfg.requestTimeout)
	defer cancel()
	resp, err := w.c.Get(rctx, w.cfg.prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, err
	}
	// The registry documents of the global rules, read in a few round
	// trips rather than one per rule (check reads them from here).
	reg := w.registryReader()
	var global []string
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), w.cfg.prefix)
		if r, err := decode(id, kv.Value); err == nil && r.Scope == rules.Global {
			global = append(global, id)
		}
	}
	if err := reg.prefetch(rctx, global); err != nil {
		return 0, err // try the snapshot again; the last set stays
	}
	next := make(map[string]rules.Rule, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), w.cfg.prefix)
		r, err := w.check(rctx, reg, id, kv.Value)
		if errors.Is(err, errRegistryRead) {
			return 0, err // try the snapshot again; the last set stays
		}
		if old, ok := st.rules[id]; ok && err == nil {
			err = globalChange(old, r)
		}
		if err != nil {
			w.badDocument(st, string(kv.Key), kv.ModRevision, err)
			if old, ok := st.rules[id]; ok {
				next[id] = old
			} else if old, rev, ok := w.lastGood(rctx, reg, kv, id); ok {
				// A process that never had the good version (started
				// after the bad put) serves it as those that had it do.
				next[id] = old
				w.cfg.log.Warn("etcdstore: serving the last good version of an invalid rule document, from etcd's history",
					logKeyKey, string(kv.Key), logKeyRevision, rev)
			}
			continue
		}
		next[id] = r
	}
	st.rules = next
	rev := resp.Header.Revision
	w.deliver(st, rev, update)
	w.heardFrom()
	return rev, nil
}

// maxHistory is how many earlier versions of an invalid document lastGood
// reads at most.
const maxHistory = 16

// lastGood finds the last valid version of kv's document in etcd's history,
// among the versions since the key was last created (a deleted rule is not
// brought back) and not compacted away; it returns that version's
// ModRevision.
func (w *Watcher) lastGood(ctx context.Context, reg *registryReader, kv *mvccpb.KeyValue, id string) (rules.Rule, int64, bool) {
	for range maxHistory {
		if kv.Version <= 1 || kv.ModRevision-1 < kv.CreateRevision {
			return rules.Rule{}, 0, false // the first version of this life
		}
		resp, err := w.c.Get(ctx, string(kv.Key), clientv3.WithRev(kv.ModRevision-1))
		if err != nil || len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != kv.CreateRevision {
			return rules.Rule{}, 0, false // compacted, unreachable, or another life
		}
		kv = resp.Kvs[0]
		r, err := w.check(ctx, reg, id, kv.Value)
		if err == nil {
			return r, kv.ModRevision, true
		}
		if errors.Is(err, errRegistryRead) {
			return rules.Rule{}, 0, false
		}
	}
	return rules.Rule{}, 0, false
}

// errRegistryRead: the registry document a global rule is checked against
// could not be read (etcd unreachable): nothing is decided, the last set
// stays, and the watcher tries again.
var errRegistryRead = errors.New("etcdstore: reading the sync agents' registry document")

// check decodes a stored document as decode does and, for a global rule,
// checks its split against the sync agents' registry document of its id
// (registryMismatch): a document written by hand with another split than
// the registered one is invalid, so that this enforcer's floors stay those
// the agents' ledgers start from (else the regions' shares could add up to
// more than the limit). No registry document: no agent has started a
// ledger for the id, and the rule's split is the one they will take.
func (w *Watcher) check(ctx context.Context, reg *registryReader, id string, doc []byte) (rules.Rule, error) {
	r, err := decode(id, doc)
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
	if err := registryMismatch(r, w.cfg.registryPrefix+id, regDoc); err != nil {
		return rules.Rule{}, fmt.Errorf("%w: key %q: %w", ErrInvalidDocument, id, err)
	}
	return r, nil
}

// registryReader reads the sync agents' registry documents for check, each
// once: prefetch reads many in few round trips, get reads one it does not
// hold yet.
type registryReader struct {
	w    *Watcher
	docs map[string][]byte // rule id -> document; nil value: none
}

func (w *Watcher) registryReader() *registryReader {
	return &registryReader{w: w, docs: map[string][]byte{}}
}

// registryBatch is how many documents one prefetch transaction reads
// (etcd's default limit on a transaction's operations is 128).
const registryBatch = 64

func (g *registryReader) prefetch(ctx context.Context, ids []string) error {
	for len(ids) > 0 {
		n := min(len(ids), registryBatch)
		ops := make([]clientv3.Op, n)
		for i, id := range ids[:n] {
			ops[i] = clientv3.OpGet(g.w.cfg.registryPrefix + id)
		}
		rctx, cancel := context.WithTimeout(ctx, g.w.cfg.requestTimeout)
		resp, err := g.w.c.Txn(rctx).Then(ops...).Commit()
		cancel()
		if err != nil {
			return fmt.Errorf("%w %s...: %w", errRegistryRead, g.w.cfg.registryPrefix, err)
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

// watch applies watch responses from rev+1 until the watch ends. It returns
// the revision it got to and why it ended.
func (w *Watcher) watch(ctx context.Context, st *state, rev int64, update func([]rules.Rule)) (int64, error) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	// Watching from before the call: opening a watch while etcd is down
	// waits for it, silently.
	w.watching.Store(true)
	defer w.watching.Store(false)
	ch := w.c.Watch(wctx, w.cfg.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	for resp := range ch {
		if resp.CompactRevision != 0 {
			return rev, fmt.Errorf("%w: need %d, compacted up to %d", errCompacted, rev+1, resp.CompactRevision)
		}
		if err := resp.Err(); err != nil {
			return rev, err
		}
		w.heardFrom()
		changed := false
		for _, ev := range resp.Events {
			ok, err := w.apply(ctx, st, ev)
			if err != nil {
				if changed {
					w.deliver(st, rev, update)
				}
				return rev, err // reloaded from a snapshot
			}
			if ok {
				changed = true
			}
			rev = max(rev, ev.Kv.ModRevision)
		}
		if changed {
			w.deliver(st, rev, update)
		} else if len(resp.Events) > 0 {
			w.revision.Store(rev)
		}
	}
	if err := ctx.Err(); err != nil {
		return rev, err
	}
	return rev, errors.New("etcdstore: watch channel closed")
}

// apply folds one event into the state and reports whether the set
// changed; an error (a registry document it could not read) leaves the
// event unapplied.
func (w *Watcher) apply(ctx context.Context, st *state, ev *clientv3.Event) (bool, error) {
	id := strings.TrimPrefix(string(ev.Kv.Key), w.cfg.prefix)
	switch ev.Type {
	case mvccpb.DELETE:
		delete(st.badSeen, string(ev.Kv.Key))
		if _, ok := st.rules[id]; !ok {
			return false, nil
		}
		delete(st.rules, id)
		return true, nil
	default: // PUT
		r, err := w.check(ctx, w.registryReader(), id, ev.Kv.Value)
		if errors.Is(err, errRegistryRead) {
			return false, err
		}
		if old, ok := st.rules[id]; ok && err == nil {
			err = globalChange(old, r)
		}
		if err != nil {
			w.badDocument(st, string(ev.Kv.Key), ev.Kv.ModRevision, err)
			return false, nil
		}
		st.rules[id] = r
		return true, nil
	}
}

func (w *Watcher) badDocument(st *state, key string, modRev int64, err error) {
	if st.badSeen[key] == modRev {
		return
	}
	st.badSeen[key] = modRev
	w.invalid.Add(1)
	if w.cfg.invalidCounter != nil {
		w.cfg.invalidCounter.Inc()
	}
	w.cfg.log.Error("etcdstore: skipping invalid rule document; the last good version stays",
		logKeyKey, key, logKeyRevision, modRev, logKeyErr, err)
}

func (w *Watcher) deliver(st *state, rev int64, update func([]rules.Rule)) {
	out := make([]rules.Rule, 0, len(st.rules))
	for _, r := range st.rules {
		out = append(out, r)
	}
	sortRules(out)
	w.revision.Store(rev)
	st.delivered, st.rev, st.fromCache = true, rev, false
	update(out)
	if w.cfg.cacheFile != "" {
		if err := writeCache(w.cfg.cacheFile, rev, out); err != nil {
			w.cfg.log.Warn("etcdstore: cannot write rule cache", logKeyPath, w.cfg.cacheFile, logKeyErr, err)
		}
	}
}

// deliverCache delivers the cached set, if there is a valid one.
func (w *Watcher) deliverCache(st *state, update func([]rules.Rule)) {
	rs, rev, err := readCache(w.cfg.cacheFile)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			w.cfg.log.Warn("etcdstore: ignoring unreadable rule cache", logKeyPath, w.cfg.cacheFile, logKeyErr, err)
		}
		return
	}
	for _, r := range rs {
		st.rules[r.ID] = r
	}
	st.delivered, st.rev, st.fromCache = true, rev, true
	w.cfg.log.Warn("etcdstore: etcd unreachable; serving rules from the cache file",
		logKeyPath, w.cfg.cacheFile, logKeyRevision, rev, logKeyRules, len(rs))
	update(rs)
}

// cacheDoc is the cache file format.
type cacheDoc struct {
	Revision int64        `json:"revision"`
	Rules    []rules.Rule `json:"rules"`
}

func writeCache(path string, rev int64, rs []rules.Rule) error {
	b, err := json.Marshal(cacheDoc{Revision: rev, Rules: rs})
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// readCache reads and revalidates a cache file: a cache that holds an
// invalid rule (corrupt, or written by another version) is refused whole.
func readCache(path string) ([]rules.Rule, int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, 0, err
	}
	var doc cacheDoc
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, 0, fmt.Errorf("etcdstore: cache %s: %w", path, err)
	}
	seen := map[string]bool{}
	for i := range doc.Rules {
		r := &doc.Rules[i]
		r.Normalize()
		if err := r.Validate(); err != nil {
			return nil, 0, fmt.Errorf("etcdstore: cache %s: %w", path, err)
		}
		if seen[r.ID] {
			return nil, 0, fmt.Errorf("etcdstore: cache %s: duplicate rule %q", path, r.ID)
		}
		seen[r.ID] = true
	}
	sortRules(doc.Rules)
	return doc.Rules, doc.Revision, nil
}
