package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
)

// Store evaluates the buckets of each request atomically, many requests in
// one round trip, within a budget (see redisstore.Store.Do), and reports its
// load. *redisstore.Store implements it.
type Store interface {
	Do(ctx context.Context, b redisstore.Budget, calls []redisstore.Call, out []redisstore.Answer)
	Load() redisstore.Load
}

// DomainStore is a Store whose keys fall in failure domains that fail
// apart: the masters of a Redis Cluster (*redisstore.Store implements it).
// When Partitioned is true the enforcer keeps a circuit breaker per domain
// (Domain of the first bucket key of a request; the keys of one request
// share a domain), so that a master that fails sends only the checks of
// its own keys to the failure policy; DomainLoad is the load of one
// domain's Redis (its shedding and heardAgain), DomainName names it in the
// logs.
type DomainStore interface {
	Store
	Partitioned() bool
	Domain(key string) int
	DomainLoad(d int) redisstore.Load
	DomainName(d int) string
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
	// from empty (buckets); the w of the RateLimit-Policy header.
	WindowMs int64 `json:"window_ms"`
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
	// WindowMs is the binding rule's (Status.WindowMs).
	WindowMs int64 `json:"window_ms"`
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

// BatchError is the error of one request of a CheckBatch; Index is its position.
type BatchError struct {
	Index int
	Err   error
}

func (e *BatchError) Error() string { return fmt.Sprintf("regional: requests[%d]: %v", e.Index, e.Err) }

// Unwrap returns the request's error.
func (e *BatchError) Unwrap() error { return e.Err }
