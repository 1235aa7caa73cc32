package agent

import (
	"hash/maphash"
	"log/slog"
	"sync"

	"github.com/apportion/apportion/sync/wire"
)

// Another agent serving this region. Two agents of one region (two
// processes without --standby, or an old one still running) publish on the
// same subject with the same key and write the same Redis markers: each
// new incarnation of one makes the peers freeze the other's, which fences
// and starts a newer one, and so on (63 fence and restart cycles in 30 s
// with two agents of a region and three regions; the peers count the
// older one's reports as replayed), while each agent's log said only
// "ledger fenced; starting a new incarnation". An agent hears its own
// subject (NATS echoes what a connection publishes to its own
// subscriptions): a message there that it did not publish, that opens
// with the region's key, and that carries a rule report of an incarnation
// newer than the one this agent runs for that rule can only come from
// another agent of the region (this agent's own earlier incarnations are
// all older, and a replay cannot carry a newer one). It is counted in
// apportion_sync_other_agent_reports_total and logged, at most once per
// logEvery. The other agent's messages of older incarnations are not
// counted (they may be a restarted agent's last messages in flight): of
// two agents replacing each other, each sees the other's newer
// incarnation within a cycle.

// sentRing remembers the hashes of the last messages this agent published,
// so that their echoes are told from other agents' messages without
// opening them (a report of every key is several MB).
type sentRing struct {
	mu   sync.Mutex
	seed maphash.Seed
	ring [sentRingSize]uint64
	next int            // where the next hash goes
	n    int            // hashes in ring
	set  map[uint64]int // hash -> how many times in ring
}

// sentRingSize is how many published messages sentRing remembers: echoes
// come back within milliseconds; one older than that is opened and judged
// by its incarnation, which never counts this agent's own.
const sentRingSize = 1024

func newSentRing() *sentRing {
	return &sentRing{seed: maphash.MakeSeed(), set: make(map[uint64]int, sentRingSize)}
}

// add remembers a message published (any goroutine).
func (r *sentRing) add(msg []byte) {
	h := maphash.Bytes(r.seed, msg)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == sentRingSize {
		if old := r.ring[r.next]; r.set[old] <= 1 {
			delete(r.set, old)
		} else {
			r.set[old]--
		}
	} else {
		r.n++
	}
	r.ring[r.next] = h
	r.next = (r.next + 1) % sentRingSize
	r.set[h]++
}

// has reports whether msg is one of the messages remembered.
func (r *sentRing) has(msg []byte) bool {
	h := maphash.Bytes(r.seed, msg)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.set[h] > 0
}

// onOwnSubject runs on the NATS delivery goroutine for a message on this
// agent's own report subject: its own echoes are dropped, a message that
// does not open with this region's key too (the peers refuse it as well:
// bad_signature or unsigned), and the rest go to the loop (ownReport), or
// are dropped if it is busy: a diagnosis, not an input.
func (a *Agent) onOwnSubject(data []byte) {
	if a.sent.has(data) {
		return
	}
	msg, err := a.ownVer.Verify(a.cfg.Region, data)
	if err != nil {
		return
	}
	select {
	case a.ownCh <- msg:
	default:
	}
}

// ownVerifier opens messages signed with this region's key (cfg.Signer's),
// or, with InsecureUnsigned, unsigned ones too.
func ownVerifier(cfg Config) *wire.Verifier {
	keys := wire.Keys{}
	if cfg.Signer != nil {
		keys[cfg.Region] = cfg.Signer.Public()
	}
	return wire.NewVerifier(keys, cfg.InsecureUnsigned)
}

// ownReport judges, on the loop goroutine, a message on this region's
// subject that this agent did not publish (onOwnSubject).
func (a *Agent) ownReport(msg []byte) {
	head, _, err := wire.DecodeWindowsFromOwned(a.cfg.Region, msg, a.drv.Lists(), receiveWindow)
	if err != nil {
		return
	}
	for _, rr := range head.Rules {
		st := a.rules[rr.Rule]
		if rr.Err != nil || st == nil || st.Led == nil {
			continue
		}
		if ours := st.Led.Incarnation().Inc; rr.Report.Inc > ours {
			a.m.otherAgent.Inc()
			if a.cfg.OnOtherAgent != nil {
				a.cfg.OnOtherAgent()
			}
			a.logs.Log(slog.LevelError, "other-agent", "another agent appears to serve this region: reports signed with the region's key come on its subject from an incarnation this agent does not run. "+
				"Two agents of one region replace each other's incarnations over and over (fenced, new incarnation): run one agent per region and shard, and any other with --standby",
				logKeyRule, rr.Rule, "their_inc", rr.Report.Inc, "our_inc", ours, "subject", a.cfg.Shard.ReportSubject(a.cfg.Region))
			return
		}
	}
}
