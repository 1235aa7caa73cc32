package regional

import (
	"sync"
	"time"
)

// localLimiter is the in-process token bucket that failure_mode "local"
// falls back to while the store is unreachable. It is deliberately simple and
// conservative: each process admits at most LocalFraction of the rule's limit.
type localLimiter struct {
	maxKeys int
	now     func() time.Time

	mu      sync.Mutex
	buckets map[string]*localBucket // guarded by mu
}

type localBucket struct {
	tokens int64 // thousandths
	at     time.Time
}

type localSpec struct {
	key      string
	capacity int64 // thousandths
	rate     int64 // thousandths per second
}

type localResult struct {
	allowed      bool
	remaining    int64
	retryAfterMs int64
}

func newLocalLimiter(maxKeys int, now func() time.Time) *localLimiter {
	return &localLimiter{maxKeys: maxKeys, now: now, buckets: map[string]*localBucket{}}
}

// refillLocked brings a bucket up to now; it creates a full one if needed.
func (l *localLimiter) refillLocked(s localSpec, now time.Time) *localBucket {
	b, ok := l.buckets[s.key]
	if !ok {
		if len(l.buckets) >= l.maxKeys {
			l.buckets = map[string]*localBucket{} // bounded memory: start over
		}
		b = &localBucket{tokens: s.capacity, at: now}
		l.buckets[s.key] = b
		return b
	}
	elapsed := now.Sub(b.at)
	if elapsed > 0 {
		add := elapsed.Milliseconds() * s.rate / 1000
		if add > 0 {
			b.tokens += add
			b.at = b.at.Add(time.Duration(add*1000/s.rate) * time.Millisecond)
		}
		if b.tokens >= s.capacity {
			b.tokens = s.capacity
			b.at = now
		}
	}
	return b
}

// take evaluates specs without consuming.
func (l *localLimiter) take(specs []localSpec, cost int64) []localResult {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]localResult, len(specs))
	for i, s := range specs {
		b := l.refillLocked(s, now)
		need := cost * 1000
		if b.tokens >= need {
			out[i] = localResult{allowed: true, remaining: (b.tokens - need) / 1000}
		} else {
			out[i] = localResult{remaining: b.tokens / 1000, retryAfterMs: ceilDiv((need-b.tokens)*1000, s.rate)}
		}
	}
	return out
}

// commit consumes cost from specs (after take said every one allows).
func (l *localLimiter) commit(specs []localSpec, cost int64) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range specs {
		b := l.refillLocked(s, now)
		b.tokens -= cost * 1000
		if b.tokens < 0 {
			b.tokens = 0
		}
	}
}

func ceilDiv(a, b int64) int64 {
	if b <= 0 {
		return 0
	}
	return (a + b - 1) / b
}
