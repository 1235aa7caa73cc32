package agent

import (
	"context"
	"log/slog"
	"sync"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/prometheus/client_golang/prometheus"
)

// writeChunk bounds the share records of one store call. A call holds, until
// it returns, its records (128 B each) and what the Redis store allocates
// for them, go-redis's command and arguments for each: 915 B per record
// (BenchmarkWriteShares in regional/redisstore, 3.7 MB a call of 4,096);
// the time per record is the same at 256, 1,024 and 4,096 records a call
// (Redis's script time, 10-13 µs).
const writeChunk = 1024

// applyWrites runs every rule's writes on the store, rules in parallel.
func (a *Agent) applyWrites(ctx context.Context, writes map[*driver.Rule][]ledger.Write) map[*driver.Rule]driver.Applied {
	type job struct {
		st *ruleState
		ws []ledger.Write
		sr driver.StoreRule
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
			stats := st.Led.Stats()
			addNew(a.m.gifts, stats.Lowered, &st.lowered)
			addNew(a.m.paced, stats.Paced, &st.paced)
			// A renewal answered with no marker under the store's run id:
			// its data was flushed, or the marker deleted or evicted. The
			// ledger re-asserts every share and creates the marker anew;
			// these writes are that.
			if n := stats.MarkerLost; n > st.lost {
				a.m.storeResets.WithLabelValues(ResetMarkerLost).Add(float64(n - st.lost))
				st.lost = n
				a.log.Warn("the store lost this rule's marker with its run id unchanged (FLUSHALL or FLUSHDB, the key deleted, or evicted: see maxmemory-policy); re-asserting every share and creating the marker anew",
					logKeyRule, st.ID, "run_id", a.runID)
			}
		}
		jobs = append(jobs, job{st: st, ws: ws, sr: storeRule(st)})
	}
	began := a.now() // the markers' flush (lapse.go)
	out := make(map[*driver.Rule]driver.Applied, len(jobs))
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, writeWorkers)
	for _, j := range jobs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			// A confirmation per write, allocated once for the flush.
			res := driver.Applied{Confirmations: make([]ledger.Confirmation, 0, len(j.ws))}
			var markers []redisstore.Marker
			// The records in chunks of writeChunk, in the ledger's order,
			// through one buffer: only one chunk's store records exist at
			// a time (a tick writing every key held them all, about 130 B
			// per key; a buffer per chunk left them all to the next GC). The
			// store does not keep recs past its call. A failed call ends
			// the rule's writes for this flush: the ledger retries what
			// was not confirmed.
			var buf []redisstore.ShareRecord
			for ws := j.ws; len(ws) > 0; {
				n := min(len(ws), writeChunk)
				recs, ms := driver.AppendStoreWrites(buf[:0], ws[:n], j.sr)
				buf = recs
				ws = ws[n:]
				markers = append(markers, ms...)
				if len(recs) == 0 {
					continue
				}
				a.holdRecords(recs)
				cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
				vs, err := a.writeShares(cctx, j.st.ID, recs)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-shares", "share writes failed; the ledger retries them", logKeyRule, j.st.ID, logKeyErr, err)
					for _, w := range ws { // the markers still go: the lease depends on them
						if w.Key == ledger.MarkerKey {
							_, ms := driver.StoreWrites([]ledger.Write{w}, j.sr)
							markers = append(markers, ms...)
						}
					}
					break
				}
				res.Add(recs, vs, nil)
			}
			var mvs []redisstore.Version
			for _, m := range markers {
				cctx, cancel := context.WithTimeout(ctx, a.cfg.StoreTimeout)
				sent := a.now()
				v, err := a.store.WriteMarker(cctx, j.st.ID, m)
				a.markerWritten(j.st, m, began, sent, a.now(), v, err) // lapse.go
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-marker", "marker write failed", logKeyRule, j.st.ID, logKeyErr, err)
					continue
				}
				mvs = append(mvs, v)
			}
			res.Add(nil, nil, mvs)
			mu.Lock()
			out[j.st.Rule] = res
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

// addNew adds to c what the ledger's count n has grown since *counted
// (a ledger's Stats count from 0 for its incarnation: ruleState.newLedger).
func addNew(c prometheus.Counter, n uint64, counted *uint64) {
	if n > *counted {
		c.Add(float64(n - *counted))
		*counted = n
	}
}
