package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// ports are the driver's ports in production: Redis (store.go), NATS and
// etcd, the registry calls on goroutines the agent owns whose results come
// back to the loop goroutine (post).
type ports struct{ a *Agent }

var _ driver.Ports = ports{}

func (p ports) Now() time.Duration { return p.a.now() }

// state returns the agent's state of r, or nil if r is no longer its rule.
func (a *Agent) state(r *driver.Rule) *ruleState {
	if st := a.rules[r.ID]; st != nil && st.Rule == r {
		return st
	}
	return nil
}

func (p ports) Write(writes map[*driver.Rule][]ledger.Write) map[*driver.Rule]driver.Applied {
	return p.a.applyWrites(p.a.ctx, writes)
}

func (p ports) Publish(m wire.Message) {
	a := p.a
	// One part encoded, sealed and handed to NATS at a time: a report of
	// every key is several parts of up to the max payload each.
	m.Version = a.cfg.WireVersion
	mp := a.nc.MaxPayload()
	if mp <= 0 {
		// Never connected: the server's max payload is unknown (0), and a
		// message published now would wait in the reconnect buffer and
		// reach the peers stale. The report is lost, which the ledger
		// tolerates (its next reports carry what it said).
		a.m.unsent.WithLabelValues(UnsentDisconnected).Inc()
		a.logs.Log(slog.LevelWarn, "publish-unconnected", "report not sent: NATS has not connected yet (its max payload is unknown)",
			"servers", RedactURLs(a.nc.Servers()), "status", a.nc.Status().String())
		return
	}
	parts, err := wire.EncodeParts(m, int(mp)-wire.Overhead)
	if err != nil {
		a.m.unsent.WithLabelValues(UnsentEncode).Inc()
		a.logs.Log(slog.LevelError, "encode", "cannot encode reports", logKeyErr, err)
		return
	}
	// Every byte of this tick's reports counts towards the inbox's budget
	// (an estimate of the peers' reports, so also while they are not
	// sent): a report of more than driver.SendWindow keys comes as one
	// Publish per part, and the peers' inboxes must hold all of one.
	var total int64
	sentAny := false
	defer func() {
		a.published += total
		if sentAny {
			now := time.Now()
			for _, rr := range m.Rules {
				a.acks.sentReport(now, rr.Rule, rr.Report.Inc, rr.Report.Seq)
			}
		}
	}()
	for part := range parts {
		if a.cfg.Signer != nil {
			part = a.cfg.Signer.Seal(part)
		}
		total += int64(len(part))
		if !a.nc.IsConnected() {
			// Disconnected (reconnecting, or closed): nats.go would take
			// the part into its reconnect buffer, answer nil, and send it
			// on reconnect, stale. It is not sent, not counted as sent, and
			// not taken as published by the acknowledgement check (acks.go);
			// the ledger tolerates the loss (its next reports carry what
			// it said).
			a.m.unsent.WithLabelValues(UnsentDisconnected).Inc()
			a.logs.Log(slog.LevelWarn, "publish-disconnected", "report not sent: NATS is not connected (it would reach the peers stale from the reconnect buffer)",
				"servers", RedactURLs(a.nc.Servers()), "status", a.nc.Status().String())
			continue
		}
		a.sent.add(part) // its echo is not another agent's (own.go)
		if err := a.nc.Publish(a.cfg.Shard.ReportSubject(a.cfg.Region), part); err != nil {
			a.m.unsent.WithLabelValues(UnsentError).Inc()
			a.logs.Log(slog.LevelWarn, "publish", "report publish failed (the ledger tolerates loss)", logKeyErr, err)
			continue
		}
		a.acks.published(time.Now(), a.cfg.Lease)
		sentAny = true
		a.m.reports.WithLabelValues("sent").Inc()
		a.m.bytes.WithLabelValues("sent").Add(float64(len(part)))
	}
}

// Contribute submits a frozen incarnation's contributions to the registry
// (the driver keeps one batch per rule in flight; the ledger re-emits
// pending ones).
func (p ports) Contribute(r *driver.Rule, cs []ledger.Contribution) {
	a, ctx, id := p.a, p.a.ctx, r.ID
	a.goOwned(func() {
		var recs []ledger.Record
		for _, c := range cs {
			cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
			rec, err := a.reg.Contribute(cctx, id, c)
			cancel()
			if err != nil {
				a.logs.Log(slog.LevelWarn, "contribute/"+id, "reclaim contribution failed; it is retried", logKeyRule, id, logKeyErr, err)
				continue
			}
			recs = append(recs, rec)
		}
		a.post(ctx, func(context.Context) { a.drv.Contributed(r, recs) })
	})
}

// Close records in the registry that this incarnation's marker is confirmed
// (the ledger repeats the request until it sees it recorded).
func (p ports) Close(r *driver.Rule, by ledger.Incarnation) {
	a, ctx, id := p.a, p.a.ctx, r.ID
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		err := a.reg.Close(cctx, id, by)
		cancel()
		if err != nil {
			a.logs.Log(slog.LevelWarn, "close/"+id, "recording the end of earlier incarnations failed; it is retried", logKeyRule, id, logKeyErr, err)
		}
		a.post(ctx, func(context.Context) { a.drv.Closed(r) })
	})
}

func (p ports) Start(r *driver.Rule) {
	if st := p.a.state(r); st != nil {
		p.a.maybeStart(p.a.ctx, st)
	}
}

// Fenced starts a new incarnation of a fenced rule.
func (p ports) Fenced(r *driver.Rule, inc ledger.Incarnation, v ledger.Version) {
	a := p.a
	if v != (ledger.Version{}) {
		a.m.superseded.Inc()
		a.logs.Log(slog.LevelError, "superseded/"+r.ID, "the region's store holds a marker of this rule that this agent's incarnation never wrote, so its keys held their floors; fenced, starting a newer incarnation",
			logKeyRule, r.ID, logKeyInc, inc.Inc, "store_marker_inc", v.Inc, "store_marker_seq", v.Seq,
			"hint", "either another sync agent of this region runs a newer incarnation (apportion_sync_other_agent_reports_total; run one per region and shard, the others with --standby), or the reclaim registry in etcd is older than this region's Redis: etcd lost its data or was restored from an older snapshot. Then shares that regions held before are stranded until every global rule is put again under a new id: docs/operations.md#etcd-lost-or-restored")
	}
	a.log.Warn("ledger fenced; starting a new incarnation", logKeyRule, r.ID, logKeyInc, inc.Inc)
	a.fencedAt = time.Now()
	if st := a.state(r); st != nil {
		a.maybeStart(a.ctx, st)
	}
}

func (p ports) Rejected(reason, peer, rule string, err error) { p.a.reject(reason, peer, rule, err) }

func (p ports) Reclaimed(r *driver.Rule, rec ledger.Record) {
	a := p.a
	k := r.ID + "/" + rec.Of.Region + "/" + fmt.Sprint(rec.Of.Inc)
	if !a.reclaimed[k] {
		a.reclaimed[k] = true
		a.m.reclaims.Inc()
		a.log.Info("reclaim recorded", logKeyRule, r.ID, "of", fmt.Sprintf("%s/%d", rec.Of.Region, rec.Of.Inc))
	}
}

// pollRegistry reads every rule's registry and feeds changed ones to the
// ledgers, and the peers' witness keys (witness.go). After failed reads
// it waits driver.PollWait; the first read that succeeds after failures
// ends the wait of every start that failed meanwhile (registryBack).
func (a *Agent) pollRegistry(ctx context.Context) {
	if a.polling || time.Since(a.lastPoll) < driver.PollWait(a.cfg.RegistryPoll, a.pollFails) {
		return
	}
	a.polling, a.lastPoll = true, time.Now()
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		recs, err := a.reg.Records(cctx)
		cancel()
		a.post(ctx, func(context.Context) {
			a.polling = false
			a.feedWitness()
			if errors.Is(err, ErrLayout) {
				a.layoutLost(err)
			}
			if err != nil {
				a.pollFails++
				a.logs.Log(slog.LevelWarn, "registry-poll", "reading the reclaim registry failed", logKeyErr, err)
				return
			}
			back := a.pollFails > 0
			a.pollFails = 0
			a.drv.Records(recs)
			if back {
				a.registryBack(ctx)
			}
		})
	})
}

// registryBack starts at once every rule whose start failed while the
// registry did not answer, instead of after its backoff (up to 10 s), and
// marks a start still in flight, sent in the outage, to be tried again at
// once if it fails (it is given up after EtcdTimeout): a region cut off
// from etcd, whose incarnation fenced meanwhile, starts again a registry
// round trip after the cut heals, or EtcdTimeout after it.
func (a *Agent) registryBack(ctx context.Context) {
	for _, st := range a.rules {
		switch {
		case st.Led != nil:
		case st.starting:
			st.again = true
		case time.Now().Before(st.retryAt):
			st.retryAt = time.Time{}
			a.maybeStart(ctx, st)
		}
	}
}
