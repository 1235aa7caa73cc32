package agent

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

func (a *Agent) loop(ctx context.Context) {
	defer a.wg.Done()
	tick := time.NewTicker(a.cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case rs := <-a.rulesCh:
			a.setRules(rs)
		case m := <-a.reports:
			a.receive(ctx, m)
		case fn := <-a.results:
			fn(ctx)
		case <-tick.C:
			a.tick(ctx)
		}
	}
}

// batch collects the outputs of ledger calls until they are applied.
type batch struct {
	writes  map[*ruleState][]ledger.Write
	reports []wire.RuleReport
}

func (a *Agent) collect(ctx context.Context, b *batch, st *ruleState, out ledger.Output) {
	if st.led == nil {
		return
	}
	if len(out.Writes) > 0 {
		if b.writes == nil {
			b.writes = map[*ruleState][]ledger.Write{}
		}
		b.writes[st] = append(b.writes[st], out.Writes...)
	}
	if out.Report != nil {
		b.reports = append(b.reports, wire.RuleReport{Rule: st.id, Report: *out.Report})
	}
	if len(out.Contributions) > 0 {
		a.contribute(ctx, st, out.Contributions)
	}
	if out.Close != (ledger.Incarnation{}) {
		a.closePredecessors(ctx, st, out.Close)
	}
	if out.Fenced {
		a.fence(ctx, st)
	}
}

// flush applies the batch's writes, feeds the confirmations back and
// publishes the reports.
func (a *Agent) flush(ctx context.Context, b *batch) {
	for len(b.writes) > 0 {
		writes := b.writes
		b.writes = nil
		res := a.applyWrites(ctx, writes)
		now := a.now()
		for _, st := range slices.SortedFunc(maps.Keys(res), func(x, y *ruleState) int { return strings.Compare(x.id, y.id) }) {
			if st.led == nil {
				continue
			}
			holdRefused(st, now, res[st])
			cs := make([]ledger.Confirmation, len(res[st]))
			for i, ap := range res[st] {
				cs[i] = ledger.Confirmation{Key: ap.key, Version: ap.v}
			}
			// One report for the whole batch, not one per confirmed key.
			a.collect(ctx, b, st, st.led.SharesApplied(now, cs))
		}
	}
	a.publish(b.reports)
	b.reports = nil
}

func (a *Agent) publish(rs []wire.RuleReport) {
	if len(rs) == 0 {
		return
	}
	parts, err := wire.EncodeSplit(wire.Message{From: a.cfg.Region, Rules: rs}, int(a.nc.MaxPayload())-wire.Overhead)
	if err != nil {
		a.logs.Log(slog.LevelError, "encode", "cannot encode reports", logKeyErr, err)
		return
	}
	for _, p := range parts {
		if a.cfg.Signer != nil {
			p = a.cfg.Signer.Seal(p)
		}
		if err := a.nc.Publish(ReportSubject(a.cfg.Region), p); err != nil {
			a.logs.Log(slog.LevelWarn, "publish", "report publish failed (the ledger tolerates loss)", logKeyErr, err)
			continue
		}
		a.m.reports.WithLabelValues("sent").Inc()
		a.m.bytes.WithLabelValues("sent").Add(float64(len(p)))
	}
}

// tick runs one interval: run id, usage, ledger ticks, writes, reports.
func (a *Agent) tick(ctx context.Context) {
	t0 := time.Now()
	b := &batch{}
	a.checkRunID(ctx, b)
	now := a.now()
	a.usageMu.Lock()
	pending := a.usage
	a.usage = make(map[bucketID]usageCounts, len(pending))
	a.usageMu.Unlock()
	for id, c := range pending {
		if st := a.rules[id.rule]; st != nil && st.led != nil {
			st.led.Usage(now, id.key, usageRate(st.rule), c.admitted, c.rejected)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(a.rules)) {
		st := a.rules[id]
		if st.led == nil {
			a.maybeStart(ctx, st)
			continue
		}
		a.collect(ctx, b, st, st.led.Tick(now))
	}
	a.flush(ctx, b)
	a.pollRegistry(ctx)
	a.publishSnapshot()
	a.m.tickDuration.Observe(time.Since(t0).Seconds())
}

func (a *Agent) checkRunID(ctx context.Context, b *batch) {
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
		now := a.now()
		for _, rid := range slices.Sorted(maps.Keys(a.rules)) {
			if st := a.rules[rid]; st.led != nil {
				a.collect(ctx, b, st, st.led.StoreReset(now, id))
			}
		}
	}
	a.runID = id
	a.ready.Store(a.everRules)
}
