package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
)

// classify names what went wrong in a store call: "" (nothing), the
// enforcer's own overload (queue_timeout), the caller (canceled), a request
// the store refuses (invalid), a Redis Cluster's refusal about the slot of
// the call's keys (slot: TRYAGAIN, a slot half migrated with the call's
// keys split; MOVED or ASK past the client's redirections; CLUSTERDOWN
// Hash slot not served: a slot no master serves), or a store failure:
// timeout, breaker_open, or error (connection refused or reset, a server
// that is loading, busy, read-only, out of memory, or down).
func classify(err error) string {
	if err == nil {
		return "" // before rerr: its address escapes, one allocation per call
	}
	var rerr redis.Error
	switch {
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
		// An error reply: Redis itself is unwell, it refuses this
		// request (a script error about one key, a wrong type), or a
		// Cluster refuses it for its slot alone, which says nothing of
		// the master's health (the other slots' calls succeed).
		for _, p := range []string{"TRYAGAIN", "MOVED", "ASK", "CLUSTERDOWN Hash slot not served"} {
			if redis.HasErrorPrefix(err, p) {
				return "slot"
			}
		}
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

// worstAcc gathers the outcomes of a breaker's requests in a store call
// (worst, one by one).
type worstAcc struct {
	n, failed int
	failure   error // the first store failure
	other     error // the first other error
}

func (w *worstAcc) add(err error) {
	w.n++
	if err == nil {
		return
	}
	w.failed++
	if w.failure == nil && isStoreFailure(classify(err)) {
		w.failure = err
	}
	if w.other == nil {
		w.other = err
	}
}

// err is worst of the outcomes added.
func (w *worstAcc) err() error {
	switch {
	case w.failure != nil:
		return w.failure
	case w.failed == w.n:
		return w.other
	}
	return nil
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
	if kind == "slot" {
		kind = "error" // counted with the errors; only the breaker tells them apart
	}
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

// unlistedRule reports whether a matched rule is a global rule that does
// not list this region (bucketParams.unlisted; shadow ones are not matched).
func unlistedRule(ms []matched) bool {
	for _, m := range ms {
		if m.params.unlisted {
			return true
		}
	}
	return false
}

// unlistedAnswer rejects a check that a global rule not listing this region
// matched, without the store and whatever its failure_mode: the rule's
// whole limit belongs to the regions it lists. Its status has limit 0 and
// retry_after_ms -1 (waiting cannot help); the other rules are not
// consumed.
func (e *Enforcer) unlistedAnswer(ms []matched) Response {
	resp := Response{Statuses: make([]Status, len(ms))}
	for i, m := range ms {
		st := Status{RuleID: m.rule.ID, Allowed: true, Shadow: m.rule.Shadow, WindowMs: m.params.windowMs}
		if m.params.unlisted {
			st.Allowed, st.RetryAfterMs, st.ResetAfterMs = false, -1, -1
		} else {
			st.Limit = m.limitTokens()
		}
		resp.Statuses[i] = st
	}
	e.bind(&resp)
	e.sampled.Log(slog.LevelWarn, "unlisted", "check rejected: a global rule it matched does not list this region", "rule", resp.RuleID)
	return resp
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

// shedReason says why low-priority checks are shed now, or "", from the
// load l of the store (a Cluster: of the checks' master).
func (e *Enforcer) shedReason(l redisstore.Load) string {
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
	msg := "store unavailable; answering from the failure policy"
	if kind := classify(cause); !isStoreFailure(kind) {
		// The store answered, refusing this check alone (a key of the
		// wrong type or layout, a slot moving): nothing is wrong with it.
		msg = "the store refused this check (" + kind + "); answering it alone from the failure policy"
	}
	e.sampled.Log(slog.LevelWarn, "failure_policy", msg,
		"error", cause.Error(), "allowed", resp.Allowed, "breaker", e.BreakerState())
	return resp
}

func (m matched) limitTokens() int64 {
	if g := m.params.global; g != nil && m.params.algorithm == rules.TokenBucket {
		return m.params.capacity * g.Floor / g.Units / 1000
	} else if g != nil { // a global window
		return m.params.limit * g.Floor / g.Units
	}
	return m.wholeTokens()
}

// wholeTokens is the rule's limit in tokens, over every region for a
// global rule: a bucket's capacity, a window's limit.
func (m matched) wholeTokens() int64 {
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
