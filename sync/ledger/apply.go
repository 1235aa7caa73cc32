package ledger

import (
	"time"
)

// ShareApplied tells the ledger that the store now holds a version >= v for
// the key (or the marker, MarkerKey). Gifts lowered by writes up to v become
// durable: their counters are published in the returned report.
func (l *Ledger) ShareApplied(now time.Duration, name string, v Version) Output {
	if l.markerLost(name, v) {
		return l.lostMarker(now)
	}
	if l.foreign(name, v) {
		return l.supersededBy(v)
	}
	if l.fenced || v.Inc != l.inc {
		return Output{Fenced: l.fenced}
	}
	if !l.confirm(name, v) {
		return Output{}
	}
	return Output{Report: l.reportNow(now)}
}

// Confirmation is one store write the store confirmed: it holds Version
// (or a later one) for Key.
type Confirmation struct {
	Key     string
	Version Version
}

// SharesApplied is ShareApplied for many confirmations at once: it applies
// them all and returns at most one report, so an agent that confirms the
// writes of a whole interval publishes one report, not one per key.
func (l *Ledger) SharesApplied(now time.Duration, cs []Confirmation) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	changed := false
	for _, c := range cs {
		if l.markerLost(c.Key, c.Version) {
			// The confirmations after it need not be applied: every
			// key is written again.
			out := l.lostMarker(now)
			if changed {
				out.Report = l.reportNow(now)
			}
			return out
		}
		if l.foreign(c.Key, c.Version) {
			return l.supersededBy(c.Version)
		}
		if c.Version.Inc != l.inc {
			continue
		}
		if l.confirm(c.Key, c.Version) {
			changed = true
		}
	}
	if !changed {
		return Output{}
	}
	return Output{Report: l.reportNow(now)}
}

// reportNow is a confirmation's report: built now, or with DeferReports
// owed like a Tick's (built when the caller sends it, OwedReport), so
// that no report is held built while more of the store's answers are
// awaited.
func (l *Ledger) reportNow(now time.Duration) *Report {
	if l.paceRoom(now) == 0 {
		return nil // the keys stay due (pace.go)
	}
	if l.deferReports {
		l.repOwed = true
		return nil
	}
	return l.report(now, false)
}

// confirm applies one confirmation; it reports whether a gift became
// durable (and so a report is due).
func (l *Ledger) confirm(name string, v Version) bool {
	if name == MarkerKey {
		if l.creating != (Version{}) && !v.Less(l.creating) {
			l.markerOK, l.everOK, l.reset, l.creating = true, true, false, Version{}
			l.held(func(k *key) bool {
				if k.rare != nil {
					k.rare.reassert = Version{}
					k.dropRare()
				}
				return true
			})
		}
		return false
	}
	k := l.keys[name]
	if k == nil {
		return false
	}
	if l.version(k.confSeq).Less(v) { // v is of this incarnation (the callers check)
		k.confSeq = v.Seq
	}
	changed := false
	if k.pend == nil {
		return false
	}
	// The snapshots above v stay, moved to the front in order.
	ps, w, n := *k.pend, snapWidth(len(l.names)), 0
	for off := 0; off+w <= len(ps); off += w {
		s := snap(ps[off : off+w : off+w])
		if v.Less(s.ver()) {
			n += copy(ps[n:], s)
			continue
		}
		for i := range l.names {
			if i == l.self {
				continue
			}
			if pr := l.pair(k, i); s.inc(i) == l.peers[i].inc && s.give(i) > pr.conf {
				pr.conf = s.give(i)
				changed = true
			}
		}
	}
	if n == 0 {
		k.pend = nil // an idle array (and its snapshots) would stay with every key
	} else {
		*k.pend = ps[:n]
	}
	if changed {
		k.dirty = true
	}
	return changed
}

// markerLost reports a renewal of this incarnation's confirmed marker
// answered with no marker at all (version zero: none of the store's
// current run): the store lost its data while keeping its run id (FLUSHALL,
// FLUSHDB, the marker deleted or evicted). A renewal is written only once
// a marker of the incarnation is confirmed (markerOK), and it applies over
// any marker of the incarnation, so no answer of a healthy store is zero;
// an answer of a store that restarted is zero too, and the agent's run id
// check resets the ledger for it as well.
// foreign reports whether v, the store's answer for the marker, is a
// marker this incarnation never wrote: a higher incarnation's, or its own
// number with a sequence past every write it made. The store keeps the
// marker of the highest incarnation (a Create of a lower one is refused,
// answered with the marker held), so this incarnation can never write its
// own, and its region enforces floors for the rule as long as it runs:
// it must end. Either another agent of the region runs a newer
// incarnation, or the reclaim registry that numbered this one is older
// than the store (etcd lost its data, or was restored from an older
// snapshot) and handed out a number the region had used: the explorer's
// case, a region at its floor for good with nothing logged (the
// confirmations were ignored as another incarnation's; one with the same
// number even counted as this one's marker being confirmed).
func (l *Ledger) foreign(name string, v Version) bool {
	return name == MarkerKey && !l.fenced && (v.Inc > l.inc || v.Inc == l.inc && v.Seq > l.wseq)
}

// supersededBy fences the incarnation for a foreign marker v (foreign).
func (l *Ledger) supersededBy(v Version) Output {
	out := l.fence()
	out.Superseded = v
	return out
}

func (l *Ledger) markerLost(name string, v Version) bool {
	return name == MarkerKey && v == (Version{}) && l.markerOK && !l.fenced
}

// lostMarker is StoreReset for a store that lost its marker under the
// same run id: every key is written again and the marker created anew
// (Stats.MarkerLost counts it). Until then the store, with no marker,
// enforces floors, as after a restart. Any later answer of the lost
// renewals is zero too, and changes nothing (markerOK is false until the
// new marker is confirmed).
func (l *Ledger) lostMarker(now time.Duration) Output {
	l.stats.MarkerLost++
	return l.StoreReset(now, l.runID)
}

// StoreReset tells the ledger that the local store lost its data and now runs
// as runID. Until the ledger has re-asserted every key and re-created the
// marker, the store enforces floors (no marker).
func (l *Ledger) StoreReset(now time.Duration, runID string) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	l.runID, l.markerOK, l.reset, l.wasReset, l.creating = runID, false, true, true, Version{}
	var out Output
	for k := range l.inNameOrder() {
		if !k.written {
			continue
		}
		k.force = true
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	return out
}
