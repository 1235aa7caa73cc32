package ledger

import (
	"math"
	"slices"
	"time"
)

func (l *Ledger) fence() Output {
	l.fenced = true
	return Output{Fenced: true}
}

// leaseDeadline is D, the end of the store lease this incarnation may
// write (the package doc, invariant 3): the ack deadline among three
// regions or more. With one region, or two without a witness, it never
// comes: no peer can freeze us by silence (see ackDeadline), so nobody can
// reclaim what we hold while we live, and a cut-off region keeps its
// position instead of fencing to its floor. With two regions and a
// witness it is the later of the ack deadline and the witness's
// (witness.go): a peer freezes us only once our witness key has been
// unchanged for WitnessReclaimAfter, and our acknowledgements stopped as
// long ago.
func (l *Ledger) leaseDeadline() time.Duration {
	if l.witnessed() {
		return max(l.ackDeadline(), l.witnessDeadline())
	}
	if len(l.names) <= 2 {
		return math.MaxInt64
	}
	return l.ackDeadline()
}

// ackDeadline is the latest local send time of one of our reports that a
// peer has acknowledged (or the start), plus Lease. A peer freezes us by
// silence only while a peer acknowledges it (joined: now < its own ack
// deadline). With two regions that peer is us: the ack that set its
// ackDeadline came in a report of ours it heard at or after that send time,
// so it has heard from us within Lease < ReclaimAfter, and it cannot freeze
// us by silence (only through the witness, after WitnessReclaimAfter).
func (l *Ledger) ackDeadline() time.Duration {
	d := l.started
	for i := range l.peers {
		if i != l.self && l.peers[i].ackedSend > d {
			d = l.peers[i].ackedSend
		}
	}
	return d + l.cfg.Lease
}

// holdsMore reports whether this incarnation holds more than its floor on
// any key (or for keys without state).
func (l *Ledger) holdsMore() bool {
	f := l.floor[l.self]
	if l.base > f {
		return true
	}
	more := false
	l.held(func(k *key) bool {
		more = l.position(k) > f
		return !more
	})
	return more
}

// joined reports whether a peer has acknowledged one of our reports within
// the lease (or, between two regions, the witness's lease holds): only then
// does the ledger take reclaim payments, since holding more than the floor
// without a lease would make it fence at once.
func (l *Ledger) joined(now time.Duration) bool {
	if len(l.names) == 1 {
		return true
	}
	if l.witnessed() && now < l.witnessDeadline() {
		return true // the witness stands for the peer (witness.go)
	}
	acked := false
	for i := range l.peers {
		acked = acked || i != l.self && l.peers[i].ackedSend > 0
	}
	return acked && now < l.ackDeadline()
}

// payOwed applies the part of the registry's payment not applied yet.
func (l *Ledger) payOwed(now time.Duration) {
	if l.owed.Seq <= l.paid.Seq || !l.joined(now) {
		return
	}
	l.base += l.owed.Base - l.paid.Base
	keys := map[string]int64{}
	for _, ku := range l.paid.Keys {
		keys[ku.Key] = 0 // listed before: reset unless listed again
	}
	for _, ku := range l.owed.Keys {
		keys[ku.Key] = ku.Units
	}
	for n, v := range keys {
		k := l.key(n)
		if k.extra() != v {
			k.rareState().extra = v
			k.dropRare()
			k.active, k.dirty = true, true
			k.lastUse = now
		}
	}
	if l.owed.Base != l.paid.Base {
		l.held(func(k *key) bool {
			k.dirty = true // every position moved
			return true
		})
	}
	l.paid = l.owed
}

// freeze stops pairing with incarnations up to inc of peer i: it moves the
// pair terms of inc into the frozen terms and returns the contributions.
func (l *Ledger) freeze(i int, inc uint64, now time.Duration) []Contribution {
	p := &l.peers[i]
	if inc <= p.frozenInc {
		return nil
	}
	var out []Contribution
	for x := max(p.frozenInc+1, p.inc); x <= inc; x++ {
		c := Contribution{Of: Incarnation{p.name, x}, From: Incarnation{l.names[l.self], l.inc}}
		if x == p.inc {
			for k := range l.inNameOrder() {
				pr := l.pair(k, i)
				// Only confirmed gifts count: an unconfirmed one is cancelled
				// (a raise back), since its lowering may not be in the store yet.
				if q := pr.conf - pr.recv; q != 0 {
					c.Q = append(c.Q, KeyUnits{k.name, q})
					k.addFrozen(-q)
					k.dirty = true
				}
				*pr = pair{}
			}
		}
		p.pending[x] = c
		out = append(out, c)
	}
	p.frozenInc, p.inc, p.seen, p.mayFreeze, p.heard, p.lastSeq, p.ackedSend = inc, inc+1, false, p.wanted[inc+1], now, 0, 0
	for x := range p.wanted {
		if x <= inc {
			delete(p.wanted, x)
		}
	}
	return out
}

// ReclaimRecorded feeds the registry's record of an incarnation. An
// incomplete record that needs this incarnation's contribution makes the
// incarnation freezable; a complete one freezes it (and fences it, if it is
// this one). A record of this incarnation carries what reclaims paid it,
// applied (now or later) while a peer acknowledges us.
func (l *Ledger) ReclaimRecorded(now time.Duration, rec Record) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	me := Incarnation{l.names[l.self], l.inc}
	if rec.Of.Region == me.Region {
		if rec.Of != me {
			return Output{}
		}
		if rec.Complete {
			return l.fence()
		}
		if rec.Closer {
			l.closeAck = true
		}
		if p := rec.Paid; p != nil && p.Seq > l.owed.Seq {
			l.owed = Payment{Seq: p.Seq, Base: p.Base, Keys: append([]KeyUnits(nil), p.Keys...)}
			l.payOwed(now)
		}
		return Output{}
	}
	i := l.index(rec.Of.Region)
	if i < 0 {
		l.stats.Rejected++
		return Output{}
	}
	p := &l.peers[i]
	for _, c := range rec.Contributions {
		if c.From == me {
			delete(p.pending, rec.Of.Inc)
		}
	}
	p.known = max(p.known, rec.Of.Inc) // a record is of a registered incarnation
	if !rec.Complete {
		for _, q := range rec.Required {
			if q == me && rec.Of.Inc >= p.inc {
				// The incarnation exists and others find it silent: freeze it
				// once it is silent for ReclaimAfter here too. A newer one than
				// ours proves ours existed; each is frozen only on its own silence.
				p.mayFreeze = true
				p.wanted[rec.Of.Inc] = true
			}
		}
		return Output{}
	}
	var out Output
	if rec.Of.Inc > p.frozenInc {
		out.Contributions = l.freeze(i, rec.Of.Inc, now)
	}
	delete(p.pending, rec.Of.Inc)
	l.paidUnheard(now, rec)
	return out
}

// paidUnheard makes the recipients of a completed reclaim that succeed one
// of its members, if we have not heard them, freezable once silent for
// ReclaimAfter from now. A
// payment is applied only while a peer acknowledges the recipient
// (joined), so one paid to a region cut off from all its peers waits
// there, held by nobody, for the whole cut: a region cut off alone fences,
// starts a new incarnation, and the reclaim of its old one pays the new one
// its weight's part of what the old one held (for a 1/s limit with a burst
// of 1, the whole token when the tie falls on it), while its traffic has
// moved to the other regions. Reclaiming the recipient gives it back to the
// others (its record counts what it was paid, applied or not), and since it
// fences only once that reclaim is complete, its successor is allocated
// after it and is paid nothing by it. The silence may count from now: the
// recipient was allocated before the record was written, so its start,
// from which its lease counts when no peer acknowledges it, is before now,
// and we never acknowledged it. One heard within ReclaimAfter is never
// frozen; one that others hear is not reclaimed without their
// contributions (the registry's cohort rule). Only a member's successor:
// a region alone that is paid by the reclaim of another region's
// incarnation would, once reclaimed, pay that other region's successor if
// it is alone too, and the two would pass the units back and forth, a new
// incarnation each time, for as long as both are alone; their part waits
// for them instead (the package doc, Partitions). It is frozen by silence as
// any peer is, by a ledger that a peer acknowledges (Tick). The record is
// applied after the freeze of the reclaimed incarnation (ReclaimRecorded),
// so we pair with the recipient by then.
func (l *Ledger) paidUnheard(now time.Duration, rec Record) {
	for _, r := range rec.Recipients {
		j := l.index(r.Region)
		if j < 0 || j == l.self || !slices.ContainsFunc(rec.Cohort, func(m Incarnation) bool { return m.Region == r.Region }) {
			continue
		}
		q := &l.peers[j]
		if r.Inc != q.inc || q.seen || q.mayFreeze {
			continue // not the one we pair with, heard, or freezable already
		}
		q.known = max(q.known, r.Inc)
		q.mayFreeze, q.heard = true, now
	}
}
