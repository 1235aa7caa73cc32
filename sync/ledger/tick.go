package ledger

import (
	"iter"
	"sort"
	"time"
)

func (l *Ledger) live(i int, now time.Duration) bool {
	p := &l.peers[i]
	return i != l.self && p.seen && now-p.heard <= l.cfg.Lease
}

// giftable reports whether gifts may go to peer i: a later incarnation (a
// restarted or fenced region) only once it has acknowledged one of our
// reports. Hearing it is not enough: behind a one-way or flapping link it
// could never apply a gift, and the units would sit in flight until its
// reclaim returned them (measured live: survivors of a cut region lost a
// third of their share that way, one new incarnation after another).
func (l *Ledger) giftable(i int) bool {
	p := &l.peers[i]
	return p.inc <= 1 || p.ackedSend > 0
}

// Tick runs one sync interval.
func (l *Ledger) Tick(now time.Duration) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	if l.told {
		return l.fence()
	}
	if now >= l.leaseDeadline() {
		// The store lease has lapsed: the store enforces the floor. An
		// incarnation that holds more must end (peers may reclaim it); one
		// that holds only its floor has nothing to give up and carries on,
		// so a region alone does not start a new life every lease. Its next
		// marker is a Create, once a peer acknowledges it again.
		if l.holdsMore() {
			return l.fence()
		}
		l.markerOK = false
	}
	var out Output
	l.payOwed(now)
	if l.everOK && l.inc > 1 && !l.closeAck && (!l.closeSent || (l.ticks+1)%(4*l.cfg.FullEvery) == 0) {
		out.Close, l.closeSent = Incarnation{l.names[l.self], l.inc}, true
	}
	// Freeze silent incarnations, if a peer acknowledges us, or if the
	// registry needs our contribution to their reclaim (another region
	// froze them first). A region with no live peer does not start a
	// reclaim: it could not take the payment anyway (see joined), and
	// reclaiming the other side of a partition would only make it start a
	// new life. But it must finish one: a reclaim needs a contribution from
	// every incarnation whose life overlapped the silent one (the registry's
	// cohort rule), so two regions alone at once would each wait for the
	// other's, and every reclaim overlapping theirs with them, until one is
	// healed. Its silence towards the peer is what the contribution
	// attests, whether or not anyone hears it. Not between two regions:
	// there the silent peer is our only one, and without a witness its
	// lease has no deadline (leaseDeadline), so silence proves nothing. A
	// newer incarnation seen in a report freezes at once (Receive). Between
	// two regions with a witness, a silent peer is frozen only through its
	// witness key (witness.go): ask for the take.
	joined := l.joined(now)
	for i := range l.peers {
		p := &l.peers[i]
		switch {
		case i == l.self:
		case l.witnessed():
			if l.tookFreezable(i, now) {
				out.Contributions = append(out.Contributions, l.freeze(i, p.inc, now)...)
			} else if l.takeable(i, now) {
				out.Take, p.asked = Take{Region: p.name, Rev: p.wRev}, p.wRev
			}
		case (joined || len(p.wanted) > 0 && len(l.names) > 2) && p.mayFreeze && now-p.heard >= l.cfg.ReclaimAfter():
			out.Contributions = append(out.Contributions, l.freeze(i, p.inc, now)...)
		}
	}
	// Demand: the usage since the last observation, unless some of it is
	// late (UsageLate).
	late := l.usageLate
	l.usageLate = false
	dt := (now - l.lastTick).Seconds()
	if l.ticks == 0 || dt <= 0 {
		dt = l.cfg.Interval.Seconds()
	}
	if !late {
		l.lastTick = now
	}
	l.ticks++
	// DemandBand holds back moves of a key's demand within the band; once
	// every DemandRefresh the band is a tenth of it, so that a demand that
	// drifts slowly within the band is reported within that time instead
	// of being left up to the band away.
	l.band = l.cfg.DemandBand
	if l.band > 0 && l.cfg.DemandRefresh > 0 && now-l.refreshAt >= l.cfg.DemandRefresh {
		l.band, l.refreshAt = l.band/10, now
	}
	l.mergeKeys()
	for _, k := range l.sorted {
		if late {
			break // the usage waits in k.used
		}
		if gone(k) {
			continue
		}
		if k.rate > 0 {
			l.observe(k, dt, now) // demand.go
		}
		k.used = 0
	}
	// Every key held, in name order (Ledger.sorted: the writes come out
	// sorted); retireStep may forget k, and the pass drops the forgotten.
	changed := false
	keep := l.sorted[:0]
	for _, k := range l.sorted {
		if gone(k) {
			continue // forgotten since the last Tick (Receive)
		}
		if k.active && !k.retiring() {
			l.give(k, now)
			l.maybeIdle(k, now)
		}
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
		changed = changed || k.dirty
		l.retireStep(k, now) // retire.go: may forget k
		if !gone(k) {
			keep = append(keep, k)
		}
	}
	clear(l.sorted[len(keep):])
	l.sorted = keep
	if w, ok := l.marker(now); ok {
		out.Writes = append(out.Writes, w)
	}
	// A change makes a report only if some key fits; a peer's report
	// heard may make one, with the acknowledgements (pace.go). The
	// heartbeat goes out either way.
	room := l.paceRoom(now)
	if l.reportDue(now, (changed || l.resync) && room > 0 || l.ackDue(room)) {
		l.treports++
		full := l.treports%l.cfg.FullEvery == 0 || l.resync
		if l.deferReports {
			l.repOwed, l.owedFull, l.owedResync = true, l.owedFull || full, l.owedResync || l.resync
		} else {
			out.Report = l.report(now, full)
			l.resync = l.resync && (out.Report == nil || l.cut)
		}
	}
	// Resend contributions the registry has not shown us yet.
	if l.ticks%l.cfg.FullEvery == 0 {
		for i := range l.peers {
			for _, c := range l.peers[i].pending {
				out.Contributions = append(out.Contributions, c)
			}
		}
		sort.Slice(out.Contributions, func(a, b int) bool {
			x, y := out.Contributions[a].Of, out.Contributions[b].Of
			return x.Region < y.Region || x.Region == y.Region && x.Inc < y.Inc
		})
	}
	return out
}

// give hands this region's excess over its target to the live regions below
// theirs, in proportion to their deficits.
func (l *Ledger) give(k *key, now time.Duration) {
	// The slices are the ledger's, reused from key to key (give runs per key
	// and tick; nothing keeps them past the call).
	sc := &l.scratch
	idx, wants, proj := sc.idx[:0], sc.wants[:0], sc.proj[:0]
	defer func() { sc.idx, sc.wants, sc.proj = idx, wants, proj }()
	var pool int64
	for i := range l.names {
		var pos, dem int64
		switch {
		case i == l.self:
			pos, dem = l.position(k), k.reported() // as reported: peers allocate with it too
		case l.live(i, now):
			pr := l.pair(k, i)
			pos = l.peers[i].base
			if pr.peerSeq > 0 {
				pos, dem = pr.peerPos, pr.peerDemand
			}
			pos += pr.give - pr.peerApplied
		default:
			continue
		}
		idx = append(idx, i)
		proj = append(proj, pos)
		pool += pos - l.floor[i]
		wants = append(wants, Want{Weight: l.weights[i], Demand: max(0, dem-l.floor[i])})
	}
	if len(idx) < 2 || pool <= 0 {
		return
	}
	rest := l.restWants(idx, wants) // retire.go: nobody wants more than its floor
	if !rest {
		l.cfg.evenBand(pool, wants, float64(k.rate))
	}
	tg := l.cfg.Allocate(pool, wants)
	if len(tg) != len(idx) {
		return
	}
	hold := false
	if l.cfg.Quantum > 1 && !rest { // whole tokens, by demand (nothing to round when nobody wants more than its floor)
		fl, dem := make([]int64, len(idx)), make([]int64, len(idx))
		for j, i := range idx {
			fl[j], dem[j] = l.floor[i], wants[j].Demand
		}
		tg = l.cfg.wholeTokens(tg, fl, dem, proj)
		// Views that disagree (a gift between two other regions in
		// flight) hold the gifts back, for holdTicks Ticks at most.
		hold = !l.consistent(k, idx) && int(k.waited) < l.cfg.holdTicks()
	}
	var excess, sumD int64
	def := sc.def[:0]
	for range idx {
		def = append(def, 0)
	}
	sc.def = def
	for j, i := range idx {
		if i == l.self {
			excess = min(proj[j]-l.floor[i]-tg[j], l.giveable(k, proj[j], now))
		} else if d := tg[j] - (proj[j] - l.floor[i]); d > 0 {
			def[j] = d
			sumD += d
		}
	}
	excess -= l.settleGive(k, idx, rest, now) // settle.go: debts first
	if hold {
		k.waited++
		return
	}
	// Hysteresis spares small gifts while there is demand; at rest the
	// positions must reach the bases exactly, or the key never goes idle
	// (maybeIdle) and is held for good.
	if excess <= 0 || sumD == 0 || !rest && excess <= l.cfg.Hysteresis {
		k.waited = 0
		return
	}
	// An excess within GiftBand waits GiftWait in a row (Config.GiftBand),
	// counted in the same byte as the hold above: that one only with
	// Quantum, this one only without.
	if !rest && l.cfg.smallGift(excess) && int(k.waited) < l.cfg.giftWaitTicks() {
		k.waited++
		return
	}
	k.waited = 0
	// Never below our floor: excess <= position - floor since targets are >= 0.
	best, gave := -1, false
	for j, i := range idx {
		if def[j] == 0 || !l.giftable(i) {
			continue
		}
		if best < 0 || def[j] > def[best] {
			best = j
		}
		g := min(def[j], int64(float64(excess)*float64(def[j])/float64(sumD)))
		if g > 0 {
			l.gift(k, i, g)
			gave = true
		}
	}
	if best >= 0 && !gave {
		// Every share rounded down to zero (an excess of a few units over
		// several deficits): the largest deficit takes it, or the units
		// would stay off their targets for good.
		l.gift(k, idx[best], min(def[best], excess))
	}
}

// consistent reports whether this region's views of k's live regions idx
// agree: every live peer m has acknowledged, in the report we hold from it,
// the report of every other live peer j that our view of j on k comes from.
// Then m's reported position includes every gift j published to m there, and
// no units move between two other regions unseen.
func (l *Ledger) consistent(k *key, idx []int) bool {
	for _, j := range idx {
		if j == l.self {
			continue
		}
		s := l.pair(k, j).peerSeq
		if s == 0 {
			continue
		}
		for _, m := range idx {
			if m == l.self || m == j {
				continue
			}
			h := l.peers[m].heardOf[j]
			if h.inc != l.peers[j].inc || h.seq < s {
				return false
			}
		}
	}
	return true
}

// gift adds g units to what this region gives peer i on k: the one way
// units leave a region, for the gifts to deficits and the settlement's
// payments (settle.go) alike.
func (l *Ledger) gift(k *key, i int, g int64) {
	l.pair(k, i).give += g
	k.dirty, k.gifted = true, true
}

// maybeIdle releases a key from coordination once every region is back at its
// initial part, nothing is in flight and the key has had no usage for IdleAfter.
func (l *Ledger) maybeIdle(k *key, now time.Duration) {
	if now-k.lastUse < l.cfg.IdleAfter || k.demand > 0 || k.extra() != 0 || k.frozen() != 0 || l.position(k) != l.base {
		return
	}
	for i := range l.names {
		if i == l.self {
			continue
		}
		pr := l.pair(k, i)
		if pr.give != pr.conf || pr.conf != pr.peerApplied || !l.peerAtRest(k, i) {
			return
		}
	}
	k.active, k.dirty, k.idleAt = false, true, now
	settleReset(k, false) // settle.go: a new chance to settle once quiet
}

// peerAtRest reports whether peer i's last report shows k at its base with
// no demand (or it has not reported k: it is at its base).
func (l *Ledger) peerAtRest(k *key, i int) bool {
	pr := l.pair(k, i)
	return pr.peerDemand <= 0 && (pr.peerSeq == 0 || pr.peerPos == l.peers[i].base)
}

// reportDue reports whether Tick sends a report: at every Tick without a
// heartbeat (Config.heartbeat at most Interval), else when a key changed,
// or HeartbeatEvery has passed since the last report.
func (l *Ledger) reportDue(now time.Duration, changed bool) bool {
	hb := l.cfg.heartbeat()
	return changed || hb <= l.cfg.Interval || now-l.lastSent >= hb || l.rseq == 0
}

// DeferReports makes Tick and the confirmations (ShareApplied,
// SharesApplied) leave their report to be built later, when the caller
// sends it: by OwedReport (every report carries the keys that changed
// since the last one, so one report built then carries all that were
// owed). A caller that sends a Tick's report only with the store's
// answers to its writes (sync/driver, so that they leave in one message)
// then holds no built report while the store answers, and the report it
// sends has the state of the moment it is sent, with a sequence number of
// that moment. For the ledger it is as if the owed reports had been lost
// and the one built carried them all.
func (l *Ledger) DeferReports() { l.deferReports = true }

// UsageLate tells the ledger that some of the usage of the interval its
// next Tick ends has not arrived yet (an enforcer's flush is late: a
// stalled NATS server delivers nothing for a while, then all at once).
// That Tick then leaves the demand estimates as they are and keeps the
// usage fed so far; the first Tick without UsageLate folds everything fed
// since the last observation into them as one interval of that length
// (observe weighs an interval by its length). Without it, an interval
// whose usage is late reads as traffic that stopped: the estimates decay
// (half of them in HalfLife) and the region gives its shares away, to
// take them back once the usage arrives. The caller bounds how long it
// holds the estimates (sync/agent: Config.UsageGrace); everything else a
// Tick does (allocation from the estimates held, reports, reclaims) goes
// on.
func (l *Ledger) UsageLate() { l.usageLate = true }

// OwedReport builds the report a Tick deferred (DeferReports), if no
// report was built since; nil if none is owed (or none can be sent yet:
// before the first marker is confirmed, a report is owed until then).
func (l *Ledger) OwedReport(now time.Duration) *Report {
	if l.fenced || !l.repOwed {
		return nil
	}
	return l.report(now, false)
}

// OwedReportParts is OwedReport built a part of at most maxKeys keys at a
// time, so that a report of every key is never held built whole: each
// part has the report's header (sequence number, acknowledgements,
// closures) and the next keys in name order, as wire.EncodeParts would
// cut the report (a receiver merges the parts of one sequence number as
// one report). more is true while parts follow; a part's slices are used
// again for the next, so the caller must be done with a part (sent it)
// before it asks for the next. A caller that stops early leaves the keys
// not yet reported to the next report.
func (l *Ledger) OwedReportParts(now time.Duration, maxKeys int) iter.Seq2[*Report, bool] {
	return func(yield func(*Report, bool) bool) {
		if l.fenced || !l.repOwed {
			return
		}
		l.reportParts(now, false, maxKeys, yield)
	}
}

func (l *Ledger) report(now time.Duration, full bool) *Report {
	var out *Report
	l.reportParts(now, full, 0, func(r *Report, _ bool) bool {
		out = r
		return true
	})
	return out
}

// reportParts builds the report, a part of at most maxKeys keys at a time
// (0: one part), and yields each part and whether more follow.
func (l *Ledger) reportParts(now time.Duration, full bool, maxKeys int, yield func(*Report, bool) bool) {
	if !l.everOK {
		return
	}
	// A report built while a Tick's is owed is that report too.
	resyncing := false
	if l.repOwed {
		full = full || l.owedFull
		if l.owedResync {
			l.resync, resyncing = false, true
		}
		l.repOwed, l.owedFull, l.owedResync = false, false, false
	}
	room := l.paceRoom(now)
	l.ackOwed = 0
	l.rseq++
	l.lastSent = now
	for s, t := range l.sent {
		if now-t.at > sentKept*l.cfg.Lease {
			delete(l.sent, s)
		}
	}
	r := &Report{From: l.names[l.self], Inc: l.inc, Seq: l.rseq, Base: l.base}
	for i := range l.peers {
		p := &l.peers[i]
		if i == l.self {
			continue
		}
		if p.frozenInc > 0 {
			r.Acks = append(r.Acks, Ack{Region: p.name, Inc: p.frozenInc, Frozen: true})
		}
		if p.seen {
			r.Acks = append(r.Acks, Ack{Region: p.name, Inc: p.inc, Seq: p.lastSeq})
		}
	}
	sort.Slice(r.Acks, func(a, b int) bool {
		x, y := r.Acks[a], r.Acks[b]
		return x.Region < y.Region || x.Region == y.Region && x.Inc < y.Inc
	})
	// The keys to report, in name order (Ledger.sorted): counted, then
	// reported, two passes and no sort.
	l.mergeKeys()
	due := func(k *key) bool {
		return !gone(k) && (k.dirty || full && (k.active || !l.idleDone(k)))
	}
	// Pacing (pace.go): at most room keys, from the first due key at or
	// after paceFrom on, wrapping round; those taken from the start (low)
	// come first in name order, then those from paceFrom on (high), so
	// the report stays in name order.
	from := 0
	if l.paceFrom != "" {
		from = sort.Search(len(l.sorted), func(i int) bool { return l.sorted[i].name >= l.paceFrom })
	}
	nLow, nHigh := 0, 0
	for i, k := range l.sorted {
		if due(k) {
			if i < from {
				nLow++
			} else {
				nHigh++
			}
		}
	}
	takeHigh := min(nHigh, room)
	takeLow := min(nLow, room-takeHigh)
	n := takeLow + takeHigh
	cut := n < nLow+nHigh
	var cursorLow, cursorHigh string
	// Closures do not depend on the keys: computed before them, every
	// part carries them.
	r.Closes = l.closures(r.Seq)
	// The keys' counters share one array, cut as it fills (a report of n
	// keys is a few allocations, not 2n); peers in name order
	// (Ledger.order), so each key's counters come out sorted by region.
	// With parts, a part's keys and its array are used again for the next.
	part := n
	if maxKeys > 0 {
		part = min(n, maxKeys)
	}
	var arena []Counter
	r.Keys = make([]KeyReport, 0, part)
	for i, k := range l.sorted {
		if !due(k) {
			continue
		}
		if i < from {
			if takeLow == 0 {
				if cursorLow == "" {
					cursorLow = k.name
				}
				continue
			}
			takeLow--
		} else {
			if takeHigh == 0 {
				if cursorHigh == "" {
					cursorHigh = k.name
				}
				continue
			}
			takeHigh--
		}
		// A whole part, and k is due: more to come (without parts, part is
		// every due key, so this never holds).
		if len(r.Keys) == part {
			l.sent[l.rseq] = sentReport{now, l.keysSent} // the keys sent so far: a caller may stop here
			if !yield(r, true) {
				return
			}
			clear(r.Keys)
			r.Keys, arena = r.Keys[:0], arena[:0]
		}
		k.dirty = false
		kr := KeyReport{Key: k.name, Demand: k.reported(), Position: l.position(k), Retire: k.retireSeq()}
		if cap(arena)-len(arena) < 2*len(l.order) {
			size := min(part, 512)
			if maxKeys > 0 {
				size = part // one array a part
			}
			arena = make([]Counter, 0, 2*len(l.order)*size)
		}
		kr.Gave, arena = l.counters(k, arena, true)
		kr.Applied, arena = l.counters(k, arena, false)
		r.Keys = append(r.Keys, kr)
		l.keysSent++
	}
	l.cut = cut
	switch {
	case cut: // the rest next time, from the first left out (pace.go)
		l.stats.Paced++
		l.paceFrom = cursorHigh
		if l.paceFrom == "" {
			l.paceFrom = cursorLow
		}
		l.resync = l.resync || resyncing
	case full: // after the keys: this report counts for idleDone from now on
		copy(l.fullAt[:], l.fullAt[1:])
		l.fullAt[len(l.fullAt)-1] = now
		fallthrough
	default:
		l.paceFrom = ""
	}
	l.sent[l.rseq] = sentReport{now, l.keysSent}
	yield(r, false)
}

// counters appends k's nonzero confirmed gifts (gave) or applied receipts
// (!gave) to arena, peers in name order, and returns them as a slice of
// their own (nil when none: a later append cannot reach the next key's)
// with the grown arena.
func (l *Ledger) counters(k *key, arena []Counter, gave bool) ([]Counter, []Counter) {
	start := len(arena)
	for _, i := range l.order {
		pr := l.pair(k, i)
		v := pr.recv
		if gave {
			v = pr.conf
		}
		if v > 0 {
			arena = append(arena, Counter{l.names[i], l.peers[i].inc, v})
		}
	}
	if len(arena) == start {
		return nil, arena
	}
	return arena[start:len(arena):len(arena)], arena
}
