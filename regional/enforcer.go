package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
)

// Store evaluates the buckets of each request atomically, many requests in
// one round trip, within a budget (see redisstore.Store.Do), and reports its
// load. *redisstore.Store implements it.
type Store interface {
	Do(ctx context.Context, b redisstore.Budget, calls []redisstore.Call, out []redisstore.Answer)
	Load() redisstore.Load
}

// Limits on request fields.
const (
	MaxClientKeyBytes = 256
	maxFieldBytes     = 1024
	maxAttributes     = 64
)

// Config configures an Enforcer.
type Config struct {
	// Region is this enforcer's region; it selects the static share of global rules.
	Region string
	// MaxCost is the largest cost a request may ask for (default 1000 tokens).
	MaxCost int64
	// Timeout bounds the Redis round trip of each store call, from the
	// moment its pipeline is sent (default 10ms). Only a store that does not
	// answer in time counts as failed; time spent waiting inside the
	// enforcer does not count (QueueTimeout bounds it).
	Timeout time.Duration
	// QueueTimeout bounds the time a check waits inside the enforcer for a
	// pipeline to Redis (default, when zero: 100ms or Timeout, whichever is
	// longer: a store allowed to be slow makes the queue wait for it). A
	// check that waits longer is shed:
	// answered rejected without Redis (shed=true), never admitted
	// unchecked, and it does not count against the store.
	QueueTimeout time.Duration
	// ShedQueue is the number of checks waiting for a pipeline at which
	// checks of low-priority rules are shed (default 256; 0: never on
	// queue depth). High-priority rules keep going to Redis.
	ShedQueue int
	// ShedLatency is the moving average of the Redis round trip at which
	// checks of low-priority rules are shed (default Timeout/2; negative:
	// never on latency).
	ShedLatency time.Duration
	// ShedRetryAfter is the retry_after_ms of a shed answer (default 1s).
	ShedRetryAfter time.Duration
	// BreakerFailures consecutive store failures open the circuit breaker (default 5).
	BreakerFailures uint32
	// BreakerOpen is how long the breaker stays open before half-open probes (default 1s).
	BreakerOpen time.Duration
	// BreakerProbes is how many probe calls the half-open breaker lets through (default 3).
	BreakerProbes uint32
	// LocalFraction scales a rule's limit for the in-process limiter that
	// failure_mode "local" uses while the store is unreachable (default 0.5:
	// each enforcer process admits at most half the rule's limit).
	LocalFraction float64
	// LocalMaxKeys bounds the in-process limiter's memory (default 100,000 buckets).
	LocalMaxKeys int
	// Logger receives structured logs (default slog.Default()).
	Logger *slog.Logger
	// Metrics, when non-nil, records checks, latency, store errors and breaker state.
	Metrics *Metrics
	// StaticGlobal makes global rules enforce their static share (weight /
	// sum of weights) instead of the share the region's sync agent writes.
	// Only for regions that run no sync agent: with agents, a region whose
	// store lost its state would re-grant what it gave away. Default false:
	// a global token bucket enforces the agent's share, and its floor while
	// no agent holds a valid lease.
	StaticGlobal bool
	// Usage, when non-nil, receives the admitted and rejected cost of every
	// check of a global rule, per rule and bucket key, for the region's sync
	// agent (usage.Recorder.Add). It is called on the request path and must
	// not block.
	Usage func(rule, key string, admitted, rejected int64)
}

// DefaultConfig returns a Config with every default filled in.
func DefaultConfig() Config {
	return Config{
		MaxCost:         1000,
		Timeout:         10 * time.Millisecond,
		ShedQueue:       256,
		ShedRetryAfter:  time.Second,
		BreakerFailures: 5,
		BreakerOpen:     time.Second,
		BreakerProbes:   3,
		LocalFraction:   0.5,
		LocalMaxKeys:    100000,
	}
}

// Validate reports the first invalid setting.
func (c Config) Validate() error {
	switch {
	case c.Region == "":
		return errors.New("regional: config: region is required")
	case c.MaxCost < 1:
		return fmt.Errorf("regional: config: max cost must be >= 1, got %d", c.MaxCost)
	case c.Timeout <= 0:
		return fmt.Errorf("regional: config: timeout must be > 0, got %v", c.Timeout)
	case c.QueueTimeout < 0:
		return fmt.Errorf("regional: config: queue timeout must be >= 0, got %v", c.QueueTimeout)
	case c.ShedQueue < 0:
		return fmt.Errorf("regional: config: shed queue must be >= 0, got %d", c.ShedQueue)
	case c.ShedRetryAfter < 0:
		return fmt.Errorf("regional: config: shed retry-after must be >= 0, got %v", c.ShedRetryAfter)
	case c.BreakerFailures < 1:
		return errors.New("regional: config: breaker failures must be >= 1")
	case c.BreakerOpen <= 0:
		return errors.New("regional: config: breaker open time must be > 0")
	case c.LocalFraction <= 0 || c.LocalFraction > 1:
		return fmt.Errorf("regional: config: local fraction must be in (0,1], got %v", c.LocalFraction)
	}
	return nil
}

// Request is one CheckLimit call.
type Request struct {
	ClientKey  string            `json:"client_key"`
	Resource   string            `json:"resource"`
	Cost       int64             `json:"cost"`
	Attributes map[string]string `json:"attributes,omitempty"`
}

// Status is the outcome of one matched rule.
type Status struct {
	RuleID       string `json:"rule_id"`
	Allowed      bool   `json:"allowed"`
	Limit        int64  `json:"limit"`
	Remaining    int64  `json:"remaining"`
	RetryAfterMs int64  `json:"retry_after_ms"`
	ResetAfterMs int64  `json:"reset_after_ms"`
	Shadow       bool   `json:"shadow"`
	// WindowMs is the rule's window (window algorithms) or the time to refill
	// from empty (buckets); used for the RateLimit-Policy header.
	WindowMs int64 `json:"-"`
}

// Response is the answer to a Request. Limit, Remaining, RetryAfterMs and
// ResetAfterMs are those of the binding rule (RuleID): the rejecting rule, or
// when allowed the enforced rule with the fewest remaining tokens.
type Response struct {
	Allowed      bool     `json:"allowed"`
	Limit        int64    `json:"limit"`
	Remaining    int64    `json:"remaining"`
	RetryAfterMs int64    `json:"retry_after_ms"`
	ResetAfterMs int64    `json:"reset_after_ms"`
	RuleID       string   `json:"rule_id"`
	Statuses     []Status `json:"statuses"`
	FailOpen     bool     `json:"fail_open"`
	// Shed is true when the enforcer was overloaded and answered without
	// the store: rejected (unless only shadow rules matched), nothing
	// consumed. Over gRPC it is the response header "apportion-shed".
	Shed bool `json:"shed,omitempty"`

	windowMs int64
}

// RequestError is a bad request; Field names the offending field.
type RequestError struct {
	Field string
	Msg   string
}

func (e *RequestError) Error() string { return fmt.Sprintf("regional: %s: %s", e.Field, e.Msg) }

// Unwrap makes errors.Is(err, ErrInvalidRequest) true.
func (e *RequestError) Unwrap() error { return ErrInvalidRequest }

// Errors.
var (
	ErrInvalidRequest = errors.New("regional: invalid request")
	ErrNoRules        = errors.New("regional: no rule set loaded yet")
)

// Enforcer answers CheckLimit. It is safe for concurrent use.
type Enforcer struct {
	cfg     Config
	store   Store
	log     *slog.Logger
	sampled *logsample.Logger
	metrics *Metrics
	breaker *gobreaker.CircuitBreaker[struct{}]
	local   *localLimiter
	leases  *leaseTable

	index atomic.Pointer[compiled]
	// firstFailure is the unix ns of the first store failure since the
	// last success (0: none), for the breaker.
	firstFailure atomic.Int64
	lastTimeout  atomic.Bool // the latest store failure was a timeout
}

// compiled is an immutable rule set with per-rule derived bucket parameters.
type compiled struct {
	index  *rules.Index
	params map[string]bucketParams // by rule id; absent: rule not enforced in this region
}

type bucketParams struct {
	global    *redisstore.Global // coordinated global token bucket; nil otherwise
	algorithm rules.Algorithm
	capacity  int64 // thousandths
	rate      int64 // thousandths per second
	limit     int64
	window    time.Duration
	windowMs  int64
	// invalid is why the store cannot hold this rule's bucket; its checks
	// are answered by its failure_mode without the store.
	invalid error
}

// New returns an Enforcer that evaluates rules against store. Call SetRules
// before the first check; until then checks fail with ErrNoRules.
func New(cfg Config, store Store) (*Enforcer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if store == nil {
		return nil, errors.New("regional: nil store")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	e := &Enforcer{
		cfg:     cfg,
		store:   store,
		log:     log,
		sampled: logsample.New(log, 10*time.Second),
		metrics: cfg.Metrics,
		local:   newLocalLimiter(cfg.LocalMaxKeys, time.Now),
		leases:  newLeaseTable(cfg.LocalMaxKeys, time.Now),
	}
	if e.cfg.QueueTimeout == 0 {
		e.cfg.QueueTimeout = max(100*time.Millisecond, cfg.Timeout)
	}
	if e.cfg.ShedLatency == 0 {
		e.cfg.ShedLatency = cfg.Timeout / 2
	}
	e.breaker = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: cfg.BreakerProbes,
		Timeout:     cfg.BreakerOpen,
		// Consecutive failures; timeouts must also span at least one
		// Timeout: the calls of one stalled pipeline fail together and are
		// one event, not many.
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures < cfg.BreakerFailures {
				return false
			}
			first := e.firstFailure.Load()
			return !e.lastTimeout.Load() || (first != 0 && time.Since(time.Unix(0, first)) >= cfg.Timeout)
		},
		// Only the store failing counts: a caller that went away, a check
		// shed by our own queue, or a request the store refuses as invalid
		// is neither a failure nor a success.
		IsExcluded: func(err error) bool { return !isStoreFailure(classify(err)) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			log.Warn("store circuit breaker changed state", "from", from.String(), "to", to.String())
			if e.metrics != nil {
				e.metrics.setBreaker(to)
			}
		},
	})
	if e.metrics != nil {
		e.metrics.setBreaker(gobreaker.StateClosed)
	}
	return e, nil
}

// SetRules compiles rs and swaps it in atomically. It fails, leaving the
// current set in place, when the set is invalid.
func (e *Enforcer) SetRules(rs []rules.Rule) error {
	ix, err := rules.NewIndex(rs)
	if err != nil {
		return err
	}
	c := &compiled{index: ix, params: make(map[string]bucketParams, len(rs))}
	for _, r := range ix.Rules() {
		p, ok := e.params(r)
		if !ok {
			e.log.Warn("global rule does not list this region; not enforced here", "rule", r.ID, "region", e.cfg.Region)
			continue
		}
		if err := redisstore.ValidateBucket(p.bucket("", &r)); err != nil {
			p.invalid = err
			e.log.Error("the store cannot hold this rule's bucket in this region; its checks are answered by its failure_mode", "rule", r.ID, "error", err)
		}
		c.params[r.ID] = p
	}
	e.index.Store(c)
	if e.metrics != nil {
		e.metrics.rulesLoaded.Set(float64(len(c.params)))
		e.metrics.ruleSet(slices.Collect(maps.Keys(c.params)))
		e.metrics.ruleUpdates.Inc()
	}
	e.log.Info("rule set applied", "rules", ix.Len(), "enforced_here", len(c.params))
	return nil
}

// Ready reports whether a rule set is loaded.
func (e *Enforcer) Ready() bool { return e.index.Load() != nil }

// BreakerState is the store circuit breaker's state: "closed", "half-open" or "open".
func (e *Enforcer) BreakerState() string { return e.breaker.State().String() }

// params derives the bucket parameters a rule has in this region.
func (e *Enforcer) params(r rules.Rule) (bucketParams, bool) {
	frac := 1.0
	if r.Scope == rules.Global {
		f, ok := r.StaticShare(e.cfg.Region)
		if !ok {
			return bucketParams{}, false
		}
		frac = f
	}
	p := bucketParams{algorithm: r.Algorithm}
	if r.Scope == rules.Global && r.Algorithm == rules.TokenBucket && !e.cfg.StaticGlobal {
		// The store enforces floor(global x units / Units): the agent's share,
		// or this region's floor while no agent lease is valid.
		floor, ok := globalFloor(r, e.cfg.Region)
		if !ok {
			return bucketParams{}, false
		}
		p.capacity = r.Capacity * 1000
		p.rate = int64(r.RefillPerSecond * 1000)
		p.windowMs = p.capacity * 1000 / max(p.rate, 1)
		p.global = &redisstore.Global{Rule: r.ID, Units: allocation.DefaultUnits, Floor: floor}
		return p, true
	}
	if r.Split >= 2 {
		frac /= float64(r.Split) // each sub-bucket holds 1/split of the limit
	}
	switch r.Algorithm {
	case rules.TokenBucket, rules.LeakyBucket:
		p.capacity = int64(float64(r.Capacity) * 1000 * frac)
		p.rate = int64(r.RefillPerSecond * 1000 * frac)
		if p.rate > 0 {
			p.windowMs = p.capacity * 1000 / p.rate
		}
	default:
		p.limit = int64(float64(r.Limit) * frac)
		p.window = time.Duration(r.Window)
		p.windowMs = p.window.Milliseconds()
	}
	return p, true
}

// globalFloor is the region's floor units of a global rule: the static
// split the sync agent's ledger starts from (allocation.Floors).
func globalFloor(r rules.Rule, region string) (int64, bool) {
	names, floor, _ := allocation.Floors(allocation.DefaultUnits, r.MinShare, r.Regions)
	for i, n := range names {
		if n == region {
			return floor[i], true
		}
	}
	return 0, false
}

// validate checks a request and fills cost's default.
func (e *Enforcer) validate(req *Request) error {
	switch {
	case req.ClientKey == "":
		return &RequestError{Field: "client_key", Msg: "is required"}
	case len(req.ClientKey) > MaxClientKeyBytes:
		return &RequestError{Field: "client_key", Msg: fmt.Sprintf("is %d bytes, the maximum is %d", len(req.ClientKey), MaxClientKeyBytes)}
	case !utf8.ValidString(req.ClientKey):
		return &RequestError{Field: "client_key", Msg: "is not valid UTF-8"}
	case len(req.Resource) > maxFieldBytes:
		return &RequestError{Field: "resource", Msg: fmt.Sprintf("is %d bytes, the maximum is %d", len(req.Resource), maxFieldBytes)}
	case !utf8.ValidString(req.Resource):
		return &RequestError{Field: "resource", Msg: "is not valid UTF-8"}
	case req.Cost < 0:
		return &RequestError{Field: "cost", Msg: fmt.Sprintf("must not be negative, got %d", req.Cost)}
	case req.Cost > e.cfg.MaxCost:
		return &RequestError{Field: "cost", Msg: fmt.Sprintf("%d is above the maximum of %d", req.Cost, e.cfg.MaxCost)}
	case len(req.Attributes) > maxAttributes:
		return &RequestError{Field: "attributes", Msg: fmt.Sprintf("has %d entries, the maximum is %d", len(req.Attributes), maxAttributes)}
	}
	for k, v := range req.Attributes {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return &RequestError{Field: "attributes", Msg: "contains invalid UTF-8"}
		}
		if len(k) > maxFieldBytes || len(v) > maxFieldBytes {
			return &RequestError{Field: "attributes." + truncate(k, 64), Msg: fmt.Sprintf("is longer than %d bytes", maxFieldBytes)}
		}
	}
	if req.Cost == 0 {
		req.Cost = 1
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// matched is one rule that applies to a request.
type matched struct {
	rule   *rules.Rule
	params bucketParams
	bucket redisstore.Bucket
}

// pending is one request on its way through run.
type pending struct {
	req  Request
	take int64 // the cost asked of the store: the request's, or a local batch
	ms   []matched
	resp Response
	err  error
	done bool
}

// BatchError is the error of one request of a CheckBatch; Index is its position.
type BatchError struct {
	Index int
	Err   error
}

func (e *BatchError) Error() string { return fmt.Sprintf("regional: requests[%d]: %v", e.Index, e.Err) }

// Unwrap returns the request's error.
func (e *BatchError) Unwrap() error { return e.Err }

// Check answers one request. The only errors are a *RequestError (bad
// input), ErrNoRules, and ctx's error when the caller has gone away; store
// failures are answered by the failure policy, and overload by shedding.
func (e *Enforcer) Check(ctx context.Context, req Request) (Response, error) {
	var one [1]pending
	one[0].req = req
	if err := e.validate(&one[0].req); err != nil {
		return Response{}, err
	}
	if err := e.run(ctx, one[:]); err != nil {
		return Response{}, err
	}
	return one[0].resp, one[0].err
}

// CheckBatch answers reqs in order, as Check would one by one, but sends
// them to the store together: one pipeline, one round trip. An invalid
// request fails the whole batch before anything is checked (a *BatchError
// naming its index); so does the caller going away.
func (e *Enforcer) CheckBatch(ctx context.Context, reqs []Request) ([]Response, error) {
	ps := make([]pending, len(reqs))
	for i := range reqs {
		ps[i].req = reqs[i]
		if err := e.validate(&ps[i].req); err != nil {
			return nil, &BatchError{Index: i, Err: err}
		}
	}
	if err := e.run(ctx, ps); err != nil {
		return nil, err
	}
	out := make([]Response, len(ps))
	for i := range ps {
		if ps[i].err != nil {
			return nil, &BatchError{Index: i, Err: ps[i].err}
		}
		out[i] = ps[i].resp
	}
	return out, nil
}

// run answers validated requests: those that match nothing, those of a rule
// the store cannot hold, and low-priority ones while shedding, without the
// store; all others in one store call through the breaker.
func (e *Enforcer) run(ctx context.Context, ps []pending) error {
	start := time.Now()
	if e.metrics != nil {
		e.metrics.inFlight.Add(float64(len(ps)))
		defer e.metrics.inFlight.Sub(float64(len(ps)))
	}
	c := e.index.Load()
	if c == nil {
		return ErrNoRules
	}
	var oneIdx [1]int
	idx := oneIdx[:0]
	shed := e.shedReason()
	for i := range ps {
		p := &ps[i]
		p.ms = e.match(c, &p.req)
		p.take = p.req.Cost
		switch {
		case len(p.ms) == 0:
			p.resp, p.done = Response{Allowed: true, Statuses: []Status{}}, true
			e.observe(start, "none")
		case invalidRule(p.ms) != nil:
			e.storeError("invalid")
			p.resp = e.failurePolicy(p.ms, p.req.Cost, invalidRule(p.ms))
		case shed != "" && lowPriority(p.ms):
			p.resp = e.shedAnswer(p.ms, shed)
		case e.fromLease(p):
		default:
			idx = append(idx, i)
		}
	}
	e.callStore(ctx, ps, idx, true)
	for i := range ps {
		p := &ps[i]
		if p.done {
			continue
		}
		e.record(p.ms, &p.resp, p.req.Cost)
		e.observe(start, decision(p.resp))
	}
	return nil
}

// callStore answers ps[idx] from the store, in one call through the breaker.
// A request that asked for a local batch (take above its cost) and was
// refused because the bucket holds less than the batch is asked again for
// its own cost once (retry).
func (e *Enforcer) callStore(ctx context.Context, ps []pending, idx []int, retry bool) {
	if len(idx) == 0 {
		return
	}
	var oneCall [1]redisstore.Call
	calls := oneCall[:0]
	for _, i := range idx {
		p := &ps[i]
		buckets := make([]redisstore.Bucket, len(p.ms))
		for j := range p.ms {
			buckets[j] = p.ms[j].bucket
		}
		calls = append(calls, redisstore.Call{Cost: p.take, Buckets: buckets})
	}
	var oneAns [1]redisstore.Answer
	answers := oneAns[:]
	if len(calls) > 1 {
		answers = make([]redisstore.Answer, len(calls))
	}
	budget := redisstore.Budget{Queue: e.cfg.QueueTimeout, RoundTrip: e.cfg.Timeout}
	_, berr := e.breaker.Execute(func() (struct{}, error) {
		e.store.Do(ctx, budget, calls, answers)
		if ctx.Err() != nil {
			return struct{}{}, ctx.Err()
		}
		err := worst(answers)
		if kind := classify(err); isStoreFailure(kind) {
			e.firstFailure.CompareAndSwap(0, time.Now().UnixNano())
			e.lastTimeout.Store(kind == "timeout")
		}
		return struct{}{}, err
	})
	rejected := errors.Is(berr, gobreaker.ErrOpenState) || errors.Is(berr, gobreaker.ErrTooManyRequests)
	if berr == nil {
		e.firstFailure.Store(0)
	}
	var again []int
	for j, i := range idx {
		p := &ps[i]
		err := answers[j].Err
		if rejected {
			err = berr
		} else if err == nil && len(answers[j].Results) != len(p.ms) {
			err = fmt.Errorf("%w: %d results for %d buckets", redisstore.ErrBadReply, len(answers[j].Results), len(p.ms))
		}
		if err != nil && ctx.Err() != nil {
			e.leaseAbandon(p)
			p.err, p.done = ctx.Err(), true
			continue
		}
		switch kind := classify(err); kind {
		case "":
			if p.take > p.req.Cost {
				if !answers[j].Allowed {
					if retry {
						p.take = p.req.Cost
						again = append(again, i)
					} else {
						p.resp = e.fromStore(p.ms, answers[j])
					}
					e.leases.done(p.ms[0].bucket.Key, 0, p.ms[0].leaseLife(), true)
					continue
				}
				e.leases.done(p.ms[0].bucket.Key, p.take-p.req.Cost, p.ms[0].leaseLife(), false)
			}
			p.resp = e.fromStore(p.ms, answers[j])
		case "queue_timeout":
			e.leaseAbandon(p)
			p.resp = e.shedAnswer(p.ms, kind)
		default:
			e.leaseAbandon(p)
			e.storeError(kind)
			p.resp = e.failurePolicy(p.ms, p.req.Cost, err)
		}
	}
	e.callStore(ctx, ps, again, false)
}

// classify names what went wrong in a store call: "" (nothing), the
// enforcer's own overload (queue_timeout), the caller (canceled), a request
// the store refuses (invalid), or a store failure: timeout, breaker_open,
// or error (connection refused or reset, a server that is loading, busy,
// read-only, out of memory, or down).
func classify(err error) string {
	var rerr redis.Error
	switch {
	case err == nil:
		return ""
	case errors.Is(err, redisstore.ErrQueueTimeout):
		return "queue_timeout"
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return "breaker_open"
	case errors.Is(err, redisstore.ErrTimeout):
		return "timeout"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	case errors.Is(err, redisstore.ErrInvalidBucket), errors.Is(err, redisstore.ErrInvalidCost),
		errors.Is(err, redisstore.ErrClock), errors.Is(err, redisstore.ErrBadReply):
		return "invalid"
	case errors.As(err, &rerr):
		// An error reply: Redis itself is unwell, or it refuses this
		// request (a script error about one key, a wrong type).
		for _, p := range []string{"LOADING", "BUSY", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "OOM", "NOREPLICAS", "MISCONF", "NOAUTH", "WRONGPASS", "NOPERM"} {
			if redis.HasErrorPrefix(err, p) {
				return "error"
			}
		}
		return "invalid"
	}
	return "error"
}

func isStoreFailure(kind string) bool {
	return kind == "timeout" || kind == "error" || kind == "breaker_open"
}

// worst is the error the breaker sees for one store call: the first store
// failure, else the first other error if every answer failed, else nil.
func worst(answers []redisstore.Answer) error {
	var other error
	failed := 0
	for _, a := range answers {
		if a.Err == nil {
			continue
		}
		failed++
		if isStoreFailure(classify(a.Err)) {
			return a.Err
		}
		if other == nil {
			other = a.Err
		}
	}
	if failed == len(answers) {
		return other
	}
	return nil
}

func (e *Enforcer) storeError(kind string) {
	if e.metrics != nil {
		e.metrics.storeErrors.WithLabelValues(kind).Inc()
	}
}

func invalidRule(ms []matched) error {
	for _, m := range ms {
		if m.params.invalid != nil {
			return fmt.Errorf("rule %s: %w", m.rule.ID, m.params.invalid)
		}
	}
	return nil
}

// lowPriority reports whether every matched rule may be shed.
func lowPriority(ms []matched) bool {
	for _, m := range ms {
		if m.rule.Priority != rules.PriorityLow {
			return false
		}
	}
	return true
}

// shedReason says why low-priority checks are shed now, or "".
func (e *Enforcer) shedReason() string {
	l := e.store.Load()
	switch {
	case e.cfg.ShedQueue > 0 && l.Queued >= e.cfg.ShedQueue:
		return "queue_depth"
	case e.cfg.ShedLatency > 0 && l.RoundTrip >= e.cfg.ShedLatency:
		return "latency"
	}
	return ""
}

// shedAnswer answers without the store while overloaded: every enforced
// rule rejects (nothing is consumed, so no bucket can pass its bound),
// shadow rules allow.
func (e *Enforcer) shedAnswer(ms []matched, reason string) Response {
	resp := Response{Allowed: true, Shed: true, Statuses: make([]Status, len(ms))}
	for i, m := range ms {
		st := Status{RuleID: m.rule.ID, Allowed: m.rule.Shadow, Shadow: m.rule.Shadow, WindowMs: m.params.windowMs, Limit: m.limitTokens()}
		if !st.Allowed {
			st.RetryAfterMs = e.cfg.ShedRetryAfter.Milliseconds()
			resp.Allowed = false
		}
		resp.Statuses[i] = st
	}
	e.bind(&resp)
	if e.metrics != nil {
		e.metrics.shed.WithLabelValues(reason).Inc()
	}
	e.sampled.Log(slog.LevelWarn, "shed", "enforcer overloaded; shedding checks without the store", "reason", reason)
	return resp
}

func decision(r Response) string {
	switch {
	case r.Shed:
		return "shed"
	case r.FailOpen && r.Allowed:
		return "fail_allowed"
	case r.FailOpen:
		return "fail_rejected"
	case r.Allowed:
		return "allowed"
	default:
		return "rejected"
	}
}

func (e *Enforcer) observe(start time.Time, outcome string) {
	if e.metrics != nil {
		e.metrics.latency.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	}
}

// match finds the rules for req and builds their buckets.
func (e *Enforcer) match(c *compiled, req *Request) []matched {
	rs := c.index.Match(req.Resource, req.Attributes)
	out := make([]matched, 0, len(rs))
	var splitParts []string
	for _, r := range rs {
		p, ok := c.params[r.ID]
		if !ok {
			continue
		}
		parts, ok := r.KeyValues(req.ClientKey, req.Resource, req.Attributes)
		if !ok || len(parts) == 0 {
			continue
		}
		out = append(out, matched{rule: r, params: p, bucket: p.bucket(redisstore.Key(parts[0], r.ID, parts[1:]...), r)})
		if r.Split >= 2 && len(out) == 1 {
			splitParts = parts
		}
	}
	if len(out) == 1 && splitParts != nil {
		// A hot key spread over Split sub-buckets, each its own hash tag
		// (its own Redis Cluster slot), one picked at random per check. A
		// request that matches other rules too stays on the client's own
		// tag (one script, one slot): sub-bucket "0", the plain key.
		r := out[0].rule
		if i := rand.IntN(r.Split); i > 0 {
			out[0].bucket.Key = redisstore.Key(splitParts[0]+"#"+strconv.Itoa(i), r.ID, splitParts[1:]...)
		}
	}
	return out
}

// bucket is the store bucket of this rule for one key.
func (p bucketParams) bucket(key string, r *rules.Rule) redisstore.Bucket {
	return redisstore.Bucket{Key: key, Algorithm: p.algorithm, Capacity: p.capacity, Rate: p.rate,
		Limit: p.limit, Window: p.window, Shadow: r.Shadow, Global: p.global}
}

// fromStore builds the response from the store's answer.
func (e *Enforcer) fromStore(ms []matched, ans redisstore.Answer) Response {
	resp := Response{Allowed: ans.Allowed, Statuses: make([]Status, len(ms))}
	for i, m := range ms {
		r := ans.Results[i]
		resp.Statuses[i] = Status{RuleID: m.rule.ID, Allowed: r.Allowed, Limit: r.Limit, Remaining: r.Remaining,
			RetryAfterMs: r.RetryAfterMs, ResetAfterMs: r.ResetAfterMs, Shadow: m.rule.Shadow, WindowMs: m.params.windowMs}
	}
	e.bind(&resp)
	return resp
}

// failurePolicy answers from each rule's failure_mode when the store failed.
func (e *Enforcer) failurePolicy(ms []matched, cost int64, cause error) Response {
	resp := Response{Allowed: true, FailOpen: true, Statuses: make([]Status, len(ms))}
	var localBuckets []int
	for i, m := range ms {
		st := Status{RuleID: m.rule.ID, Allowed: true, Shadow: m.rule.Shadow, WindowMs: m.params.windowMs, Limit: m.limitTokens()}
		switch m.rule.FailureMode {
		case rules.FailClosed:
			st.Allowed = false
			st.RetryAfterMs = e.cfg.BreakerOpen.Milliseconds()
		case rules.FailLocal:
			localBuckets = append(localBuckets, i)
		}
		resp.Statuses[i] = st
	}
	if len(localBuckets) > 0 {
		specs := make([]localSpec, len(localBuckets))
		for j, i := range localBuckets {
			specs[j] = ms[i].localSpec(e.cfg.LocalFraction)
		}
		results := e.local.take(specs, cost)
		for j, i := range localBuckets {
			r := results[j]
			resp.Statuses[i].Allowed, resp.Statuses[i].Remaining, resp.Statuses[i].RetryAfterMs = r.allowed, r.remaining, r.retryAfterMs
		}
	}
	for _, st := range resp.Statuses {
		if !st.Shadow && !st.Allowed {
			resp.Allowed = false
		}
	}
	if resp.Allowed && len(localBuckets) > 0 {
		// Nothing is consumed on rejection; commit the local takes only now.
		specs := make([]localSpec, 0, len(localBuckets))
		for _, i := range localBuckets {
			if resp.Statuses[i].Allowed {
				specs = append(specs, ms[i].localSpec(e.cfg.LocalFraction))
			}
		}
		e.local.commit(specs, cost)
	}
	e.bind(&resp)
	e.sampled.Log(slog.LevelWarn, "failure_policy", "store unavailable; answering from the failure policy",
		"error", cause.Error(), "allowed", resp.Allowed, "breaker", e.BreakerState())
	return resp
}

func (m matched) limitTokens() int64 {
	if g := m.params.global; g != nil {
		return m.params.capacity * g.Floor / g.Units / 1000
	}
	if m.params.algorithm == rules.TokenBucket || m.params.algorithm == rules.LeakyBucket {
		return m.params.capacity / 1000
	}
	return m.params.limit
}

func (m matched) localSpec(frac float64) localSpec {
	s := localSpec{key: m.bucket.Key}
	if m.params.algorithm == rules.TokenBucket || m.params.algorithm == rules.LeakyBucket {
		s.capacity, s.rate = m.params.capacity, m.params.rate
	} else {
		s.capacity = m.params.limit * 1000
		if ms := m.params.window.Milliseconds(); ms > 0 {
			s.rate = m.params.limit * 1000 * 1000 / ms
		}
	}
	if g := m.params.global; g != nil {
		// Without the store there is no agent share to read: use the floor.
		frac *= float64(g.Floor) / float64(g.Units)
	}
	s.capacity = int64(float64(s.capacity) * frac)
	s.rate = int64(float64(s.rate) * frac)
	if s.rate < 1 {
		s.rate = 1
	}
	return s
}

// bind picks the binding rule: the rejecting enforced rule with the longest
// retry, or when allowed the enforced rule with the fewest remaining tokens.
// Shadow rules bind only when no enforced rule matched.
func (e *Enforcer) bind(resp *Response) {
	best := -1
	better := func(i int) bool {
		if best < 0 {
			return true
		}
		a, b := resp.Statuses[i], resp.Statuses[best]
		if a.Shadow != b.Shadow {
			return !a.Shadow
		}
		if a.Allowed != b.Allowed {
			return !a.Allowed
		}
		if !a.Allowed {
			return a.RetryAfterMs > b.RetryAfterMs
		}
		return a.Remaining < b.Remaining
	}
	for i := range resp.Statuses {
		if better(i) {
			best = i
		}
	}
	if best < 0 {
		return
	}
	s := resp.Statuses[best]
	resp.RuleID, resp.Limit, resp.Remaining, resp.ResetAfterMs, resp.windowMs = s.RuleID, s.Limit, s.Remaining, s.ResetAfterMs, s.WindowMs
	if !resp.Allowed {
		resp.RetryAfterMs = s.RetryAfterMs
	}
}

// record counts the decision per rule, logs shadow rejections and reports
// the usage of global rules.
func (e *Enforcer) record(ms []matched, resp *Response, cost int64) {
	for i, st := range resp.Statuses {
		if e.cfg.Usage != nil && ms[i].rule.Scope == rules.Global && !resp.Shed {
			switch {
			case st.Allowed && resp.Allowed:
				e.cfg.Usage(st.RuleID, ms[i].bucket.Key, cost, 0)
			case !st.Allowed && !st.Shadow:
				e.cfg.Usage(st.RuleID, ms[i].bucket.Key, 0, cost)
			}
		}
		d := "allowed"
		switch {
		case st.Shadow && !st.Allowed:
			d = "shadow_rejected"
			e.sampled.Log(slog.LevelInfo, "shadow:"+st.RuleID, "shadow rule would have rejected",
				"rule", st.RuleID, "key", ms[i].bucket.Key)
		case !st.Allowed:
			d = "rejected"
		case !resp.Allowed:
			d = "not_consumed" // this rule allowed but another rejected
		}
		switch {
		case resp.Shed:
			d = "shed"
		case resp.FailOpen:
			d = "fail_" + d
		}
		if e.metrics != nil {
			e.metrics.checks.WithLabelValues(st.RuleID, d).Inc()
		}
	}
}

// CountRequest counts one answered call in apportion_requests_total under
// protocol (grpc, http and envoy are this module's); for front ends outside
// this package.
func (e *Enforcer) CountRequest(protocol string, resp Response, err error) {
	e.metrics.request(protocol, resp, err)
}

// Rules returns the active rules sorted by id.
func (e *Enforcer) Rules() []rules.Rule {
	c := e.index.Load()
	if c == nil {
		return nil
	}
	rs := append([]rules.Rule(nil), c.index.Rules()...)
	sort.Slice(rs, func(i, j int) bool { return rs[i].ID < rs[j].ID })
	return rs
}

// RuleIndex returns the active rule index, nil before the first SetRules.
// The index is immutable: a front end may derive data from it and keep it
// until RuleIndex returns another one.
func (e *Enforcer) RuleIndex() *rules.Index {
	c := e.index.Load()
	if c == nil {
		return nil
	}
	return c.index
}
