package ledger

import (
	"math"
	"time"
)

// Pacing the reports to the peers' acknowledgements (Config.PaceKeys).
//
// A link between regions that is up but slower than the reports (a
// gateway link throttled, a congested path) delivers every report, in
// order and ever later: its backlog grows for as long as the link is
// slow. Nothing fences (the reports arrive, and with two regions the
// witness keeps the lease), while every gift in the backlog is in flight,
// lowered at the giver and not yet raised at the receiver: measured before
// pacing, a 20 KB/s link under 1,000 moving keys left both regions of a
// global limit admitting nothing for as long as it lasted. So a report
// carries keys only while the peers keep up with them:
//
//   - In flight to a peer are the key reports of ours sent after the
//     newest report it acknowledged (Ledger.keysSent at each report:
//     sentReport).
//   - Each peer has a window of key reports in flight: PaceKeys when the
//     ledger starts, grown by the keys the peer acknowledges while it
//     acknowledges within paceTarget (1 s: a healthy link's round trip
//     and the peer's next Tick are well within it), up to twice the keys
//     that were in flight or twice the keys held (room for a full report
//     and what follows it), so that on a link that keeps up it doubles
//     every acknowledgement round until it no longer holds anything back;
//     halved (never below PaceKeys) when a report is acknowledged later
//     than that, once a round trip. Behind a link slower than the
//     reports about a second of them then waits in it, however long it
//     stays slow, where the backlog grew without end.
//   - Every peer heard within the lease paces us, and so does one not
//     heard yet for the first lease of the ledger (so the first reports
//     do not flood a slow link before a peer has answered); a peer we
//     froze does not (a region lost must not hold back the survivors),
//     nor one silent for a lease (it may hold them back for that lease).
//     A peer that is heard but hears nothing of us (a link cut one way,
//     a report key it lacks) holds back our keys to every peer until it
//     freezes us, or we fence: the pair could not move shares anyway.
//   - A report carries at most the smallest room left in the windows
//     (none when a window is full: the report has its header only, the
//     acknowledgements and closures that leases and retirements need). The
//     keys it leaves out stay due, and the next report starts at the first
//     of them and wraps round (the report stays in name order: the keys
//     taken after the wrap come first), so no key waits behind keys that
//     change at every report. While no key fits, a change makes no report:
//     only the heartbeat does, and a report with the acknowledgements once
//     a peer's report with keys was heard (so that the peer's window is
//     not held by our heartbeat), so a sender held back does not fill the
//     link with headers.
//
// Safety does not depend on pacing: for the proof a key left out of a
// report is a report part lost, which it tolerates (a part's keys reach
// the peer later or never; acknowledgements and closures are in every
// part). A full report cut short does not count as one for idle keys
// (Ledger.idleDone): they stay in the full reports until three went out
// whole, once the link keeps up. A receiver reads a key its sender left
// out of 8 FullEvery reports as idle at the sender (Ledger.retireStep):
// a rotation slower than that (more keys than the link carries in that
// many reports) costs allocation accuracy on the keys it has not reached,
// not safety.

// sentKept: the reports of ours sent within sentKept leases are kept
// (Ledger.sent), so that an acknowledgement that waited in a slow link
// for longer than the lease still counts for pacing (the lease counts
// only the newest acknowledged send, so older ones change nothing there).
const sentKept = 3

// sentReport is one report of ours: when it was sent and Ledger.keysSent
// once its keys were.
type sentReport struct {
	at   time.Duration
	keys int64
}

// paceTarget is the acknowledgement age above which a window is halved:
// a second, or the heartbeat and two intervals if longer (a slower sync
// interval), at most half the lease. On a healthy link a report is
// acknowledged within the round trip and the peer's next Tick, or, by a
// peer with nothing to report, in its heartbeat (685 ms at the defaults):
// a peer acknowledges a report of paceAckKeys keys or more at its next
// Tick (ackDue), so that the reports large enough to fill a window are
// never acknowledged by the heartbeat alone.
func (l *Ledger) paceTarget() time.Duration {
	return min(max(time.Second, l.cfg.heartbeat()+2*l.cfg.Interval), l.cfg.Lease/2)
}

// paceAckKeys is the fewest keys of a peer's report that make our next
// Tick report, to acknowledge it: PaceKeys/16 (64 at the default), so
// that such an acknowledgement costs a few percent of the report's bytes.
func (l *Ledger) paceAckKeys() int { return max(1, l.cfg.PaceKeys/16) }

// ackDue reports whether a Tick reports only to acknowledge the peers'
// reports heard since our last report: one of paceAckKeys keys or more,
// or, while no key of ours fits (room 0), any with keys.
func (l *Ledger) ackDue(room int) bool {
	return l.cfg.PaceKeys > 0 && (l.ackOwed >= l.paceAckKeys() || room == 0 && l.ackOwed > 0)
}

// ackedReport records that peer p acknowledged our report s (newer than
// any it acknowledged before) at now, and adjusts its window.
func (l *Ledger) ackedReport(p *peer, s sentReport, now time.Duration) {
	p.ackedSend = s.at
	newly := s.keys - p.ackedKeys
	if newly <= 0 {
		return // no key reports newly acknowledged
	}
	inflight := l.keysSent - p.ackedKeys
	p.ackedKeys = s.keys
	if l.cfg.PaceKeys <= 0 {
		return
	}
	if age := now - s.at; age > l.paceTarget() {
		if now-p.halved > age { // once a round trip
			p.window, p.halved = max(int64(l.cfg.PaceKeys), p.window/2), now
		}
	} else {
		p.window = min(p.window+newly, max(int64(l.cfg.PaceKeys), 2*inflight, 2*int64(len(l.keys))))
	}
}

// paceRoom returns how many keys the next report may carry: the smallest
// room left in the windows of the peers that pace us, or math.MaxInt
// when none does.
func (l *Ledger) paceRoom(now time.Duration) int {
	room := math.MaxInt
	for i := range l.peers {
		p := &l.peers[i]
		if i == l.self || p.window == 0 || now-p.heard > l.cfg.Lease || !p.seen && p.frozenInc > 0 {
			continue
		}
		left := p.window - (l.keysSent - p.ackedKeys)
		room = min(room, int(max(left, 0)))
	}
	return room
}
