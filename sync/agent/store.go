package agent

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
)

// applyWrites runs every rule's writes on the store, rules in parallel.
func (a *Agent) applyWrites(ctx context.Context, writes map[*driver.Rule][]ledger.Write) map[*driver.Rule]driver.Applied {
	type job struct {
		st      *ruleState
		recs    []redisstore.ShareRecord
		markers []redisstore.Marker
	}
	var jobs []job
	for r, ws := range writes {
		st := a.state(r)
		if st == nil {
			continue
		}
		// Gifts: the ledger counts its writes that lowered a key (no
		// per-key state here, which would grow with the keys ever seen).
		if st.Led != nil {
			if n := st.Led.Stats().Lowered; n > st.lowered {
				a.m.gifts.Add(float64(n - st.lowered))
				st.lowered = n
			}
		}
		j := job{st: st}
		j.recs, j.markers = driver.StoreWrites(ws, storeRule(st))
		a.holdRecords(j.recs)
		jobs = append(jobs, j)
	}
	out := make(map[*driver.Rule]driver.Applied, len(jobs))
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, writeWorkers)
	for _, j := range jobs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			var vs []redisstore.WindowApplied
			var mvs []redisstore.Version
			if len(j.recs) > 0 {
				cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
				var err error
				vs, err = a.writeShares(cctx, j.st.ID, j.recs)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-shares", "share writes failed; the ledger retries them", logKeyRule, j.st.ID, logKeyErr, err)
				}
			}
			for _, m := range j.markers {
				cctx, cancel := context.WithTimeout(ctx, a.cfg.StoreTimeout)
				v, err := a.store.WriteMarker(cctx, j.st.ID, m)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-marker", "marker write failed", logKeyRule, j.st.ID, logKeyErr, err)
					continue
				}
				mvs = append(mvs, v)
			}
			res := driver.Confirmations(j.recs, vs, mvs)
			mu.Lock()
			a.noteHeld(j.st, j.recs, vs, time.Now())
			out[j.st.Rule] = res
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}
