package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
)

// onUsage runs on the NATS delivery goroutine.
func (a *Agent) onUsage(b usage.Batch) {
	a.usageMu.Lock()
	defer a.usageMu.Unlock()
	sh := a.cfg.Shard
	for _, d := range b.Deltas {
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
		c.admitted += d.Admitted
		c.rejected += d.Rejected
		ks[d.Key] = c
	}
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
	for m := range windows {
		if a.drv.Receive(m) {
			accepted = true
		}
	}
	if accepted {
		a.peers[head.From] = time.Now()
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
