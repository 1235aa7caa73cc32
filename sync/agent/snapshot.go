package agent

import (
	"maps"
	"slices"
	"time"
)

// Shares returns, for rule, the units this region may enforce per key the
// ledger holds state for (as of the last tick); nil if the rule is not
// coordinated here.
func (a *Agent) Shares(rule string) map[string]int64 {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	ks, ok := a.snap[rule]
	if !ok {
		return nil
	}
	out := make(map[string]int64, len(ks))
	for _, k := range ks {
		out[k.Key] = k.Units
	}
	return out
}

// Snapshot returns every coordinated key of every rule as of the last tick,
// sorted by rule and key.
func (a *Agent) Snapshot() []KeyShare {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	var out []KeyShare
	for _, id := range slices.Sorted(maps.Keys(a.snap)) {
		out = append(out, a.snap[id]...)
	}
	return out
}

// Incarnation returns the incarnation rule's ledger runs as here (0: none yet,
// or fenced and waiting for a new one).
func (a *Agent) Incarnation(rule string) uint64 {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	return a.incs[rule]
}

// publishSnapshot copies the ledgers' positions for Shares, Snapshot and the
// share collector, and updates the gauges.
func (a *Agent) publishSnapshot() {
	snap := make(map[string][]KeyShare, len(a.rules))
	incs := make(map[string]uint64, len(a.rules))
	active, fenced := 0, 0
	for id, st := range a.rules {
		if st.Led == nil {
			fenced++
			incs[id] = 0
			snap[id] = nil
			continue
		}
		incs[id] = st.Led.Incarnation().Inc
		var ks []KeyShare
		for _, k := range st.Led.Keys() {
			p := st.Led.Position(k)
			ks = append(ks, KeyShare{Rule: id, Key: k, Units: p.Units, Demand: p.Demand, Active: p.Active})
			if p.Active {
				active++
			}
		}
		snap[id] = ks
	}
	a.snapMu.Lock()
	a.snap, a.incs = snap, incs
	a.snapMu.Unlock()
	a.m.coordinated.Set(float64(active))
	if fenced > 0 && a.fencedSeen {
		a.m.fenced.Set(1)
	} else {
		a.m.fenced.Set(0)
		a.fencedSeen = false
	}
	seen := 0
	for p, t := range a.peers {
		lag := time.Since(t)
		a.m.peerLag.WithLabelValues(p).Set(lag.Seconds())
		if lag <= a.cfg.Lease {
			seen++
		}
	}
	a.m.peersSeen.Set(float64(seen))
}
