package ledger

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Retirement: how a key's counters are forgotten (see "Idle keys" in the
// package doc for the protocol and its proof). The hooks in Tick, Receive,
// report, check and plausible call the functions of this file.

// retireState is the bookkeeping of a key this region is retiring; nil for
// every other key.
type retireState struct {
	seq    uint64 // this retirement's number (Ledger.retires), in our reports' KeyReport.Retire
	closed []bool // per region: the peer closed its pair with us for seq
}

// closeID names one closure we sent: a peer's retirement of a key.
type closeID struct {
	key  string
	peer int
}

// closing is a closure we repeat in every report, from the first that
// carries it, until the peer acknowledges one of those reports.
type closing struct {
	inc    uint64 // the peer incarnation that retires
	retire uint64 // its retirement number
	since  uint64 // our first report carrying the closure; 0 until one does
}

// closureBytes is what Config.MaxClosureBytes counts for a closure of key:
// at least its encoded size (the key with its length, the region's index,
// the incarnation and the retirement number: sync/wire).
func closureBytes(key string) int { return len(key) + 24 }

// mark is a per-peer watermark: the keys of a report of incarnation inc with
// a sequence below seq are ignored (counters from before a pair's restart).
type mark struct{ inc, seq uint64 }

func (k *key) retiring() bool { return k.retState() != nil }

// retState is the key's retirement, nil unless this region retires it.
func (k *key) retState() *retireState {
	if k.rare == nil {
		return nil
	}
	return k.rare.ret
}

func (k *key) retireSeq() uint64 {
	if !k.retiring() {
		return 0
	}
	return k.rare.ret.seq
}

func zeroPair(pr *pair) bool {
	return pr.give == 0 && pr.conf == 0 && pr.recv == 0 && pr.peerApplied == 0
}

// stale reports whether the keys of r (from peer i) come from before a
// restart of one of its pairs with us, and so must be ignored.
func (l *Ledger) stale(i int, r *Report) bool {
	if l.marks == nil {
		return false
	}
	m := l.marks[i]
	return m.inc == r.Inc && r.Seq < m.seq
}

func (l *Ledger) raiseMark(i int, r *Report) {
	if l.marks == nil {
		l.marks = make([]mark, len(l.names))
	}
	m := &l.marks[i]
	if m.inc != r.Inc {
		*m = mark{inc: r.Inc}
	}
	m.seq = max(m.seq, r.Seq)
}

// countersFor returns a key report's counters for this incarnation: units
// it gave us (confirmed) and units of our gifts it applied.
func (l *Ledger) countersFor(kr *KeyReport) (gave, applied int64) {
	me := l.names[l.self]
	for _, c := range kr.Gave {
		if c.Region == me && c.Inc == l.inc {
			gave = c.Units
		}
	}
	for _, c := range kr.Applied {
		if c.Region == me && c.Inc == l.inc {
			applied = c.Units
		}
	}
	return gave, applied
}

// rebase restarts the pair of k with peer i: a units of our gifts and b
// units of its gifts are taken out of the pair's counters into the key's
// ended terms (frozen), which leaves the position unchanged; gifts beyond a
// stay in flight in the new counters.
func (l *Ledger) rebase(k *key, i int, a, b int64) {
	pr := l.pair(k, i)
	k.addFrozen(b - a)
	pr.give -= a
	pr.conf -= a
	pr.peerApplied = max(0, pr.peerApplied-a)
	pr.recv -= b
	l.snaps(k, func(s snap) {
		if s.inc(i) == l.peers[i].inc {
			s.setGive(i, max(0, s.give(i)-a))
		}
	})
	k.dirty = true
}

// exempt reports whether the counters of kr (from peer i in r) are outside
// the checks that compare them with our pair (backwards, plausible): they
// are ignored (a stale report, a key we are retiring) or handled by
// retireKey (a retirement, checked by checkRetire).
func (l *Ledger) exempt(i int, r *Report, kr *KeyReport, k *key) bool {
	if kr.Retire != 0 || l.stale(i, r) {
		return true
	}
	return k != nil && k.retiring()
}

// checkRetire validates the retirement fields of a report from peer i.
func (l *Ledger) checkRetire(i int, r *Report) error {
	for j, c := range r.Closes {
		if l.index(c.Region) < 0 {
			return fmt.Errorf("%w: closure for %q", ErrUnknownRegion, c.Region)
		}
		if c.Inc == 0 || c.Retire == 0 {
			return fmt.Errorf("%w: closure with zero incarnation or retirement", ErrMalformed)
		}
		if j > 0 {
			p := r.Closes[j-1]
			if p.Key > c.Key || p.Key == c.Key && (p.Region > c.Region || p.Region == c.Region && p.Inc >= c.Inc) {
				return fmt.Errorf("%w: closures not sorted", ErrMalformed)
			}
		}
	}
	if l.stale(i, r) || r.Inc != l.peers[i].inc {
		return nil
	}
	for _, kr := range r.Keys {
		if kr.Retire == 0 {
			continue
		}
		k := l.keys[kr.Key]
		if k == nil || k.retiring() {
			continue
		}
		if c, ok := l.closing[closeID{kr.Key, i}]; ok && c.inc == r.Inc && c.retire == kr.Retire {
			continue
		}
		// The counters we are about to apply and close with: the gift
		// counter never below what we applied, the applied one never above
		// what we confirmed (as plausible checks for any report).
		pr := l.pair(k, i)
		gave, applied := l.countersFor(&kr)
		if gave != applied || gave < pr.recv || applied > pr.conf {
			// (A region retires only a key whose pairs are net zero.)
			return fmt.Errorf("%w: %s retires %q at gave %d applied %d, we applied %d and confirmed %d",
				ErrImplausible, r.From, kr.Key, gave, applied, pr.recv, pr.conf)
		}
		if gave-pr.recv > l.maxHold(l.self)-l.publishedUnits(k) {
			return fmt.Errorf("%w: %s retires %q with a gift above what we can hold", ErrImplausible, r.From, kr.Key)
		}
	}
	return nil
}

// retireAcks handles the retirement parts of a report from peer i that do
// not belong to one key: acknowledgements of our closures, and closures of
// our retirements. It runs after the report's acks.
func (l *Ledger) retireAcks(now time.Duration, i int, r *Report) {
	if l.stale(i, r) {
		return
	}
	me := l.names[l.self]
	if len(l.closing) > 0 {
		var acked uint64
		for _, a := range r.Acks {
			if a.Region == me && a.Inc == l.inc && !a.Frozen {
				acked = a.Seq
			}
		}
		for id, c := range l.closing {
			if id.peer == i && (c.inc != r.Inc || c.since != 0 && c.since <= acked) {
				// The peer processed a report carrying the closure before
				// sending this one (every report since the first carrying
				// it carries it): its reports from this one on count the
				// pair afresh (or come from a newer incarnation).
				delete(l.closing, id)
				l.raiseMark(i, r)
			}
		}
	}
	for _, c := range r.Closes {
		if c.Region != me || c.Inc != l.inc {
			continue
		}
		k := l.keys[c.Key]
		if k == nil || k.retireSeq() != c.Retire || k.retState().closed[i] {
			continue
		}
		pr := l.pair(k, i)
		l.rebase(k, i, pr.give, pr.recv)
		k.rare.ret.closed[i] = true
		l.raiseMark(i, r)
		l.finishRetire(k, now)
	}
}

// retireKey handles one key report of peer i when retirement is involved;
// it returns false when Receive should merge the report as usual.
func (l *Ledger) retireKey(now time.Duration, i int, r *Report, kr *KeyReport, k *key, out *Output) bool {
	if l.stale(i, r) {
		return true
	}
	gave, applied := l.countersFor(kr)
	if kr.Retire == 0 {
		if k == nil {
			// A key we hold nothing for, at the sender's base with no
			// demand and no counters for us, would make a state equal to
			// none: keep none (an idle key a peer still reports).
			return gave == 0 && applied == 0 && kr.Demand == 0 && kr.Position == r.Base
		}
		// A key we retire takes no counters until its retirement is over.
		return k.retiring()
	}
	if gave == 0 && applied == 0 {
		return true // nothing between us in this pair: nothing to close
	}
	id := closeID{kr.Key, i}
	if c, ok := l.closing[id]; ok && c.inc == r.Inc && c.retire == kr.Retire {
		return true // closed already: the closure goes out in every report
	}
	if k == nil {
		k = l.key(kr.Key)
	}
	pr := l.pair(k, i)
	if r.Seq > pr.peerSeq {
		pr.peerSeq, pr.peerPos, pr.peerDemand = r.Seq, kr.Position, kr.Demand
	}
	raised := false
	if !k.retiring() {
		// Apply its final gift counter, then restart the pair at the
		// final counters; what we gave beyond what it applied stays in
		// flight. (Retiring ourselves, the pair is balanced: see the doc.)
		if gave > pr.recv {
			pr.recv, raised = gave, true
		}
		pr.peerApplied = max(pr.peerApplied, applied)
	}
	l.rebase(k, i, applied, gave)
	if k.retiring() {
		k.rare.ret.closed[i] = true
	}
	if l.closing == nil {
		l.closing = map[closeID]closing{}
	}
	id.key = strings.Clone(id.key) // kept: not a string of the report's message
	l.closing[id] = closing{inc: r.Inc, retire: kr.Retire}
	l.raiseMark(i, r)
	if raised {
		k.active, k.lastUse = true, now
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	l.finishRetire(k, now)
	return true
}

// Closures returns how many closures of peers' retirements this ledger
// holds until their acknowledgement: carried in its reports, and waiting
// for room in them (Config.MaxClosureBytes; a closure new since the last
// report waits for the next one too). Closures waiting report after report
// say that retirements queue for the room: the agent exports both
// (apportion_sync_closures). It visits every closure held: call it at
// most once a tick or so.
func (l *Ledger) Closures() (carried, waiting int) {
	for _, c := range l.closing {
		if c.since != 0 {
			carried++
		} else {
			waiting++
		}
	}
	return carried, waiting
}

// closures returns the closures to carry in report seq, sorted: every
// closure already carried (a closure, once carried, is in every report
// until acknowledged: retireAcks relies on it), then the others in order
// while the report's closures stay within MaxClosureBytes, and beyond it
// the first waiting closure of each peer none is carried to (at most one
// per peer, so at most the regions' count over the room). Those left wait
// for acknowledgements of the carried ones: the pair is restarted already,
// and the retiring peer ignores our counters on the key until it reads the
// closure, so a closure that waits delays the retirement and nothing else
// (the package doc, Idle keys). Each peer acknowledges on its own, so a
// closure to one peer never waits for another's acknowledgement: with room
// for one closure in all, the closures of a region retiring keys with
// nine peers drained one acknowledgement round trip at a time, every peer
// in turn (TestRandomized with LEDGER_REGIONS=10, seed 39: two retirements
// still waiting for their closures at the end of the calm phase).
func (l *Ledger) closures(seq uint64) []Closure {
	if len(l.closing) == 0 {
		return nil
	}
	var carried, waiting []closeID
	size := 0
	to := l.scratch.closeTo[:0] // per region: a closure is carried to it
	for range l.names {
		to = append(to, false)
	}
	l.scratch.closeTo = to
	for id, c := range l.closing {
		if c.inc != l.peers[id.peer].inc {
			delete(l.closing, id) // that incarnation is frozen: its pairs are gone
			continue
		}
		if c.since != 0 {
			carried = append(carried, id)
			size += closureBytes(id.key)
			to[id.peer] = true
		} else {
			waiting = append(waiting, id)
		}
	}
	less := func(x, y closeID) int {
		if c := strings.Compare(x.key, y.key); c != 0 {
			return c
		}
		return strings.Compare(l.names[x.peer], l.names[y.peer])
	}
	slices.SortFunc(waiting, less) // deterministic: the same closures wait in every run
	full := false
	for _, id := range waiting {
		if n := size + closureBytes(id.key); n > l.cfg.MaxClosureBytes && len(carried) > 0 {
			full = true
		}
		if full && to[id.peer] {
			continue
		}
		c := l.closing[id]
		c.since = seq
		l.closing[id] = c
		carried = append(carried, id)
		size += closureBytes(id.key)
		to[id.peer] = true
	}
	// One closing per key and peer, so (Key, Region) orders them as the
	// report needs (Key, Region, Inc).
	slices.SortFunc(carried, less)
	out := make([]Closure, len(carried))
	for j, id := range carried {
		c := l.closing[id]
		out[j] = Closure{Key: id.key, Region: l.names[id.peer], Inc: c.inc, Retire: c.retire}
	}
	return out
}

// quiet reports whether k may retire or be forgotten: idle and released,
// at the base with nothing paid, no usage for IdleAfter, its last store
// write confirmed.
func (l *Ledger) quiet(k *key, now time.Duration) bool {
	if k.active || k.extra() != 0 || k.frozen() != 0 || k.used != 0 || k.demand != 0 || now-k.lastUse < l.cfg.IdleAfter ||
		k.force || k.gifted || l.position(k) != l.base {
		return false
	}
	return !k.written || k.wRelease && k.confSeq >= k.wSeq
}

// retireStep runs once per Tick for every key held: it forgets a quiet key
// whose pairs are all zero, starts the retirement of a quiet key whose
// gifts are all confirmed and applied, and keeps a retiring key reported.
func (l *Ledger) retireStep(k *key, now time.Duration) {
	// A peer reports every key it coordinates in every full report: one
	// it has not reported in 8 FullEvery reports (at least two full ones,
	// with up to three reports an interval: the tick's and confirmations')
	// holds no state or is idle (at its base, no demand), whatever its last
	// report said.
	for i := range l.names {
		if i == l.self {
			continue
		}
		pr := l.pair(k, i)
		if pr.peerSeq > 0 && l.peers[i].lastSeq > pr.peerSeq+uint64(8*l.cfg.FullEvery) {
			pr.peerSeq, pr.peerPos, pr.peerDemand = 0, 0, 0
		}
	}
	if k.retiring() {
		k.dirty = true
		l.finishRetire(k, now)
		return
	}
	if !l.quiet(k, now) {
		return
	}
	zero, net := true, false
	for i := range l.names {
		if i == l.self {
			continue
		}
		pr := l.pair(k, i)
		if pr.give != pr.conf || pr.conf != pr.peerApplied {
			return // a gift in flight
		}
		net = net || pr.recv != pr.give
		zero = zero && zeroPair(pr)
	}
	if net {
		// The pair's units not back where they came from: settle first.
		l.settleStart(k, now) // settle.go
		return
	}
	if zero {
		// Nothing to protect: as if never seen, once peers have had the
		// idle key in its last reports (they would keep a demand they
		// last heard otherwise).
		if l.idleDone(k) {
			l.forget(k)
		}
		return
	}
	l.retires++
	k.rareState().ret = &retireState{seq: l.retires, closed: make([]bool, len(l.names))}
	k.dirty = true
}

// finishRetire ends the retirement of k once every pair is closed or zero,
// and forgets k if nothing else holds it.
func (l *Ledger) finishRetire(k *key, now time.Duration) {
	if !k.retiring() {
		return
	}
	for i := range l.names {
		if i != l.self && !k.rare.ret.closed[i] && !zeroPair(l.pair(k, i)) {
			return
		}
	}
	k.rare.ret = nil
	k.dropRare()
	k.dirty = true
	if l.quiet(k, now) {
		ps := l.pairsOf(k)
		for i := range ps { // every peer's pair
			if !zeroPair(&ps[i]) {
				return // gifts in flight in the new counters: stays, idle
			}
		}
		l.forget(k)
		return
	}
	if k.used > 0 || k.demand > 0 || k.extra() != 0 || l.position(k) != l.base {
		k.active = true
	}
}

// restWants handles a key nobody wants more than its floor of: it makes
// every live region's base (above its floor) its want, so the allocator's
// targets are the bases whenever they account for the pool, and keys go
// back to their static shares, leave coordination and are forgotten. (The
// allocator's split of no demand, by weight, differs from the bases once a
// region has restarted: such keys would stay coordinated for good.) It
// reports whether it did.
func (l *Ledger) restWants(idx []int, wants []Want) bool {
	for j := range idx {
		if wants[j].Demand != 0 {
			return false
		}
	}
	for j, i := range idx {
		b := l.base
		if i != l.self {
			b = l.peers[i].base
		}
		wants[j].Demand = b - l.floor[i]
	}
	return true
}

// idleFullReports is how many full reports carry a key after it went idle,
// so that a peer that lost one or two still learns it is idle.
const idleFullReports = 3

// idleDone reports whether idleFullReports full reports have carried k
// since it went idle (report keeps an idle key in full reports until then;
// retire forgets a key with all pairs zero only after). Counted in full
// reports, not in time: until 3 December 2026 an idle key stayed in full
// reports for 3 FullEvery heartbeats (16.4 s at the defaults) even when
// reports went out at every Tick, so an agent with many keys moving
// carried each idle key 6.85 times as long as it needed to (`go run
// ./cmd/rlsim run simulations/scenarios/hot-key.yaml --duration 60s`: 634
// B/key/s against 452 with this count, same utilization).
func (l *Ledger) idleDone(k *key) bool { return l.fullAt[0] >= k.idleAt }

// idleReported bounds how long an idle key stays in full reports: three
// full reports, FullEvery reports apart, each at most reportEvery apart.
func (l *Ledger) idleReported() time.Duration {
	return idleFullReports * time.Duration(l.cfg.FullEvery) * l.cfg.reportEvery()
}

func (l *Ledger) forget(k *key) {
	delete(l.keys, k.name)
	k.pairs = nil // gone(k): Ledger.sorted drops it
	l.stats.Forgotten++
}
