package agent

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Deleting the markers of rules no longer coordinated. A marker has no TTL
// (regional/redisstore, so that no volatile-* eviction takes it), so every
// rule id ever coordinated left its marker in the region's Redis for good
// (16384 slot copies on a Cluster, ~3 MB a rule), and the docs send a
// changed split or region set to a new rule id. Now:
//
//   - When a rule stops being coordinated here (deleted, or no longer a
//     global rule listing this region), setRules drops its ledger and the
//     next tick deletes its marker (Store.DeleteMarker: every slot copy of
//     this agent's on a Cluster). The loop owns the ledgers and runs every
//     store write of theirs to its end (applyWrites), and the Cluster
//     store waits for a marker fan-out still in flight, so no write of the
//     dropped ledger is issued after the delete. A write Redis applied
//     only after its call had given up (a paused server) could still land
//     later: the delete runs once more markerRecheck later.
//   - On start, once the first rule set and the store's run id are known,
//     the agent lists the markers of its store (Store.MarkerRules: SCAN,
//     on every master of a Cluster, within its own marker slots) and
//     deletes those of rules it does not coordinate: markers of rules
//     deleted while it was down, or left by a delete that failed.
//   - A rule coordinated again (re-created under the same id) cancels its
//     pending delete; while a delete of its id runs, its incarnation does
//     not start (maybeStart), and it starts when the delete is done, so its
//     new marker is never the one deleted.
//
// Safety: an enforcer whose rule set still has the rule reads a missing
// marker as every key at its floor (redisstore: "Global.Floor if the marker
// is missing"), so a delete never raises a share; the worst a delete that
// races a rule set change can do is what a FLUSHALL does, which the ledger
// repairs at its next renewal (marker_lost).

// markerDeleter is a Store that can delete and list markers
// (regional/redisstore.Store).
type markerDeleter interface {
	DeleteMarker(ctx context.Context, rule string) error
	MarkerRules(ctx context.Context) ([]string, error)
}

// errNoMarkerDelete: the store cannot delete markers (shardStore over one
// that cannot).
var errNoMarkerDelete = errors.New("agent: the store cannot delete markers")

const (
	// markerRecheck is when the marker of a rule no longer coordinated is
	// deleted a second time, after the first.
	markerRecheck = 30 * time.Second
	// markerRetry is the wait after a failed delete or listing.
	markerRetry = 5 * time.Second
	// markerTimeout bounds one round of deletes, or a listing.
	markerTimeout = 30 * time.Second
)

// markerGC is the loop's state of marker deletes.
type markerGC struct {
	due      map[string]markerDue // rule (group) id -> its next delete
	inflight map[string]bool      // ids being deleted now
	running  bool                 // a round of deletes runs
	listing  bool                 // the start's listing runs
	swept    bool                 // the start's listing is done
	listAt   time.Time            // not before (after a failed listing)
}

type markerDue struct {
	at   time.Time
	last bool // the final delete (no recheck after it)
}

// markerStore returns the store as a markerDeleter, or nil.
func (a *Agent) markerStore() markerDeleter {
	md, ok := a.store.(markerDeleter)
	if !ok {
		return nil
	}
	if ss, ok := a.store.(shardStore); ok {
		if _, ok := ss.Store.(markerDeleter); !ok {
			return nil
		}
	}
	return md
}

// dropMarker schedules the deletion of id's marker (its ledger is gone).
func (a *Agent) dropMarker(id string) {
	if a.markerStore() == nil {
		return
	}
	if a.mgc.due == nil {
		a.mgc.due = map[string]markerDue{}
	}
	a.mgc.due[id] = markerDue{at: time.Now()}
}

// keepMarker cancels a pending delete of id's marker: id is coordinated
// again, and its new marker replaces the old one.
func (a *Agent) keepMarker(id string) { delete(a.mgc.due, id) }

// deletingMarker reports whether a delete of id's marker runs now (id's
// incarnation waits for it).
func (a *Agent) deletingMarker(id string) bool { return a.mgc.inflight[id] }

// collectMarkers runs, on the loop at every tick, the start's listing and
// the deletes that are due.
func (a *Agent) collectMarkers(ctx context.Context) {
	md := a.markerStore()
	if md == nil {
		return
	}
	now := time.Now()
	if !a.mgc.swept && !a.mgc.listing && a.everRules && a.runID != "" && !now.Before(a.mgc.listAt) {
		a.mgc.listing = true
		a.goOwned(func() {
			cctx, cancel := context.WithTimeout(ctx, markerTimeout)
			ids, err := md.MarkerRules(cctx)
			cancel()
			a.post(ctx, func(context.Context) { a.listed(ids, err) })
		})
	}
	if a.mgc.running || len(a.mgc.due) == 0 {
		return
	}
	var ids []string
	for id, d := range a.mgc.due {
		if a.rules[id] != nil { // coordinated again
			delete(a.mgc.due, id)
			continue
		}
		if !now.Before(d.at) {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return
	}
	if a.mgc.inflight == nil {
		a.mgc.inflight = map[string]bool{}
	}
	for _, id := range ids {
		a.mgc.inflight[id] = true
	}
	a.mgc.running = true
	a.goOwned(func() {
		errs := make([]error, len(ids))
		cctx, cancel := context.WithTimeout(ctx, markerTimeout)
		for i, id := range ids {
			errs[i] = md.DeleteMarker(cctx, id)
		}
		cancel()
		a.post(ctx, func(ctx context.Context) { a.markersDeleted(ctx, ids, errs) })
	})
}

// listed takes the start's listing: every marker of a rule not coordinated
// here is deleted (once: no write of this agent's made it).
func (a *Agent) listed(ids []string, err error) {
	a.mgc.listing = false
	if err != nil {
		a.mgc.listAt = time.Now().Add(markerRetry)
		a.logs.Log(slog.LevelWarn, "marker-list", "cannot list the store's markers (to delete those of rules no longer coordinated); retrying", logKeyErr, err)
		return
	}
	a.mgc.swept = true
	n := 0
	for _, id := range ids {
		if a.rules[id] != nil || a.mgc.inflight[id] {
			continue
		}
		if _, ok := a.mgc.due[id]; ok {
			continue
		}
		if a.mgc.due == nil {
			a.mgc.due = map[string]markerDue{}
		}
		a.mgc.due[id] = markerDue{at: time.Now(), last: true}
		n++
	}
	if n > 0 {
		a.log.Info("deleting the markers of rules not coordinated here (deleted, or no longer listing this region)", "markers", n)
	}
}

// markersDeleted takes a round of deletes' results and starts the
// incarnations that waited for them.
func (a *Agent) markersDeleted(ctx context.Context, ids []string, errs []error) {
	a.mgc.running = false
	now := time.Now()
	for i, id := range ids {
		delete(a.mgc.inflight, id)
		d, ok := a.mgc.due[id]
		switch {
		case !ok || a.rules[id] != nil:
			delete(a.mgc.due, id)
		case errs[i] != nil:
			a.mgc.due[id] = markerDue{at: now.Add(markerRetry), last: d.last}
			a.m.storeErrors.Inc()
			a.logs.Log(slog.LevelWarn, "marker-delete", "cannot delete the marker of a rule no longer coordinated; retrying", logKeyRule, id, logKeyErr, errs[i])
		case d.last:
			delete(a.mgc.due, id)
		default:
			a.mgc.due[id] = markerDue{at: now.Add(markerRecheck), last: true}
			a.log.Info("deleted the marker of a rule no longer coordinated here", logKeyRule, id)
		}
		if st := a.rules[id]; st != nil {
			a.maybeStart(ctx, st)
		}
	}
}
