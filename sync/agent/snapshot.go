package agent

import (
	"cmp"
	"container/heap"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/apportion/apportion/sync/ledger"
)

// The keys' shares are read from the ledgers on demand, on the loop
// goroutine (onLoop), not copied every tick: a copy of every key per tick
// cost about 150 bytes per key (two copies alive while the new one was
// built) and a sort of every key per tick, for readers that come rarely
// (an HTTP request, a metrics scrape) and mostly want a few keys.

// onLoop runs fn on the loop goroutine, which owns a.rules and the
// ledgers, and waits for it. It fails with ErrNotRunning when the agent is
// not started or closed, or when ctx ends first (fn may then still run,
// and its results must not be read).
func (a *Agent) onLoop(ctx context.Context, fn func()) error {
	a.mu.Lock()
	running, lctx := a.cancel != nil && !a.closed, a.ctx
	a.mu.Unlock()
	if !running {
		return ErrNotRunning
	}
	done := make(chan struct{})
	select {
	case a.results <- func(context.Context) { fn(); close(done) }:
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrNotRunning, ctx.Err())
	case <-lctx.Done():
		return ErrNotRunning
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrNotRunning, ctx.Err())
	case <-lctx.Done():
		return ErrNotRunning
	}
}

// eachKey calls fn with every key of every rule with a ledger (on the loop
// goroutine), rules in no particular order.
func (a *Agent) eachKey(fn func(rule, key string, s ledger.Share)) {
	for id, st := range a.rules {
		if st.Led != nil {
			st.Led.Each(func(k string, s ledger.Share) { fn(id, k, s) })
		}
	}
}

// topN keeps the n first of the keys added by cmp's order, in a heap
// (container/heap) whose root is the last of those kept: a key that does not
// come before it costs one comparison, and one that does replaces it (log n
// comparisons). It runs on the agent's loop over every key (the shares
// view, the hottest keys' metrics at every scrape). O(n) memory.
// BenchmarkTopN, 1,000,000 keys: see the README ("The agent's loop and its
// readers").
type topN struct {
	n   int
	cmp func(x, y KeyShare) int
	ks  []KeyShare
}

func (t *topN) add(k KeyShare) {
	switch {
	case len(t.ks) < t.n:
		heap.Push(t, k)
	case t.n > 0 && t.cmp(k, t.ks[0]) < 0: // before the last kept
		t.ks[0] = k
		heap.Fix(t, 0)
	}
}

// result returns the kept keys in order.
func (t *topN) result() []KeyShare {
	slices.SortFunc(t.ks, t.cmp)
	return t.ks
}

// heap.Interface: the root is the key that comes last by cmp.
func (t *topN) Len() int           { return len(t.ks) }
func (t *topN) Less(i, j int) bool { return t.cmp(t.ks[i], t.ks[j]) > 0 }
func (t *topN) Swap(i, j int)      { t.ks[i], t.ks[j] = t.ks[j], t.ks[i] }
func (t *topN) Push(x any)         { t.ks = append(t.ks, x.(KeyShare)) }
func (t *topN) Pop() any {
	k := t.ks[len(t.ks)-1]
	t.ks = t.ks[:len(t.ks)-1]
	return k
}

// Shares returns, for rule, the units this region may enforce per key the
// ledger holds state for (as the loop goroutine holds them when it
// answers); nil if the rule is not coordinated here, has no ledger, or the
// agent does not run or did not answer within shareViewTimeout.
func (a *Agent) Shares(rule string) map[string]int64 {
	ctx, cancel := context.WithTimeout(context.Background(), shareViewTimeout)
	defer cancel()
	var out map[string]int64
	err := a.onLoop(ctx, func() {
		st := a.rules[rule]
		if st == nil || st.Led == nil {
			return
		}
		m := map[string]int64{}
		st.Led.Each(func(k string, s ledger.Share) { m[k] = s.Units })
		out = m
	})
	if err != nil {
		return nil
	}
	return out
}

// Snapshot returns every coordinated key of every rule (as the loop
// goroutine holds them when it answers), sorted by rule and key; nil if
// the agent does not run or did not answer within shareViewTimeout.
func (a *Agent) Snapshot() []KeyShare {
	ctx, cancel := context.WithTimeout(context.Background(), shareViewTimeout)
	defer cancel()
	var out []KeyShare
	err := a.onLoop(ctx, func() {
		var all []KeyShare
		a.eachKey(func(rule, key string, s ledger.Share) {
			all = append(all, KeyShare{Rule: rule, Key: key, Units: s.Units, Demand: s.Demand, Active: s.Active})
		})
		slices.SortFunc(all, func(x, y KeyShare) int { return cmp.Or(cmp.Compare(x.Rule, y.Rule), cmp.Compare(x.Key, y.Key)) })
		out = all
	})
	if err != nil {
		return nil
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

// coordinatedEvery is how often publishSnapshot counts the coordinated keys.
const coordinatedEvery = 10

// publishSnapshot publishes the ledgers' incarnations for Incarnation and
// updates the gauges (the coordinated keys every coordinatedEvery-th call:
// every tick and rule change calls it).
func (a *Agent) publishSnapshot() {
	incs := make(map[string]uint64, len(a.rules))
	active := 0
	for id, st := range a.rules {
		if st.Led == nil {
			incs[id] = 0
			continue
		}
		incs[id] = st.Led.Incarnation().Inc
	}
	a.snapMu.Lock()
	a.incs = incs
	a.snapMu.Unlock()
	// The coordinated keys: a visit of every key (most of a tick's cost
	// outside the ledgers at 100,000 keys), so every coordinatedEvery-th
	// call only.
	if a.snapshots%coordinatedEvery == 0 {
		a.eachKey(func(_, _ string, s ledger.Share) {
			if s.Active {
				active++
			}
		})
		a.m.coordinated.Set(float64(active))
		carried, waiting := 0, 0
		for _, st := range a.rules {
			if st.Led != nil {
				c, w := st.Led.Closures()
				carried, waiting = carried+c, waiting+w
			}
		}
		a.m.closures.WithLabelValues("carried").Set(float64(carried))
		a.m.closures.WithLabelValues("waiting").Set(float64(waiting))
	}
	a.snapshots++
	// Fenced: from a ledger's fence (its lease ran out without a peer's
	// report) until a peer's report is accepted again. A fenced ledger
	// starts a new incarnation at once, holding its floor, so "no ledger"
	// lasts milliseconds: the gauge is the region at its floor because it
	// hears no peer, which is what ApportionRegionFenced alerts on.
	if !a.fencedAt.IsZero() {
		for _, t := range a.peers {
			if t.After(a.fencedAt) {
				a.fencedAt = time.Time{}
				break
			}
		}
	}
	if !a.fencedAt.IsZero() {
		a.m.fenced.Set(1)
	} else {
		a.m.fenced.Set(0)
	}
	if a.listChanged { // the rules' region lists change only with setRules and a ledger's start
		a.listChanged = false
		a.forgetUnlisted()
	}
	a.checkAcks(time.Now())
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

// forgetUnlisted forgets every peer heard that no rule coordinated here
// lists any more (in its rule or in its ledger's spec): a region taken out
// of every rule. Its per-peer series (apportion_sync_peer_lag_seconds,
// apportion_sync_peer_unacknowledged) are deleted, where they stayed, the
// lag growing, until the agent restarted, and ApportionSyncPeerLag and
// ApportionSyncPeersMissing fired for a region no rule has. A rule that
// lists it again brings it back with its next accepted report.
func (a *Agent) forgetUnlisted() {
	if len(a.peers) == 0 {
		return
	}
	listed := map[string]bool{}
	for _, st := range a.rules {
		for n := range st.rule.Regions {
			listed[n] = true
		}
		for _, r := range st.spec.Regions {
			listed[r.Name] = true
		}
	}
	for p := range a.peers {
		if listed[p] {
			continue
		}
		delete(a.peers, p)
		a.m.peerLag.DeleteLabelValues(p)
		a.m.unacked.DeleteLabelValues(p)
		a.m.ackAge.DeleteLabelValues(p)
		a.acks.forget(p)
		a.log.Info("no rule coordinated here lists this peer region any more: its series are removed", logKeyPeer, p)
	}
}
