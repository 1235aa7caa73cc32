package agent

import (
	"cmp"
	"context"
	"strings"
	"time"

	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"

	"github.com/prometheus/client_golang/prometheus"
)

// Reasons of apportion_sync_reports_rejected_total (the driver's, see
// sync/driver, and the agent's own).
const (
	ReasonMalformed   = driver.ReasonMalformed
	ReasonUnknownRule = driver.ReasonUnknownRule
	ReasonUnknownReg  = driver.ReasonUnknownReg
	ReasonRegions     = driver.ReasonRegions
	ReasonStale       = driver.ReasonStale
	ReasonFrozen      = driver.ReasonFrozen
	ReasonBackwards   = driver.ReasonBackwards
	ReasonOverflow    = "overflow" // dropped from the report queue for a newer report of its sender (inbox.go)
	ReasonOther       = driver.ReasonOther
)

// Reasons of apportion_sync_reports_unsent_total: report messages (parts)
// built but not handed to NATS.
const (
	UnsentDisconnected = "disconnected" // NATS not connected (never yet, or reconnecting): not buffered to reach the peers stale
	UnsentEncode       = "encode"       // the reports did not encode
	UnsentError        = "error"        // NATS refused the publish
)

type metrics struct {
	reports      *prometheus.CounterVec
	bytes        *prometheus.CounterVec
	unsent       *prometheus.CounterVec
	rejected     *prometheus.CounterVec
	peersSeen    prometheus.Gauge
	peerLag      *prometheus.GaugeVec
	unacked      *prometheus.GaugeVec
	ackAge       *prometheus.GaugeVec
	storeResets  *prometheus.CounterVec
	coordinated  prometheus.Gauge
	closures     *prometheus.GaugeVec
	gifts        prometheus.Counter
	paced        prometheus.Counter
	fenced       prometheus.Gauge
	reclaims     prometheus.Counter
	tickDuration prometheus.Histogram
	usageDropped prometheus.Counter
	enforcers    prometheus.Gauge
	lateTicks    prometheus.Counter
	storeErrors  prometheus.Counter
	witness      *prometheus.CounterVec
	witnessTakes prometheus.Counter
	otherAgent   prometheus.Counter
	superseded   prometheus.Counter
	markerLapses *prometheus.CounterVec
	margin       *minWindow // apportion_sync_marker_margin_seconds (lapse.go)
}

func newMetrics(region string, reg prometheus.Registerer, a *Agent) *metrics {
	cl := prometheus.Labels{"region": region}
	m := &metrics{
		reports: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_reports_total",
			Help: "Report messages sent (handed to NATS while connected; apportion_sync_reports_unsent_total counts the others) and received (own messages are not counted as received).", ConstLabels: cl}, []string{"direction"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_report_bytes_total",
			Help: "Bytes of report messages sent (handed to NATS while connected) and received.", ConstLabels: cl}, []string{"direction"}),
		unsent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_reports_unsent_total",
			Help: "Report messages not sent, by reason: disconnected (NATS not connected, never yet or reconnecting: a message would wait in the reconnect buffer and reach the peers stale, so it is dropped; not counted as sent), encode (the reports did not encode), error (NATS refused the publish). The ledger tolerates the loss.", ConstLabels: cl}, []string{"reason"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_reports_rejected_total",
			Help: "Rule reports dropped without effect, by reason.", ConstLabels: cl}, []string{"reason"}),
		peersSeen: prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_sync_peers_seen",
			Help: "Peer regions heard from within the lease.", ConstLabels: cl}),
		peerLag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "apportion_sync_peer_lag_seconds",
			Help: "Seconds since the last accepted report of each peer region.", ConstLabels: cl}, []string{"peer"}),
		ackAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "apportion_sync_peer_ack_age_seconds",
			Help: "Age of the oldest report of this agent that the peer (heard within the lease) has not acknowledged yet, over every rule; 0 if none. Under a second on a healthy link; growing by the second means a backlog on the way to the peer (a link slower than the reports: the gifts in it are in flight) or a peer that cannot read the reports.", ConstLabels: cl}, []string{"peer"}),
		unacked: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "apportion_sync_peer_unacknowledged",
			Help: "1 for a peer region heard within the lease whose reports have acknowledged none of this agent's for two leases while it published: the peer does not receive or cannot read them (its --report-peer-keys lacks this region's key or has another, it reads only an older report format: --wire-version 2, or the link is cut one way); no share moves between the two meanwhile.", ConstLabels: cl}, []string{"peer"}),
		storeResets: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_store_resets_total",
			Help: "Times the agent found the region's store had lost its data and re-asserted every share, then created the markers anew (floors meanwhile), by cause: run_id (the run id changed: Redis restarted or failed over), marker_lost (a rule's marker gone under the same run id: FLUSHALL or FLUSHDB, the key deleted or evicted; counted per rule).", ConstLabels: cl}, []string{"cause"}),
		coordinated: prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_sync_keys_coordinated",
			Help: "Keys of global rules under coordination (not on static shares).", ConstLabels: cl}),
		closures: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "apportion_sync_closures",
			Help: "Closures of peers' key retirements held until acknowledged: carried in the reports, or waiting for room in them (a quarter of the NATS max payload at most).", ConstLabels: cl}, []string{"state"}),
		gifts: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_gifts_total",
			Help: "Share writes that lowered a coordinated key's units (gifts to other regions).", ConstLabels: cl}),
		paced: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_reports_paced_total",
			Help: "Reports that left keys due to later reports because a peer had not acknowledged enough of the earlier ones: a link slower than the reports (the keys left out wait here instead of in the link, which then carries about a second of reports).", ConstLabels: cl}),
		fenced: prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_sync_fenced",
			Help: "1 from a ledger's fence (its lease ran out with no peer's report) until a peer's report is accepted again: the region holds its floor.", ConstLabels: cl}),
		reclaims: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_reclaims_total",
			Help: "Completed reclaim records applied to this region's ledgers.", ConstLabels: cl}),
		tickDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "apportion_sync_tick_duration_seconds",
			Help: "Duration of one sync interval's work (ledger ticks, store writes, publish).", ConstLabels: cl,
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1}}),
		usageDropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_usage_dropped_total",
			Help: "Usage deltas dropped (buffer full, undecodable, or a rule or key not valid UTF-8).", ConstLabels: cl}),
		enforcers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_sync_usage_enforcers",
			Help: "Enforcers whose usage batches (empty ones too: one every flush) this agent received within --usage-grace.", ConstLabels: cl}),
		lateTicks: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_usage_late_ticks_total",
			Help: "Ticks whose demand estimates waited for late usage: an enforcer heard every flush missed one (a stalled NATS server, a slow link, an enforcer gone), for at most --usage-grace.", ConstLabels: cl}),
		storeErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_store_errors_total",
			Help: "Failed Redis calls (writes and run id reads).", ConstLabels: cl}),
		witness: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_witness_renewals_total",
			Help: "Renewals of this region's witness key in etcd (two-region rules), by result: renewed, taken (the peer had taken it: written again), error.", ConstLabels: cl}, []string{"result"}),
		witnessTakes: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_witness_takes_total",
			Help: "Witness keys of silent peer regions this agent took (their shares of two-region rules reclaimed).", ConstLabels: cl}),
		otherAgent: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_other_agent_reports_total",
			Help: "Reports on this region's own subject, signed with its key, of a newer incarnation than this agent runs: another agent appears to serve the region (run one per region and shard, the others with --standby).", ConstLabels: cl}),
		superseded: prometheus.NewCounter(prometheus.CounterOpts{Name: "apportion_sync_incarnations_superseded_total",
			Help: "Incarnations fenced because the region's store held a marker of the rule they never wrote (a newer incarnation's, or one of the same number): another agent serves the region, or the reclaim registry in etcd went back (etcd data lost, or restored from an older snapshot).", ConstLabels: cl}),
		markerLapses: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "apportion_sync_marker_lapses_total",
			Help: "Marker leases that ran out before a renewal was confirmed, without a fence: every key of the rule in this region enforced its floor meanwhile. By cause: late (the agent's loop came to the renewal after the lease had run out: too slow), store (the renewal's writes began in time but Redis failed or answered after it), deadline (the ledger let the lease run out: its peers' acknowledgements stopped, a partition or heavy loss).", ConstLabels: cl}, []string{"cause"}),
		margin: newMinWindow(marginWindow),
	}
	for _, r := range []string{UnsentDisconnected, UnsentEncode, UnsentError} {
		m.unsent.WithLabelValues(r)
	}
	for _, c := range lapseCauses {
		m.markerLapses.WithLabelValues(c)
	}
	for _, c := range []string{ResetRunID, ResetMarkerLost} {
		m.storeResets.WithLabelValues(c)
	}
	for _, r := range []string{"renewed", "taken", "error"} {
		m.witness.WithLabelValues(r)
	}
	for _, r := range reasons {
		m.rejected.WithLabelValues(r)
	}
	for _, st := range []string{"carried", "waiting"} {
		m.closures.WithLabelValues(st)
	}
	for _, d := range []string{"sent", "received"} {
		m.reports.WithLabelValues(d)
		m.bytes.WithLabelValues(d)
	}
	if reg != nil {
		reg.MustRegister(m.reports, m.bytes, m.unsent, m.rejected, m.peersSeen, m.peerLag, m.unacked, m.ackAge, m.storeResets, m.coordinated, m.closures, m.gifts, m.paced, m.fenced,
			m.reclaims, m.tickDuration, m.usageDropped, m.enforcers, m.lateTicks, m.storeErrors, m.witness, m.witnessTakes, m.otherAgent, m.superseded, m.markerLapses, newShareCollector(a, region),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "apportion_sync_marker_margin_seconds",
				Help: "Smallest lease left at a marker renewal over the last 15-30 s, any rule: the held lease's end minus the renewal's answer, on the agent's clock (a lower bound: it understates by at most the two writes' round trips). Negative: the marker lapsed. NaN: no renewal.", ConstLabels: cl},
				func() float64 { return m.margin.value(time.Now()) }))
		if er, ok := a.reg.(*EtcdRegistry); ok {
			reg.MustRegister(
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "apportion_sync_registry_document_bytes",
					Help: "Size of the reclaim registry document this agent last wrote (per-key lists above 256 KiB in all go to chunks).", ConstLabels: cl},
					func() float64 { return float64(er.stats.docBytes.Load()) }),
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "apportion_sync_registry_chunk_bytes",
					Help: "Bytes in the chunks the reclaim registry document this agent last wrote references (0: none).", ConstLabels: cl},
					func() float64 { return float64(er.stats.chunkBytes.Load()) }))
		}
	}
	return m
}

// shareCollector exports apportion_sync_share_units for the hottest keys,
// computed at scrape time from the agent's last snapshot.
type shareCollector struct {
	a    *Agent
	desc *prometheus.Desc
}

func newShareCollector(a *Agent, region string) *shareCollector {
	return &shareCollector{a: a, desc: prometheus.NewDesc("apportion_sync_share_units",
		"Units (of the agent's Units per global limit) this region may enforce, for the hottest keys by demand.",
		[]string{"rule", "key"}, prometheus.Labels{"region": region})}
}

func (c *shareCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect never panics, whatever the keys: a label value must be valid
// UTF-8, and one key that was not (from a usage delta, before onUsage
// dropped such deltas, or in a peer's report) made MustNewConstMetric
// panic, and every scrape of /metrics answered 500 while the key was
// held. Invalid bytes become U+FFFD; a series whose labels are then those
// of a series already collected (two keys that differ only in invalid
// bytes) is left out, as is one the client library refuses, since either
// would fail the whole scrape too.
func (c *shareCollector) Collect(ch chan<- prometheus.Metric) {
	type labels struct{ rule, key string }
	hot := c.a.hottest(c.a.cfg.HotKeys)
	seen := make(map[labels]bool, len(hot))
	for _, k := range hot {
		l := labels{strings.ToValidUTF8(k.Rule, "\uFFFD"), strings.ToValidUTF8(k.Key, "\uFFFD")}
		if seen[l] {
			continue
		}
		seen[l] = true
		m, err := prometheus.NewConstMetric(c.desc, prometheus.GaugeValue, float64(k.Units), l.rule, l.key)
		if err != nil {
			continue
		}
		ch <- m
	}
}

// KeyShare is one key's state in a Snapshot.
type KeyShare struct {
	Rule, Key string
	Units     int64 // units this region may enforce (its ledger position)
	Demand    int64 // demand estimate, units
	Active    bool
}

// hottest returns the n keys of the most demand (then by rule and key),
// read from the ledgers on the loop goroutine; none if the agent does not
// run or its loop did not answer within shareViewTimeout.
func (a *Agent) hottest(n int) []KeyShare {
	ctx, cancel := context.WithTimeout(context.Background(), shareViewTimeout)
	defer cancel()
	var out []KeyShare
	err := a.onLoop(ctx, func() {
		t := topN{n: n, cmp: func(x, y KeyShare) int {
			return cmp.Or(cmp.Compare(y.Demand, x.Demand), cmp.Compare(x.Rule, y.Rule), cmp.Compare(x.Key, y.Key))
		}}
		a.eachKey(func(rule, key string, s ledger.Share) {
			t.add(KeyShare{Rule: rule, Key: key, Units: s.Units, Demand: s.Demand, Active: s.Active})
		})
		out = t.result()
	})
	if err != nil {
		return nil
	}
	return out
}
