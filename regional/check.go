package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/sony/gobreaker/v2"
)

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

// Enforces reports whether a rule not in shadow mode applies to req, whatever
// its cost: the Envoy service asks it of a descriptor whose cost the
// enforcer refused (envoyproxy/ratelimit counts hits_addend only against a
// limit that applies). False before the first rule set.
func (e *Enforcer) Enforces(req Request) bool {
	c := e.index.Load()
	if c == nil {
		return false
	}
	for _, m := range e.match(c, &req) {
		if !m.rule.Shadow {
			return true
		}
	}
	return false
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
	// One allocation for the calls, answers, buckets and results of a single
	// request of up to two rules (the closure below takes them to the
	// heap), three for a batch.
	total := 0
	for _, i := range idx {
		total += len(ps[i].ms)
	}
	var calls []redisstore.Call
	var answers []redisstore.Answer
	var all []redisstore.Bucket
	if len(idx) == 1 && total <= 2 {
		one := new(oneStoreCall)
		calls, answers, all = one.calls[:0], one.answers[:], one.buckets[:total]
		answers[0].Results = one.results[:0]
	} else {
		calls, answers, all = make([]redisstore.Call, 0, len(idx)), make([]redisstore.Answer, len(idx)), make([]redisstore.Bucket, total)
	}
	for _, i := range idx {
		p := &ps[i]
		n := len(p.ms)
		buckets := all[:n:n]
		all = all[n:]
		for j := range p.ms {
			buckets[j] = p.ms[j].bucket
		}
		calls = append(calls, redisstore.Call{Cost: p.take, Buckets: buckets})
	}
	budget := redisstore.Budget{Queue: e.cfg.QueueTimeout, RoundTrip: e.cfg.Timeout}
	call := func() (struct{}, error) {
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
	}
	_, berr := e.breaker.Execute(call)
	rejected := errors.Is(berr, gobreaker.ErrOpenState) || errors.Is(berr, gobreaker.ErrTooManyRequests)
	if rejected {
		if pass, look := e.heardAgain(); pass {
			// Past the breaker, which counts nothing. Failing, the next
			// checks need an answer from Redis heard after this one was sent.
			sent := time.Now().UnixNano()
			if _, berr = call(); isStoreFailure(classify(berr)) {
				if since := e.stallSince.Load(); since != 0 && since < sent {
					e.stallSince.CompareAndSwap(since, sent)
				}
			}
			if look {
				e.looking.Store(false)
			}
			rejected = false
		}
	}
	if berr == nil {
		e.firstFailure.Store(0)
		if e.stallSince.Load() != 0 { // the breaker is not closed: heardAgain reads it
			e.lastOK.Store(time.Now().UnixNano())
		}
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
						p.resp = e.fromStore(p.ms, answers[j], p.req.Cost)
					}
					e.leases.done(p.ms[0].bucket.Key, 0, p.ms[0].leaseLife(), true)
					continue
				}
				e.leases.done(p.ms[0].bucket.Key, p.take-p.req.Cost, p.ms[0].leaseLife(), false)
			}
			p.resp = e.fromStore(p.ms, answers[j], p.req.Cost)
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

// oneStoreCall holds callStore's slices for one request of up to two rules.
type oneStoreCall struct {
	calls   [1]redisstore.Call
	answers [1]redisstore.Answer
	buckets [2]redisstore.Bucket
	results [2]redisstore.Result
}

// lookEvery is the least time between two checks that go past an open
// breaker to look whether Redis is back (heardAgain): --timeout, at most
// 10 ms.
func (e *Enforcer) lookEvery() int64 { return int64(min(e.cfg.Timeout, 10*time.Millisecond)) }

// heardAgain reports, for a check the breaker refused (open, or half-open
// with its probes taken), whether it may go to Redis all the same (pass),
// because Redis is back, or to look whether it is (look: the caller ends
// the look when its call returns). Back: opened by a stall (timeouts),
// Redis has answered since the first of those timeouts (the replies of the
// pipelines it held arrive when it resumes, often before the breaker has
// even opened); opened by errors (Redis refusing connections, resetting
// them, answering errors), a check has succeeded since it opened. Else a
// check goes to look if none is looking and none went in the last
// lookEvery (each bounded by --timeout; a refused connection fails at
// once). The breaker is there for a store that has failed; a Redis that
// paused (a busy host, a slow fork) or restarted and answers again is not
// failing, and its checks go to it while the breaker waits out its open
// time (then its probes close it): the failure policy answers while Redis
// fails, not for the rest of a fixed second after it is back. A check that
// fails past the breaker makes the next ones wait for an answer (a
// success, after errors) heard after it was sent, so a Redis that stays
// silent or keeps failing keeps the checks on the failure policy; one that
// answers gets them, each bounded by its budget, as with a closed breaker.
func (e *Enforcer) heardAgain() (pass, look bool) {
	since := e.stallSince.Load()
	if since == 0 {
		return false, false
	}
	heard := e.store.Load().Answered.UnixNano()
	if e.byErrors.Load() {
		heard = e.lastOK.Load()
	}
	if heard > since {
		return true, false
	}
	now := time.Now().UnixNano()
	if now-e.stallProbe.Load() < e.lookEvery() || !e.looking.CompareAndSwap(false, true) {
		return false, false
	}
	e.stallProbe.Store(now) // the look is ours alone (looking)
	return true, true
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
		e.metrics.observe(outcome, time.Since(start).Seconds())
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
			out[0].bucket.Key = redisstore.AlgorithmKey(redisstore.SubKey(splitParts[0], i, r.ID, splitParts[1:]...), out[0].params.algorithm)
		}
	}
	return out
}

// shareRetryAfter is the retry_after_ms of a coordinated global rule
// whose share here is below the cost now (see fromStore).
const shareRetryAfter = time.Second

// fromStore builds the response from the store's answer to a request of
// cost tokens.
//
// The store answers "never" (retry -1) when the cost is above the bucket's
// capacity or its rate is zero. For a coordinated global rule that bucket
// is this region's share, which the sync agents move to where the demand
// is (a rejection is reported as demand): unless the cost is above the
// whole rule's limit, waiting can help, and the answer says to try again
// after shareRetryAfter (a 429 with Retry-After, not a 413).
func (e *Enforcer) fromStore(ms []matched, ans redisstore.Answer, cost int64) Response {
	resp := Response{Allowed: ans.Allowed, Statuses: make([]Status, len(ms))}
	for i, m := range ms {
		r := ans.Results[i]
		resp.Statuses[i] = Status{RuleID: m.rule.ID, Allowed: r.Allowed, Limit: r.Limit, Remaining: r.Remaining,
			RetryAfterMs: r.RetryAfterMs, ResetAfterMs: r.ResetAfterMs, Shadow: m.rule.Shadow, WindowMs: m.params.windowMs}
		if m.params.global != nil && !r.Allowed && r.RetryAfterMs < 0 && max(cost, 1) <= m.wholeTokens() {
			resp.Statuses[i].RetryAfterMs = shareRetryAfter.Milliseconds()
		}
	}
	e.bind(&resp)
	return resp
}

// bind picks the binding rule: the rejecting enforced rule with the longest
// retry, or when allowed the enforced rule with the fewest remaining tokens
// (and the longest delay of an admitting leaky bucket).
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
	resp.RuleID, resp.Limit, resp.Remaining, resp.ResetAfterMs, resp.WindowMs = s.RuleID, s.Limit, s.Remaining, s.ResetAfterMs, s.WindowMs
	if !resp.Allowed {
		resp.RetryAfterMs = s.RetryAfterMs
		return
	}
	// Allowed: a leaky bucket admits with a delay to wait before acting
	// (its RetryAfterMs); the caller waits for the longest of the enforced
	// rules', whichever binds by remaining tokens.
	for _, st := range resp.Statuses {
		if !st.Shadow && st.RetryAfterMs > resp.RetryAfterMs {
			resp.RetryAfterMs = st.RetryAfterMs
		}
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
			e.metrics.checked(st.RuleID, d)
		}
	}
}
