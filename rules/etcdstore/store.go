package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"strings"
	"time"

	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultPrefix is the etcd key prefix under which rules live.
const DefaultPrefix = "/ratelimit/rules/"

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
	log            *slog.Logger
	cacheFile      string
	invalidCounter prometheus.Counter
	minBackoff     time.Duration
	maxBackoff     time.Duration
	requestTimeout time.Duration
	logEvery       time.Duration
}

func newConfig(opts []Option) (config, error) {
	c := config{
		prefix:         DefaultPrefix,
		log:            slog.New(slog.DiscardHandler),
		minBackoff:     100 * time.Millisecond,
		maxBackoff:     10 * time.Second,
		requestTimeout: 5 * time.Second,
		logEvery:       30 * time.Second,
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

// WithInvalidCounter also counts invalid documents on a Prometheus counter
// owned (and registered) by the caller. Default: none; InvalidDocuments
// always counts. Watcher only.
func WithInvalidCounter(ctr prometheus.Counter) Option {
	return func(c *config) error {
		c.invalidCounter = ctr
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
	return &Store{c: c, cfg: cfg}, nil
}

// Prefix is the key prefix of the rules.
func (s *Store) Prefix() string { return s.cfg.prefix }

func (s *Store) key(id string) string { return s.cfg.prefix + id }

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
// (and the *rules.FieldError) when the stored document is not a valid rule.
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
	return r, kv.ModRevision, nil
}

// List returns the valid rules in id order and the store revision they were
// read at. Documents that are not valid rules are left out (the Watcher logs
// and counts them; Get explains them).
func (s *Store) List(ctx context.Context) ([]rules.Rule, int64, error) {
	resp, err := s.c.Get(ctx, s.cfg.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, fmt.Errorf("etcdstore: list: %w", err)
	}
	out := make([]rules.Rule, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		r, err := decode(strings.TrimPrefix(string(kv.Key), s.cfg.prefix), kv.Value)
		if err != nil {
			continue
		}
		out = append(out, r)
	}
	sortRules(out)
	return out, resp.Header.Revision, nil
}

// Put normalizes and validates r (Validate, and CheckFloors: a new rule
// must not strand whole tokens) and stores its canonical JSON. ifMatch is
// Unconditional (0), MustNotExist (-1: create only), or the ModRevision the
// stored rule must still have. A failed precondition returns ErrConflict; an
// invalid rule returns its *rules.FieldError and writes nothing. Put returns
// the new ModRevision.
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
	if r.Scope == rules.Global {
		var err error
		if ifMatch, err = s.checkSplit(ctx, r, ifMatch); err != nil {
			return 0, err
		}
	}
	doc, err := Encode(r)
	if err != nil {
		return 0, err
	}
	key := s.key(r.ID)
	put := clientv3.OpPut(key, string(doc))
	if ifMatch == Unconditional {
		resp, err := s.c.Put(ctx, key, string(doc))
		if err != nil {
			return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
		}
		return resp.Header.Revision, nil
	}
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", ifMatch)
	if ifMatch == MustNotExist {
		cmp = clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
	}
	resp, err := s.c.Txn(ctx).If(cmp).Then(put).Commit()
	if err != nil {
		return 0, fmt.Errorf("etcdstore: put %q: %w", r.ID, err)
	}
	if !resp.Succeeded {
		if ifMatch == MustNotExist {
			return 0, fmt.Errorf("%w: rule %q already exists", ErrConflict, r.ID)
		}
		return 0, fmt.Errorf("%w: rule %q is not at revision %d", ErrConflict, r.ID, ifMatch)
	}
	return resp.Header.Revision, nil
}

// checkSplit refuses to change the regions, weights or min_share of a
// stored global rule: the sync agents keep the split a rule's ledgers started
// with, and the enforcers derive their floors from the rule, so a changed
// split would make the two disagree (a new rule id starts a new ledger).
// It returns the precondition that makes the put conditional on the version
// it checked (an unconditional put becomes one on the revision read).
func (s *Store) checkSplit(ctx context.Context, r rules.Rule, ifMatch int64) (int64, error) {
	old, rev, err := s.Get(ctx, r.ID)
	switch {
	case errors.Is(err, ErrNotFound):
		if ifMatch == Unconditional {
			ifMatch = MustNotExist
		}
		return ifMatch, nil
	case errors.Is(err, ErrInvalidDocument):
		return ifMatch, nil // a bad stored document may be replaced
	case err != nil:
		return 0, err
	}
	if old.Scope == rules.Global {
		const why = "cannot change on a stored global rule (the sync agents keep the split its ledgers started with); put the new split under a new rule id"
		if !maps.Equal(old.Regions, r.Regions) {
			return 0, &rules.FieldError{RuleID: r.ID, Field: "regions", Msg: why}
		}
		if old.MinShare != r.MinShare {
			return 0, &rules.FieldError{RuleID: r.ID, Field: "min_share", Msg: why}
		}
	}
	if ifMatch == Unconditional {
		ifMatch = rev
	}
	return ifMatch, nil
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
	r, err := rules.ParseRule(doc)
	if err != nil {
		return rules.Rule{}, fmt.Errorf("%w: key %q: %w", ErrInvalidDocument, id, err)
	}
	if r.ID != id {
		return rules.Rule{}, fmt.Errorf("%w: key %q: %w", ErrInvalidDocument, id,
			&rules.FieldError{RuleID: r.ID, Field: "id", Msg: fmt.Sprintf("does not match the key's id %q", id)})
	}
	return r, nil
}

func sortRules(rs []rules.Rule) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].ID < rs[j].ID })
}
