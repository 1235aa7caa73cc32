package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/rules"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
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
	// clusterID is the etcd cluster id of the last snapshot (0 before it):
	// an answer from another cluster means the history followed is gone.
	clusterID atomic.Uint64
	// reload tells the watch (from the monitor) that etcd's history
	// changed under it; reloadPending is set from then until the next
	// snapshot, so that it is told, and logged, once.
	reload        chan struct{}
	reloadPending atomic.Bool

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
	return &Watcher{c: c, cfg: cfg, reload: make(chan struct{}, 1)}, nil
}

// InvalidDocuments is the number of invalid rule documents met so far (each
// stored version counted once).
func (w *Watcher) InvalidDocuments() uint64 { return w.invalid.Load() }

// Revision is the etcd revision of the last applied snapshot or watch
// response (0 before the first). It goes down only when etcd's history
// changed (see Run).
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
	// lives holds, per id, the life (CreateRevision) of its key that the
	// state follows and that life's baseline.
	lives map[string]life
	// badSeen holds the keys whose current version is invalid, each with
	// the ModRevision of that version (WithInvalidGauge counts them), so
	// that a reload does not count the same bad version twice.
	badSeen   map[string]int64
	delivered bool
	// rev is the revision of the set delivered last, fromCache whether it
	// came from the cache file.
	rev       int64
	fromCache bool
	// historyGone: etcd's history changed under the state (a restore, or
	// another cluster): the next snapshot is taken as a fresh watcher's.
	historyGone bool
}

// life is what the watcher remembers of one life of a rule's key.
type life struct {
	create int64 // the key's CreateRevision
	// base is the life's first valid global version (the algorithm and
	// window every later global version must keep), nil if none yet;
	// known is false while it has not been determined (a life met in a
	// snapshot at a regional version: read from its history if needed).
	base  *rules.Rule
	known bool
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
//
// When a linearizable answer of etcd (that probe, a snapshot) shows a
// revision below the one already applied, or any answer another cluster
// id, the history Run followed is gone (etcd restored from a snapshot, or
// replaced): it logs once (WARN) "etcdstore: etcd's history changed (...);
// reloading the rule set", ends the watch and delivers a fresh snapshot,
// judged as a watcher started then would (its revision may be lower).
// Every snapshot delivered is logged (INFO, "etcdstore: rule set loaded
// from etcd", with its revision).
func (w *Watcher) Run(ctx context.Context, update func([]rules.Rule)) error {
	st := &state{rules: map[string]rules.Rule{}, lives: map[string]life{}, badSeen: map[string]int64{}}
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
		select {
		case <-w.reload: // a reload is what comes next anyway
		default:
		}
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
			if errors.Is(err, errHistoryChanged) { // logged where found
				st.historyGone = true
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

// errHistoryChanged: etcd's history is not the one the watch followed.
var errHistoryChanged = errors.New("etcdstore: etcd's history changed")

// historyChange says why h, the header of a linearizable answer of etcd to
// a request sent when applied was the revision applied, shows that the
// history followed is gone, or "": another cluster id, or a revision below
// the applied one.
func (w *Watcher) historyChange(h *etcdserverpb.ResponseHeader, applied int64) string {
	if h == nil {
		return ""
	}
	if known := w.clusterID.Load(); known != 0 && h.ClusterId != 0 && h.ClusterId != known {
		return fmt.Sprintf("cluster id %x to %x", known, h.ClusterId)
	}
	if applied > 0 && h.Revision < applied {
		return fmt.Sprintf("revision %d below applied %d", h.Revision, applied)
	}
	return ""
}

// historyWarn logs that etcd's history changed, why.
func (w *Watcher) historyWarn(why string) {
	w.cfg.log.Warn(fmt.Sprintf("etcdstore: etcd's history changed (%s); reloading the rule set", why),
		logKeyEnds, w.endpoints(), logKeyRevision, w.Revision())
}

// endpoints names the etcd client's endpoints for the log.
func (w *Watcher) endpoints() string { return strings.Join(w.c.Endpoints(), ",") }

// monitor probes etcd while the watch is open and has not heard from it
// for a probe interval (etcd's client resumes a broken watch silently,
// also on an etcd restored to an older revision), until ctx is done: a
// probe interval after the last answer, then every interval. Outside the
// watch the snapshot loop tells. A probe's answer showing that etcd's
// history changed (historyChange) ends the watch for a reload.
func (w *Watcher) monitor(ctx context.Context) {
	timeout := min(w.cfg.probeEvery, w.cfg.requestTimeout, 2*time.Second)
	t := time.NewTimer(w.cfg.probeEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		silent := time.Since(time.Unix(0, w.heard.Load()))
		if !w.watching.Load() || silent < w.cfg.probeEvery {
			t.Reset(max(w.cfg.probeEvery-silent, w.cfg.probeEvery/10))
			continue
		}
		t.Reset(w.cfg.probeEvery)
		// Read before the probe is sent: a linearizable read answers at a
		// revision at least as recent as all applied by then.
		applied := w.revision.Load()
		pctx, cancel := context.WithTimeout(ctx, timeout)
		resp, err := w.c.Get(pctx, w.cfg.prefix, clientv3.WithCountOnly())
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			w.lost(err, true)
		default:
			w.reached()
			if why := w.historyChange(resp.Header, applied); why != "" && w.reloadPending.CompareAndSwap(false, true) {
				w.historyWarn(why)
				select {
				case w.reload <- struct{}{}:
				default:
				}
			}
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
//
// Each etcd request has its own requestTimeout (the Get here; prefetch,
// lifeHistories and the registry reads bound theirs): with one deadline
// for the whole load, an etcd 1.3 s away each way never fitted the Get
// and the registry read in 5 s, and a restarted agent never loaded its
// rules while the latency lasted (an explorer: 35 s at its floor).
func (w *Watcher) snapshot(ctx context.Context, st *state, update func([]rules.Rule)) (int64, error) {
	gctx, cancel := context.WithTimeout(ctx, w.cfg.requestTimeout)
	resp, err := w.c.Get(gctx, w.cfg.prefix, clientv3.WithPrefix())
	cancel()
	if err != nil {
		return 0, err
	}
	if !st.historyGone && st.delivered {
		if why := w.historyChange(resp.Header, w.Revision()); why != "" {
			w.historyWarn(why)
			st.historyGone = true
		}
	}
	// After a change of history, what the state remembers belongs to
	// another history: judge as a watcher started now.
	fresh := st.historyGone
	if fresh {
		st.badSeen = map[string]int64{}
	}
	sameLife := func(id string, kv *mvccpb.KeyValue) (life, bool) {
		l, ok := st.lives[id]
		return l, ok && !fresh && l.create == kv.CreateRevision
	}
	// The registry documents of the global rules, read in a few round
	// trips rather than one per rule (validate reads them from here).
	reg := newRegistryReader(w.c, &w.cfg)
	global, _ := globalIDs(w.cfg.prefix, resp.Kvs)
	if err := reg.prefetch(ctx, global); err != nil {
		return 0, err // try the snapshot again; the last set stays
	}
	// The histories of the lives the state does not know, where they
	// decide: an invalid document's last good version, a global rule's
	// baseline.
	var need []*mvccpb.KeyValue
	for _, kv := range resp.Kvs {
		id := kv2id(w.cfg.prefix, kv)
		if l, same := sameLife(id, kv); kv.Version <= 1 || same && l.known {
			continue
		}
		if r, err := parseDoc(id, kv.Value); err != nil || r.Scope == rules.Global {
			need = append(need, kv)
		}
	}
	hist, failed := lifeHistories(ctx, w.c, w.cfg.requestTimeout, need)
	for key, err := range failed {
		// Judged on its own below, as if it had no history: one rule's
		// history (a long one, a compaction racing it) never holds up
		// the whole set. A watcher that knew the life keeps what it knew.
		w.cfg.log.Warn("etcdstore: cannot read a rule's history; judging its stored version alone", logKeyKey, key, logKeyErr, err)
	}
	next := make(map[string]rules.Rule, len(resp.Kvs))
	lives := make(map[string]life, len(resp.Kvs))
	invalid := map[string]bool{} // the keys whose current version is invalid
	for _, kv := range resp.Kvs {
		id := kv2id(w.cfg.prefix, kv)
		l, same := sameLife(id, kv)
		if !same {
			l = life{create: kv.CreateRevision, known: kv.Version <= 1}
		}
		var v lifeView
		if h, ok := hist[string(kv.Key)]; ok {
			if v, err = judge(ctx, reg, id, h); err != nil {
				return 0, err // try the snapshot again; the last set stays
			}
			l.base, l.known = v.base, true
		} else {
			r, err := validate(ctx, reg, id, kv.Value)
			if errors.Is(err, errRegistryRead) {
				return 0, err // try the snapshot again; the last set stays
			}
			if err == nil && r.Scope == rules.Global && l.known {
				if l.base == nil {
					l.base = &r
				} else {
					err = globalChange(*l.base, r)
				}
			}
			v = lifeView{cur: r, err: err}
		}
		lives[id] = l
		if v.err != nil {
			invalid[string(kv.Key)] = true
			w.badDocument(st, string(kv.Key), kv.ModRevision, invalidDoc(id, v.err))
			if old, ok := st.rules[id]; ok && same {
				next[id] = old
			} else if v.good != nil {
				// A process that never had the good version (started
				// after the bad put) serves it as those that had it do.
				next[id] = *v.good
				w.cfg.log.Warn("etcdstore: serving the last good version of an invalid rule document, from etcd's history",
					logKeyKey, string(kv.Key), logKeyRevision, v.goodRev)
			}
			continue
		}
		next[id] = v.cur
	}
	st.rules, st.lives = next, lives
	maps.DeleteFunc(st.badSeen, func(k string, _ int64) bool { return !invalid[k] })
	w.setInvalid(st)
	rev := resp.Header.Revision
	w.clusterID.Store(resp.Header.ClusterId)
	w.cfg.log.Info("etcdstore: rule set loaded from etcd", logKeyRevision, rev, logKeyRules, len(next), logKeyEnds, w.endpoints())
	w.deliver(st, rev, update)
	st.historyGone = false
	w.reloadPending.Store(false)
	w.heardFrom()
	return rev, nil
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
	// Deliveries at least deliverGap apart (DeliverGap): a change that
	// comes sooner is held (pending), with those that follow it, until the
	// gap has passed. Held changes are delivered before any return.
	var (
		last    time.Time
		pending bool
		gap     *time.Timer
		gapC    <-chan time.Time
	)
	defer func() {
		if gap != nil {
			gap.Stop()
		}
	}()
	flush := func() {
		if pending {
			w.deliver(st, rev, update)
			pending, last = false, time.Now()
		}
	}
	for {
		var resp clientv3.WatchResponse
		select {
		case <-w.reload:
			flush()
			return rev, errHistoryChanged
		case <-gapC:
			gapC = nil
			flush()
			continue
		case r, ok := <-ch:
			if !ok {
				flush()
				if err := ctx.Err(); err != nil {
					return rev, err
				}
				return rev, errors.New("etcdstore: watch channel closed")
			}
			resp = r
		}
		// Every member answers with the cluster's id; its revision is no
		// proof of anything (a lagging member may answer).
		if known, id := w.clusterID.Load(), resp.Header.ClusterId; known != 0 && id != 0 && id != known {
			if w.reloadPending.CompareAndSwap(false, true) { // else the monitor said it
				w.historyWarn(fmt.Sprintf("cluster id %x to %x", known, id))
			}
			return rev, errHistoryChanged
		}
		if resp.CompactRevision != 0 {
			flush()
			return rev, fmt.Errorf("%w: need %d, compacted up to %d", errCompacted, rev+1, resp.CompactRevision)
		}
		if err := resp.Err(); err != nil {
			flush()
			return rev, err
		}
		w.heardFrom()
		changed := false
		for _, ev := range resp.Events {
			ok, err := w.apply(ctx, st, ev)
			if err != nil {
				pending = pending || changed
				flush()
				return rev, err // reloaded from a snapshot
			}
			if ok {
				changed = true
			}
			rev = max(rev, ev.Kv.ModRevision)
		}
		switch {
		case changed:
			pending = true
			if wait := w.cfg.deliverGap - time.Since(last); wait <= 0 {
				flush()
			} else if gapC == nil {
				if gap == nil {
					gap = time.NewTimer(wait)
				} else {
					gap.Reset(wait)
				}
				gapC = gap.C
			}
		case len(resp.Events) > 0 && !pending:
			w.revision.Store(rev)
		}
	}
}

// apply folds one event into the state and reports whether the set
// changed; an error (a registry document or a history it could not read)
// leaves the event unapplied.
func (w *Watcher) apply(ctx context.Context, st *state, ev *clientv3.Event) (bool, error) {
	id := kv2id(w.cfg.prefix, ev.Kv)
	switch ev.Type {
	case mvccpb.DELETE:
		delete(st.badSeen, string(ev.Kv.Key))
		w.setInvalid(st)
		delete(st.lives, id) // the life ends, and its baseline with it
		if _, ok := st.rules[id]; !ok {
			return false, nil
		}
		delete(st.rules, id)
		return true, nil
	default: // PUT
		reg := newRegistryReader(w.c, &w.cfg)
		r, err := validate(ctx, reg, id, ev.Kv.Value)
		if errors.Is(err, errRegistryRead) {
			return false, err
		}
		changed := false
		l, ok := st.lives[id]
		if !ok || l.create != ev.Kv.CreateRevision {
			// A new life (its DELETE came first; a missed one is
			// dropped here all the same).
			if _, had := st.rules[id]; had && ok {
				delete(st.rules, id)
				changed = true
			}
			l = life{create: ev.Kv.CreateRevision, known: ev.Kv.Version <= 1}
		}
		if err == nil && r.Scope == rules.Global {
			switch {
			case !l.known:
				// Met in a snapshot as a regional rule: the baseline is in
				// the life's history.
				h, herr := lifeHistory(ctx, w.c, w.cfg.requestTimeout, ev.Kv)
				if herr != nil {
					// As in a snapshot: judged alone rather than holding
					// up every later change behind this one.
					w.cfg.log.Warn("etcdstore: cannot read a rule's history; judging its stored version alone", logKeyKey, string(ev.Kv.Key), logKeyErr, herr)
					h = []*mvccpb.KeyValue{ev.Kv}
				}
				v, herr := judge(ctx, reg, id, h)
				if herr != nil {
					return changed, herr
				}
				l.base, l.known, err = v.base, true, v.err
			case l.base == nil:
				l.base = &r
			default:
				err = globalChange(*l.base, r)
			}
		}
		st.lives[id] = l
		if err != nil {
			w.badDocument(st, string(ev.Kv.Key), ev.Kv.ModRevision, invalidDoc(id, err))
			w.setInvalid(st)
			return changed, nil
		}
		delete(st.badSeen, string(ev.Kv.Key))
		w.setInvalid(st)
		st.rules[id] = r
		return true, nil
	}
}

// setInvalid sets WithInvalidGauge's gauge to the invalid documents now.
func (w *Watcher) setInvalid(st *state) {
	if w.cfg.invalidGauge != nil {
		w.cfg.invalidGauge.Set(float64(len(st.badSeen)))
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
	if w.cfg.revisionGauge != nil {
		w.cfg.revisionGauge.Set(float64(rev))
	}
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
	if w.cfg.revisionGauge != nil {
		w.cfg.revisionGauge.Set(float64(rev))
	}
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
