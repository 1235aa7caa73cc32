package regional

import (
	"sync"
	"time"

	"github.com/apportion/apportion/rules"
)

// Local pre-aggregation (a rule's local_batch: N). A check of such a rule
// that finds no tokens held here asks Redis for N tokens at once instead of
// its cost, keeps what it did not use, and later checks of that key are
// answered from memory until those are spent. Every token admitted was
// taken from Redis first, so a key never admits more in total than its
// bucket gives; what batching costs is timing: an enforcer holds at most
// N-1 tokens of a key at a time (one take in flight per key), so over any
// window a key may admit up to (N-1) x enforcers more than its rule's bound
// for that window (tokens taken earlier, spent now). For a global rule the
// tokens come out of the region's share in Redis like any other take.
//
// Batching applies to requests that match exactly one enforced rule, a
// token bucket with local_batch > 1 (other requests take their own cost in
// one script call, as usual). Held tokens expire after the time the rule
// takes to refill N (at least 1s, at most 10s): unspent, they are lost,
// never minted. A lease answer's remaining is what this enforcer holds.

// leaseTable holds the tokens each key has taken in advance. mu guards
// everything.
type leaseTable struct {
	maxKeys int
	now     func() time.Time

	mu sync.Mutex
	m  map[string]*lease
}

type lease struct {
	tokens  int64 // whole tokens held
	expires time.Time
	taking  bool // a batch take is in flight for this key
	// noBatch: the last batch was refused (the bucket holds less than N):
	// until then, checks take their own cost from Redis.
	noBatch time.Time
}

func newLeaseTable(maxKeys int, now func() time.Time) *leaseTable {
	return &leaseTable{maxKeys: maxKeys, now: now, m: map[string]*lease{}}
}

// take spends cost from key's lease. When the lease cannot pay, and no
// batch take is in flight, it returns batch: the caller should ask the
// store for want tokens (at least cost) and report with done.
func (l *leaseTable) take(key string, cost, n int64) (left int64, ok bool, batch bool, want int64) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.m[key]
	if ls != nil && !now.Before(ls.expires) {
		ls.tokens = 0
	}
	if ls != nil && ls.tokens >= cost {
		ls.tokens -= cost
		return ls.tokens, true, false, 0
	}
	if ls != nil && (ls.taking || now.Before(ls.noBatch)) {
		return 0, false, false, 0 // go to the store with the cost alone
	}
	if ls == nil {
		if len(l.m) >= l.maxKeys {
			l.sweepLocked(now)
		}
		ls = &lease{}
		l.m[key] = ls
	}
	ls.taking = true
	return 0, false, true, max(cost, n-ls.tokens)
}

// done ends a batch take: extra tokens (taken and not used by the request
// that took them) are added to key's lease, which then lives for life. A
// refused batch (refused) stops batching on key for life.
func (l *leaseTable) done(key string, extra int64, life time.Duration, refused bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := l.m[key]
	if ls == nil {
		return
	}
	ls.taking = false
	if extra > 0 {
		ls.tokens += extra
		ls.expires = l.now().Add(life)
	}
	if refused {
		ls.noBatch = l.now().Add(life)
	}
}

// sweepLocked drops expired and empty leases; if the table is still full it
// drops them all (their tokens are lost, never minted).
func (l *leaseTable) sweepLocked(now time.Time) {
	for k, ls := range l.m {
		if !ls.taking && (ls.tokens == 0 || !now.Before(ls.expires)) {
			delete(l.m, k)
		}
	}
	if len(l.m) >= l.maxKeys {
		l.m = map[string]*lease{}
	}

}

// batchable reports whether p may use a local batch, and its size.
func batchable(p *pending) (int64, bool) {
	if len(p.ms) != 1 {
		return 0, false
	}
	m := p.ms[0]
	if m.rule.LocalBatch < 2 || m.rule.Algorithm != rules.TokenBucket || m.rule.Shadow || p.req.Cost >= m.rule.LocalBatch {
		return 0, false
	}
	return m.rule.LocalBatch, true
}

// fromLease answers p from tokens held here, or sets p.take to a batch to
// ask the store for; it reports whether p is answered.
func (e *Enforcer) fromLease(p *pending) bool {
	n, ok := batchable(p)
	if !ok {
		return false
	}
	m := p.ms[0]
	left, hit, batch, want := e.leases.take(m.bucket.Key, p.req.Cost, n)
	if batch {
		p.take = want
	}
	if !hit {
		return false
	}
	p.resp = Response{Allowed: true, Statuses: []Status{{RuleID: m.rule.ID, Allowed: true, Limit: m.limitTokens(),
		Remaining: left, WindowMs: m.params.windowMs}}}
	e.bind(&p.resp)
	if e.metrics != nil {
		e.metrics.leaseAnswers.Inc()
	}
	return true
}

// leaseAbandon ends p's batch take without tokens (the store failed).
func (e *Enforcer) leaseAbandon(p *pending) {
	if p.take > p.req.Cost {
		e.leases.done(p.ms[0].bucket.Key, 0, 0, false)
	}
}

// leaseLife is how long tokens taken in advance for m are held.
func (m matched) leaseLife() time.Duration {
	d := time.Second
	if m.params.rate > 0 {
		d = time.Duration(m.rule.LocalBatch*1000*1000/m.params.rate) * time.Millisecond
	}
	return min(max(d, time.Second), 10*time.Second)
}
