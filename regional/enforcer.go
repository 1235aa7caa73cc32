package regional

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
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
	local   *localLimiter
	leases  *leaseTable

	index atomic.Pointer[compiled]

	// The store's circuit breakers (breaker.go): main is the only one of
	// a standalone Redis; on a Redis Cluster (domains set) every master
	// has its own, by domain (main is domain 0's: keys whose master the
	// client does not know yet).
	main    guard
	domains DomainStore
	guards  atomic.Pointer[[]*guard] // by domain; [0] is &main
	guardMu sync.Mutex
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
	if ds, ok := store.(DomainStore); ok && ds.Partitioned() {
		e.domains = ds
	}
	e.initGuard(&e.main, 0, "")
	e.guards.Store(&[]*guard{&e.main})
	if e.metrics != nil {
		e.metrics.setBreakers(gobreaker.StateClosed, 0)
		e.metrics.summary.Store(&breakerSummaryFunc{e.breakerSummary})
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
	unlisted := 0
	for _, r := range ix.Rules() {
		p, ok := e.params(r)
		if !ok {
			// The region in the message: ratelimitd's logger carries a
			// "region" key already (JSON would hold it twice).
			e.log.Warn(fmt.Sprintf("global rule does not list this region (%s); not enforced here", e.cfg.Region), "rule", r.ID)
			continue
		}
		if p.unlisted {
			unlisted++
			if !r.Shadow {
				e.log.Error(fmt.Sprintf("global rule does not list this region (%s): its checks are rejected here, since its whole limit belongs to the regions it lists; check --region, or put the rule's split with this region under a new rule id", e.cfg.Region),
					"rule", r.ID, "regions", strings.Join(slices.Sorted(maps.Keys(r.Regions)), ","))
			}
			c.params[r.ID] = p
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
		e.metrics.rulesLoaded.Set(float64(len(c.params) - unlisted))
		e.metrics.rulesUnlisted.Set(float64(unlisted))
		e.metrics.ruleSet(slices.Collect(maps.Keys(c.params)))
		e.metrics.ruleUpdates.Inc()
	}
	e.log.Info("rule set applied", "rules", ix.Len(), "enforced_here", len(c.params)-unlisted, "unlisted_here", unlisted)
	return nil
}

// Ready reports whether a rule set is loaded.
func (e *Enforcer) Ready() bool { return e.index.Load() != nil }

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
