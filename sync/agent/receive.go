package agent

import (
	"errors"
	"log/slog"
	"strings"

	"github.com/apportion/apportion/regional/usage"
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
