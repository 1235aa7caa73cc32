package agent

import (
	"context"
	"log/slog"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/driver"
)

func (a *Agent) loop(ctx context.Context) {
	defer a.wg.Done()
	tick := time.NewTimer(time.Until(nextTick(time.Now(), a.cfg.Interval)))
	defer tick.Stop()
	// The store's run id at once, so that a rule that arrives starts its
	// incarnation then (setRules), not an interval later.
	a.checkRunID(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case rs := <-a.rulesCh:
			a.setRules(rs)
		case <-a.inbox.ready:
			if q, ok := a.inbox.pop(); ok {
				a.receive(q)
			}
		case fn := <-a.results:
			fn(ctx)
		case m := <-a.ownCh:
			a.ownReport(m)
		case <-tick.C:
			a.tick(ctx)
			tick.Reset(time.Until(nextTick(time.Now(), a.cfg.Interval)))
		}
	}
}

// tick runs one interval: run id, usage, the driver's tick (ledger ticks,
// writes, reports), the registry poll.
func (a *Agent) tick(ctx context.Context) {
	t0 := time.Now()
	a.checkRunID(ctx)
	a.usageMu.Lock()
	pending := a.usage
	a.usage = pending.next()
	a.usageMu.Unlock()
	if a.usageLate(t0) {
		a.drv.UsageLate() // lateusage.go
	}
	// Straight from the interval's maps: no slice of every key.
	a.drv.TickFrom(func(yield func(driver.Usage) bool) {
		for rule, ks := range pending.rules {
			st := a.rules[rule]
			if st == nil {
				continue
			}
			rate := usageRate(st.rule)
			for k, c := range ks {
				if !yield(driver.Usage{Rule: rule, Key: k, Rate: rate, Admitted: c.admitted, Rejected: c.rejected}) {
					return
				}
			}
		}
	})
	// The inbox's budget: the most bytes published in one tick lately,
	// decaying by 1/64 a tick (a full report every FullEvery ticks keeps it
	// up).
	peak := a.peakPublished.Load()
	a.peakPublished.Store(max(peak-peak/64, a.published))
	a.published = 0
	a.refreshHeld(ctx)
	a.renewWitness(ctx)
	a.pollRegistry(ctx)
	a.collectMarkers(ctx)
	a.publishSnapshot()
	a.m.tickDuration.Observe(time.Since(t0).Seconds())
}

// checkRunID reads the store's run id; when it changed (Redis restarted
// empty) the ledgers re-assert every share in the tick's flush.
func (a *Agent) checkRunID(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
	id, err := a.store.RunID(cctx)
	cancel()
	if err != nil || id == "" {
		a.m.storeErrors.Inc()
		a.logs.Log(slog.LevelWarn, "run-id", "cannot read the store's run id", logKeyErr, err)
		return
	}
	if id == a.runID {
		return
	}
	if a.runID != "" {
		a.log.Warn("store run id changed (Redis restarted); re-asserting every share", "old", a.runID, "new", id)
		a.m.storeResets.WithLabelValues(ResetRunID).Inc()
		a.drv.StoreReset(id)
	}
	a.runID = id
	a.ready.Store(a.everRules)
}

// nextTick is when the loop ticks next after now: at the next multiple of
// interval on the wall clock, moved on to the middle between two of the
// enforcers' usage flushes (usage.NextFlush: multiples of
// usage.DefaultInterval), if interval is at least that long. Every
// interval then holds the same number of flushes (one at the default
// 100 ms; two or three, in turn, at 250 ms, each interval as long as its
// flushes), where a ticker started at an arbitrary instant let an
// enforcer's flush land on either side of a tick, by a few ms of
// scheduling: an interval with none, and the next with two. A tick that
// runs late skips to the next slot, as a ticker drops ticks.
func nextTick(now time.Time, interval time.Duration) time.Time {
	t := usage.NextFlush(now, interval) // the next multiple of interval
	const p, off = usage.DefaultInterval, usage.DefaultInterval / 2
	if interval < p {
		return t
	}
	// The first instant at or after t that is off past a multiple of p.
	return t.Add((off - t.Sub(t.Truncate(p)) + p) % p)
}
