package ledger

import (
	"errors"
	"fmt"
)

// ErrImplausible is returned by Receive for a report whose values its sender
// could not hold (see plausible). Like every rejection it changes nothing.
var ErrImplausible = errors.New("ledger: implausible report")

// maxHold is the most units region i can ever hold for a key: the whole
// limit less every other region's floor (floors never move).
func (l *Ledger) maxHold(i int) int64 {
	var others int64
	for j, f := range l.floor {
		if j != i {
			others += f
		}
	}
	return l.cfg.Units - others
}

// publishedUnits is the position of k counting only the gifts this region
// has published (confirmed): the bound its store enforces (invariant 1).
func (l *Ledger) publishedUnits(k *key) int64 {
	u := l.base + k.extra() + k.frozen()
	for _, pr := range l.pairsOf(k) {
		u += pr.recv - pr.conf
	}
	return u
}

// plausible checks the counters of a report (from a known peer, checked
// for form by check) against what its sender and this region could hold.
// Every bound holds for any report an honest ledger sends, at any delay,
// so a report that breaks one is forged or corrupt:
//
//   - the sender's base and every position it reports lie between its floor
//     and maxHold (a region never gives below its floor, and the published
//     positions of all regions sum to at most Units, each at least its floor);
//   - a gift to this incarnation never raises this region above maxHold:
//     the giver lowered itself first, so after the raise the published
//     positions still sum to at most Units (a gift never exceeds what its
//     giver could hold, nor a counter's unapplied part the global pool);
//   - the units the sender says it applied of our gifts never exceed what we
//     confirmed to it (it can only apply counters we published).
func (l *Ledger) plausible(r Report, ks []*key) error {
	i := l.index(r.From)
	lo, hi := l.floor[i], l.maxHold(i)
	if r.Base < lo || r.Base > hi {
		return fmt.Errorf("%w: %s base %d outside [%d, %d]", ErrImplausible, r.From, r.Base, lo, hi)
	}
	me, mine := l.names[l.self], l.maxHold(l.self)
	same := r.Inc == l.peers[i].inc // else Receive starts new pairs with r.Inc
	for j, kr := range r.Keys {
		k := ks[j]
		if kr.Position < lo || kr.Position > hi {
			return fmt.Errorf("%w: %s key %q position %d outside [%d, %d]", ErrImplausible, r.From, kr.Key, kr.Position, lo, hi)
		}
		if l.exempt(i, &r, &kr, k) {
			continue // ignored, or checked by checkRetire (retire.go)
		}
		pub, recv, conf := l.base, int64(0), int64(0)
		if k != nil {
			pub = l.publishedUnits(k)
			if same {
				pr := l.pair(k, i)
				recv, conf = pr.recv, pr.conf
			}
		}
		for _, c := range kr.Gave {
			if c.Region == me && c.Inc == l.inc && c.Units > recv && c.Units-recv > mine-pub {
				return fmt.Errorf("%w: %s key %q: a gift of %d would raise us from %d above %d", ErrImplausible, r.From, kr.Key, c.Units-recv, pub, mine)
			}
		}
		for _, c := range kr.Applied {
			if c.Region == me && c.Inc == l.inc && c.Units > conf {
				return fmt.Errorf("%w: %s key %q: applied %d of our gifts, we confirmed %d", ErrImplausible, r.From, kr.Key, c.Units, conf)
			}
		}
	}
	return nil
}
