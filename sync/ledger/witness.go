package ledger

import (
	"math"
	"time"
)

// The witness: between two regions, etcd decides which side of a long
// silence is the lost one (the package doc, Two regions and the witness).
// Each region's agent renews a witness key of its own in etcd by
// compare-and-swap (WitnessRenewed); a survivor that has heard nothing
// from its peer, and seen the peer's key unchanged, for WitnessReclaimAfter
// takes the peer's key by compare-and-swap (Output.Take, then WitnessTaken)
// and freezes the peer, whose renewals fail from then on.

// Take asks the agent to take region's witness key by compare-and-swap:
// succeed only if the key is still at revision Rev (what WitnessSeen
// gave), then call WitnessTaken. Repeated by Tick while the condition holds.
type Take struct {
	Region string
	Rev    int64
}

// witnessed reports whether this incarnation uses the witness: a rule of
// two regions with a WitnessLease.
func (l *Ledger) witnessed() bool {
	return len(l.names) == 2 && l.cfg.WitnessLease > 0
}

// WitnessRenewed feeds a renewal of this region's witness key that
// succeeded, sent at sent on the agent's clock: until sent +
// WitnessLease this incarnation keeps its lease without a peer's
// acknowledgement. Renewals after WitnessLost are ignored.
func (l *Ledger) WitnessRenewed(sent time.Duration) {
	if l.wLost || !l.witnessed() {
		return
	}
	l.wUntil = max(l.wUntil, sent+l.cfg.WitnessLease)
}

// WitnessLost tells that this region's witness key was taken (or is
// otherwise not the one this incarnation renewed): renewals no longer
// extend its lease, whatever comes later.
func (l *Ledger) WitnessLost() { l.wLost = true }

// WitnessSeen feeds the revision of a peer region's witness key as first
// seen at now (0: the key does not exist; a peer without a key is never
// taken). A revision already known keeps the time it was first seen.
func (l *Ledger) WitnessSeen(now time.Duration, region string, rev int64) {
	i := l.index(region)
	if i < 0 || i == l.self {
		return
	}
	p := &l.peers[i]
	if p.wRev != rev {
		p.wRev, p.wAt = rev, now
	}
}

// WitnessTaken feeds a take (Output.Take) that succeeded: the peer's key
// was at rev when this region replaced it, so the peer can no longer renew
// it. The peer's incarnation is frozen if, now, it has been silent and its
// key at rev for WitnessReclaimAfter (the take may serve another rule's
// request).
func (l *Ledger) WitnessTaken(now time.Duration, region string, rev int64) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	i := l.index(region)
	if i < 0 || i == l.self {
		return Output{}
	}
	p := &l.peers[i]
	wait := l.cfg.WitnessReclaimAfter()
	// The take proves the key stayed at rev until then; rev must have been
	// seen for the wait: asked for by this ledger (takeable when it asked),
	// or seen that long here (another rule's take). Our own take shows
	// here as a new revision of the key, which does not undo it.
	seen := rev == p.asked || rev == p.wRev && now-p.wAt >= wait
	if !l.witnessed() || !seen || rev <= 0 || !p.mayFreeze {
		return Output{}
	}
	// The take proves that p's witness lease is over for good (p renews
	// no more: every renewal after it fails). What this ledger may still
	// lack is its own silence of p (its last report of p may be a
	// heartbeat younger than the asking rule's) or its own lease: remember
	// the take for the incarnation we pair with, and Tick freezes it once
	// they hold (tookFreezable). Before, such a ledger waited for a second
	// take, a whole wait after its own take's revision was first seen.
	p.took, p.tookInc = rev, p.inc
	if now-p.heard < wait || now >= l.leaseDeadline() {
		return Output{}
	}
	return Output{Contributions: l.freeze(i, p.inc, now)}
}

// tookFreezable reports whether peer i's key was taken (WitnessTaken) while
// we paired with the incarnation we still pair with, and that incarnation
// has now been silent for WitnessReclaimAfter while this one holds its lease.
func (l *Ledger) tookFreezable(i int, now time.Duration) bool {
	p := &l.peers[i]
	return l.witnessed() && p.took > 0 && p.tookInc == p.inc && p.mayFreeze &&
		now-p.heard >= l.cfg.WitnessReclaimAfter() && now < l.leaseDeadline()
}

// takeable reports whether peer i may be frozen through the witness: a
// two-region rule whose peer incarnation is known, silent for
// WitnessReclaimAfter, its key seen at one revision that long, while this
// incarnation holds its own lease.
func (l *Ledger) takeable(i int, now time.Duration) bool {
	p := &l.peers[i]
	wait := l.cfg.WitnessReclaimAfter()
	return l.witnessed() && p.mayFreeze && p.wRev > 0 &&
		now-p.heard >= wait && now-p.wAt >= wait && now < l.leaseDeadline()
}

// witnessDeadline is the end of the lease the witness gives: the last
// renewal's send time plus WitnessLease (0 without one).
func (l *Ledger) witnessDeadline() time.Duration {
	if l.wLost || !l.witnessed() {
		return 0
	}
	return l.wUntil
}

// WitnessReclaimAfter is how long, on a survivor's clock, a two-region peer
// must be silent and its witness key unchanged before the survivor takes the
// key: WitnessLease(1+Rho)/(1-Rho) + Margin, as ReclaimAfter is for Lease.
func (c Config) WitnessReclaimAfter() time.Duration {
	return time.Duration(math.Ceil(float64(c.WitnessLease)*(1+c.Rho)/(1-c.Rho))) + c.Margin
}
