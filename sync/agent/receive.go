package agent

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
)

// onUsage runs on the NATS delivery goroutine.
func (a *Agent) onUsage(b usage.Batch) {
	a.usageMu.Lock()
	defer a.usageMu.Unlock()
	for _, d := range b.Deltas {
		id := bucketID{d.Rule, d.Key}
		c, ok := a.usage[id]
		if !ok && len(a.usage) >= a.cfg.MaxUsageKeys {
			a.m.usageDropped.Inc()
			continue
		}
		c.admitted += d.Admitted
		c.rejected += d.Rejected
		a.usage[id] = c
	}
}

// onReport runs on the NATS delivery goroutine: it decodes and queues.
func (a *Agent) onReport(msg *nats.Msg) {
	from := strings.TrimPrefix(msg.Subject, ReportPrefix)
	if from == a.cfg.Region {
		return
	}
	a.m.reports.WithLabelValues("received").Inc()
	a.m.bytes.WithLabelValues("received").Add(float64(len(msg.Data)))
	m, err := a.ver.Open(from, msg.Data)
	if err != nil {
		a.reject(openReason(err), from, "", err)
		return
	}
	select {
	case a.reports <- m:
	default:
		a.reject(ReasonOverflow, from, "", errors.New("report queue full"))
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

func rejectReason(err error) string {
	switch {
	case errors.Is(err, ledger.ErrUnknownRegion):
		return ReasonUnknownReg
	case errors.Is(err, ledger.ErrMalformed):
		return ReasonMalformed
	case errors.Is(err, ledger.ErrStaleIncarnation):
		return ReasonStale
	case errors.Is(err, ledger.ErrFrozenIncarnation):
		return ReasonFrozen
	case errors.Is(err, ledger.ErrBackwards):
		return ReasonBackwards
	case errors.Is(err, ledger.ErrImplausible):
		return ReasonImplausible
	}
	return ReasonOther
}

// receive merges a peer's message into the ledgers.
func (a *Agent) receive(ctx context.Context, m wire.Message) {
	now := a.now()
	b := &batch{}
	accepted := false
	for _, rr := range m.Rules {
		st := a.rules[rr.Rule]
		if st == nil {
			a.reject(ReasonUnknownRule, m.From, rr.Rule, errors.New("rule not coordinated here"))
			continue
		}
		if st.led == nil {
			continue // starting: the peer repeats itself
		}
		if err := st.fresh[m.From].check(rr.Report); err != nil {
			a.reject(ReasonReplayed, m.From, rr.Rule, err)
			continue
		}
		out, err := st.led.Receive(now, rr.Report)
		if err != nil && !errors.Is(err, ledger.ErrFenced) {
			a.reject(rejectReason(err), m.From, rr.Rule, err)
		}
		if err == nil {
			accepted = true
			st.fresh[m.From] = st.fresh[m.From].accepted(rr.Report)
		}
		a.collect(ctx, b, st, out)
	}
	if accepted {
		a.peers[m.From] = time.Now()
	}
	a.flush(ctx, b)
}
