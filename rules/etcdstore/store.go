package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultPrefix is the etcd key prefix under which rules live.
const DefaultPrefix = "/ratelimit/rules/"

// DefaultRegistryPrefix is the etcd key prefix under which the sync agents
// keep one reclaim-registry document per global rule (key = prefix + rule
// id), holding the split (regions, weights, min_share) the rule's ledgers
// started with. sync/agent.DefaultRegistryPrefix is this constant; the
// store reads the documents (Put) and never writes them.
const DefaultRegistryPrefix = "/ratelimit/registry/"

// maxPutAttempts bounds how often Put reads, checks and writes a global rule
// again when the rule (on a put without a precondition) or its registry
// document changed between its read and its write.
const maxPutAttempts = 16

// Revision preconditions for Put and Delete.
const (
	// Unconditional writes whatever is stored.
	Unconditional int64 = 0
	// MustNotExist makes Put create only.
	MustNotExist int64 = -1
)

// Sentinel errors.
var (
	ErrNotFound = errors.New("etcdstore: rule not found")
	ErrConflict = errors.New("etcdstore: revision conflict")
	// ErrInvalidDocument wraps the validation error of a document found in
	// etcd that is not a valid rule (written by hand or by another tool).
	ErrInvalidDocument = errors.New("etcdstore: invalid rule document in etcd")
)

// Option configures a Store or a Watcher.
type Option func(*config) error

type config struct {
	prefix         string
	registryPrefix string
	log            *slog.Logger
	cacheFile      string
	invalidCounter prometheus.Counter
	reachable      prometheus.Gauge
	revisionGauge  prometheus.Gauge
	invalidGauge   prometheus.Gauge
	probeEvery     time.Duration
	minBackoff     time.Duration
	maxBackoff     time.Duration
	requestTimeout time.Duration
	logEvery       time.Duration
	deliverGap     time.Duration
}

func newConfig(opts []Option) (config, error) {
	c := config{
		prefix:         DefaultPrefix,
		registryPrefix: DefaultRegistryPrefix,
		log:            slog.New(slog.DiscardHandler),
		minBackoff:     100 * time.Millisecond,
		maxBackoff:     10 * time.Second,
		requestTimeout: 5 * time.Second,
		logEvery:       30 * time.Second,
		probeEvery:     5 * time.Second,
		deliverGap:     DeliverGap,
	}
	for _, o := range opts {
		if err := o(&c); err != nil {
			return config{}, err
		}
	}
	return c, nil
}

// WithPrefix sets the key prefix. Default DefaultPrefix. It must end in "/".
func WithPrefix(p string) Option {
	return func(c *config) error {
		if p == "" || !strings.HasSuffix(p, "/") {
			return fmt.Errorf("etcdstore: prefix %q must be non-empty and end in \"/\"", p)
		}
		c.prefix = p
		return nil
	}
}

// WithRegistryPrefix sets the key prefix of the sync agents' reclaim
// registry, against which Put checks a global rule's split: give the
// agents' --registry-prefix where it is not the default. Default
// DefaultRegistryPrefix. It must end in "/" and differ from the rules'
// prefix. The Store checks a global rule's put against the registered split,
// the Watcher a stored document (registryMismatch).
func WithRegistryPrefix(p string) Option {
	return func(c *config) error {
		if p == "" || !strings.HasSuffix(p, "/") {
			return fmt.Errorf("etcdstore: registry prefix %q must be non-empty and end in \"/\"", p)
		}
		c.registryPrefix = p
		return nil
	}
}

// WithLogger sets the logger. Default: discard.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return errors.New("etcdstore: nil logger")
		}
		c.log = l
		return nil
	}
}

// WithRequestTimeout bounds each etcd request (a snapshot load, a write).
// Default 5s.
func WithRequestTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return errors.New("etcdstore: request timeout must be positive")
		}
		c.requestTimeout = d
		return nil
	}
}

// WithCacheFile makes the Watcher write every delivered rule set to path
// (atomically: temporary file in the same directory, then rename) and
// deliver the cached set at start-up when etcd cannot be reached. Default:
// no cache. Watcher only.
func WithCacheFile(path string) Option {
	return func(c *config) error {
		c.cacheFile = path
		return nil
	}
}

// WithInvalidGauge sets a Prometheus gauge, owned (and registered) by the
// caller, to the number of documents stored now whose current version is
// invalid (skipped; the last good version of each stays in force): it goes
// back to 0 once each is fixed or deleted, where the counter of
// WithInvalidCounter only grows. Default: none. Watcher only.
func WithInvalidGauge(g prometheus.Gauge) Option {
	return func(c *config) error {
		c.invalidGauge = g
		return nil
	}
}

// WithInvalidCounter also counts invalid documents on a Prometheus counter
// owned (and registered) by the caller. Default: none; InvalidDocuments
// always counts. Watcher only.
func WithInvalidCounter(ctr prometheus.Counter) Option {
	return func(c *config) error {
		c.invalidCounter = ctr
		return nil
	}
}

// WithReachableGauge also reports on a Prometheus gauge owned (and
// registered) by the caller whether the Watcher reaches etcd: 1 from its
// first snapshot and while etcd answers, 0 while it does not (see
// WithProbeInterval). Default: none. Watcher only.
func WithReachableGauge(g prometheus.Gauge) Option {
	return func(c *config) error {
		c.reachable = g
		return nil
	}
}

// WithRevisionGauge also reports on a Prometheus gauge owned (and
// registered) by the caller the etcd revision of the rule set the Watcher
// delivered last: set on every delivery (a set served from the cache file:
// its cached revision), so that an operator can see every enforcer reach a
// change. It goes down when etcd's history changed (see Run). Default:
// none; Revision always tells. Watcher only.
func WithRevisionGauge(g prometheus.Gauge) Option {
	return func(c *config) error {
		c.revisionGauge = g
		return nil
	}
}

// WithProbeInterval sets how long the Watcher's watch may stay silent
// before it asks etcd whether it is still there (a count-only read of one
// key, bounded by the interval, 2 s at most): etcd's client resumes a
// broken watch by itself without a word, so a lost etcd is found, logged
// once and reported by WithReachableGauge this way, and an etcd restored to
// an older revision (or replaced by another cluster) is found by the
// probe's answer, within about one interval of etcd answering again, and
// the rule set reloaded (see Watcher.Run). Default 5s. Watcher only.
func WithProbeInterval(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return errors.New("etcdstore: probe interval must be positive")
		}
		c.probeEvery = d
		return nil
	}
}

// DeliverGap is the least time between two rule sets the Watcher delivers
// from its watch: a change that comes sooner after the last delivery waits
// for the gap, together with every change that comes meanwhile. Each
// delivery rebuilds the consumer's whole rule set (an enforcer's index of
// every rule) and writes the cache file, so with thousands of rules a
// hundred rule writes a second delivered one by one can take every CPU of
// the process; with the gap a watcher rebuilds at most 1/DeliverGap times
// a second, and one change alone is delivered at once
// (TestWatcherCoalescesRapidChanges).
const DeliverGap = 100 * time.Millisecond

// WithDeliverGap sets the least time between two deliveries of the watch
// (DeliverGap by default; 0: every watch response at once). Watcher only.
func WithDeliverGap(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return errors.New("etcdstore: deliver gap must not be negative")
		}
		c.deliverGap = d
		return nil
	}
}

// WithBackoff sets the reconnect backoff: it starts at min and doubles up to
// max. Default 100ms to 10s. Watcher only.
func WithBackoff(min, max time.Duration) Option {
	return func(c *config) error {
		if min <= 0 || max < min {
			return fmt.Errorf("etcdstore: backoff %v..%v: need 0 < min <= max", min, max)
		}
		c.minBackoff, c.maxBackoff = min, max
		return nil
	}
}

// Store reads and writes rule documents. It is safe for concurrent use.
type Store struct {
	c   *clientv3.Client
	cfg config
	// beforeWrite, when set (tests), runs in Put of a global rule between
	// its read and its conditional write.
	beforeWrite func(id string)
}

// New returns a Store over an etcd client owned by the caller.
func New(c *clientv3.Client, opts ...Option) (*Store, error) {
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
	return &Store{c: c, cfg: cfg}, nil
}

// Prefix is the key prefix of the rules.
func (s *Store) Prefix() string { return s.cfg.prefix }

// RegistryPrefix is the key prefix of the sync agents' registry documents.
func (s *Store) RegistryPrefix() string { return s.cfg.registryPrefix }

func (s *Store) key(id string) string { return s.cfg.prefix + id }

func (s *Store) registryKey(id string) string { return s.cfg.registryPrefix + id }

// checkID refuses ids that cannot name a key under the prefix.
func checkID(id string) error {
	if id == "" {
		return &rules.FieldError{Field: "id", Msg: "required"}
	}
	if strings.ContainsAny(id, "/\x00") {
		return &rules.FieldError{RuleID: id, Field: "id", Msg: "must not contain \"/\""}
	}
	return nil
}

// Get returns the rule stored under id and the key's ModRevision. It returns
// ErrNotFound when there is none, and an error wrapping ErrInvalidDocument
// (and the *rules.FieldError) when the stored document is not a valid rule,
// or one the Watcher skips: a global rule whose split differs from the sync
// agents' registered one (registryMismatch), or whose algorithm or window
// differ from its life's baseline (see globalChange).
func (s *Store) Get(ctx context.Context, id string) (rules.Rule, int64, error) {
	if err := checkID(id); err != nil {
		return rules.Rule{}, 0, err
	}
	resp, err := s.c.Get(ctx, s.key(id))
	if err != nil {
		return rules.Rule{}, 0, fmt.Errorf("etcdstore: get %q: %w", id, err)
	}
	if len(resp.Kvs) == 0 {
		return rules.Rule{}, 0, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	kv := resp.Kvs[0]
	r, err := decode(id, kv.Value)
	if err != nil {
		return rules.Rule{}, kv.ModRevision, err
	}
	if r.Scope != rules.Global {
		return r, kv.ModRevision, nil
	}
	h, err := lifeHistory(ctx, s.c, s.cfg.requestTimeout, kv)
	if err != nil {
		return rules.Rule{}, 0, fmt.Errorf("etcdstore: get %q: %w", id, err)
	}
	v, err := judge(ctx, newRegistryReader(s.c, &s.cfg), id, h)
	if err != nil {
		return rules.Rule{}, 0, fmt.Errorf("etcdstore: get %q: %w", id, err)
	}
	if v.err != nil {
		return rules.Rule{}, kv.ModRevision, invalidDoc(id, v.err)
	}
	return r, kv.ModRevision, nil
}

// List returns the valid rules in id order and the store revision they were
// read at. Documents that are not valid rules are left out (ListAll returns
// them too; the Watcher logs and counts them; Get explains them).
func (s *Store) List(ctx context.Context) ([]rules.Rule, int64, error) {
	rs, _, rev, err := s.ListAll(ctx)
	return rs, rev, err
}

// InvalidDocument is a document under the rules' prefix that is not a valid
// rule (written by hand or by another tool). The enforcers skip it and keep
// the last valid version of the rule they saw, if any.
type InvalidDocument struct {
	// ID is the key without the prefix (it need not be a valid rule id).
	ID       string `json:"id"`
	Revision int64  `json:"revision"` // the key's ModRevision
	// Error says what is wrong; Field names the rule field at fault, when one is.
	Error string `json:"error"`
	Field string `json:"field,omitempty"`
}

// ListAll returns, read at one store revision (returned), the valid rules
// and the documents that are not valid rules, each in id order. A global
// rule the Watcher skips is such a document (see Get): its registry
// document (read a batch of ids at a time, after the rules) and its key's
// history (one watch per global rule with more than one version) are read
// for it.
func (s *Store) ListAll(ctx context.Context) ([]rules.Rule, []InvalidDocument, int64, error) {
	resp, err := s.c.Get(ctx, s.cfg.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, nil, 0, fmt.Errorf("etcdstore: list: %w", err)
	}
	reg := newRegistryReader(s.c, &s.cfg)
	global, multi := globalIDs(s.cfg.prefix, resp.Kvs)
	if err := reg.prefetch(ctx, global); err != nil {
		return nil, nil, 0, fmt.Errorf("etcdstore: list: %w", err)
	}
	hist, failed := lifeHistories(ctx, s.c, s.cfg.requestTimeout, multi)
	if err := firstFailure(failed); err != nil {
		return nil, nil, 0, fmt.Errorf("etcdstore: list: %w", err)
	}
	out := make([]rules.Rule, 0, len(resp.Kvs))
	var bad []InvalidDocument
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), s.cfg.prefix)
		r, err := parseDoc(id, kv.Value)
		if err == nil && r.Scope == rules.Global {
			h, ok := hist[string(kv.Key)]
			if !ok {
				h = []*mvccpb.KeyValue{kv}
			}
			v, jerr := judge(ctx, reg, id, h)
			if jerr != nil {
				return nil, nil, 0, fmt.Errorf("etcdstore: list: %w", jerr)
			}
			err = v.err
		}
		if err != nil {
			d := InvalidDocument{ID: id, Revision: kv.ModRevision, Error: err.Error()}
			var fe *rules.FieldError
			if errors.As(err, &fe) {
				d.Field = fe.Field
			}
			bad = append(bad, d)
			continue
		}
		out = append(out, r)
	}
	sortRules(out)
	slices.SortFunc(bad, func(a, b InvalidDocument) int { return strings.Compare(a.ID, b.ID) })
	return out, bad, resp.Header.Revision, nil
}

// Put normalizes and validates r (Validate, and CheckFloors: a new rule
// must not strand whole tokens) and stores its canonical JSON. ifMatch is
// Unconditional (0), MustNotExist (-1: create only), or the ModRevision the
// stored rule must still have. A failed precondition returns ErrConflict; an
// invalid rule returns its *rules.FieldError and writes nothing. Put returns
// the new ModRevision.
//
// A global rule is also checked against what is stored (see checkSplit): its
// regions, weights and min_share must be those of the stored global rule,
// and those of the sync agents' registry document for its id if there is
// one. Its write is then conditional on the rule's key and the registry
// document being as read: when either changed meanwhile, Put reads and
// checks again (at most maxPutAttempts times in all), unless the change
// broke the caller's own precondition (ErrConflict). So a put without a
// precondition never fails for a concurrent change it could have been
// applied after, short of the rule changing on every attempt.
func (s *Store) Put(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error) {
	r.Normalize()
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if err := r.CheckFloors(); err != nil {
		return 0, err
	}
	if err := checkID(r.ID); err != nil {
		return 0, err
	}
	if ifMatch < MustNotExist {
		return 0, fmt.Errorf("etcdstore: invalid precondition revision %d", ifMatch)
	}
	doc, err := Encode(r)
	if err != nil {
		return 0, err
	}
	if r.Scope != rules.Global {
		return s.putPlain(ctx, r.ID, doc, ifMatch)
	}
	for attempt := 1; ; attempt++ {
		rev, err := s.putGlobal(ctx, r, doc, ifMatch)
		if !errors.Is(err, errRaced) {
			return rev, err
		}
		if attempt == maxPutAttempts {
			return 0, fmt.Errorf("%w: rule %q: it or its registry document changed during each of %d attempts to check and store it; try again", ErrConflict, r.ID, attempt)
		}
		// A short random pause, so that writers racing on one key spread out.
		t := time.NewTimer(rand.N(time.Duration(attempt) * 5 * time.Millisecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, ctx.Err())
		case <-t.C:
		}
	}
}

// putPlain writes doc under id's key on ifMatch, with no other check.
func (s *Store) putPlain(ctx context.Context, id string, doc []byte, ifMatch int64) (int64, error) {
	key := s.key(id)
	if ifMatch == Unconditional {
		resp, err := s.c.Put(ctx, key, string(doc))
		if err != nil {
			return 0, fmt.Errorf("etcdstore: put %q: %w", id, err)
		}
		return resp.Header.Revision, nil
	}
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", ifMatch)
	if ifMatch == MustNotExist {
		cmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
	}
	resp, err := s.c.Txn(ctx).If(cmp).Then(clientv3.OpPut(key, string(doc))).Commit()
	if err != nil {
		return 0, fmt.Errorf("etcdstore: put %q: %w", id, err)
	}
	if !resp.Succeeded {
		return 0, conflictError(id, ifMatch)
	}
	return resp.Header.Revision, nil
}

func conflictError(id string, ifMatch int64) error {
	if ifMatch == MustNotExist {
		return fmt.Errorf("%w: rule %q already exists", ErrConflict, id)
	}
	return fmt.Errorf("%w: rule %q is not at revision %d", ErrConflict, id, ifMatch)
}

// errRaced: the rule's key or its registry document changed between
// putGlobal's read and its write, and the caller's precondition (if any)
// still held: read, check and write again.
var errRaced = errors.New("etcdstore: changed while being checked")

// putGlobal is one attempt of Put for a global rule: it reads the stored
// rule and its registry document at one revision, reads the stored key's
// life to find its baseline, checks r against them (checkSplit), and
// writes doc if neither key changed since and the caller's precondition
// holds.
func (s *Store) putGlobal(ctx context.Context, r rules.Rule, doc []byte, ifMatch int64) (int64, error) {
	key, regKey := s.key(r.ID), s.registryKey(r.ID)
	read, err := s.c.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(regKey)).Commit()
	if err != nil {
		return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
	}
	ruleKV, regKV := firstKV(read.Responses[0]), firstKV(read.Responses[1])
	var stored, regRev int64 // ModRevisions as read; 0: no such key
	if ruleKV != nil {
		stored = ruleKV.ModRevision
	}
	if regKV != nil {
		regRev = regKV.ModRevision
	}
	// The caller's precondition, already broken: nothing to check.
	switch {
	case ifMatch == MustNotExist && ruleKV != nil, ifMatch > 0 && stored != ifMatch:
		return 0, conflictError(r.ID, ifMatch)
	}
	// The stored life's baseline, from its history: the first valid
	// global version, valid for the registry document as read.
	var base *rules.Rule
	if ruleKV != nil {
		h, err := lifeHistory(ctx, s.c, s.cfg.requestTimeout, ruleKV)
		if err != nil {
			return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
		}
		reg := newRegistryReader(s.c, &s.cfg)
		reg.docs[r.ID] = nil
		if regKV != nil {
			reg.docs[r.ID] = regKV.Value
		}
		v, err := judge(ctx, reg, r.ID, h)
		if err != nil {
			return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
		}
		base = v.base
	}
	if err := s.checkSplit(r, ruleKV, base, regKey, regKV); err != nil {
		return 0, err
	}
	// The write holds only if both keys are still as read: the rule's at
	// stored (or absent), which the caller's precondition implies when it
	// gave one, and the registry document's at regRev (ModRevision 0: absent).
	if s.beforeWrite != nil {
		s.beforeWrite(r.ID)
	}
	ruleCmp := clientv3.Compare(clientv3.ModRevision(key), "=", stored)
	if ruleKV == nil {
		ruleCmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
	}
	regCmp := clientv3.Compare(clientv3.ModRevision(regKey), "=", regRev)
	resp, err := s.c.Txn(ctx).If(ruleCmp, regCmp).
		Then(clientv3.OpPut(key, string(doc))).
		Else(clientv3.OpGet(key, clientv3.WithKeysOnly())).
		Commit()
	if err != nil {
		return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
	}
	if resp.Succeeded {
		return resp.Header.Revision, nil
	}
	if ifMatch != Unconditional {
		now := firstKV(resp.Responses[0])
		if ifMatch == MustNotExist && now != nil || ifMatch > 0 && (now == nil || now.ModRevision != ifMatch) {
			return 0, conflictError(r.ID, ifMatch)
		}
	}
	return 0, errRaced
}

func firstKV(op *etcdserverpb.ResponseOp) *mvccpb.KeyValue {
	if kvs := op.GetResponseRange().GetKvs(); len(kvs) > 0 {
		return kvs[0]
	}
	return nil
}

// checkSplit refuses a global rule r whose algorithm or window differ from
// those of base, the first valid global version of the stored key's life
// (globalChange: it is what the Watchers hold every later version to, so
// a put giving back the algorithm a hand-written document changed is
// accepted, and one of a third algorithm refused), and one whose regions,
// weights or min_share differ from those of
//   - the sync agents' registry document of r's id (regKV), if there is one:
//     the agents keep the split a rule's ledgers started with there, also
//     after the rule is deleted or its stored document replaced by hand, and
//     build every later ledger of that id from it (sync/agent's Spec), so a
//     rule re-created with another split would admit nothing where the two
//     disagree. It is the split in force: a put that gives it back is
//     accepted whatever the stored document says. A registry document that
//     cannot be read is refused too: no agent can coordinate the id.
//   - else the stored rule (ruleKV), if it is a valid global rule: changing
//     the split of a live rule would make the enforcers' floors (derived
//     from the rule) and the sync agents' ledgers (started with the old
//     split) disagree. A stored document that is not a valid rule may be
//     replaced.
//
// A new rule id starts a new ledger and a new registry document.
func (s *Store) checkSplit(r rules.Rule, ruleKV *mvccpb.KeyValue, base *rules.Rule, regKey string, regKV *mvccpb.KeyValue) error {
	var old *rules.Rule
	if ruleKV != nil {
		if o, err := decode(r.ID, ruleKV.Value); err == nil && o.Scope == rules.Global {
			old = &o
		}
	}
	if base != nil {
		if err := globalChange(*base, r); err != nil {
			return err
		}
	}
	if regKV != nil {
		// The agents' registered split is the one in force (the stored
		// rule may have been written by hand with another): a put that
		// gives it back is accepted.
		return registryMismatch(r, regKey, regKV.Value)
	}
	if old != nil {
		const why = "cannot change on a stored global rule (the sync agents keep the split its ledgers started with); put the new split under a new rule id"
		if !maps.Equal(old.Regions, r.Regions) {
			return &rules.FieldError{RuleID: r.ID, Field: "regions", Msg: why}
		}
		if old.MinShare != r.MinShare {
			return &rules.FieldError{RuleID: r.ID, Field: "min_share", Msg: why}
		}
	}
	return nil
}

// globalChange is the FieldError of r as a change of old, both global
// rules, that the sync agents' ledgers cannot follow, or nil:
//   - its algorithm: the ledgers of a token bucket reclaim a silent region's
//     share once its lease has run out, those of a window wait one window
//     more (what it admitted stays admitted until the window ends), and
//     the share records in Redis belong to the old algorithm's keys;
//   - the window of a window rule: that wait is computed when the rule's
//     ledgers start, and under a longer window a region lost mid-window
//     would have its share used twice in that window.
//
// old is the baseline of the rule's key's current life: its first valid
// global version (see life.go). The Store refuses a put that changes it,
// and every Watcher skips such a stored document (the last good version
// stays), running or started later, so no process runs the rule with an
// algorithm or window its ledgers did not start with.
func globalChange(old, r rules.Rule) error {
	if old.Scope != rules.Global || r.Scope != rules.Global {
		return nil
	}
	if old.Algorithm != r.Algorithm {
		return &rules.FieldError{RuleID: r.ID, Field: "algorithm", Msg: fmt.Sprintf(
			"cannot change on a stored global rule (%s to %s: the sync agents' ledgers of the rule started with the old algorithm); put the rule with the new algorithm under a new rule id",
			old.Algorithm, r.Algorithm)}
	}
	if old.Window == r.Window || (old.Algorithm != rules.FixedWindow && old.Algorithm != rules.SlidingWindow) {
		return nil
	}
	return &rules.FieldError{RuleID: r.ID, Field: "window", Msg: fmt.Sprintf(
		"cannot change on a stored global window rule (%v to %v: the sync agents wait one window, computed when its ledgers started, before they reclaim a silent region's share); put the new window under a new rule id",
		time.Duration(old.Window), time.Duration(r.Window))}
}

// registryMismatch is the FieldError of a global rule r whose split differs
// from the one in the sync agents' registry document doc (at regKey), or
// nil. Put refuses such a rule, and the Watcher skips a stored document
// that is one (written by hand): the agents build every ledger of the id
// from the registered split, and an enforcer must derive its floors from
// the same one, or the regions' shares could add up to more than the limit.
func registryMismatch(r rules.Rule, regKey string, doc []byte) error {
	regions, minShare, err := registeredSplit(doc)
	if err != nil {
		return &rules.FieldError{RuleID: r.ID, Field: "id", Msg: fmt.Sprintf(
			"the sync agents' registry document of this id (%s) cannot be read (%v), so no sync agent can coordinate a global rule under it; use a new rule id", regKey, err)}
	}
	field := ""
	switch {
	case !maps.Equal(regions, r.Regions):
		field = "regions"
	case minShare != r.MinShare:
		field = "min_share"
	default:
		return nil
	}
	return &rules.FieldError{RuleID: r.ID, Field: field, Msg: fmt.Sprintf(
		"this id's split is still registered by the sync agents (regions %s, min_share %v, in %s): they keep it after the rule is deleted or its stored document is replaced, and build every ledger of the id from it; put the new split under a new rule id (or give this rule that split)",
		formatRegions(regions), minShare, regKey)}
}

// registeredSplit reads the split of a sync agents' registry document
// ({"spec": {"min_share": F, "regions": [{"name": N, "weight": W}, ...]},
// ...}, sync/agent's registryDoc; names match case-insensitively, as the
// agent reads them): the regions and weights as a rule's map, and min_share,
// as the agent compares them with the spec it builds from a rule.
func registeredSplit(doc []byte) (map[string]float64, float64, error) {
	var d struct {
		Spec *struct {
			MinShare float64 `json:"min_share"`
			Regions  []struct {
				Name   string  `json:"name"`
				Weight float64 `json:"weight"`
			} `json:"regions"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(doc, &d); err != nil {
		return nil, 0, err
	}
	if d.Spec == nil || len(d.Spec.Regions) == 0 {
		return nil, 0, errors.New("it has no spec with regions")
	}
	regions := make(map[string]float64, len(d.Spec.Regions))
	for _, x := range d.Spec.Regions {
		if _, dup := regions[x.Name]; dup {
			return nil, 0, fmt.Errorf("region %q is listed twice", x.Name)
		}
		regions[x.Name] = x.Weight
	}
	return regions, d.Spec.MinShare, nil
}

// formatRegions writes weights as "{a: 1, b: 2}", names in order.
func formatRegions(m map[string]float64) string {
	parts := make([]string, 0, len(m))
	for _, n := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s: %v", n, m[n]))
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// Delete removes the rule id. ifMatch is Unconditional (0) or the
// ModRevision the stored rule must still have (else ErrConflict). Deleting a
// missing rule returns ErrNotFound.
func (s *Store) Delete(ctx context.Context, id string, ifMatch int64) error {
	if err := checkID(id); err != nil {
		return err
	}
	if ifMatch < 0 {
		return fmt.Errorf("etcdstore: invalid precondition revision %d", ifMatch)
	}
	key := s.key(id)
	if ifMatch == Unconditional {
		resp, err := s.c.Delete(ctx, key)
		if err != nil {
			return fmt.Errorf("etcdstore: delete %q: %w", id, err)
		}
		if resp.Deleted == 0 {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		return nil
	}
	resp, err := s.c.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(key), "=", ifMatch)).
		Then(clientv3.OpDelete(key)).
		Else(clientv3.OpGet(key, clientv3.WithKeysOnly())).
		Commit()
	if err != nil {
		return fmt.Errorf("etcdstore: delete %q: %w", id, err)
	}
	if !resp.Succeeded {
		if len(resp.Responses) == 1 && len(resp.Responses[0].GetResponseRange().Kvs) == 0 {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		return fmt.Errorf("%w: rule %q is not at revision %d", ErrConflict, id, ifMatch)
	}
	return nil
}

// Encode returns the canonical JSON document of a normalized rule (struct
// field order, map keys sorted).
func Encode(r rules.Rule) ([]byte, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("etcdstore: encode rule %q: %w", r.ID, err)
	}
	return b, nil
}

// decode parses a stored document strictly and checks that it names the rule
// of its key. Errors wrap ErrInvalidDocument.
func decode(id string, doc []byte) (rules.Rule, error) {
	r, err := parseDoc(id, doc)
	if err != nil {
		return rules.Rule{}, fmt.Errorf("%w: key %q: %w", ErrInvalidDocument, id, err)
	}
	return r, nil
}

// parseDoc is decode without the wrapping: the document's own error.
func parseDoc(id string, doc []byte) (rules.Rule, error) {
	r, err := rules.ParseRule(doc)
	if err != nil {
		return rules.Rule{}, err
	}
	if r.ID != id {
		return rules.Rule{}, &rules.FieldError{RuleID: r.ID, Field: "id", Msg: fmt.Sprintf("does not match the key's id %q", id)}
	}
	return r, nil
}

func sortRules(rs []rules.Rule) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].ID < rs[j].ID })
}
