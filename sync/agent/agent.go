package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
)

// ReportPrefix is the subject tree of report messages: every region's agent
// publishes on ReportPrefix+region and subscribes to ReportPrefix+"*".
const ReportPrefix = "ratelimit.report."

// ReportSubject is the subject region's agent publishes its reports on.
func ReportSubject(region string) string { return ReportPrefix + region }

// Log keys.
const (
	logKeyErr    = "err"
	logKeyRule   = "rule"
	logKeyPeer   = "peer"
	logKeyReason = "reason"
	logKeyInc    = "inc"
)

const (
	logEvery     = 10 * time.Second
	maxBackoff   = 10 * time.Second
	reportQueue  = 1024
	writeWorkers = 16
)

// Agent is one region's sync agent: it runs a ledger per global token-bucket
// rule that lists the region, feeds it usage from the region's enforcers and
// the other regions' reports, applies its writes to Redis, publishes its
// reports and keeps the reclaim registry. See the package doc.
//
// The ledgers and everything about them belong to one goroutine (the loop);
// NATS callbacks and registry calls hand their results to it over channels.
type Agent struct {
	cfg   Config
	lcfg  ledger.Config
	store Store
	nc    *nats.Conn
	reg   Registry
	src   rules.Source
	log   *slog.Logger
	logs  *logsample.Logger
	m     *metrics
	start time.Time
	ver   *wire.Verifier

	mu     sync.Mutex // guards cancel, subs, closed
	cancel context.CancelFunc
	subs   []*nats.Subscription
	closed bool
	wg     sync.WaitGroup

	usageMu sync.Mutex
	usage   map[bucketID]usageCounts // guarded by usageMu

	rulesCh chan []rules.Rule // latest rule set, capacity 1
	reports chan wire.Message
	results chan func(context.Context)

	snapMu sync.Mutex
	snap   map[string][]KeyShare // rule -> keys, guarded by snapMu
	incs   map[string]uint64     // rule -> incarnation (0: none), guarded by snapMu
	ready  atomic.Bool

	// Loop state: owned by the loop goroutine.
	rules      map[string]*ruleState
	runID      string
	peers      map[string]time.Time // peer region -> last accepted report
	polling    bool
	lastPoll   time.Time
	pollFails  int
	reclaimed  map[string]bool // rule + "/" + incarnation: completed reclaims counted
	everRules  bool
	fencedSeen bool
}

type bucketID struct{ rule, key string }

type usageCounts struct{ admitted, rejected int64 }

// ruleState is the loop goroutine's state of one coordinated rule.
type ruleState struct {
	id           string
	rule         rules.Rule
	spec         Spec // in force for led (from the registry)
	led          *ledger.Ledger
	floor        int64
	starting     bool
	retryAt      time.Time
	backoff      time.Duration
	contributing bool
	closing      bool
	fedRev       int64
	written      map[string]int64     // last units written per key (gift metric)
	fresh        map[string]freshness // peer region -> newest report accepted (verify.go)
}

// New returns an agent. It does nothing until Start. store is the region's
// Redis, nc a NATS connection reaching the region's server (reports cross
// regions through the super-cluster gateways), reg the reclaim registry and
// src the rule source (rules/etcdstore.Watcher in production).
func New(cfg Config, store Store, nc *nats.Conn, reg Registry, src rules.Source) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if store == nil || nc == nil || reg == nil || src == nil {
		return nil, fmt.Errorf("%w: store, NATS connection, registry and rule source are required", ErrConfig)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	a := &Agent{
		cfg: cfg, lcfg: cfg.LedgerConfig(), store: store, nc: nc, reg: reg, src: src,
		log:       cfg.Logger,
		ver:       wire.NewVerifier(cfg.PeerKeys, cfg.InsecureUnsigned),
		logs:      logsample.New(cfg.Logger, logEvery),
		usage:     map[bucketID]usageCounts{},
		rulesCh:   make(chan []rules.Rule, 1),
		reports:   make(chan wire.Message, reportQueue),
		results:   make(chan func(context.Context), 64),
		snap:      map[string][]KeyShare{},
		incs:      map[string]uint64{},
		rules:     map[string]*ruleState{},
		peers:     map[string]time.Time{},
		reclaimed: map[string]bool{},
	}
	a.m = newMetrics(cfg.Region, cfg.Metrics, a)
	return a, nil
}

// Start subscribes to usage and reports and launches the agent's goroutines.
// It fails if called after Close or twice.
func (a *Agent) Start() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.cancel != nil {
		return errors.New("agent: Start after Start or Close")
	}
	us, err := usage.Subscribe(a.nc, a.cfg.Region, a.onUsage, func(err error) {
		a.m.usageDropped.Inc()
		a.logs.Log(slog.LevelWarn, "usage-malformed", "usage message dropped", logKeyErr, err)
	})
	if err != nil {
		return fmt.Errorf("agent: subscribe usage: %w", err)
	}
	rs, err := a.nc.Subscribe(ReportPrefix+"*", a.onReport)
	if err != nil {
		us.Unsubscribe()
		return fmt.Errorf("agent: subscribe reports: %w", err)
	}
	rs.SetPendingLimits(64*1024, 256<<20)
	a.subs = []*nats.Subscription{us, rs}
	if err := a.nc.Flush(); err != nil {
		a.logs.Log(slog.LevelWarn, "nats-flush", "NATS flush after subscribing failed; subscriptions apply on reconnect", logKeyErr, err)
	}
	a.start = time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	a.wg.Add(2)
	go a.runRules(ctx)
	go a.loop(ctx)
	return nil
}

// Close stops the agent and waits for its goroutines, or for ctx. It is safe
// to call twice. The ledgers' state is dropped: the store markers lapse and
// each region's store falls back to its floor; a restarted agent begins a
// new incarnation (see the ledger package doc on restarts).
func (a *Agent) Close(ctx context.Context) error {
	a.mu.Lock()
	a.closed = true
	cancel, subs := a.cancel, a.subs
	a.subs = nil
	a.mu.Unlock()
	for _, s := range subs {
		s.Unsubscribe()
	}
	if cancel != nil {
		cancel()
	}
	done := make(chan struct{})
	go func() { a.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Ready reports whether the agent has a rule set and its first run id.
func (a *Agent) Ready() bool { return a.ready.Load() }

// Shares returns, for rule, the units this region may enforce per key the
// ledger holds state for (as of the last tick); nil if the rule is not
// coordinated here.
func (a *Agent) Shares(rule string) map[string]int64 {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	ks, ok := a.snap[rule]
	if !ok {
		return nil
	}
	out := make(map[string]int64, len(ks))
	for _, k := range ks {
		out[k.Key] = k.Units
	}
	return out
}

// Snapshot returns every coordinated key of every rule as of the last tick,
// sorted by rule and key.
func (a *Agent) Snapshot() []KeyShare {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	var out []KeyShare
	for _, id := range slices.Sorted(maps.Keys(a.snap)) {
		out = append(out, a.snap[id]...)
	}
	return out
}

// Incarnation returns the incarnation rule's ledger runs as here (0: none yet,
// or fenced and waiting for a new one).
func (a *Agent) Incarnation(rule string) uint64 {
	a.snapMu.Lock()
	defer a.snapMu.Unlock()
	return a.incs[rule]
}

func (a *Agent) now() time.Duration { return time.Since(a.start) }

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

// runRules runs the rule source, restarting it with backoff when it fails.
func (a *Agent) runRules(ctx context.Context) {
	defer a.wg.Done()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := a.src.Run(ctx, func(rs []rules.Rule) {
			select { // keep only the latest set
			case <-a.rulesCh:
			default:
			}
			a.rulesCh <- rs
		})
		if ctx.Err() != nil {
			return
		}
		a.logs.Log(slog.LevelError, "rules", "rule source stopped; retrying", logKeyErr, err, "retry_in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// post hands fn to the loop goroutine (from a goroutine the agent owns).
func (a *Agent) post(ctx context.Context, fn func(context.Context)) {
	select {
	case a.results <- fn:
	case <-ctx.Done():
	}
}

// goOwned runs fn on a goroutine the agent waits for on Close.
func (a *Agent) goOwned(fn func()) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		fn()
	}()
}

func (a *Agent) loop(ctx context.Context) {
	defer a.wg.Done()
	tick := time.NewTicker(a.cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case rs := <-a.rulesCh:
			a.setRules(rs)
		case m := <-a.reports:
			a.receive(ctx, m)
		case fn := <-a.results:
			fn(ctx)
		case <-tick.C:
			a.tick(ctx)
		}
	}
}

// coordinated reports whether r is a global token bucket this region shares.
func (a *Agent) coordinated(r rules.Rule) bool {
	if r.Scope != rules.Global || r.Algorithm != rules.TokenBucket || r.Capacity <= 0 || !(r.RefillPerSecond > 0) {
		return false
	}
	_, ok := r.StaticShare(a.cfg.Region)
	return ok
}

func (a *Agent) specOf(r rules.Rule) Spec {
	return Spec{Units: a.cfg.Units, MinShare: r.MinShare, Regions: ledger.Regions(r.Regions)}
}

func (a *Agent) setRules(rs []rules.Rule) {
	want := map[string]rules.Rule{}
	for _, r := range rs {
		if a.coordinated(r) {
			want[r.ID] = r
		}
	}
	for id := range a.rules {
		if _, ok := want[id]; !ok {
			a.log.Info("rule no longer coordinated here; dropping its ledger", logKeyRule, id)
			delete(a.rules, id)
		}
	}
	for id, r := range want {
		st := a.rules[id]
		if st == nil {
			st = &ruleState{id: id, written: map[string]int64{}, fresh: map[string]freshness{}}
			a.rules[id] = st
		} else if st.led != nil && !a.specOf(r).equal(st.spec) {
			a.logs.Log(slog.LevelWarn, "spec/"+id, "rule's regions, weights or min_share changed; coordination keeps the spec it started with (use a new rule id to change it)", logKeyRule, id)
		}
		st.rule = r
	}
	a.everRules = true
	a.ready.Store(a.everRules && a.runID != "")
	a.publishSnapshot()
}

// maybeStart asks the registry for a new incarnation of st's rule.
func (a *Agent) maybeStart(ctx context.Context, st *ruleState) {
	if st.led != nil || st.starting || a.runID == "" || time.Now().Before(st.retryAt) {
		return
	}
	st.starting = true
	id, spec := st.id, a.specOf(st.rule)
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		start, used, err := a.reg.Start(cctx, id, spec, a.cfg.Region)
		cancel()
		a.post(ctx, func(ctx context.Context) { a.started(ctx, st, start, used, err) })
	})
}

func (a *Agent) failStart(st *ruleState, err error) {
	st.backoff = min(max(2*st.backoff, 200*time.Millisecond), maxBackoff)
	st.retryAt = time.Now().Add(st.backoff)
	a.logs.Log(slog.LevelError, "start/"+st.id, "cannot start an incarnation; retrying", logKeyRule, st.id, logKeyErr, err, "retry_in", st.backoff)
}

func (a *Agent) started(ctx context.Context, st *ruleState, start ledger.Start, spec Spec, err error) {
	st.starting = false
	if a.rules[st.id] != st {
		return // the rule went away meanwhile
	}
	if err != nil {
		a.failStart(st, err)
		return
	}
	start.RunID = a.runID
	lcfg := spec.ledgerConfig(a.lcfg)
	lcfg.Quantum = ledger.QuantumOf(lcfg.Units, float64(st.rule.Capacity))
	led, err := ledger.New(lcfg, a.cfg.Region, spec.Regions, start, a.now())
	if err != nil {
		a.failStart(st, err)
		return
	}
	floors, _ := ledger.Split(spec.ledgerConfig(a.lcfg), spec.Regions)
	for i, r := range spec.Regions {
		if r.Name == a.cfg.Region {
			st.floor = floors[i]
		}
	}
	st.led, st.spec, st.backoff, st.fedRev = led, spec, 0, 0
	clear(st.written)
	a.log.Info("ledger started", logKeyRule, st.id, logKeyInc, start.Inc)
	a.publishSnapshot()
}

// fence drops a fenced ledger and starts a new incarnation.
func (a *Agent) fence(ctx context.Context, st *ruleState) {
	if st.led == nil {
		return
	}
	a.log.Warn("ledger fenced; starting a new incarnation", logKeyRule, st.id, logKeyInc, st.led.Incarnation().Inc)
	st.led = nil
	a.fencedSeen = true
	a.maybeStart(ctx, st)
}

// batch collects the outputs of ledger calls until they are applied.
type batch struct {
	writes  map[*ruleState][]ledger.Write
	reports []wire.RuleReport
}

func (a *Agent) collect(ctx context.Context, b *batch, st *ruleState, out ledger.Output) {
	if st.led == nil {
		return
	}
	if len(out.Writes) > 0 {
		if b.writes == nil {
			b.writes = map[*ruleState][]ledger.Write{}
		}
		b.writes[st] = append(b.writes[st], out.Writes...)
	}
	if out.Report != nil {
		b.reports = append(b.reports, wire.RuleReport{Rule: st.id, Report: *out.Report})
	}
	if len(out.Contributions) > 0 {
		a.contribute(ctx, st, out.Contributions)
	}
	if out.Close != (ledger.Incarnation{}) {
		a.closePredecessors(ctx, st, out.Close)
	}
	if out.Fenced {
		a.fence(ctx, st)
	}
}

// flush applies the batch's writes, feeds the confirmations back and
// publishes the reports.
func (a *Agent) flush(ctx context.Context, b *batch) {
	for len(b.writes) > 0 {
		writes := b.writes
		b.writes = nil
		res := a.applyWrites(ctx, writes)
		now := a.now()
		for _, st := range slices.SortedFunc(maps.Keys(res), func(x, y *ruleState) int { return strings.Compare(x.id, y.id) }) {
			if st.led == nil {
				continue
			}
			cs := make([]ledger.Confirmation, len(res[st]))
			for i, ap := range res[st] {
				cs[i] = ledger.Confirmation{Key: ap.key, Version: ap.v}
			}
			// One report for the whole batch, not one per confirmed key.
			a.collect(ctx, b, st, st.led.SharesApplied(now, cs))
		}
	}
	a.publish(b.reports)
	b.reports = nil
}

type applied struct {
	key string
	v   ledger.Version
}

// applyWrites runs every rule's writes on the store, rules in parallel.
func (a *Agent) applyWrites(ctx context.Context, writes map[*ruleState][]ledger.Write) map[*ruleState][]applied {
	type job struct {
		st      *ruleState
		recs    []redisstore.ShareRecord
		markers []redisstore.Marker
	}
	var jobs []job
	for st, ws := range writes {
		if st.led == nil {
			continue
		}
		j := job{st: st}
		capacity := st.rule.Capacity * 1000
		rate := max(1, int64(math.Round(st.rule.RefillPerSecond*1000)))
		// TTL: time to refill the whole bucket from empty, plus a second.
		ttl := time.Duration(float64(capacity)/float64(rate)*float64(time.Second)) + time.Second
		for _, w := range ws {
			if w.Key == ledger.MarkerKey {
				j.markers = append(j.markers, redisstore.Marker{Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
					Lease: w.Lease.Truncate(time.Millisecond), Create: w.Create, RunID: w.RunID})
				continue
			}
			if prev, ok := st.written[w.Key]; ok && w.Units < prev && !w.Release {
				a.m.gifts.Inc()
			}
			st.written[w.Key] = w.Units
			j.recs = append(j.recs, redisstore.ShareRecord{Key: w.Key, Inc: w.Version.Inc, Seq: w.Version.Seq, Units: w.Units,
				Release: w.Release, Capacity: capacity, Rate: rate, Total: st.spec.Units, Floor: st.floor, TTL: min(ttl, 365*24*time.Hour)})
		}
		jobs = append(jobs, j)
	}
	out := make(map[*ruleState][]applied, len(jobs))
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, writeWorkers)
	for _, j := range jobs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			var res []applied
			if len(j.recs) > 0 {
				cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
				vs, err := a.store.WriteShares(cctx, j.st.id, j.recs)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-shares", "share writes failed; the ledger retries them", logKeyRule, j.st.id, logKeyErr, err)
				}
				for i, v := range vs {
					if i < len(j.recs) {
						res = append(res, applied{j.recs[i].Key, ledger.Version{Inc: v.Inc, Seq: v.Seq}})
					}
				}
			}
			for _, m := range j.markers {
				cctx, cancel := context.WithTimeout(ctx, a.cfg.StoreTimeout)
				v, err := a.store.WriteMarker(cctx, j.st.id, m)
				cancel()
				if err != nil {
					a.m.storeErrors.Inc()
					a.logs.Log(slog.LevelWarn, "write-marker", "marker write failed", logKeyRule, j.st.id, logKeyErr, err)
					continue
				}
				res = append(res, applied{ledger.MarkerKey, ledger.Version{Inc: v.Inc, Seq: v.Seq}})
			}
			mu.Lock()
			out[j.st] = res
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

func (a *Agent) publish(rs []wire.RuleReport) {
	if len(rs) == 0 {
		return
	}
	parts, err := wire.EncodeSplit(wire.Message{From: a.cfg.Region, Rules: rs}, int(a.nc.MaxPayload())-wire.Overhead)
	if err != nil {
		a.logs.Log(slog.LevelError, "encode", "cannot encode reports", logKeyErr, err)
		return
	}
	for _, p := range parts {
		if a.cfg.Signer != nil {
			p = a.cfg.Signer.Seal(p)
		}
		if err := a.nc.Publish(ReportSubject(a.cfg.Region), p); err != nil {
			a.logs.Log(slog.LevelWarn, "publish", "report publish failed (the ledger tolerates loss)", logKeyErr, err)
			continue
		}
		a.m.reports.WithLabelValues("sent").Inc()
		a.m.bytes.WithLabelValues("sent").Add(float64(len(p)))
	}
}

// contribute submits a frozen incarnation's contributions to the registry,
// one batch per rule at a time (the ledger re-emits pending ones).
func (a *Agent) contribute(ctx context.Context, st *ruleState, cs []ledger.Contribution) {
	if st.contributing {
		return
	}
	st.contributing = true
	id := st.id
	cs = slices.Clone(cs)
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
		a.post(ctx, func(ctx context.Context) {
			st.contributing = false
			if a.rules[id] != st {
				return
			}
			b := &batch{}
			for _, rec := range recs {
				a.recorded(ctx, b, st, rec)
			}
			a.flush(ctx, b)
		})
	})
}

// closePredecessors records in the registry that this incarnation's marker
// is confirmed (the ledger repeats the request until it sees it recorded).
func (a *Agent) closePredecessors(ctx context.Context, st *ruleState, by ledger.Incarnation) {
	if st.closing {
		return
	}
	st.closing = true
	id := st.id
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		err := a.reg.Close(cctx, id, by)
		cancel()
		if err != nil {
			a.logs.Log(slog.LevelWarn, "close/"+id, "recording the end of earlier incarnations failed; it is retried", logKeyRule, id, logKeyErr, err)
		}
		a.post(ctx, func(ctx context.Context) { st.closing = false })
	})
}

func (a *Agent) recorded(ctx context.Context, b *batch, st *ruleState, rec ledger.Record) {
	if st.led == nil {
		return
	}
	if rec.Complete {
		k := st.id + "/" + rec.Of.Region + "/" + fmt.Sprint(rec.Of.Inc)
		if !a.reclaimed[k] {
			for _, r := range rec.Recipients {
				if r == st.led.Incarnation() {
					a.reclaimed[k] = true
					a.m.reclaims.Inc()
					a.log.Info("reclaim recorded", logKeyRule, st.id, "of", fmt.Sprintf("%s/%d", rec.Of.Region, rec.Of.Inc))
				}
			}
		}
	}
	a.collect(ctx, b, st, st.led.ReclaimRecorded(a.now(), rec))
}

// pollRegistry reads every rule's registry and feeds changed ones to the ledgers.
func (a *Agent) pollRegistry(ctx context.Context) {
	if a.polling || time.Since(a.lastPoll) < a.cfg.RegistryPoll*time.Duration(1<<min(a.pollFails, 4)) {
		return
	}
	a.polling, a.lastPoll = true, time.Now()
	a.goOwned(func() {
		cctx, cancel := context.WithTimeout(ctx, a.cfg.EtcdTimeout)
		recs, err := a.reg.Records(cctx)
		cancel()
		a.post(ctx, func(ctx context.Context) {
			a.polling = false
			if err != nil {
				a.pollFails++
				a.logs.Log(slog.LevelWarn, "registry-poll", "reading the reclaim registry failed", logKeyErr, err)
				return
			}
			a.pollFails = 0
			b := &batch{}
			for _, id := range slices.Sorted(maps.Keys(recs)) {
				st := a.rules[id]
				rr := recs[id]
				if st == nil || st.led == nil || rr.Revision == st.fedRev {
					continue
				}
				st.fedRev = rr.Revision
				for _, rec := range rr.Records {
					a.recorded(ctx, b, st, rec)
				}
			}
			a.flush(ctx, b)
		})
	})
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

// tick runs one interval: run id, usage, ledger ticks, writes, reports.
func (a *Agent) tick(ctx context.Context) {
	t0 := time.Now()
	b := &batch{}
	a.checkRunID(ctx, b)
	now := a.now()
	a.usageMu.Lock()
	pending := a.usage
	a.usage = make(map[bucketID]usageCounts, len(pending))
	a.usageMu.Unlock()
	for id, c := range pending {
		if st := a.rules[id.rule]; st != nil && st.led != nil {
			st.led.Usage(now, id.key, st.rule.RefillPerSecond, c.admitted, c.rejected)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(a.rules)) {
		st := a.rules[id]
		if st.led == nil {
			a.maybeStart(ctx, st)
			continue
		}
		a.collect(ctx, b, st, st.led.Tick(now))
	}
	a.flush(ctx, b)
	a.pollRegistry(ctx)
	a.publishSnapshot()
	a.m.tickDuration.Observe(time.Since(t0).Seconds())
}

func (a *Agent) checkRunID(ctx context.Context, b *batch) {
	cctx, cancel := context.WithTimeout(ctx, max(a.cfg.StoreTimeout, a.cfg.Interval))
	id, err := a.store.RunID(cctx)
	cancel()
	if err != nil || id == "" {
		a.m.storeErrors.Inc()
		a.logs.Log(slog.LevelWarn, "run-id", "cannot read the store's run id", logKeyErr, err)
		return
	}
	if id == a.runID {
		return
	}
	if a.runID != "" {
		a.log.Warn("store run id changed (Redis restarted); re-asserting every share", "old", a.runID, "new", id)
		now := a.now()
		for _, rid := range slices.Sorted(maps.Keys(a.rules)) {
			if st := a.rules[rid]; st.led != nil {
				a.collect(ctx, b, st, st.led.StoreReset(now, id))
			}
		}
	}
	a.runID = id
	a.ready.Store(a.everRules)
}

// publishSnapshot copies the ledgers' positions for Shares, Snapshot and the
// share collector, and updates the gauges.
func (a *Agent) publishSnapshot() {
	snap := make(map[string][]KeyShare, len(a.rules))
	incs := make(map[string]uint64, len(a.rules))
	active, fenced := 0, 0
	for id, st := range a.rules {
		if st.led == nil {
			fenced++
			incs[id] = 0
			snap[id] = nil
			continue
		}
		incs[id] = st.led.Incarnation().Inc
		var ks []KeyShare
		for _, k := range st.led.Keys() {
			p := st.led.Position(k)
			ks = append(ks, KeyShare{Rule: id, Key: k, Units: p.Units, Demand: p.Demand, Active: p.Active})
			if p.Active {
				active++
			}
		}
		snap[id] = ks
	}
	a.snapMu.Lock()
	a.snap, a.incs = snap, incs
	a.snapMu.Unlock()
	a.m.coordinated.Set(float64(active))
	if fenced > 0 && a.fencedSeen {
		a.m.fenced.Set(1)
	} else {
		a.m.fenced.Set(0)
		a.fencedSeen = false
	}
	seen := 0
	for p, t := range a.peers {
		lag := time.Since(t)
		a.m.peerLag.WithLabelValues(p).Set(lag.Seconds())
		if lag <= a.cfg.Lease {
			seen++
		}
	}
	a.m.peersSeen.Set(float64(seen))
}
