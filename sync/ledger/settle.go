package ledger

import "time"

// Settling a cycle: how an idle key whose units came back to every region's
// base along other pairs than they went (some pair is not net zero) is
// brought to net-zero pairs, so that retirement (retire.go) can forget it.
// See "Settling cycles" in the package doc for the rule and its proof; in
// short, the settlement moves units only by ordinary gifts, so it inherits
// their safety, and each of its gifts lowers the sum of the pairs' nets.

// owedTo is what this region owes peer i on k: the units of i's gifts it
// applied beyond those it gave i (negative: i owes us).
func (l *Ledger) owedTo(k *key, i int) int64 {
	pr := l.pair(k, i)
	return pr.recv - pr.give
}

// settleOwed gives each live peer of idx this region owes on k what it
// owes it, as far as room allows, in region order, and returns what it
// gave: whole debts at a time. It pays only if at least half of its last
// payment stuck: the sum of k's nets must be at least ceil(g/2) below the
// sum S before its last payment of g (the record is S - ceil(g/2) + 1). A
// peer with reclaim terms on the key cannot pay on what it was paid (its
// nets cannot all be zero at its base) and returns it by its deficit
// gifts, which raise the nets again: paying again would go round for
// good. (It is not all of the payment: views of a payment in flight
// differ, and regions without reclaim terms give part of it back by
// deficit gifts for a while; and a return spread over several deficits
// leaves the payer's sum a little below S, so a record of S alone let it
// pay its whole debts again for a few units of progress.) The records
// fall by at least half of each payment, so between two records cleared
// (when the key goes idle, and with demand) a region pays at most twice
// the sum it started from.
func (l *Ledger) settleOwed(k *key, idx []int, room int64) int64 {
	sum := l.netSum(k)
	if room <= 0 || sum == 0 || k.rare != nil && k.rare.settled != 0 && sum >= k.rare.settled {
		return 0
	}
	var gave int64
	for _, i := range idx {
		if room <= 0 {
			break
		}
		if i == l.self || !l.giftable(i) {
			continue
		}
		if o := l.owedTo(k, i); o > 0 {
			g := min(o, room)
			l.gift(k, i, g)
			room -= g
			gave += g
		}
	}
	if gave > 0 {
		k.rareState().settled = sum - (gave+1)/2 + 1
		l.stats.Settled++
	}
	return gave
}

// settleReset clears k's records of its payments: both with demand
// anywhere (give, demand true); the last payment's only when k leaves
// coordination (maybeIdle), so that a settlement can begin afresh from
// rest, under settleStart's rule.
func settleReset(k *key, demand bool) {
	if r := k.rare; r != nil && (r.settled != 0 || demand && r.round != 0) {
		r.settled = 0
		if demand {
			r.round, r.tries, r.retryAt = 0, 0, 0
		}
		k.dropRare()
	}
}

// settleRoom is what k may give to settle: its position above the floor,
// less a hold in force.
func (l *Ledger) settleRoom(k *key, pos int64, now time.Duration) int64 {
	return min(pos-l.floor[l.self], l.giveable(k, pos, now))
}

// settleGive runs in give, before the gifts to deficits, and returns what
// it gave. When nobody wants more than its floor (rest), a region above its
// base pays the live peers of idx it owes their whole debts, as far as its
// position above its floor allows (such a region owes at least its excess,
// without reclaim terms: see the package doc, Settling cycles). One with
// reclaim terms on k pays as far as its position above its base allows:
// its nets cannot all be zero at its base, and what it was paid on a cycle
// then goes on round the cycle instead of back by its deficit gifts.
func (l *Ledger) settleGive(k *key, idx []int, rest bool, now time.Duration) int64 {
	if !rest {
		settleReset(k, true)
		return 0
	}
	pos := l.position(k)
	if pos <= l.base {
		return 0
	}
	room := l.settleRoom(k, pos, now)
	if k.extra() != 0 || k.frozen() != 0 {
		room = min(room, pos-l.base)
	}
	return l.settleOwed(k, idx, room)
}

// netSum is the sum of k's pairs' |net| as this region sees them.
func (l *Ledger) netSum(k *key) int64 {
	var s int64
	for _, pr := range l.pairsOf(k) { // every peer's pair
		o := pr.recv - pr.give
		s += max(o, -o)
	}
	return s
}

// settleStart begins settling a quiet key whose gifts are all confirmed and
// applied but that has a pair with a net, when every live peer reports it
// at its base with no demand: the key becomes active again and this region
// pays the peers it owes (settleOwed); they, above their bases then, pay
// what they owe in turn (settleGive) until the units are back. A region
// begins again from rest only if its last beginning since the key's
// demand at least halved its sum of |net|: a key whose cycle cannot settle
// (a region owed on it holds reclaim terms) comes back to rest with its
// nets about where they were, and beginning every time it came to rest
// moved its units round for good, off the bases (TestSettleNoLivelock).
// A beginning that did not halve it is retried after settleBackoff,
// doubled with each such beginning since the key's last demand: with many regions beginning
// at once, the deficit gifts of some payments can close new cycles and
// leave a region's sum where it was though the key's nets fell, and
// without a retry such a key was held for good (TestChurnLiveness, ten
// regions). So a region begins at most log2 of its first sum times plus
// log2 of the time over the backoff.
func (l *Ledger) settleStart(k *key, now time.Duration) {
	var idx []int
	for i := range l.names {
		if i == l.self || !l.live(i, now) {
			continue
		}
		if !l.peerAtRest(k, i) {
			return // not at rest everywhere yet
		}
		idx = append(idx, i)
	}
	sum := l.netSum(k)
	again := k.rare != nil && k.rare.round != 0 && 2*sum > k.rare.round
	if again && now < k.rare.retryAt {
		return // the last beginning did not halve it: not yet
	}
	if l.settleOwed(k, idx, l.settleRoom(k, l.position(k), now)) > 0 {
		k.active, k.dirty = true, true
		r := k.rareState()
		if again {
			r.tries = min(r.tries+1, settleMaxTries)
		}
		r.round, r.retryAt = sum, now+l.settleBackoff()<<r.tries
	}
}

// settleMaxTries caps settleStart's doubling: a retry at most
// 2^settleMaxTries backoffs after the last.
const settleMaxTries = 6

// settleBackoff is the wait before a region begins again a settlement
// whose last beginning did not halve its sum, doubled with every such
// beginning since the key's last demand: an idle period and its reports
// (retire.go), so that the payments and deficit gifts of the last
// beginning are over everywhere.
func (l *Ledger) settleBackoff() time.Duration {
	return l.cfg.IdleAfter + l.idleReported()
}
