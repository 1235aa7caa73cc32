package agent

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/ledger"
)

type applied struct {
	key   string
	v     ledger.Version
	need  int64         // a refused window record: the fewest units the key can take (Ledger.Hold)
	until time.Duration // and for how long
}

// applyWrites runs every rule's writes on the store, rules in parallel.
func (a *Agent) applyWrites(ctx context.Context, writes map[*ruleState][]ledger.Write) map[*ruleState][]applied {
	type job struct {
		st      *ruleState
		recs    []redisstore.ShareRecord
		markers []redisstore.Marker
	}
	var jobs []job
	for st, ws := range writes {
		if st.led == nil {
			continue
		}
		j := job{st: st}
		for _, w := range ws {
			if w.Key == ledger.MarkerKey {
				j.markers = append(j.markers, redisstore.Marker{Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
					Lease: w.Lease.Truncate(time.Millisecond), Create: w.Create, RunID: w.RunID})
				continue
			}
			if prev, ok := st.written[w.Key]; ok && w.Units < prev && !w.Release {
				a.m.gifts.Inc()
			}
			st.written[w.Key] = w.Units
			j.recs = append(j.recs, shareRecord(st, w))
		}
		jobs = append(jobs, j)
	}
	out := make(map[*ruleState][]applied, len(jobs))
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, writeWorkers)
	for _, j := range jobs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			var res []applied
			if len(j.recs) > 0 {
				cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
				vs, err := a.writeShares(cctx, j.st.id, j.recs)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-shares", "share writes failed; the ledger retries them", logKeyRule, j.st.id, logKeyErr, err)
				}
				for i, v := range vs {
					if i < len(j.recs) {
						res = append(res, applied{j.recs[i].Key, ledger.Version{Inc: v.Version.Inc, Seq: v.Version.Seq}, v.Need, v.Until})
					}
				}
			}
			for _, m := range j.markers {
				cctx, cancel := context.WithTimeout(ctx, a.cfg.StoreTimeout)
				v, err := a.store.WriteMarker(cctx, j.st.id, m)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-marker", "marker write failed", logKeyRule, j.st.id, logKeyErr, err)
					continue
				}
				res = append(res, applied{key: ledger.MarkerKey, v: ledger.Version{Inc: v.Inc, Seq: v.Seq}})
			}
			mu.Lock()
			out[j.st] = res
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}
