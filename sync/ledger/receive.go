package ledger

import (
	"errors"
	"fmt"
	"sort"
	"time"
)

func validCounters(cs []Counter, known func(string) bool) bool {
	for j, c := range cs {
		if !known(c.Region) || c.Inc == 0 || c.Units < 0 || j > 0 && cs[j-1].Region >= c.Region {
			return false
		}
	}
	return true
}

// Receive merges a peer's report. A report that is malformed, names unknown
// regions, comes from a stale or frozen incarnation, or carries a counter that
// went backwards is rejected whole: it returns an error and changes nothing.
// A key's demand is not checked but bounded to [0, DemandCap whole limits]
// (Config.readDemand): it is the allocator's input, never a counter's.
// The returned Output carries the raises the report allows (and may fence).
func (l *Ledger) Receive(now time.Duration, r Report) (Output, error) {
	if l.fenced {
		return Output{Fenced: true}, ErrFenced
	}
	ks, err := l.check(r)
	if err != nil {
		l.stats.Rejected++
		if errors.Is(err, ErrFrozenIncarnation) && l.frozenBy(r) && !l.superseded(r) {
			// We ignore the sender, but it tells us it froze us: both
			// incarnations are over for each other, and neither would
			// ever take the other's gifts again; ours ends here, so that
			// our successor pairs with it anew. Not if we know a later
			// incarnation of the sender: it is over, we pair with its
			// successor, and its report is late or replayed (an
			// adversary replaying a dead incarnation's freeze fenced a
			// live region 13 s after a heal: TestRandomizedAdversary's
			// seed 141 of 300).
			return l.fence(), err
		}
		return Output{}, err
	}
	var out Output
	i := l.index(r.From)
	p := &l.peers[i]
	if r.Inc > p.inc {
		out.Contributions = l.freeze(i, r.Inc-1, now)
		clear(p.heardOf) // what its predecessor heard is not in its positions
	}
	newer := r.Seq > p.lastSeq
	// A peer heard again after a silence of more than two report periods
	// (a cut, or a restart) most likely missed our reports too: the next
	// Tick repairs what it missed with a full report at once, instead of
	// after up to FullEvery reports (FullEvery heartbeats, with nothing
	// changed). With a report at every Tick (no heartbeat above the
	// interval, the default) one lost report is a silence of two intervals
	// give or take the jitter, and not a cut: the silence must pass two
	// intervals and a half (Config.silence; at two, 1% loss with 5 ms of
	// jitter made a full report of every key out of half the losses: rlsim
	// hot-key, a third more full reports once the agent sent one message
	// per interval). It delays the repair of cuts that short: of
	// TestRandomized's seeds 1 to 2,000, seed 292 healed in 5.35 s instead
	// of at most 4.1 s (bound 7.1 s). With a heartbeat, two of its periods
	// stay the threshold (at two and a half, TestPartitionDuringShift's
	// five-region cuts healed in 1.75 s instead of 1.41 s, above their
	// bound).
	gap := l.cfg.silence()
	if p.seen && r.Inc == p.inc && now-p.heard > gap || r.Inc > p.inc {
		l.resync = true
	}
	p.seen, p.mayFreeze, p.heard = true, true, now
	l.ackOwed = max(l.ackOwed, len(r.Keys))
	p.took = 0 // a take counts only for the silence it ended (WitnessTaken)
	if newer {
		p.lastSeq, p.base = r.Seq, r.Base
	}
	me := l.names[l.self]
	for _, a := range r.Acks {
		if j := l.index(a.Region); j >= 0 && !a.Frozen {
			if h := &p.heardOf[j]; a.Inc > h.inc || a.Inc == h.inc && a.Seq > h.seq {
				*h = heard{a.Inc, a.Seq}
			}
		}
		if a.Region != me || a.Inc != l.inc {
			continue
		}
		if a.Frozen {
			l.told = true
		} else if t, ok := l.sent[a.Seq]; ok && t.at > p.ackedSend {
			if t.at-p.ackedSend > gap {
				l.resync = true // it acknowledged none of ours for a while: a cut one way
			}
			l.ackedReport(p, t, now)
		}
	}
	if l.told {
		return l.fence(), nil
	}
	l.retireAcks(now, i, &r) // may forget keys: gone(k) below
	for j, kr := range r.Keys {
		// check's lookup (none here: the loop is that of the agent's
		// busiest input); a key forgotten since is none (a key report
		// creates or forgets its own key only, so check's hold for the rest).
		k := ks[j]
		kr.Demand = l.cfg.readDemand(kr.Demand) // allocator input only: bounded, never refused (demand.go)
		if k != nil && gone(k) {
			k = nil
		}
		if l.retireKey(now, i, &r, &kr, k, &out) {
			continue
		}
		if k == nil {
			k = l.key(kr.Key)
		}
		pr := l.pair(k, i)
		if r.Seq > pr.peerSeq {
			pr.peerSeq, pr.peerPos, pr.peerDemand = r.Seq, kr.Position, kr.Demand
		}
		for _, c := range kr.Gave {
			if c.Region == me && c.Inc == l.inc && c.Units > pr.recv {
				pr.recv = c.Units
				k.active, k.dirty = true, true
			}
		}
		for _, c := range kr.Applied {
			if c.Region == me && c.Inc == l.inc && c.Units > pr.peerApplied {
				pr.peerApplied = c.Units
			}
		}
		if !k.active && (kr.Demand > 0 || kr.Position != r.Base) {
			k.active, k.dirty = true, true
			k.lastUse = now
		}
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	return out, nil
}

func (l *Ledger) frozenBy(r Report) bool {
	for _, a := range r.Acks {
		if a.Region == l.names[l.self] && a.Inc == l.inc && a.Frozen {
			return true
		}
	}
	return false
}

// superseded reports whether r's sender incarnation, one we froze, has a
// successor we have heard from or know of: one we froze too, or one the
// registry showed registered (Start.Live, a reclaim record). Freeze leaves
// peer.inc at the frozen incarnation's next, which may not exist, so that
// alone proves nothing.
func (l *Ledger) superseded(r Report) bool {
	p := &l.peers[l.index(r.From)]
	return p.inc > r.Inc+1 || p.inc == r.Inc+1 && p.seen || p.known > r.Inc
}

// mergeSpan: check merges a report with the ledger's keys when the keys held
// from its first key to its last are at most mergeSpan times the keys it
// names (a merge visits each of them once, in order; a lookup costs a hash
// and a probe). A full report, or a part of one (wire.EncodeParts cuts a
// report into parts of consecutive keys), names every key of its span.
const mergeSpan = 2

// mergeFrom returns where in l.sorted a merge with keys (sorted) starts,
// or -1 if a lookup per key is cheaper (mergeSpan). l.sorted must be
// merged (mergeKeys).
func (l *Ledger) mergeFrom(keys []KeyReport) int {
	if len(keys) < 2 {
		return -1
	}
	s := l.sorted
	lo := sort.Search(len(s), func(i int) bool { return s[i].name >= keys[0].Key })
	hi := sort.Search(len(s), func(i int) bool { return s[i].name > keys[len(keys)-1].Key })
	if hi-lo > mergeSpan*len(keys) {
		return -1
	}
	return lo
}

// check checks r and returns the keys its key reports name (nil for a key
// not held), looked up once for the checks and Receive's merge.
func (l *Ledger) check(r Report) ([]*key, error) {
	i := l.index(r.From)
	if i < 0 || i == l.self {
		return nil, fmt.Errorf("%w: from %q", ErrUnknownRegion, r.From)
	}
	if r.Inc == 0 || r.Seq == 0 || r.Base < 0 {
		return nil, fmt.Errorf("%w: zero incarnation or sequence, or negative base", ErrMalformed)
	}
	p := &l.peers[i]
	if r.Inc <= p.frozenInc {
		return nil, fmt.Errorf("%w: %s/%d", ErrFrozenIncarnation, r.From, r.Inc)
	}
	if r.Inc < p.inc {
		return nil, fmt.Errorf("%w: %s/%d < %d", ErrStaleIncarnation, r.From, r.Inc, p.inc)
	}
	known := func(n string) bool { return l.index(n) >= 0 }
	for j, a := range r.Acks {
		if !known(a.Region) {
			return nil, fmt.Errorf("%w: ack for %q", ErrUnknownRegion, a.Region)
		}
		if j > 0 && (r.Acks[j-1].Region > a.Region || r.Acks[j-1].Region == a.Region && r.Acks[j-1].Inc >= a.Inc) {
			return nil, fmt.Errorf("%w: acks not sorted", ErrMalformed)
		}
	}
	same := r.Inc == p.inc && p.seen
	me := l.names[l.self]
	// Each key report's key, looked up once for check, plausible and
	// Receive (a slice per call: kept in the ledger it would cost 8 B per
	// key).
	ks := make([]*key, 0, len(r.Keys))
	// A report naming most of the keys of its span is matched against
	// Ledger.sorted in one merge (both in name order) instead of a map
	// lookup per key: at 100,000 keys the lookups were a third of check's
	// time (BenchmarkAgent100kKeys' profile). The loop checks the order
	// of r.Keys at each key before the merge relies on it, and returns
	// the error at the first key out of order.
	l.mergeKeys()
	w := l.mergeFrom(r.Keys)
	walk := w >= 0
	for j, kr := range r.Keys {
		if j > 0 && r.Keys[j-1].Key >= kr.Key {
			return nil, fmt.Errorf("%w: keys not sorted", ErrMalformed)
		}
		if kr.Position < 0 {
			// A demand out of range is not refused: Receive bounds it
			// (Config.readDemand).
			return nil, fmt.Errorf("%w: negative position", ErrMalformed)
		}
		if !validCounters(kr.Gave, known) || !validCounters(kr.Applied, known) {
			return nil, fmt.Errorf("%w: counters", ErrMalformed)
		}
		var k *key
		if walk {
			for w < len(l.sorted) && l.sorted[w].name < kr.Key {
				w++
			}
			if w < len(l.sorted) && l.sorted[w].name == kr.Key && !gone(l.sorted[w]) {
				k = l.sorted[w]
			}
		} else {
			k = l.keys[kr.Key]
		}
		ks = append(ks, k)
		if !same || k == nil || r.Seq <= p.lastSeq || l.exempt(i, &r, &kr, k) {
			continue
		}
		pr := l.pair(k, i)
		for _, c := range kr.Gave {
			if c.Region == me && c.Inc == l.inc && c.Units < pr.recv {
				return nil, fmt.Errorf("%w: gave %d < %d", ErrBackwards, c.Units, pr.recv)
			}
		}
		for _, c := range kr.Applied {
			if c.Region == me && c.Inc == l.inc && c.Units < pr.peerApplied {
				return nil, fmt.Errorf("%w: applied %d < %d", ErrBackwards, c.Units, pr.peerApplied)
			}
		}
	}
	if err := l.checkRetire(i, &r); err != nil {
		return nil, err
	}
	if err := l.plausible(r, ks); err != nil { // plausible.go
		return nil, err
	}
	return ks, nil
}
