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
// gave: whole debts at a time. It pays only if the sum of k's nets is below
// the sum when it last paid (settleReset clears that record): a peer with
// reclaim terms on the key returns a payment by its deficit, which brings
// the nets back, and paying again would go round for good.
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
		k.rareState().settled = sum
		l.stats.Settled++
	}
	return gave
}

// settleReset clears k's record of its last payment: with demand anywhere
// (give), and when k leaves coordination (maybeIdle).
func settleReset(k *key) {
	if k.rare != nil && k.rare.settled != 0 {
		k.rare.settled = 0
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
// base with no reclaim terms on k pays the live peers of idx it owes their
// whole debts, as far as its position above its floor allows (such a
// region owes at least its excess: see the package doc, Settling cycles).
func (l *Ledger) settleGive(k *key, idx []int, rest bool, now time.Duration) int64 {
	if !rest {
		settleReset(k)
		return 0
	}
	pos := l.position(k)
	if pos <= l.base || k.extra() != 0 || k.frozen() != 0 {
		return 0
	}
	return l.settleOwed(k, idx, l.settleRoom(k, pos, now))
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
// what they owe in turn (settleGive) until the units are back.
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
	if l.settleOwed(k, idx, l.settleRoom(k, l.position(k), now)) > 0 {
		k.active, k.dirty = true, true
	}
}
