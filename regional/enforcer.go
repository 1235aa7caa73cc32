package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/sony/gobreaker/v2"
)

// Store evaluates the buckets of one request atomically.
// *redisstore.Store implements it.
type Store interface {
	Check(ctx context.Context, cost int64, buckets []redisstore.Bucket) (bool, []redisstore.Result, error)
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
	// Timeout bounds each store call (default 10ms).
	Timeout time.Duration
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
	breaker *gobreaker.CircuitBreaker[storeAnswer]
	local   *localLimiter

	index atomic.Pointer[compiled]
}

type storeAnswer struct {
	allowed bool
	results []redisstore.Result
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
	}
	e.breaker = gobreaker.NewCircuitBreaker[storeAnswer](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: cfg.BreakerProbes,
		Timeout:     cfg.BreakerOpen,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= cfg.BreakerFailures },
		IsSuccessful: func(err error) bool {
			// A caller that went away is not the store's fault.
			return err == nil || errors.Is(err, context.Canceled)
		},
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
		c.params[r.ID] = p
	}
	e.index.Store(c)
	if e.metrics != nil {
		e.metrics.rulesLoaded.Set(float64(len(c.params)))
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
		p.global = &redisstore.Global{Rule: r.ID, Units: ledger.DefaultConfig().Units, Floor: floor}
		return p, true
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

// globalFloor is the region's floor units of a global rule, computed as the
// sync agent's ledger does (ledger.Regions, ledger.Split).
func globalFloor(r rules.Rule, region string) (int64, bool) {
	specs := ledger.Regions(r.Regions)
	cfg := ledger.DefaultConfig()
	cfg.MinShare = r.MinShare
	floor, _ := ledger.Split(cfg, specs)
	for i, s := range specs {
		if s.Name == region {
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

// Check answers one request. The only errors are a *RequestError (bad
// input), ErrNoRules, and ctx's error when the caller has gone away; store
// failures are answered by the failure policy.
func (e *Enforcer) Check(ctx context.Context, req Request) (Response, error) {
	start := time.Now()
	if e.metrics != nil {
		e.metrics.inFlight.Inc()
		defer e.metrics.inFlight.Dec()
	}
	if err := e.validate(&req); err != nil {
		return Response{}, err
	}
	c := e.index.Load()
	if c == nil {
		return Response{}, ErrNoRules
	}
	ms := e.match(c, &req)
	if len(ms) == 0 {
		e.observe(start, "none")
		return Response{Allowed: true, Statuses: []Status{}}, nil
	}
	buckets := make([]redisstore.Bucket, len(ms))
	for i := range ms {
		buckets[i] = ms[i].bucket
	}
	ans, err := e.callStore(ctx, req.Cost, buckets)
	var resp Response
	if err != nil {
		if ctx.Err() != nil && !errors.Is(err, context.DeadlineExceeded) {
			return Response{}, ctx.Err()
		}
		resp = e.failurePolicy(ms, req.Cost, err)
	} else {
		resp = e.fromStore(ms, ans)
	}
	e.record(ms, &resp, req.Cost)
	e.observe(start, decision(resp))
	return resp, nil
}

func decision(r Response) string {
	switch {
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
	for _, r := range rs {
		p, ok := c.params[r.ID]
		if !ok {
			continue
		}
		parts, ok := r.KeyValues(req.ClientKey, req.Resource, req.Attributes)
		if !ok || len(parts) == 0 {
			continue
		}
		out = append(out, matched{rule: r, params: p, bucket: redisstore.Bucket{
			Key:       redisstore.Key(parts[0], r.ID, parts[1:]...),
			Algorithm: p.algorithm,
			Capacity:  p.capacity,
			Rate:      p.rate,
			Limit:     p.limit,
			Window:    p.window,
			Shadow:    r.Shadow,
			Global:    p.global,
		}})
	}
	return out
}

// callStore calls the store through the breaker with the configured timeout.
func (e *Enforcer) callStore(ctx context.Context, cost int64, buckets []redisstore.Bucket) (storeAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
	defer cancel()
	ans, err := e.breaker.Execute(func() (storeAnswer, error) {
		ok, res, err := e.store.Check(ctx, cost, buckets)
		if err == nil && len(res) != len(buckets) {
			err = fmt.Errorf("regional: store answered %d results for %d buckets", len(res), len(buckets))
		}
		return storeAnswer{allowed: ok, results: res}, err
	})
	if err != nil && e.metrics != nil {
		kind := "error"
		switch {
		case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
			kind = "breaker_open"
		case errors.Is(err, context.DeadlineExceeded):
			kind = "timeout"
		}
		e.metrics.storeErrors.WithLabelValues(kind).Inc()
	}
	return ans, err
}

// fromStore builds the response from the store's answer.
func (e *Enforcer) fromStore(ms []matched, ans storeAnswer) Response {
	resp := Response{Allowed: ans.allowed, Statuses: make([]Status, len(ms))}
	for i, m := range ms {
		r := ans.results[i]
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
		if e.cfg.Usage != nil && ms[i].rule.Scope == rules.Global {
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
		if resp.FailOpen {
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
