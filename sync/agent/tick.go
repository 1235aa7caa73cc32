package agent

import (
	"context"
	"log/slog"
	"time"

	"github.com/apportion/apportion/sync/driver"
)

func (a *Agent) loop(ctx context.Context) {
	defer a.wg.Done()
	tick := time.NewTicker(a.cfg.Interval)
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
		case <-tick.C:
			a.tick(ctx)
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
	// The inbox's budget: the largest report published lately, decaying by
	// 1/64 a tick (a full report every FullEvery ticks keeps it up).
	peak := a.peakPublished.Load()
	a.peakPublished.Store(max(peak-peak/64, a.published))
	a.published = 0
	a.refreshHeld(ctx)
	a.pollRegistry(ctx)
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
		a.drv.StoreReset(id)
	}
	a.runID = id
	a.ready.Store(a.everRules)
}
