package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
)

// onUsage runs on the NATS delivery goroutine.
//
// Anyone who can publish on the region's usage subject can send any
// delta, so each delta is taken alone: one that is unusable is dropped
// and counted (apportion_sync_usage_dropped_total) and the rest of the
// batch applies. A rule or key that is not valid UTF-8 is dropped: the
// enforcers only ever send valid UTF-8 (regional refuses a request whose
// client key or attributes are not), and such a key, held by a ledger,
// broke every scrape of /metrics (a label value must be UTF-8) for as
// long as it was held.
// Counts of any size add with saturation (two deltas of 2^62 wrapped to a
// negative count); the ledger bounds the demand they make (sync/ledger,
// DemandCap).
func (a *Agent) onUsage(b usage.Batch) {
	invalid := 0
	a.usageMu.Lock()
	a.heardEnforcer(b.Enforcer, time.Now())
	sh := a.cfg.Shard
	for _, d := range b.Deltas {
		if !utf8.ValidString(d.Key) || !utf8.ValidString(d.Rule) {
			invalid++
			continue
		}
		if !sh.Owns(d.Key) {
			continue // another shard's key (see the package doc, "Shards")
		}
		g := a.groupOf(d.Rule)
		ks := a.usage.rules[g]
		c, ok := ks[d.Key]
		if !ok {
			if a.usage.n >= a.cfg.MaxUsageKeys {
				a.m.usageDropped.Inc()
				continue
			}
			if ks == nil {
				if a.usage.rules == nil {
					a.usage.rules = map[string]map[string]usageCounts{}
				}
				ks = map[string]usageCounts{}
				// A copy: the set's next intervals keep the rule's entry
				// (usageSet.next), which would keep this message alive.
				a.usage.rules[strings.Clone(g)] = ks
			}
			a.usage.n++
		}
		c.admitted = addCount(c.admitted, d.Admitted)
		c.rejected = addCount(c.rejected, d.Rejected)
		ks[d.Key] = c
	}
	a.usageMu.Unlock()
	if invalid > 0 {
		a.m.usageDropped.Add(float64(invalid))
		a.logs.Log(slog.LevelWarn, "usage-invalid", "usage deltas dropped: rule or key not valid UTF-8 (no enforcer sends one)",
			"deltas", invalid, "enforcer", strings.ToValidUTF8(b.Enforcer, "\uFFFD"), "seq", b.Seq)
	}
}

// addCount adds two usage counts (each >= 0: usage.Decode), saturating at
// math.MaxInt64 instead of wrapping negative.
func addCount(a, b int64) int64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxInt64
}

// queuedReport is a peer's report message, verified (its signature and
// sender) but kept in its encoded form until the loop consumes it: a
// decoded report costs several times its encoding (about 200 bytes per
// key against 40), and while the loop is busy with a tick the queue holds
// several messages of every peer.
type queuedReport struct {
	from string
	data []byte // the report message (wire.Verifier.Verify's result)
	seq  uint64 // arrival order (inbox)
}

// onReport runs on the NATS delivery goroutine: it verifies and queues.
func (a *Agent) onReport(msg *nats.Msg) {
	from := a.cfg.Shard.regionOf(msg.Subject)
	if from == a.cfg.Region {
		a.onOwnSubject(msg.Data) // its own echoes, or another agent of the region (own.go)
		return
	}
	a.m.reports.WithLabelValues("received").Inc()
	a.m.bytes.WithLabelValues("received").Add(float64(len(msg.Data)))
	data, err := a.ver.Verify(from, msg.Data)
	if err != nil {
		a.reject(openReason(err), from, "", err)
		return
	}
	for _, d := range a.inbox.push(queuedReport{from: from, data: data}, a.peakPublished.Load()) {
		a.reject(ReasonOverflow, d.from, "", errOverflow)
	}
}

// errOverflow is the error of a report the inbox dropped for a newer one.
var errOverflow = errors.New("report queue over its byte budget: the sender's oldest report dropped")

// receiveWindow is the most keys of a report the agent holds decoded
// (driver.ReceiveWindow; BenchmarkAgent100kKeys: a report decoded whole,
// at 20,000 keys all of them in one part, was the largest part of its
// samples above 500 B per key there). A variable for the tests (one key
// per window).
var receiveWindow = driver.ReceiveWindow

// receive decodes a queued report on the loop goroutine and merges it into
// the ledgers, a window of keys at a time; a message that does not decode,
// or names a rule of another shard's group, is dropped whole (the whole
// message is checked before any window is merged).
func (a *Agent) receive(q queuedReport) {
	// q.data is the NATS message's own: nothing else reads it.
	head, windows, err := wire.DecodeWindowsFromOwned(q.from, q.data, a.drv.Lists(), receiveWindow)
	if err != nil {
		a.reject(openReason(err), q.from, "", err)
		return
	}
	for _, rr := range head.Rules {
		if !a.cfg.Shard.ownGroup(rr.Rule) {
			a.reject(ReasonLayout, q.from, rr.Rule, fmt.Errorf("%w: a report of group %q reached shard %s", ErrLayout, rr.Rule, a.cfg.Shard))
			return
		}
	}
	accepted := false
	now := time.Now()
	for m := range windows {
		if a.drv.Receive(m) {
			accepted = true
			a.acks.heard(now, head.From, a.cfg.Region, m)
		}
	}
	if accepted {
		a.peers[head.From] = now
	}
}

func (a *Agent) reject(reason, peer, rule string, err error) {
	a.m.rejected.WithLabelValues(reason).Inc()
	// The log is rate-limited per reason and peer; a peer without a key is
	// only a subject token anyone can choose, so those share one limit.
	who := peer
	if a.cfg.PeerKeys[peer] == nil {
		who = "?"
	}
	a.logs.Log(slog.LevelWarn, "reject/"+reason+"/"+who, "report dropped", logKeyReason, reason, logKeyPeer, peer, logKeyRule, rule, logKeyErr, err)
}

// groupOf is Shard.Group of rule, remembered (under usageMu): deltas name a
// few rules many times.
func (a *Agent) groupOf(rule string) string {
	if a.cfg.Shard.plain() {
		return rule
	}
	if g, ok := a.groups[rule]; ok {
		return g
	}
	if a.groups == nil || len(a.groups) >= 4096 {
		a.groups = map[string]string{}
	}
	g := a.cfg.Shard.Group(rule)
	a.groups[strings.Clone(rule)] = g // rule is a string of a usage message: not kept
	return g
}
