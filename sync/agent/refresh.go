package agent

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/redis/go-redis/v9"
)

// Record holds. Every share record but a Release one is written with a Hold
// (redisstore.ShareRecord.Hold): its key expires Hold after the write unless
// the agent writes it again. The ledger knows, per key, its last write, whether
// the store confirmed it, and when it was last sent (ledger.Ledger.Held);
// the agent writes each confirmed record that is not a Release record
// again, same version (the store re-applies an equal version: nothing
// changes but the TTL, and the bucket takes the rule's parameters of now),
// once half the Hold has passed since it was last sent, at most
// refreshBatch records per rule and tick, and tells the ledger
// (ledger.Ledger.Refreshed). A failed write is retried at the next tick,
// and one Redis answers with an error (one key's bad state fails the whole
// pipelined call) is written again one record at a time, so one key does
// not hold back the others. A record the store holds a newer version of is
// refused and changes nothing. A write not yet confirmed is not refreshed:
// the ledger sends it again every RetryWrite until it is, each time with
// the Hold.
//
// The agent keeps no per-key state for this (it kept a map of the records
// the store confirmed, 60-90 B per key held: BenchmarkAgent100kKeys); the
// ledger's key already holds the last write's units, version and time.
//
// Why this is safe: a key whose record is gone enforces the marker's
// default units (its base), so a held record must outlive its
// incarnation's marker. While the agent runs and its writes succeed, each
// held key is re-written at least every Hold/2 + Interval (with up to
// refreshBatch keys per tick falling due), counted from when its last
// write was sent: the store applied it then or later, or at most
// RetryWrite + StoreTimeout earlier when a resend overtook the answer that
// confirmed it, which the Hold's margin (Hold/2, at least 30 minutes by
// default) covers. The marker's lease ends at most Lease after its last
// renewal. An agent that dies renews neither: its records then last at
// least Hold/2 - Interval, more than Lease (recordHold keeps Hold >=
// 4(Lease + Interval + StoreTimeout)), so the marker has lapsed, and the
// store enforces the floor on every key, before any of its records
// expires. A new incarnation's marker floors the old records at once; they
// expire a Hold later. Not covered: a store that refuses every refresh of
// a key for Hold/2 while it accepts the marker's renewals (the same
// server; on a Cluster the same master), and eviction: a volatile-*
// maxmemory policy may now evict a held record, which then enforces its
// base (volatile-ttl evicts it only after every key closer to expiry).

// refreshBatch bounds the records one refresh call writes (per rule and tick).
const refreshBatch = 1024

// recordHold is the Hold of the agent's records: cfg.RecordHold, else
// DefaultRecordHold, and never below 4(Lease + Interval + StoreTimeout).
func recordHold(cfg Config) time.Duration {
	h := cfg.RecordHold
	if h == 0 {
		h = DefaultRecordHold
	}
	return max(h, 4*(cfg.Lease+cfg.Interval+cfg.StoreTimeout))
}

// recordHolds is a rule's refresh schedule.
type recordHolds struct {
	refreshing bool          // a refresh is in flight
	next       time.Duration // no record is due before (agent time, Agent.now); 0: look at the next tick
}

// holdRecords gives recs the agent's Hold.
func (a *Agent) holdRecords(recs []redisstore.ShareRecord) {
	h := recordHold(a.cfg)
	for i := range recs {
		recs[i].Hold = h
	}
}

// holdsAt reports whether v, the store's answer to a write of r, says it
// holds r at the version written.
func holdsAt(r redisstore.ShareRecord, v redisstore.WindowApplied) bool {
	return v.Need == 0 && v.Version == (redisstore.Version{Inc: r.Inc, Seq: r.Seq})
}

// refreshWrite writes recs with write. When Redis answered an error (a
// script's: one key's bad state fails the whole pipelined call), it writes
// them again one by one, so that one key does not keep every other from
// its refresh; a record whose write failed then has a zero answer. A
// failure to reach Redis is returned as it is.
func refreshWrite(recs []redisstore.ShareRecord, write func([]redisstore.ShareRecord) ([]redisstore.WindowApplied, error)) ([]redisstore.WindowApplied, error) {
	vs, err := write(recs)
	var rerr redis.Error
	if err == nil || len(recs) == 1 || !errors.As(err, &rerr) {
		return vs, err
	}
	vs = make([]redisstore.WindowApplied, len(recs))
	for i := range recs {
		if one, err := write(recs[i : i+1]); err == nil && len(one) == 1 {
			vs[i] = one[0]
		}
	}
	return vs, nil
}

// refreshHeld writes again, in the background, the held records (the
// ledger's: Held) last sent half the Hold ago, up to refreshBatch per rule
// (one call per rule at a time).
func (a *Agent) refreshHeld(ctx context.Context) {
	now := a.now()
	half := recordHold(a.cfg) / 2
	for _, st := range a.rules {
		l := st.Led
		if l == nil || st.holds.refreshing || now < st.holds.next {
			continue
		}
		var ws []ledger.Write
		next := time.Duration(math.MaxInt64)
		l.Held(func(name string, v ledger.Version, units int64, at time.Duration) bool {
			if at+half > now {
				next = min(next, at+half) // not due yet
				return true
			}
			if len(ws) == refreshBatch {
				next = now // past the batch: due now
				return false
			}
			ws = append(ws, ledger.Write{Key: name, Version: v, Units: units})
			return true
		})
		// a key written or refreshed from now on is due half a Hold later at
		// the earliest
		st.holds.next = min(next, now+half)
		if len(ws) == 0 {
			continue
		}
		recs, _ := driver.StoreWrites(ws, storeRule(st))
		a.holdRecords(recs)
		st.holds.refreshing = true
		a.goOwned(func() {
			vs, err := refreshWrite(recs, func(recs []redisstore.ShareRecord) ([]redisstore.WindowApplied, error) {
				cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
				defer cancel()
				return a.writeShares(cctx, st.ID, recs)
			})
			a.post(ctx, func(context.Context) {
				st.holds.refreshing = false
				if err != nil {
					st.holds.next = 0 // retried at the next tick
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "refresh-shares", "share record refresh failed; retrying at the next tick", logKeyRule, st.ID, logKeyErr, err)
					return
				}
				if st.Led != l {
					return // a new incarnation: the old records are at the floor
				}
				// only what the ledger still holds at that version is
				// renewed (Refreshed: a newer write replaced the rest);
				// refused ones stay due and come back at the next look,
				// at most half a Hold from the scan (st.holds.next)
				for i, r := range recs {
					if i < len(vs) && holdsAt(r, vs[i]) {
						l.Refreshed(r.Key, ledger.Version{Inc: r.Inc, Seq: r.Seq}, now)
					}
				}
			})
		})
	}
}
