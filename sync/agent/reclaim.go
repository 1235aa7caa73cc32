package agent

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/apportion/apportion/sync/ledger"
)

// contribute submits a frozen incarnation's contributions to the registry,
// one batch per rule at a time (the ledger re-emits pending ones).
func (a *Agent) contribute(ctx context.Context, st *ruleState, cs []ledger.Contribution) {
	if st.contributing {
		return
	}
	st.contributing = true
	id := st.id
	cs = slices.Clone(cs)
	a.goOwned(func() {
		var recs []ledger.Record
		for _, c := range cs {
			cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
			rec, err := a.reg.Contribute(cctx, id, c)
			cancel()
			if err != nil {
				a.logs.Log(slog.LevelWarn, "contribute/"+id, "reclaim contribution failed; it is retried", logKeyRule, id, logKeyErr, err)
				continue
			}
			recs = append(recs, rec)
		}
		a.post(ctx, func(ctx context.Context) {
			st.contributing = false
			if a.rules[id] != st {
				return
			}
			b := &batch{}
			for _, rec := range recs {
				a.recorded(ctx, b, st, rec)
			}
			a.flush(ctx, b)
		})
	})
}

// closePredecessors records in the registry that this incarnation's marker
// is confirmed (the ledger repeats the request until it sees it recorded).
func (a *Agent) closePredecessors(ctx context.Context, st *ruleState, by ledger.Incarnation) {
	if st.closing {
		return
	}
	st.closing = true
	id := st.id
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		err := a.reg.Close(cctx, id, by)
		cancel()
		if err != nil {
			a.logs.Log(slog.LevelWarn, "close/"+id, "recording the end of earlier incarnations failed; it is retried", logKeyRule, id, logKeyErr, err)
		}
		a.post(ctx, func(ctx context.Context) { st.closing = false })
	})
}

func (a *Agent) recorded(ctx context.Context, b *batch, st *ruleState, rec ledger.Record) {
	if st.led == nil {
		return
	}
	if rec.Complete {
		k := st.id + "/" + rec.Of.Region + "/" + fmt.Sprint(rec.Of.Inc)
		if !a.reclaimed[k] {
			for _, r := range rec.Recipients {
				if r == st.led.Incarnation() {
					a.reclaimed[k] = true
					a.m.reclaims.Inc()
					a.log.Info("reclaim recorded", logKeyRule, st.id, "of", fmt.Sprintf("%s/%d", rec.Of.Region, rec.Of.Inc))
				}
			}
		}
	}
	a.collect(ctx, b, st, st.led.ReclaimRecorded(a.now(), rec))
}

// pollRegistry reads every rule's registry and feeds changed ones to the ledgers.
func (a *Agent) pollRegistry(ctx context.Context) {
	if a.polling || time.Since(a.lastPoll) < a.cfg.RegistryPoll*time.Duration(1<<min(a.pollFails, 4)) {
		return
	}
	a.polling, a.lastPoll = true, time.Now()
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		recs, err := a.reg.Records(cctx)
		cancel()
		a.post(ctx, func(ctx context.Context) {
			a.polling = false
			if err != nil {
				a.pollFails++
				a.logs.Log(slog.LevelWarn, "registry-poll", "reading the reclaim registry failed", logKeyErr, err)
				return
			}
			a.pollFails = 0
			b := &batch{}
			for _, id := range slices.Sorted(maps.Keys(recs)) {
				st := a.rules[id]
				rr := recs[id]
				if st == nil || st.led == nil || rr.Revision == st.fedRev {
					continue
				}
				st.fedRev = rr.Revision
				for _, rec := range rr.Records {
					a.recorded(ctx, b, st, rec)
				}
			}
			a.flush(ctx, b)
		})
	})
}
