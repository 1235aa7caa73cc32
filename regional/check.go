package regional

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
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
	dom  int // the store's failure domain of its keys (a partitioned store's)
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
// store; all others in one store call through the breaker of their keys'
// failure domain (one for a standalone Redis; a Cluster master's own).
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
	var shed string
	if e.domains == nil {
		shed = e.shedReason(e.store.Load())
	}
	for i := range ps {
		p := &ps[i]
		p.ms = e.match(c, &p.req)
		p.take = p.req.Cost
		if e.domains != nil && len(p.ms) > 0 {
			p.dom = e.domains.Domain(p.ms[0].bucket.Key)
			shed = e.shedReason(e.domains.DomainLoad(p.dom))
		}
		switch {
		case len(p.ms) == 0:
			p.resp, p.done = Response{Allowed: true, Statuses: []Status{}}, true
			e.observe(start, "none")
		case unlistedRule(p.ms):
			p.resp = e.unlistedAnswer(p.ms)
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

// callStore answers ps[idx] from the store, in one call, each request
// through the breaker of its keys' failure domain (e.main for a
// standalone Redis). A request that asked for a local batch (take above
// its cost) and was refused because the bucket holds less than the batch
// is asked again for its own cost once (retry).
func (e *Enforcer) callStore(ctx context.Context, ps []pending, idx []int, retry bool) {
	if len(idx) == 0 {
		return
	}
	// The breakers: the one of a standalone Redis, or one per master of
	// a Cluster that idx's keys live on.
	var one [1]attempt
	sc := storeCall{ps: ps, idx: idx, atts: one[:1]}
	sc.atts[0].g = &e.main
	if e.domains != nil {
		sc.atts, sc.of = e.attempts(ps, idx, one[:0])
	}
	e.through(ctx, 0, &sc)
	for a := range sc.atts {
		if at := &sc.atts[a]; at.send {
			e.heard(at)
		}
	}
	var again []int
	k := 0 // the next answer
	for j, i := range idx {
		p := &ps[i]
		at := sc.attempt(j)
		var ans *redisstore.Answer
		err := at.berr
		if at.send {
			ans = &sc.answers[k]
			k++
			err = ans.Err
			if err == nil && len(ans.Results) != len(p.ms) {
				err = fmt.Errorf("%w: %d results for %d buckets", redisstore.ErrBadReply, len(ans.Results), len(p.ms))
			}
		}
		if err != nil && ctx.Err() != nil {
			e.leaseAbandon(p)
			p.err, p.done = ctx.Err(), true
			continue
		}
		switch kind := classify(err); kind {
		case "":
			if p.take > p.req.Cost {
				if !ans.Allowed {
					if retry {
						p.take = p.req.Cost
						again = append(again, i)
					} else {
						p.resp = e.fromStore(p.ms, *ans, p.req.Cost)
					}
					e.leases.done(p.ms[0].bucket.Key, 0, p.ms[0].leaseLife(), true)
					continue
				}
				e.leases.done(p.ms[0].bucket.Key, p.take-p.req.Cost, p.ms[0].leaseLife(), false)
			}
			p.resp = e.fromStore(p.ms, *ans, p.req.Cost)
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

// storeCall is one callStore's call to the store: the requests ps[idx],
// by attempt (one per breaker), and the calls and answers of those sent.
type storeCall struct {
	ps      []pending
	idx     []int
	atts    []attempt
	of      []int // of[j]: the attempt of idx[j] (nil: atts[0])
	answers []redisstore.Answer
}

// attempt is one breaker's part of a store call: the requests of one
// failure domain.
type attempt struct {
	g       *guard
	n       int      // its requests
	berr    error    // the breaker's refusal
	send    bool     // its requests go to the store: let through, or past it (heardAgain)
	past    bool     // past it (heardAgain), which counts nothing
	look    bool     // past it to look (heardAgain): ends the look
	sent    int64    // unix ns, when sent past it
	acc     worstAcc // the outcome of its requests
	outcome error    // what the breaker hears: acc's worst, or the caller's ctx.Err()
}

func (sc *storeCall) attempt(j int) *attempt {
	if sc.of == nil {
		return &sc.atts[0]
	}
	return &sc.atts[sc.of[j]]
}

// attempts appends to atts one attempt per guard of the domains of
// ps[idx] (a partitioned store), and returns the attempt of each idx[j].
func (e *Enforcer) attempts(ps []pending, idx []int, atts []attempt) ([]attempt, []int) {
	of := make([]int, len(idx))
	now := time.Now().UnixNano()
	for j, i := range idx {
		g := e.guardFor(ps[i].dom)
		a := slices.IndexFunc(atts, func(at attempt) bool { return at.g == g })
		if a < 0 {
			a = len(atts)
			atts = append(atts, attempt{g: g})
			g.used.Store(now)
		}
		atts[a].n++
		of[j] = a
	}
	return atts, of
}

// through passes sc's attempts from a on through their breakers, each one
// within the previous one's (so that each breaker counts its own requests'
// outcome), and makes the store call (send) inside the last.
func (e *Enforcer) through(ctx context.Context, a int, sc *storeCall) {
	if a == len(sc.atts) {
		e.send(ctx, sc)
		return
	}
	at := &sc.atts[a]
	_, berr := at.g.breaker.Execute(func() (struct{}, error) {
		at.send = true
		e.through(ctx, a+1, sc)
		return struct{}{}, at.outcome
	})
	if at.send {
		return
	}
	// Refused (open, or half-open with its probes taken).
	at.berr = berr
	if pass, look := e.heardAgain(at.g); pass {
		// Past the breaker, which counts nothing. Failing, the next
		// checks need an answer from Redis heard after this one was sent.
		at.send, at.past, at.look, at.sent = true, true, look, time.Now().UnixNano()
	}
	e.through(ctx, a+1, sc)
}

// send calls the store with the requests of the attempts that go to it,
// and sets each attempt's outcome.
func (e *Enforcer) send(ctx context.Context, sc *storeCall) {
	ps, idx := sc.ps, sc.idx
	sending, total := 0, 0
	for j, i := range idx {
		if sc.attempt(j).send {
			sending++
			total += len(ps[i].ms)
		}
	}
	if sending == 0 {
		return
	}
	// One allocation for the calls, answers, buckets and results of a single
	// request of up to two rules, three for a batch.
	var calls []redisstore.Call
	var answers []redisstore.Answer
	var all []redisstore.Bucket
	if sending == 1 && total <= 2 {
		one := new(oneStoreCall)
		calls, answers, all = one.calls[:0], one.answers[:], one.buckets[:total]
		answers[0].Results = one.results[:0]
	} else {
		calls, answers, all = make([]redisstore.Call, 0, sending), make([]redisstore.Answer, sending), make([]redisstore.Bucket, total)
	}
	for j, i := range idx {
		if !sc.attempt(j).send {
			continue
		}
		p := &ps[i]
		n := len(p.ms)
		buckets := all[:n:n]
		all = all[n:]
		for k := range p.ms {
			buckets[k] = p.ms[k].bucket
		}
		calls = append(calls, redisstore.Call{Cost: p.take, Buckets: buckets})
	}
	e.store.Do(ctx, redisstore.Budget{Queue: e.cfg.QueueTimeout, RoundTrip: e.cfg.Timeout}, calls, answers)
	sc.answers = answers
	// What each breaker hears: the worst outcome of its requests.
	if sc.of == nil {
		sc.atts[0].outcome = worst(answers)
	} else {
		k := 0
		for j := range idx {
			if at := sc.attempt(j); at.send {
				at.acc.add(answers[k].Err)
				k++
			}
		}
		for a := range sc.atts {
			sc.atts[a].outcome = sc.atts[a].acc.err()
		}
	}
	for a := range sc.atts {
		at := &sc.atts[a]
		if !at.send {
			continue
		}
		if ctx.Err() != nil {
			at.outcome = ctx.Err()
		}
		// Before the breaker hears it: ReadyToTrip reads these.
		if kind := classify(at.outcome); isStoreFailure(kind) {
			at.g.firstFailure.CompareAndSwap(0, time.Now().UnixNano())
			at.g.lastTimeout.Store(kind == "timeout")
		}
	}
}

// heard ends at, whose requests were sent, once its breaker has heard
// their outcome (see heardAgain).
func (e *Enforcer) heard(at *attempt) {
	g := at.g
	if at.past {
		if isStoreFailure(classify(at.outcome)) {
			if since := g.stallSince.Load(); since != 0 && since < at.sent {
				g.stallSince.CompareAndSwap(since, at.sent)
			}
		}
		if at.look {
			g.looking.Store(false)
		}
	}
	if at.outcome == nil {
		g.firstFailure.Store(0)
		if g.stallSince.Load() != 0 { // the breaker is not closed: heardAgain reads it
			g.lastOK.Store(time.Now().UnixNano())
		}
	}
}

// oneStoreCall holds callStore's slices for one request of up to two rules.
type oneStoreCall struct {
	calls   [1]redisstore.Call
	answers [1]redisstore.Answer
	buckets [2]redisstore.Bucket
	results [2]redisstore.Result
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
	splitAt := 0
	for _, r := range rs {
		p, ok := c.params[r.ID]
		if !ok || p.unlisted && r.Shadow {
			continue // a shadow rule with no share here has nothing to say
		}
		parts, ok := r.KeyValues(req.ClientKey, req.Resource, req.Attributes)
		if !ok || len(parts) == 0 {
			continue
		}
		out = append(out, matched{rule: r, params: p, bucket: p.bucket(redisstore.Key(parts[0], r.ID, parts[1:]...), r)})
		if r.Split >= 2 && splitParts == nil {
			splitAt, splitParts = len(out)-1, parts
		}
	}
	if splitParts != nil && (len(out) == 1 || e.domains == nil) {
		// A hot key spread over Split sub-buckets, each its own hash tag
		// (its own Redis Cluster slot), one picked at random per check. On
		// a Redis Cluster a request that matches other rules too (shadow
		// ones included) stays on the client's own tag, one script in one
		// slot: sub-bucket "0", the plain key. A standalone Redis has no
		// slots: the pick is made whatever else matched.
		m := &out[splitAt]
		if i := rand.IntN(m.rule.Split); i > 0 {
			m.bucket.Key = redisstore.AlgorithmKey(redisstore.SubKey(splitParts[0], i, m.rule.ID, splitParts[1:]...), m.params.algorithm)
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
			// -1 is "never": waiting cannot help, the longest wait of all
			// (a rule that lets the request in after a while does not
			// bind over one that never will).
			if (a.RetryAfterMs < 0) != (b.RetryAfterMs < 0) {
				return a.RetryAfterMs < 0
			}
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
		if e.cfg.Usage != nil && ms[i].rule.Scope == rules.Global && !resp.Shed && !ms[i].params.unlisted {
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
