package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/logsample"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/driver"
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

	// This region's own subject (own.go): the messages this agent
	// published lately, the verifier of the region's key, and the loop's
	// queue of messages there that it did not publish.
	sent   *sentRing
	ownVer *wire.Verifier
	ownCh  chan []byte

	mu     sync.Mutex // guards cancel, subs, closed
	cancel context.CancelFunc
	subs   []*nats.Subscription
	closed bool
	wg     sync.WaitGroup

	usageMu sync.Mutex
	usage   usageSet          // guarded by usageMu
	groups  map[string]string // rule -> group id (groupOf), guarded by usageMu
	// enforcers: enforcer id -> when a batch of it was last received,
	// guarded by usageMu (lateusage.go).
	enforcers map[string]time.Time

	rulesCh chan []rules.Rule // latest rule set, capacity 1
	inbox   *inbox            // peers' reports for the loop (inbox.go)
	results chan func(context.Context)
	// peakPublished is the most report bytes published in one tick lately
	// (every part of every message), decaying (tick): the inbox's budget
	// follows it.
	peakPublished atomic.Int64
	published     int64 // the bytes published since the last tick (loop)

	snapMu sync.Mutex
	incs   map[string]uint64 // rule -> incarnation (0: none), guarded by snapMu
	ready  atomic.Bool

	// Loop state: owned by the loop goroutine.
	ctx       context.Context // the loop's, set by Start
	drv       *driver.Driver
	rules     map[string]*ruleState
	runID     string
	peers     map[string]time.Time // peer region -> last accepted report
	acks      ackTrack             // the peers' acknowledgements of our reports (acks.go)
	polling   bool
	lastPoll  time.Time
	pollFails int
	reclaimed map[string]bool // rule + "/" + incarnation: completed reclaims counted
	everRules bool
	// fencedAt is when a ledger last fenced, until a peer's report is
	// accepted after it (zero: none since); apportion_sync_fenced is 1 meanwhile.
	fencedAt  time.Time
	snapshots int          // publishSnapshot calls
	wit       witnessState // this region's witness key (witness.go)
	// waitingSince is when the demand estimates began waiting for late
	// usage (zero: not waiting; lateusage.go).
	waitingSince time.Time
	mgc          markerGC // markers of rules no longer coordinated (markers.go)
	// listChanged: a rule set or a ledger's start since the last
	// forgetUnlisted (snapshot.go); a peer is heard only through a
	// ledger of a rule that lists it, so nothing else can unlist one.
	listChanged bool
}

type usageCounts struct{ admitted, rejected int64 }

// usageSet is the enforcers' usage of one interval, per rule (group id)
// and key: a map per rule, so that an entry is a key and its counts (the
// rule is not repeated in every entry: a key in use has an entry every
// interval).
type usageSet struct {
	rules map[string]map[string]usageCounts
	n     int // entries
}

// next returns an empty set for the next interval, each rule's map sized
// for the keys it had in this one.
func (u *usageSet) next() usageSet {
	n := usageSet{rules: make(map[string]map[string]usageCounts, len(u.rules))}
	for r, ks := range u.rules {
		if len(ks) > 0 {
			n.rules[r] = make(map[string]usageCounts, len(ks))
		}
	}
	return n
}

// ruleState is the loop goroutine's state of one coordinated rule: the
// driver's (its ID and ledger, Led) and the agent's.
type ruleState struct {
	*driver.Rule
	rule     rules.Rule
	spec     Spec // in force for Led (from the registry)
	floor    int64
	starting bool
	again    bool // a start in flight when the registry came back: if it fails, try at once (registryBack)
	retryAt  time.Time
	backoff  time.Duration
	lowered  uint64      // the ledger's Stats().Lowered already counted (gift metric)
	paced    uint64      // the ledger's Stats().Paced already counted
	lost     uint64      // the ledger's Stats().MarkerLost already counted
	holds    recordHolds // records to write again (refresh.go)
	marker   markerTrack // the marker's lease as last written (lapse.go)
}

// newLedger resets what st keeps of its ledger when another takes its
// place (a new incarnation, or none after a layout change): the new ledger
// counts its lowered writes from 0, and its records are looked at for
// refresh at the next tick.
func (st *ruleState) newLedger() {
	st.lowered, st.lost, st.paced = 0, 0, 0
	st.holds.next = 0
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
	if !cfg.Shard.plain() {
		store, src = shardStore{Store: store, s: cfg.Shard}, shardSource{Source: src, s: cfg.Shard}
	}
	if er, ok := reg.(*EtcdRegistry); ok {
		reg = er.forShard(cfg.Shard)
	}
	a := &Agent{
		cfg: cfg, lcfg: cfg.LedgerConfig(), store: store, nc: nc, reg: reg, src: src,
		log:       cfg.Logger,
		ver:       wire.NewVerifier(cfg.PeerKeys, cfg.InsecureUnsigned),
		sent:      newSentRing(),
		ownVer:    ownVerifier(cfg),
		ownCh:     make(chan []byte, 4),
		logs:      logsample.New(cfg.Logger, logEvery),
		rulesCh:   make(chan []rules.Rule, 1),
		inbox:     newInbox(),
		results:   make(chan func(context.Context), 64),
		incs:      map[string]uint64{},
		rules:     map[string]*ruleState{},
		peers:     map[string]time.Time{},
		reclaimed: map[string]bool{},
	}
	a.lcfg.MaxClosureBytes = closureRoom(nc, a.lcfg.MaxClosureBytes)
	if wk, ok := reg.(witnessKeys); ok && a.lcfg.WitnessLease > 0 {
		a.wit.keys, a.wit.nonce = wk, randomNonce()
	} else {
		a.lcfg.WitnessLease = 0 // renewals are what keep a two-region lease with a witness
	}
	a.drv = driver.New(cfg.Region, ports{a})
	a.m = newMetrics(cfg.Region, cfg.Metrics, a)
	return a, nil
}

// closureRoom bounds room, a ledger's MaxClosureBytes, by a quarter of the
// NATS server's max payload once it is known (the connection was made; a
// ledger started before keeps room, the ledger's default, a quarter of
// NATS's default payload). A split report repeats its closures in every
// part: a server with a smaller max_payload must still leave room for keys.
func closureRoom(nc *nats.Conn, room int) int {
	if mp := nc.MaxPayload(); mp > 0 {
		return min(room, max(1, int(mp)/4))
	}
	return room
}

// RedactURLs returns urls (NATS server URLs) for a log: comma-separated,
// without their user information (a user and password, or a token).
func RedactURLs(urls []string) string {
	out := make([]string, 0, len(urls))
	for _, s := range urls {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil {
			out = append(out, "(a URL that does not parse)")
			continue
		}
		u.User = nil
		out = append(out, u.String())
	}
	return strings.Join(out, ",")
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
	rs, err := a.nc.Subscribe(a.cfg.Shard.reportWildcard(), a.onReport)
	if err != nil {
		us.Unsubscribe()
		return fmt.Errorf("agent: subscribe reports: %w", err)
	}
	rs.SetPendingLimits(64*1024, 256<<20)
	a.subs = []*nats.Subscription{us, rs}
	if !a.nc.IsConnected() {
		// A flush would wait for a server for its whole timeout (10 s):
		// the subscriptions apply when the connection is made.
		a.log.Warn("NATS not connected: no report is sent or received, and the agent is not ready, until it connects (subscriptions apply then)",
			"servers", RedactURLs(a.nc.Servers()), "status", a.nc.Status().String())
	} else if err := a.nc.Flush(); err != nil {
		a.logs.Log(slog.LevelWarn, "nats-flush", "NATS flush after subscribing failed; subscriptions apply on reconnect", logKeyErr, err)
	}
	a.start = time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel, a.ctx = cancel, ctx
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

// Ready reports whether the agent has a rule set, its store's run id and
// a NATS connection: without one it neither sends nor hears reports, so
// its ledgers coordinate nothing (and, among three regions or more, fence
// to their floors).
func (a *Agent) Ready() bool { return a.ready.Load() && a.nc.IsConnected() }

func (a *Agent) now() time.Duration { return time.Since(a.start) }

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
