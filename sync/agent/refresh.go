package agent

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
	"github.com/redis/go-redis/v9"
)

// Record holds. Every share record but a Release one is written with a Hold
// (redisstore.ShareRecord.Hold): its key expires Hold after the write unless
// the agent writes it again. The agent keeps, per rule, the last record the
// store confirmed holding for each key (the version it wrote) and writes it
// again, same version (the store re-applies an equal version: nothing
// changes but the TTL), once half the Hold has passed since, at most
// refreshBatch records per rule and tick; a failed write is retried at the
// next tick, and one Redis answers with an error (one key's bad state fails
// the whole pipelined call) is written again one record at a time, so one
// key does not hold back the others. A record the store holds a newer
// version of is refused and changes nothing.
//
// Why this is safe: a key whose record is gone enforces the marker's
// default units (its base), so a held record must outlive its
// incarnation's marker. While the agent runs and its writes succeed, each
// held key is re-written at least every Hold/2 + Interval (with up to
// refreshBatch keys per tick falling due); the marker's lease ends at most
// Lease after its last renewal. An agent that dies renews neither: its
// records then last at least Hold/2 - Interval, more than Lease
// (recordHold keeps Hold >= 4(Lease + Interval + StoreTimeout)), so the
// marker has lapsed, and the store enforces the floor on every key, before
// any of its records expires. A new incarnation's marker floors the old
// records at once; they expire a Hold later. Not covered: a store that
// refuses every refresh of a key for Hold/2 while it accepts the marker's
// renewals (the same server; on a Cluster the same master), and eviction:
// a volatile-* maxmemory policy may now evict a held record, which then
// enforces its base (volatile-ttl evicts it only after every key closer to
// expiry).

// minRecordHold is the least Hold the agent gives its records.
const minRecordHold = time.Hour

// refreshBatch bounds the records one refresh call writes (per rule and tick).
const refreshBatch = 1024

// recordHold is the Hold of the agent's records: cfg.RecordHold, else
// minRecordHold, and never below 4(Lease + Interval + StoreTimeout).
func recordHold(cfg Config) time.Duration {
	h := cfg.RecordHold
	if h == 0 {
		h = minRecordHold
	}
	return max(h, 4*(cfg.Lease+cfg.Interval+cfg.StoreTimeout))
}

// recordHolds is a rule's records to write again.
type recordHolds struct {
	held       map[string]heldRecord    // by key: the store confirmed it
	tmpls      []redisstore.ShareRecord // the records' templates (heldRecord.tmpl)
	refreshing bool                     // a refresh is in flight
	next       time.Time                // no record is due before (zero: none held)
}

// maxTemplates bounds tmpls before it is compacted to the templates in use
// (a template per rule setting and incarnation: a new one only when the
// rule's parameters change).
const maxTemplates = 64

// template returns the index of t in h.tmpls, adding it if it is not there.
func (h *recordHolds) template(t redisstore.ShareRecord) uint32 {
	for i := len(h.tmpls) - 1; i >= 0; i-- { // the newest first: the likeliest
		if h.tmpls[i] == t {
			return uint32(i)
		}
	}
	if len(h.tmpls) >= maxTemplates {
		h.compact()
	}
	h.tmpls = append(h.tmpls, t)
	return uint32(len(h.tmpls) - 1)
}

// compact drops the templates no held record uses (one pass over them).
func (h *recordHolds) compact() {
	used := make([]int, len(h.tmpls)) // old index -> new index + 1
	var keep []redisstore.ShareRecord
	for k, r := range h.held {
		if used[r.tmpl] == 0 {
			keep = append(keep, h.tmpls[r.tmpl])
			used[r.tmpl] = len(keep)
		}
		r.tmpl = uint32(used[r.tmpl] - 1)
		h.held[k] = r
	}
	h.tmpls = keep
}

// clear forgets every record held.
func (h *recordHolds) clear() {
	clear(h.held)
	h.tmpls = nil
}

// dueBy lowers next to t.
func (h *recordHolds) dueBy(t time.Time) {
	if h.next.IsZero() || t.Before(h.next) {
		h.next = t
	}
}

// heldRecord is a record the store confirmed and when it was last written,
// compact (one per key held, so its size counts per key: 24 bytes, a map
// entry of 40 with the key): what the records of one write differ in
// (units, version) and the index of a template shared by the records of
// that write for the rest (the rule's parameters, the incarnation, the
// Hold), and the time of the write in whole seconds since the agent's
// start, rounded down (a record is then refreshed up to a second early,
// never late).
type heldRecord struct {
	seq   uint64
	units int64
	at    uint32 // seconds since the agent's start (heldAt)
	tmpl  uint32 // index in recordHolds.tmpls; Key, Seq and Units zero
}

// heldAt is t, a time since the agent's start, in heldRecord.at's unit.
func heldAt(t time.Duration) uint32 { return uint32(min(t/time.Second, math.MaxUint32)) }

// since is h.at as a time since the agent's start.
func (h heldRecord) since() time.Duration { return time.Duration(h.at) * time.Second }

// record returns the record held for key.
func (h *recordHolds) record(key string, r heldRecord) redisstore.ShareRecord {
	rec := h.tmpls[r.tmpl]
	rec.Key, rec.Seq, rec.Units = key, r.seq, r.units
	return rec
}

// holdRecords gives recs the agent's Hold.
func (a *Agent) holdRecords(recs []redisstore.ShareRecord) {
	h := recordHold(a.cfg)
	for i := range recs {
		recs[i].Hold = h
	}
}

// noteHeld records what the store answered to st's writes of recs (under
// applyWrites' lock, while the loop goroutine waits for it): a record it
// holds at the written version is held (a Release record no longer),
// written at.
func (a *Agent) noteHeld(st *ruleState, recs []redisstore.ShareRecord, vs []redisstore.WindowApplied, at time.Time) {
	if st.holds.held == nil {
		st.holds.held = map[string]heldRecord{}
	}
	st.holds.dueBy(at.Add(recordHold(a.cfg) / 2))
	since := heldAt(at.Sub(a.start))
	var tmpl redisstore.ShareRecord
	ti := -1
	for i, r := range recs {
		if i >= len(vs) || !holdsAt(r, vs[i]) {
			continue
		}
		if r.Release {
			delete(st.holds.held, r.Key)
			continue
		}
		t := r
		t.Key, t.Seq, t.Units = "", 0, 0
		if ti < 0 || tmpl != t {
			tmpl, ti = t, int(st.holds.template(t))
		}
		st.holds.held[r.Key] = heldRecord{tmpl: uint32(ti), seq: r.Seq, units: r.Units, at: since}
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

// refreshHeld writes again, in the background, the held records whose last
// write is half the Hold old, up to refreshBatch per rule (one call per
// rule at a time).
func (a *Agent) refreshHeld(ctx context.Context) {
	now := time.Now()
	half := recordHold(a.cfg) / 2
	due := now.Add(-half)
	for _, st := range a.rules {
		if st.Led == nil || st.holds.refreshing || len(st.holds.held) == 0 || now.Before(st.holds.next) {
			continue
		}
		var recs []redisstore.ShareRecord
		st.holds.next = time.Time{}
		for k, h := range st.holds.held {
			if at := a.start.Add(h.since()); !at.After(due) && len(recs) < refreshBatch {
				recs = append(recs, st.holds.record(k, h))
			} else {
				st.holds.dueBy(at.Add(half)) // not due yet, or past the batch (due now)
			}
		}
		if len(recs) == 0 {
			continue
		}
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
					st.holds.dueBy(time.Now()) // retried at the next tick
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "refresh-shares", "share record refresh failed; retrying at the next tick", logKeyRule, st.ID, logKeyErr, err)
					return
				}
				// only what is still held at that version is renewed (a
				// newer write or a new incarnation replaced the rest)
				for i, r := range recs {
					if h, ok := st.holds.held[r.Key]; ok && st.holds.tmpls[h.tmpl].Inc == r.Inc && h.seq == r.Seq && i < len(vs) && holdsAt(r, vs[i]) {
						h.at = heldAt(now.Sub(a.start))
						st.holds.held[r.Key] = h
					}
				}
				st.holds.dueBy(now.Add(half)) // refused ones are due then too, if still held
			})
		})
	}
}
