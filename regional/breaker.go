package regional

import (
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/sony/gobreaker/v2"
)

// Circuit breakers, one per failure domain of the store (DomainStore): one
// for a standalone Redis, one per master of a Redis Cluster. A master that
// fails (killed, stopped, slow, refusing) opens its own breaker and sends
// the checks of its own keys to the failure policy; the checks of the
// other masters' keys go on to Redis and are answered by it, as they
// would be with that master healthy. The store does its part: a master's
// calls go in pipelines of its own, queued apart, and a master's silence
// is its own (redisstore, "Redis Cluster").

// guard is the circuit breaker of one failure domain, and what decides
// when checks go past it while it is open (heardAgain).
type guard struct {
	domain  int
	name    string // the domain's master's address ("" for a standalone Redis)
	breaker *gobreaker.CircuitBreaker[struct{}]
	state   atomic.Int32 // the breaker's gobreaker.State, as it last changed
	used    atomic.Int64 // unix ns of its latest check (a partitioned store's guards)

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

// idleGuard is how long a guard of a partitioned store may go without a
// check before its state stops counting in apportion_breaker_state and
// BreakerState: no key lives on its master any more (a failover gave its
// slots to the promoted replica, a domain of its own), so its breaker
// answers nothing, and, with no check to probe it, would stay open.
var idleGuard = 10 * time.Second // a variable for the tests

// initGuard sets g up as the breaker of domain d (named name).
func (e *Enforcer) initGuard(g *guard, d int, name string) {
	cfg := e.cfg
	g.domain, g.name = d, name
	g.used.Store(time.Now().UnixNano())
	breakerName := "redis"
	if name != "" {
		breakerName = "redis " + name
	}
	g.breaker = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        breakerName,
		MaxRequests: cfg.BreakerProbes,
		Timeout:     cfg.BreakerOpen,
		// Consecutive failures; timeouts must also span at least one
		// Timeout: the calls of one stalled pipeline fail together and are
		// one event, not many.
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures < cfg.BreakerFailures {
				return false
			}
			first := g.firstFailure.Load()
			return !g.lastTimeout.Load() || (first != 0 && time.Since(time.Unix(0, first)) >= cfg.Timeout)
		},
		// Only the store failing counts: a caller that went away, a check
		// shed by our own queue, a request the store refuses as invalid,
		// or a Cluster's refusal about one slot is neither a failure nor
		// a success. A call without error is a success: excluding it too
		// would keep a half-open breaker from ever closing again.
		IsExcluded: func(err error) bool { return err != nil && !isStoreFailure(classify(err)) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if name == "" {
				e.log.Warn("store circuit breaker changed state", "from", from.String(), "to", to.String())
			} else {
				e.log.Warn("store circuit breaker changed state", "from", from.String(), "to", to.String(), "redis_master", name)
			}
			now := time.Now().UnixNano()
			switch since := g.firstFailure.Load(); {
			case to == gobreaker.StateOpen:
				byErrors := !g.lastTimeout.Load()
				if since == 0 || byErrors {
					since = now
				}
				g.byErrors.Store(byErrors)
				g.stallSince.Store(since)
				g.stallProbe.Store(now)
			case to == gobreaker.StateClosed:
				g.stallSince.Store(0)
			}
			g.state.Store(int32(to))
			if e.metrics != nil {
				e.metrics.setBreakers(e.breakerSummary())
			}
		},
	})
}

// guardFor is the guard of domain d, made on first use (a partitioned
// store's).
func (e *Enforcer) guardFor(d int) *guard {
	if gs := *e.guards.Load(); d >= 0 && d < len(gs) && gs[d] != nil {
		return gs[d]
	}
	if d < 0 {
		return &e.main
	}
	e.guardMu.Lock()
	defer e.guardMu.Unlock()
	gs := *e.guards.Load()
	if d < len(gs) && gs[d] != nil {
		return gs[d]
	}
	next := make([]*guard, max(len(gs), d+1))
	copy(next, gs)
	g := &guard{}
	e.initGuard(g, d, e.domains.DomainName(d))
	next[d] = g
	e.guards.Store(&next)
	return g
}

// active reports whether g's state counts in the breaker's metric and
// BreakerState: always for a standalone Redis; on a Cluster unless no
// check has reached g for idleGuard.
func (e *Enforcer) active(g *guard, now int64) bool {
	return e.domains == nil || now-g.used.Load() < int64(idleGuard)
}

// breakerSummary is the worst state of the active guards (open, then
// half-open, then closed), and how many are open.
func (e *Enforcer) breakerSummary() (worst gobreaker.State, open int) {
	now := time.Now().UnixNano()
	for _, g := range *e.guards.Load() {
		if g == nil || !e.active(g, now) {
			continue
		}
		s := gobreaker.State(g.state.Load())
		if s == gobreaker.StateOpen {
			open++
		}
		if rank(s) > rank(worst) {
			worst = s
		}
	}
	return worst, open
}

func rank(s gobreaker.State) int {
	switch s {
	case gobreaker.StateOpen:
		return 2
	case gobreaker.StateHalfOpen:
		return 1
	}
	return 0
}

// BreakerState is the store circuit breaker's state: "closed", "half-open"
// or "open". On a Redis Cluster, with a breaker per master, it is the worst
// of them (open if any is open), not counting a master no check has reached
// for 10 s.
func (e *Enforcer) BreakerState() string {
	if e.domains == nil {
		return e.main.breaker.State().String()
	}
	worst := gobreaker.StateClosed
	now := time.Now().UnixNano()
	for _, g := range *e.guards.Load() {
		if g == nil || !e.active(g, now) {
			continue
		}
		if s := g.breaker.State(); rank(s) > rank(worst) {
			worst = s
		}
	}
	return worst.String()
}

// loadOf is the load of domain d's Redis.
func (e *Enforcer) loadOf(d int) redisstore.Load {
	if e.domains == nil {
		return e.store.Load()
	}
	return e.domains.DomainLoad(d)
}

// lookEvery is the least time between two checks that go past an open
// breaker to look whether Redis is back (heardAgain): --timeout, at most
// 10 ms.
func (e *Enforcer) lookEvery() int64 { return int64(min(e.cfg.Timeout, 10*time.Millisecond)) }

// heardAgain reports, for a check g's breaker refused (open, or half-open
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
// Redis is g's domain's: on a Cluster, its master.
func (e *Enforcer) heardAgain(g *guard) (pass, look bool) {
	since := g.stallSince.Load()
	if since == 0 {
		return false, false
	}
	heard := e.loadOf(g.domain).Answered.UnixNano()
	if g.byErrors.Load() {
		heard = g.lastOK.Load()
	}
	if heard > since {
		return true, false
	}
	now := time.Now().UnixNano()
	if now-g.stallProbe.Load() < e.lookEvery() || !g.looking.CompareAndSwap(false, true) {
		return false, false
	}
	g.stallProbe.Store(now) // the look is ours alone (looking)
	return true, true
}
