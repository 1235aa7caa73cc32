package ledger

import (
	"math"
	"time"
)

// write returns the store write a key needs, if any.
func (l *Ledger) write(k *key, now time.Duration) (Write, bool) {
	units := l.position(k)
	release := !k.active
	if !k.written && !k.active && !k.force {
		return Write{}, false
	}
	if k.written && !k.force && !k.gifted && units == k.wUnits && release == k.wRelease {
		if k.confSeq < k.wSeq && now-k.wAt >= l.cfg.RetryWrite {
			k.wAt = now
			return Write{Key: k.name, Version: l.version(k.wSeq), Units: k.wUnits, Release: k.wRelease}, true
		}
		return Write{}, false
	}
	l.wseq++
	v := Version{l.inc, l.wseq}
	if k.pend == nil {
		k.pend = new([]int64)
	}
	*k.pend = append(*k.pend, int64(v.Inc), int64(v.Seq))
	for i := range l.names {
		var give int64
		if i != l.self {
			give = l.pair(k, i).give
		}
		*k.pend = append(*k.pend, give, int64(l.peers[i].inc))
	}
	k.gifted = false
	if k.force {
		k.rareState().reassert, k.force = v, false
	}
	if prev := k.wUnits; !release && units < prev || !k.written && units < l.base {
		l.stats.Lowered++
	}
	k.written, k.wUnits, k.wRelease, k.wSeq, k.wAt = true, units, release, v.Seq, now
	return Write{Key: k.name, Version: v, Units: units, Release: release}, true
}

// storeLease is how long, on the store's clock, the marker may stay valid if
// written now: (1-rho)((D-now)/(1+rho) - StoreTimeout), D the lease deadline.
func (l *Ledger) storeLease(now time.Duration) time.Duration {
	d := l.leaseDeadline()
	if d == math.MaxInt64 {
		return l.cfg.Lease
	}
	rho := l.cfg.Rho
	v := (1 - rho) * (float64(d-now)/(1+rho) - float64(l.cfg.StoreTimeout))
	if v <= 0 {
		return 0
	}
	// At most Lease (a witness's deadline is WitnessLease away), so that a
	// dead agent's store falls to its floor a Lease after its last renewal.
	return min(time.Duration(v), l.cfg.Lease)
}

// markerDefault is the marker's default units: the base, once every key
// whose position is below the base has a confirmed record of its own
// (a reclaim payment can raise the base by more than it raises some keys);
// until then the default written last. Lower first, for the marker too.
func (l *Ledger) markerDefault() int64 {
	u := l.base
	if u > l.markerUnits {
		l.held(func(k *key) bool {
			if l.position(k) < u && !(k.written && !k.wRelease && k.confSeq >= k.wSeq) {
				u = l.markerUnits
				return false
			}
			return true
		})
	}
	l.markerUnits = u
	return u
}

func (l *Ledger) marker(now time.Duration) (Write, bool) {
	lease := l.storeLease(now)
	if lease <= 0 && (l.everOK || l.holdsMore()) {
		return Write{}, false
	}
	// A first marker past the lease deadline, of an incarnation that holds
	// only its floor, gets a zero lease: it grants nothing, but it floors
	// the records of the region's earlier incarnations, so reports may
	// start and a peer's acknowledgement can give this one a lease.
	lease = max(lease, 0)
	if l.markerOK {
		l.wseq++
		return Write{Key: MarkerKey, Version: Version{l.inc, l.wseq}, Units: l.markerDefault(), Marker: &MarkerWrite{Lease: lease}}, true
	}
	if l.reset {
		pending := false
		l.held(func(k *key) bool {
			pending = k.rare != nil && k.rare.reassert != (Version{}) && l.version(k.confSeq).Less(k.rare.reassert)
			return !pending
		})
		if pending {
			return Write{}, false
		}
	}
	if l.creating != (Version{}) && now-l.createAt < l.cfg.RetryWrite {
		return Write{}, false
	}
	l.wseq++
	l.creating, l.createAt = Version{l.inc, l.wseq}, now
	// Boot: the first incarnation's Create before any marker of it was
	// confirmed and with no store reset seen; the store may then fill the
	// keys it enforced at the floor (see the package doc, "The store
	// contract"). After a reset the store cannot tell an empty Redis from a
	// first boot, so only the ledger can say.
	boot := l.inc == 1 && !l.everOK && !l.wasReset
	return Write{Key: MarkerKey, Version: l.creating, Units: l.markerDefault(), Marker: &MarkerWrite{Create: true, Boot: boot, RunID: l.runID, Lease: lease}}, true
}

// Held calls fn, in name order, for every key whose last write is
// confirmed and is not a Release record (its store record must not expire
// while this incarnation's marker may be in force: the agent writes it
// again within its TTL), with that write's version and units and when it
// was last sent to the store (by Tick, or by the agent's refresh:
// Refreshed); fn returning false stops. The store applied the record at or
// after that time, or, when a resend overtook the answer that confirmed
// it, at most one RetryWrite and StoreTimeout before. A fenced ledger
// holds nothing (a new incarnation's marker floors its records).
func (l *Ledger) Held(fn func(name string, v Version, units int64, at time.Duration) bool) {
	if l.fenced {
		return
	}
	for k := range l.inNameOrder() {
		if k.written && !k.wRelease && k.confSeq == k.wSeq && !fn(k.name, l.version(k.wSeq), k.wUnits, k.wAt) {
			return
		}
	}
}

// Refreshed records that the store applied key name's record at version v
// again (the agent's refresh), sent at time at: Held reports at for it from
// now on, if v is still its last write and confirmed.
func (l *Ledger) Refreshed(name string, v Version, at time.Duration) {
	k := l.keys[name]
	if k == nil || gone(k) || v != l.version(k.wSeq) || k.confSeq != k.wSeq || k.wRelease {
		return
	}
	k.wAt = max(k.wAt, at)
}
