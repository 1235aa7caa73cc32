package agent

import (
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
)

// Marker lapses: while the agent runs an incarnation, the ledger renews its
// marker every interval with a lease (at most Lease, shorter when its lease
// deadline is near); the store keeps the marker in force for that lease from
// applying the write, on the store's clock. A renewal that applies only
// after the held lease ran out leaves a gap in which every key of the rule
// enforces its floor (the enforcers answer limit 0) with no fence: the
// ledger never learns of it. The agent watches for it here:
// apportion_sync_marker_lapses_total{cause} counts each lease that ran out
// before a renewal was confirmed (once per lease), a WARN log names the
// rule, how late, and the likely cause (at most once per 10 s per rule and
// cause), and apportion_sync_marker_margin_seconds is the smallest lease
// left at a renewal lately.
//
// The clock: WriteMarker returns only the version the store holds, not the
// store's clock, so the times are the agent's monotonic clock (Agent.now)
// around each call. A write applied at some instant of [sent, done], so its
// lease ends within [sent+lease, done+lease] (both clocks' rate errors add
// at most 2ρ of the lease: NTP slews by 0.05% at most, 1.5 ms on 3 s; a step
// of the Redis host's wall clock, TIME, is not seen). A lapse is counted
// when a renewal's answer, applied or not, comes after the latest end of the
// held lease: the marker had lapsed, unless Redis applied the renewal in
// time and only its answer was slow (sent after that end, it is certain;
// sent before it, the store took longer than the lease left, which in a
// region is its queue, not the way back). The cause is deadline if the held
// lease was shorter than an interval and a store call (Interval +
// StoreTimeout): the ledger granted a lease it knew would end before its
// next renewal could land, which only its lease deadline makes it do (its
// peers' acknowledgements stopped: a partition, heavy loss; with them on
// time a lease is near half of Lease or more, see sync/ledger's doc,
// Heartbeats), and no renewal could have kept the marker; else late if the
// flush of the first renewal after the held write began after that end
// (the loop), else store (the store calls of the flush: the rule's share
// writes go before its marker). A call that failed (a timeout) is taken as not
// applied: Redis may still run a command it had read (the error shows in
// apportion_sync_store_errors_total). The margin is the earliest end of the
// held lease minus the renewal's answer: a lower bound of the lease left
// when the renewal applied, by at most the two writes' round trips, so it
// may dip below 0 for a lapse of less than that which is not counted.

// Causes of apportion_sync_marker_lapses_total.
const (
	// LapseLate: the flush of the first renewal after the held one began
	// after the lease had run out: the agent's loop was too slow.
	LapseLate = "late"
	// LapseStore: a renewal's flush began in time, but no renewal was
	// confirmed before the lease ran out: the store failed (a timeout, an
	// error), was too slow (the rule's share writes, which go first, or the
	// marker's), or a Redis Cluster fan-out was still running.
	LapseStore = "store"
	// LapseDeadline: the held lease was shorter than an interval and a
	// store call, as only the ledger's lease deadline makes it (its peers'
	// acknowledgements stopped: a partition, heavy loss). A region holding
	// more than its floor fences next; one at its floor carries on at it.
	LapseDeadline = "deadline"
)

var lapseCauses = []string{LapseLate, LapseStore, LapseDeadline}

// Causes of apportion_sync_store_resets_total.
const (
	// ResetRunID: the store's run id changed (Redis restarted, or a
	// failover put another server behind the address).
	ResetRunID = "run_id"
	// ResetMarkerLost: a rule's confirmed marker was gone under the same
	// run id (sync/ledger, Stats.MarkerLost).
	ResetMarkerLost = "marker_lost"
)

// marginWindow is the span of each of the two windows the margin gauge
// keeps: it reports the smallest margin of the last 15 to 30 s, so that a
// scrape every 15 s sees every renewal's.
const marginWindow = 15 * time.Second

// markerWrite is one marker write as the agent saw it.
type markerWrite struct {
	v redisstore.Version
	// Agent.now when the flush that wrote it began (its rule's share
	// writes go first), before the call, and at its answer
	began, sent, done time.Duration
	lease             time.Duration
}

// markerTrack is what the agent knows of a rule's marker lease (loop
// state, written by the rule's write goroutine of a flush).
type markerTrack struct {
	held    markerWrite   // the last write known applied (zero v: none watched)
	lapsed  bool          // held's lease ran out and that was counted
	tried   bool          // a renewal after held has not applied (yet)
	triedAt time.Duration // when the flush of the first of them began
	// pending are renewals answered without error and without applying: a
	// Redis Cluster's fan-out goes on past the call, and its copies' lease
	// was anchored within the call (redisstore, writeMarkerCluster).
	pending [4]markerWrite
	next    int
	// short: a held lease below it lapses by the ledger's deadline
	// (Interval + StoreTimeout; 0: never)
	short time.Duration
}

// markerLapse is a lapse found at a renewal's answer.
type markerLapse struct {
	cause string
	late  time.Duration // the answer came this long after the lease's latest end
	call  time.Duration // the renewal's call, sent to answered
	lease time.Duration // the lapsed lease
	gap   time.Duration // since the held write was sent
}

// markerOutcome is what one marker write tells.
type markerOutcome struct {
	margin    time.Duration // lease left at the answer, lower bound
	hasMargin bool
	lapse     *markerLapse
}

// wrote records w (a renewal unless create), answered with the version the
// store holds (got) or err, and returns what it tells of the lease.
func (t *markerTrack) wrote(w markerWrite, create bool, got redisstore.Version, err error) markerOutcome {
	applied := err == nil && got == w.v
	if create || t.held.v == (redisstore.Version{}) || t.held.v.Inc != w.v.Inc || t.held.lease <= 0 {
		// Nothing to compare with. A Create starts the watch afresh: the
		// ledger creates the marker anew when a lapse is its own doing (a
		// new incarnation after a fence, its lease deadline passed, a store
		// reset), which apportion_sync_fenced and the store's run id show;
		// a zero lease granted nothing.
		switch {
		case applied:
			*t = markerTrack{held: w, short: t.short}
		case create:
			*t = markerTrack{short: t.short}
		}
		return markerOutcome{}
	}
	var now *markerWrite // the write the store now holds, if newer than held
	switch {
	case applied:
		now = &w
	case err == nil && t.held.v.Less(got):
		for i := range t.pending {
			if t.pending[i].v == got {
				p := t.pending[i]
				now = &p
			}
		}
	}
	if err == nil && !applied {
		t.pending[t.next] = w
		t.next = (t.next + 1) % len(t.pending)
	}
	end, endMin := t.held.done+t.held.lease, t.held.sent+t.held.lease
	out := markerOutcome{margin: endMin - w.done, hasMargin: true}
	first := w.began
	if t.tried {
		first = t.triedAt
	}
	if !t.tried && !applied {
		t.tried, t.triedAt = true, w.began
	}
	// The answer that confirms the write now held (a pending one's anchor
	// was read within its own call), or w's.
	conf := w.done
	if now != nil {
		conf = now.done
	}
	if !t.lapsed && conf > end {
		cause := LapseStore
		switch {
		case t.held.lease < t.short:
			cause = LapseDeadline
		case first > end:
			cause = LapseLate
		}
		out.lapse = &markerLapse{cause: cause, late: conf - end, call: w.done - w.sent, lease: t.held.lease, gap: w.sent - t.held.sent}
		t.lapsed = true
	}
	if now != nil {
		t.held, t.lapsed = *now, false
		t.tried = !applied // an earlier write applied, w not (yet)
		t.triedAt = w.began
		for i := range t.pending {
			if !t.held.v.Less(t.pending[i].v) {
				t.pending[i] = markerWrite{}
			}
		}
	}
	return out
}

// markerWritten records a marker write of st's rule (on the rule's write
// goroutine of a flush): the margin gauge, and a lapse's count and log.
func (a *Agent) markerWritten(st *ruleState, m redisstore.Marker, began, sent, done time.Duration, got redisstore.Version, err error) {
	st.marker.short = a.cfg.Interval + a.cfg.StoreTimeout
	o := st.marker.wrote(markerWrite{v: m.Version(), began: began, sent: sent, done: done, lease: m.Lease}, m.Create, got, err)
	if o.hasMargin {
		a.m.margin.observe(time.Now(), o.margin.Seconds())
	}
	lp := o.lapse
	if lp == nil {
		return
	}
	a.m.markerLapses.WithLabelValues(lp.cause).Inc()
	hint := "the agent's loop came to the renewal after the lease had run out: it was too slow (apportion_sync_tick_duration_seconds; an overloaded host or a CPU limit)"
	switch lp.cause {
	case LapseStore:
		hint = "the renewal's writes began in time but none was confirmed before the lease ran out: Redis failed or was too slow (apportion_sync_store_errors_total; on a Redis Cluster the fan-out)"
	case LapseDeadline:
		hint = "the ledger let the lease run out: its peers' acknowledgements stopped coming (a partition or heavy loss: apportion_sync_peer_lag_seconds); a region holding more than its floor fences, one at its floor carries on at it"
	}
	switch {
	case lp.cause == LapseDeadline:
	case lp.lease < a.cfg.Lease/2:
		hint += fmt.Sprintf("; the lease was short (%v of --lease %v): the ledger shortens it when its peers' acknowledgements are late (apportion_sync_peer_lag_seconds)", lp.lease, a.cfg.Lease)
	default:
		hint += "; a longer --lease tolerates more"
	}
	ms := time.Millisecond
	a.logs.Log(slog.LevelWarn, "marker-lapse/"+lp.cause+"/"+st.ID, "marker lease lapsed before its renewal: every key of the rule in this region enforced its floor meanwhile (no fence)",
		logKeyRule, st.ID, "cause", lp.cause, "late", lp.late.Round(ms), "lease", lp.lease, "since_renewal", lp.gap.Round(ms),
		"store_call", lp.call.Round(ms), "hint", hint)
}

// minWindow is the smallest value observed in the current window of span
// and the one before it: a gauge of the worst lately, NaN with none.
type minWindow struct {
	span time.Duration

	mu        sync.Mutex
	start     time.Time // of the current window
	cur, prev float64
}

func newMinWindow(span time.Duration) *minWindow {
	return &minWindow{span: span, cur: math.Inf(1), prev: math.Inf(1)}
}

// roll moves the windows to now's (mu held).
func (w *minWindow) roll(now time.Time) {
	if w.start.IsZero() {
		w.start = now
		return
	}
	switch k := now.Sub(w.start) / w.span; {
	case k == 1:
		w.prev, w.cur = w.cur, math.Inf(1)
		w.start = w.start.Add(w.span)
	case k > 1:
		w.prev, w.cur = math.Inf(1), math.Inf(1)
		w.start = w.start.Add(k * w.span)
	}
}

func (w *minWindow) observe(now time.Time, v float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.roll(now)
	w.cur = min(w.cur, v)
}

func (w *minWindow) value(now time.Time) float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.roll(now)
	if v := min(w.cur, w.prev); !math.IsInf(v, 1) {
		return v
	}
	return math.NaN()
}
