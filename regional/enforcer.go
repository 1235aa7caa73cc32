package regional

import (
	"errors"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/sony/gobreaker/v2"
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
	// stallSince is, while the breaker is open (or half-open), the unix ns
	// from which Redis must have been heard for checks to go past it: on
	// timeouts (Redis silent) the first failure of the streak that opened
	// it, on errors (Redis refusing, resetting, answering errors) the time
	// it opened; then the latest failure of a check sent past it. 0 while
	// it is closed (see heardAgain).
	stallSince atomic.Int64
	stallProbe atomic.Int64 // unix ns of the latest check sent past it to look
	looking    atomic.Bool  // a check sent past it to look has not returned yet
	// byErrors: the breaker opened on errors, not on timeouts; then only a
	// check that succeeded (lastOK) shows Redis is back, not any reply.
	byErrors atomic.Bool
	lastOK   atomic.Int64 // unix ns of the latest store call that succeeded while stallSince was set
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
		// is neither a failure nor a success. A call without error is a
		// success: excluding it too would keep a half-open breaker from
		// ever closing again.
		IsExcluded: func(err error) bool { return err != nil && !isStoreFailure(classify(err)) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			log.Warn("store circuit breaker changed state", "from", from.String(), "to", to.String())
			now := time.Now().UnixNano()
			switch since := e.firstFailure.Load(); {
			case to == gobreaker.StateOpen:
				byErrors := !e.lastTimeout.Load()
				if since == 0 || byErrors {
					since = now
				}
				e.byErrors.Store(byErrors)
				e.stallSince.Store(since)
				e.stallProbe.Store(now)
			case to == gobreaker.StateClosed:
				e.stallSince.Store(0)
			}
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
		if p.global != nil {
			// Refused when put since 4 December 2026; one stored before is
			// enforced as it is, and said so.
			if err := r.CheckFloors(); err != nil {
				e.log.Warn("global rule in which a region can never hold a whole token (its floors strand the limit); put it again with the min_share the error gives", "rule", r.ID, "error", err)
			}
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
