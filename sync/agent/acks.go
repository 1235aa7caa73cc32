package agent

import (
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/apportion/apportion/sync/wire"
)

// Acknowledgements heard. A peer whose reports this agent accepts, but
// whose reports acknowledge none of this agent's, does not receive them or
// cannot read them: its --report-peer-keys lacks this region's key or has
// another one (it refuses them as unknown_key or bad_signature, counted on
// its side only), it runs a release that reads an older report format
// (then this agent needs --wire-version 2), or the link is cut one way.
// Nothing else in this agent's view looks wrong (the peer is heard), while
// no share can move between the two and this region's lease deadline runs
// out. So apportion_sync_peer_unacknowledged{peer} is 1 for a peer heard
// within the lease that has acknowledged no newer report of this agent for
// two leases while the agent has been publishing for that long, and a WARN
// names the peer and the likely causes (at most once per 10 s per peer).

// ackKey is one peer's acknowledgements of this region in one rule's
// reports.
type ackKey struct{ peer, rule string }

// Acknowledgement age. A peer that reads our reports acknowledges each in
// its next report (within an interval when it has news, a heartbeat when
// not). A link slower than our reports delivers every report, in order
// and ever later: the peer is heard, acknowledges newer reports of ours
// every time, and the backlog hides from every other signal
// (apportion_sync_peer_lag_seconds is the time since the peer's last
// report arrived, not that report's age) while the gifts in it stay in
// flight (docs/operations.md, Capacity planning). So the agent keeps, per
// rule, when it published each report not yet acknowledged by every peer
// (pubs: at most maxPubs, and none older than pubHorizon), and
// apportion_sync_peer_ack_age_seconds{peer} is the age of the oldest
// report that a peer heard within the lease has not acknowledged yet, over
// every rule: under a second on a healthy link, growing by the second on
// one slower than the reports.

// pubEntry is one report of ours handed to NATS.
type pubEntry struct {
	inc, seq uint64
	at       time.Time
}

// maxPubs bounds the reports kept per rule (a minute of them at the
// default interval); pubHorizon bounds their age, and peers that
// acknowledged nothing for that long do not keep them.
const (
	maxPubs    = 600
	pubHorizon = 2 * time.Minute
)

// ackTrack is what the loop knows of the acknowledgements (loop state).
type ackTrack struct {
	last map[ackKey][2]uint64  // the incarnation and sequence last acknowledged
	at   map[string]time.Time  // peer -> when it last acknowledged a newer report of ours
	pubs map[string][]pubEntry // rule -> our reports not yet acknowledged by every peer, oldest first
	// sentSince is when the agent began publishing without a pause of a
	// lease (zero: it has not published), lastSent when it last did.
	sentSince, lastSent time.Time
}

// published records a report part handed to NATS at now.
func (t *ackTrack) published(now time.Time, lease time.Duration) {
	if t.lastSent.IsZero() || now.Sub(t.lastSent) > lease {
		t.sentSince = now
	}
	t.lastSent = now
}

// sentReport records that our report seq of incarnation inc of rule was
// handed to NATS at now (once per report: its parts share the sequence).
func (t *ackTrack) sentReport(now time.Time, rule string, inc, seq uint64) {
	q := t.pubs[rule]
	if n := len(q); n > 0 && q[n-1].inc == inc && q[n-1].seq == seq {
		return
	}
	if t.pubs == nil {
		t.pubs = map[string][]pubEntry{}
	}
	if len(q) == 0 {
		rule = strings.Clone(rule) // the key outlives the message
	}
	if len(q) >= maxPubs {
		q = append(q[:0], q[1:]...)
	}
	t.pubs[rule] = append(q, pubEntry{inc, seq, now})
}

// acked reports whether pos, a peer's last acknowledgement, covers e.
func acked(pos [2]uint64, e pubEntry) bool {
	return e.inc < pos[0] || e.inc == pos[0] && e.seq <= pos[1]
}

// trim drops rule's reports that every peer acknowledging within
// pubHorizon has acknowledged, and those older than pubHorizon.
func (t *ackTrack) trim(now time.Time, rule string) {
	q := t.pubs[rule]
	drop := 0
	for drop < len(q) && now.Sub(q[drop].at) > pubHorizon {
		drop++
	}
	for ; drop < len(q); drop++ {
		covered := true
		for peer, at := range t.at {
			pos, ok := t.last[ackKey{peer, rule}]
			if ok && now.Sub(at) <= pubHorizon && !acked(pos, q[drop]) {
				covered = false
				break
			}
		}
		if !covered {
			break
		}
	}
	switch {
	case drop == len(q):
		delete(t.pubs, rule)
	case drop > 0:
		t.pubs[rule] = append(q[:0], q[drop:]...)
	}
}

// ackAge is the age at now of the oldest report of ours that peer has not
// acknowledged, over the rules whose reports it acknowledges; 0 if none.
func (t *ackTrack) ackAge(now time.Time, peer string) time.Duration {
	var age time.Duration
	for rule, q := range t.pubs {
		pos, ok := t.last[ackKey{peer, rule}]
		if !ok {
			continue
		}
		// q is in publish order, so the acknowledged ones are a prefix.
		if i := sort.Search(len(q), func(i int) bool { return !acked(pos, q[i]) }); i < len(q) {
			age = max(age, now.Sub(q[i].at))
		}
	}
	return age
}

// forget drops what t knows of peer (no rule lists it any more).
func (t *ackTrack) forget(peer string) {
	delete(t.at, peer)
	for k := range t.last {
		if k.peer == peer {
			delete(t.last, k)
		}
	}
}

// heard records the acknowledgements of region in an accepted report
// window m of peer.
func (t *ackTrack) heard(now time.Time, peer, region string, m wire.Message) {
	for _, rr := range m.Rules {
		for _, ack := range rr.Report.Acks {
			// A frozen ack says the peer froze that incarnation of ours,
			// not that it read our reports: a peer that cannot read them
			// finds us silent, freezes us, and acks each new incarnation
			// of ours frozen in turn (we fence on hearing it and start
			// another), which counted as acknowledgements and kept it from
			// being flagged in half of TestPeerUnacknowledged's runs.
			if ack.Region != region || ack.Frozen {
				continue
			}
			if t.last == nil {
				t.last, t.at = map[ackKey][2]uint64{}, map[string]time.Time{}
			}
			k, pos := ackKey{peer, rr.Rule}, [2]uint64{ack.Inc, ack.Seq}
			old, ok := t.last[k]
			if ok && old == pos {
				continue
			}
			if !ok { // the window's strings point into the message
				k.rule = strings.Clone(k.rule)
			}
			t.last[k], t.at[peer] = pos, now
			t.trim(now, k.rule)
		}
	}
}

// deaf reports whether peer, heard at heard, has acknowledged none of the
// agent's reports for two leases while the agent has been publishing.
func (t *ackTrack) deaf(now time.Time, peer string, heard time.Time, lease time.Duration) bool {
	horizon := 2 * lease
	if t.lastSent.IsZero() || now.Sub(t.lastSent) > lease || now.Sub(t.sentSince) < horizon || now.Sub(heard) > lease {
		return false
	}
	return now.Sub(t.since(peer)) > horizon
}

// since is when peer last acknowledged a newer report of ours, or when the
// agent began publishing if later.
func (t *ackTrack) since(peer string) time.Time {
	s := t.at[peer]
	if s.Before(t.sentSince) {
		s = t.sentSince
	}
	return s
}

// checkAcks sets apportion_sync_peer_unacknowledged for every peer heard
// and logs the deaf ones.
func (a *Agent) checkAcks(now time.Time) {
	for p, heard := range a.peers {
		v := 0.0
		if a.acks.deaf(now, p, heard, a.cfg.Lease) {
			v = 1
			a.logs.Log(slog.LevelWarn, "unacknowledged/"+p, "peer heard, but it acknowledges none of this agent's reports: it does not receive or cannot read them, and no share moves between the two",
				logKeyPeer, p, "for", now.Sub(a.acks.since(p)).Round(time.Second),
				"hint", "check that the peer's --report-peer-keys has this region's current key (the peer counts apportion_sync_reports_rejected_total{reason=\"unknown_key\"} or \"bad_signature\"); a peer of a release before report format 3 needs this agent run with --wire-version 2; else the link from here to the peer is cut one way")
		}
		a.m.unacked.WithLabelValues(p).Set(v)
		age := time.Duration(0)
		if now.Sub(heard) <= a.cfg.Lease {
			age = a.acks.ackAge(now, p)
		}
		a.m.ackAge.WithLabelValues(p).Set(age.Seconds())
	}
	for rule := range a.acks.pubs {
		a.acks.trim(now, rule) // also when no peer acknowledges any more
	}
}
