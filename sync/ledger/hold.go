package ledger

import "time"

// Hold tells the ledger that the store refused to lower the key below
// units until the time until from now (a global window that has already
// used that much of its window: a region can give only what it has not
// used). Gifts of the key not yet confirmed are cancelled, a raise back,
// until its position is at least units (pending write versions are capped
// accordingly, so a later confirmation never publishes a cancelled part),
// and until then no gift takes the position below units. The cancelled
// part is given again, if still due, once the store can take it.
//
// Safety does not rest on the hold: the store refuses any record below the
// key's use whatever the ledger writes, and a refused write is never
// confirmed. The hold only keeps the ledger from asking for what the store
// cannot do, so the part it can do moves now rather than at the window's end.
func (l *Ledger) Hold(now time.Duration, name string, units int64, until time.Duration) {
	k := l.keys[name]
	if l.fenced || k == nil || units <= 0 || until <= 0 {
		return
	}
	r := k.rareState()
	r.hold, r.holdUntil = units, now+until
	short := units - l.position(k)
	for i := range l.names {
		if short <= 0 {
			break
		}
		if i == l.self {
			continue
		}
		pr := l.pair(k, i)
		if c := min(pr.give-pr.conf, short); c > 0 {
			pr.give -= c
			short -= c
			l.snaps(k, func(s snap) { s.setGive(i, min(s.give(i), pr.give)) })
			k.dirty, k.gifted = true, true
		}
	}
}

// giveable is how much of position the key may give now: all of it above
// a hold in force.
func (l *Ledger) giveable(k *key, position int64, now time.Duration) int64 {
	r := k.rare
	if r == nil || r.hold <= 0 || now >= r.holdUntil {
		if r != nil {
			r.hold, r.holdUntil = 0, 0
			k.dropRare()
		}
		return position
	}
	return max(position-r.hold, 0)
}
