// Package header writes the rate-limit response headers of one CheckLimit
// answer and picks the HTTP status of a rejection. It is the one header
// writer of the module: the enforcer's HTTP API (POST /v1/check), the Go
// middleware (regional/middleware), the gRPC interceptors of
// regional/client (in lower case, as gRPC metadata) and the Envoy service's
// response_headers_to_add (regional/envoy) all write what Fields returns, so
// a client sees the same headers whichever front end answered.
//
// Invariant: the headers describe the binding rule only when it is an
// enforced rule (a shadow rule never binds in headers: a request that only
// shadow rules matched carries none), and Retry-After is written only when
// waiting can help: never when an enforced rule that rejected reports
// retry_after_ms -1 (the cost is above what the rule can ever admit, or the
// rule's share of the rate is zero).
package header

import (
	"fmt"
	"net/http"
	"strconv"

	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
)

// Header names, canonical. The Envoy service sends them in lower case.
const (
	Limit      = "X-RateLimit-Limit"
	Remaining  = "X-RateLimit-Remaining"
	Reset      = "X-RateLimit-Reset"
	Policy     = "RateLimit-Policy"
	RateLimit  = "RateLimit"
	RetryAfter = "Retry-After"
)

// Rule is the outcome of one matched rule, as CheckLimit reports it.
type Rule struct {
	ID           string
	Allowed      bool
	Shadow       bool
	Limit        int64 // tokens: capacity or limit per window
	Remaining    int64 // tokens left
	RetryAfterMs int64 // when rejected: ms until the request would pass; -1: never
	ResetAfterMs int64 // ms until full again / the window resets; -1: never
	WindowMs     int64 // the policy window: the window, or a bucket's time to refill from empty
}

// Answer is one CheckLimit answer, as the header writer needs it.
type Answer struct {
	Allowed bool
	// Cost is the request's cost in tokens (0 means 1).
	Cost int64
	// Binding is the id of the binding rule (CheckLimitResponse.rule_id);
	// "" when no rule matched.
	Binding string
	// Rules holds every matched rule's outcome.
	Rules []Rule
	// FailOpen: answered by the failure policy, the store having failed
	// (CheckLimitResponse.fail_open); the buckets' state is unknown.
	FailOpen bool
}

// FromProto is the Answer of a CheckLimit response to a request of cost
// tokens. A response whose statuses do not list the binding rule (a server
// that sends none) stands for it with its top-level fields.
func FromProto(resp *ratelimitv1.CheckLimitResponse, cost int64) Answer {
	a := Answer{Allowed: resp.GetAllowed(), Cost: cost, Binding: resp.GetRuleId(), Rules: make([]Rule, 0, len(resp.GetStatuses())+1), FailOpen: resp.GetFailOpen()}
	listed := false
	for _, s := range resp.GetStatuses() {
		a.Rules = append(a.Rules, Rule{ID: s.GetRuleId(), Allowed: s.GetAllowed(), Shadow: s.GetShadow(), Limit: s.GetLimit(),
			Remaining: s.GetRemaining(), RetryAfterMs: s.GetRetryAfterMs(), ResetAfterMs: s.GetResetAfterMs(), WindowMs: s.GetWindowMs()})
		listed = listed || s.GetRuleId() == a.Binding
	}
	if !listed && a.Binding != "" {
		a.Rules = append(a.Rules, Rule{ID: a.Binding, Allowed: resp.GetAllowed(), Limit: resp.GetLimit(), Remaining: resp.GetRemaining(),
			RetryAfterMs: resp.GetRetryAfterMs(), ResetAfterMs: resp.GetResetAfterMs(), WindowMs: resp.GetWindowMs()})
	}
	return a
}

// binding is the binding rule when it is enforced, else nil.
func (a *Answer) binding() *Rule {
	if a.Binding == "" {
		return nil
	}
	for i := range a.Rules {
		if r := &a.Rules[i]; r.ID == a.Binding {
			if r.Shadow {
				return nil
			}
			return r
		}
	}
	return nil
}

// never is the enforced rule that rejected the request for good (retry
// after -1), or nil when waiting can help (or the request was allowed).
func (a *Answer) never() *Rule {
	if a.Allowed {
		return nil
	}
	if b := a.binding(); b != nil && !b.Allowed && b.RetryAfterMs < 0 {
		return b
	}
	for i := range a.Rules {
		if r := &a.Rules[i]; !r.Shadow && !r.Allowed && r.RetryAfterMs < 0 {
			return r
		}
	}
	return nil
}

// Field is one response header.
type Field struct{ Name, Value string }

// Fields returns the rate-limit headers of a, in this order:
//
//   - X-RateLimit-Limit: the binding rule's limit in tokens (a bucket's
//     capacity, a window's limit);
//   - X-RateLimit-Remaining: tokens left after this request;
//   - X-RateLimit-Reset: whole seconds, rounded up, until the bucket is full
//     again / the window resets (a duration, not a time stamp); left out when
//     that never happens (a share of rate zero);
//   - RateLimit-Policy: "<rule id>";q=<limit>;w=<window, whole seconds, at least 1>
//     (the IETF draft field; w is the window, or a bucket's time to refill
//     from empty);
//   - RateLimit: "<rule id>";r=<remaining>;t=<reset seconds> (t left out
//     when X-RateLimit-Reset is);
//   - Retry-After: on a rejection only, whole seconds, rounded up, at least
//     1, until the request would be allowed; left out when waiting cannot
//     help (see Status).
//
// None of them when no enforced rule bound the request (no rule matched,
// or only shadow rules did: a rejection always has an enforced binding rule).
// An answer of the failure policy (FailOpen) knows no bucket's state: it
// carries X-RateLimit-Limit, RateLimit-Policy and, when rejected,
// Retry-After, and no remaining tokens or reset that a client would take
// for the bucket's (a remaining of 0 would hold back clients that pace
// themselves on it, while the policy admits).
func Fields(a Answer) []Field {
	var out []Field
	if b := a.binding(); b != nil && a.FailOpen {
		out = append(out, Field{Limit, strconv.FormatInt(b.Limit, 10)},
			Field{Policy, fmt.Sprintf("%s;q=%d;w=%d", strconv.Quote(b.ID), b.Limit, max(ceilSeconds(b.WindowMs), 1))})
	} else if b != nil {
		name := strconv.Quote(b.ID)
		limit, remaining := strconv.FormatInt(b.Limit, 10), strconv.FormatInt(b.Remaining, 10)
		out = append(out, Field{Limit, limit}, Field{Remaining, remaining})
		rl := fmt.Sprintf("%s;r=%s", name, remaining)
		if b.ResetAfterMs >= 0 {
			reset := strconv.FormatInt(ceilSeconds(b.ResetAfterMs), 10)
			out = append(out, Field{Reset, reset})
			rl += ";t=" + reset
		}
		out = append(out,
			Field{Policy, fmt.Sprintf("%s;q=%s;w=%d", name, limit, max(ceilSeconds(b.WindowMs), 1))},
			Field{RateLimit, rl})
	}
	if ra, ok := retryAfter(a); ok {
		out = append(out, Field{RetryAfter, strconv.FormatInt(ra, 10)})
	}
	return out
}

// retryAfter is the Retry-After value of a rejection in whole seconds, and
// false when there is none (allowed, or waiting cannot help).
func retryAfter(a Answer) (int64, bool) {
	if a.Allowed || a.never() != nil {
		return 0, false
	}
	ms := int64(-1)
	if b := a.binding(); b != nil {
		ms = b.RetryAfterMs
	}
	if ms < 0 { // no enforced binding status: the longest retry of the rejecting rules
		for _, r := range a.Rules {
			if !r.Shadow && !r.Allowed {
				ms = max(ms, r.RetryAfterMs)
			}
		}
	}
	return max(ceilSeconds(ms), 1), true
}

// Set writes Fields(a) into h, replacing any value already there.
func Set(h http.Header, a Answer) {
	for _, f := range Fields(a) {
		h.Set(f.Name, f.Value)
	}
}

// Status is the HTTP status of an answer and, for a rejection, a sentence
// saying why:
//
//   - 200 and "" when allowed;
//   - 413 Content Too Large when the request's cost is above what the
//     rejecting rule admits here at most (its limit in tokens, which for a
//     requests_per_unit 0 limit is 0): waiting cannot help, only a lower
//     cost or a higher limit can; no Retry-After;
//   - 429 Too Many Requests otherwise; when a rule reports that waiting
//     cannot help for another reason (its share of the rate is zero in this
//     region for good: a global rule's static share, or a global rule that
//     does not list this region, answered with limit 0 and no window) the
//     sentence says so and there is no Retry-After.
func Status(a Answer) (int, string) {
	if a.Allowed {
		return http.StatusOK, ""
	}
	cost := max(a.Cost, 1)
	if n := a.never(); n != nil {
		if n.Limit == 0 && n.WindowMs == 0 {
			// No share at all here: a global rule that does not list
			// this region (the enforcer answers it so, limit 0 and no
			// window); no cost is low enough.
			return http.StatusTooManyRequests, fmt.Sprintf(
				"rule %q admits nothing in this region (a global rule that does not list it): waiting cannot help", n.ID)
		}
		if cost > n.Limit {
			return http.StatusRequestEntityTooLarge, fmt.Sprintf(
				"cost %d is above the %d tokens rule %q admits here at most: waiting cannot help; lower the cost or raise the limit", cost, n.Limit, n.ID)
		}
		return http.StatusTooManyRequests, fmt.Sprintf(
			"rule %q admits nothing here now (its share of the rate is zero): waiting for its tokens cannot help", n.ID)
	}
	return http.StatusTooManyRequests, "too many requests"
}

func ceilSeconds(ms int64) int64 {
	if ms <= 0 {
		return 0
	}
	return (ms + 999) / 1000
}
