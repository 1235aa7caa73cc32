package agentd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/backend"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/serve"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/agent"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// maxCampaignBackoff caps the wait between two failed leader campaigns.
const maxCampaignBackoff = 10 * time.Second

type options struct {
	region         string
	redis          backend.Redis
	etcd           backend.Etcd
	nats           backend.NATS
	log            backend.Log
	registryPrefix string
	httpAddr       string
	httpTimeouts   serve.Timeouts
	interval       time.Duration
	lease          time.Duration
	rho            float64
	standby        bool
	halfLife       time.Duration
	recordHold     time.Duration
	maxUsageKeys   int
	usageGrace     time.Duration
	wireVersion    int
	heartbeat      time.Duration
	witnessLease   time.Duration
	demandBand     float64
	giftBand       float64
	giftWait       time.Duration
	seedFile       string
	peerKeys       string
	insecure       bool
	shard          agent.Shard
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	def := agent.DefaultConfig()
	fs := flag.NewFlagSet("syncagent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.region, "region", "", "this agent's region (required), e.g. us-east")
	o.redis.Register(fs)
	o.log.Register(fs)
	o.nats.Register(fs, nats.DefaultURL, "NATS URL of the region's server (reports cross regions through the super-cluster)")
	o.etcd.Register(fs, "comma-separated etcd endpoints (required): rules and the reclaim registry")
	fs.StringVar(&o.registryPrefix, "registry-prefix", agent.DefaultRegistryPrefix, "etcd key prefix of the reclaim registry (one document per global rule; the per-key lists of a rule with many keys go to chunks under this prefix without its final /, then .chunks/)")
	fs.StringVar(&o.httpAddr, "http-addr", "127.0.0.1:9091", "HTTP listen address for /metrics, /healthz, /readyz and "+agent.SharesPath+"?rule=ID")
	o.httpTimeouts.Register(fs)
	fs.DurationVar(&o.interval, "interval", def.Interval, "sync interval")
	fs.DurationVar(&o.lease, "lease", def.Lease, "lease: a region unheard for this long falls back to its floor and is reclaimed")
	fs.Float64Var(&o.rho, "clock-rate-bound", def.Rho, "bound on every clock's rate error (0.01: within 1% of real time)")
	fs.DurationVar(&o.halfLife, "demand-half-life", def.HalfLife, "half-life of the demand estimate: shorter follows shifts faster, longer is steadier under noisy traffic")
	fs.DurationVar(&o.recordHold, "record-hold", def.RecordHold, "TTL of a held share record in Redis, written again every half of it (never below 4 x (lease + interval + 100ms); 0: the default): the records of an agent gone for good expire after it")
	fs.IntVar(&o.maxUsageKeys, "max-usage-keys", def.MaxUsageKeys, "distinct keys of usage buffered between two sync intervals; the usage of further keys is dropped (apportion_sync_usage_dropped_total) and their demand goes unseen: raise it above the keys of global rules in use per interval (about 80 B of heap each while buffered)")
	fs.DurationVar(&o.usageGrace, "usage-grace", def.UsageGrace, "how long the demand estimates wait for an enforcer's late usage (a stalled NATS server: every enforcer sends a batch at every flush, empty or not) before they read the interval without it; an enforcer unheard this long counts as gone; 0: never wait")
	fs.DurationVar(&o.heartbeat, "heartbeat", def.Heartbeat, "a report goes out at least this often when nothing changed (capped by the lease: 685ms at 3s); 0: a report every interval")
	fs.DurationVar(&o.witnessLease, "witness-lease", def.WitnessLease, "two-region rules: a region cut off from its peer and from etcd keeps its share this long after its last renewal of its witness key in etcd, then its floor; a peer silent that long (x (1+rho)/(1-rho), + margin) is reclaimed; 0: no witness (a lost region's share of a two-region rule stays unused until it returns); at least --lease")
	fs.Float64Var(&o.demandBand, "demand-band", def.DemandBand, "a key's demand counts as changed only when it moved past this fraction of the value last reported (a move past a tenth of it is still reported within 3s); 0: every move")
	fs.Float64Var(&o.giftBand, "gift-band", def.GiftBand, "an excess over a key's target of at most this fraction of the limit is given only once it has lasted --gift-wait, so that units do not move on demand noise")
	fs.DurationVar(&o.giftWait, "gift-wait", def.GiftWait, "how long an excess within --gift-band must last before it is given; 0: at once")
	fs.IntVar(&o.wireVersion, "wire-version", 3, "format of the reports this agent publishes, 3 or 2: agents read both, agents before format 3 read only 2; to upgrade such a deployment run every region with 2, then switch to 3")
	fs.BoolVar(&o.standby, "standby", false, "campaign for the region's agent role in etcd and act only while leader")
	fs.StringVar(&o.seedFile, "report-seed-file", "", "file holding this region's NKey user seed (SU..., or a NATS .creds file): every report is signed with it (required unless --insecure-unsigned-reports; syncagent keygen FILE makes one)")
	fs.StringVar(&o.peerKeys, "report-peer-keys", "", "the regions' NKey public keys, region=U...,region=U... (may include this region), or @FILE to read that list from FILE: reports are accepted only when signed by their region's key")
	fs.Func("shard", "this process's shard of the region's keys, i/N (default 0/1: every key); N must be the layout in etcd (syncagent layout N), and N above 1 needs a Redis Cluster", func(v string) error {
		sh, err := agent.ParseShard(v)
		o.shard = sh
		return err
	})
	fs.BoolVar(&o.insecure, "insecure-unsigned-reports", false, "INSECURE: allow running without --report-seed-file (reports go out unsigned) and accept unsigned reports from regions without a key in --report-peer-keys; anyone who can publish on NATS can then move shares")
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	switch {
	case o.region == "":
		return nil, errors.New("--region is required")
	case o.etcd.Endpoints == "":
		return nil, errors.New("--etcd-endpoints is required")
	}
	if err := o.httpTimeouts.Validate(); err != nil {
		return nil, err
	}
	return o, nil
}

// reportKeys loads the signer and the peers' keys of o.
func (o *options) reportKeys() (*wire.Signer, wire.Keys, error) {
	var signer *wire.Signer
	if o.seedFile == "" && !o.insecure {
		return nil, nil, errors.New("--report-seed-file is required: reports are signed (make a key with: syncagent keygen FILE; " +
			"give every region's public key in --report-peer-keys), or pass --insecure-unsigned-reports to run without authentication")
	}
	if o.seedFile != "" {
		seed, err := os.ReadFile(o.seedFile)
		if err != nil {
			return nil, nil, fmt.Errorf("--report-seed-file: %w", err)
		}
		if signer, err = wire.NewSigner(o.region, seed); err != nil {
			return nil, nil, fmt.Errorf("--report-seed-file %s: %w", o.seedFile, err)
		}
	}
	list := o.peerKeys
	if f, ok := strings.CutPrefix(list, "@"); ok {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, nil, fmt.Errorf("--report-peer-keys: %w", err)
		}
		list = string(b)
	}
	keys, err := wire.ParseKeys(list)
	if err != nil {
		return nil, nil, fmt.Errorf("--report-peer-keys: %w", err)
	}
	return signer, keys, nil
}

// subcommandArgs parses the arguments of subcommand name, which takes no
// flags: -h, -help or --help prints its usage to stderr (done true: the
// caller does nothing else and succeeds), any other flag is an error, and
// "--" ends the flags (a FILE that begins with "-"). It returns the
// positional arguments.
func subcommandArgs(name, usage string, args []string, stderr io.Writer) (rest []string, done bool, err error) {
	fs := flag.NewFlagSet("syncagent "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // its own messages name no usage: ours follows
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, usage)
			return nil, true, nil
		}
		return nil, false, fmt.Errorf("%w; %s", err, usage)
	}
	return fs.Args(), false, nil
}

// keygen writes a new NKey user seed to path (which must not exist) and
// prints its public key.
func keygen(args []string, stdout, stderr io.Writer) error {
	const usage = "usage: syncagent keygen FILE (writes a new seed to FILE, which must not exist, and prints its public key)"
	args, done, err := subcommandArgs("keygen", usage, args, stderr)
	if done || err != nil {
		return err
	}
	if len(args) != 1 {
		return errors.New(usage)
	}
	seed, pub, err := wire.GenerateSeed()
	if err != nil {
		return err
	}
	if err := writeNew(args[0], append(seed, '\n'), 0o600); err != nil {
		return fmt.Errorf("keygen: %w", err)
	}
	fmt.Fprintln(stdout, pub)
	return nil
}

// pubkey prints the public key of the seed in path.
func pubkey(args []string, stdout, stderr io.Writer) error {
	const usage = "usage: syncagent pubkey FILE (prints the public key of the seed in FILE)"
	args, done, err := subcommandArgs("pubkey", usage, args, stderr)
	if done || err != nil {
		return err
	}
	if len(args) != 1 {
		return errors.New(usage)
	}
	seed, err := os.ReadFile(args[0])
	if err != nil {
		return fmt.Errorf("pubkey: %w", err)
	}
	s, err := wire.NewSigner("", seed)
	if err != nil {
		return fmt.Errorf("pubkey: %s: %w", args[0], err)
	}
	fmt.Fprintln(stdout, s.PublicKey())
	return nil
}

// RunCommand parses the syncagent command line, runs the agent and blocks
// until ctx is done, then shuts down. It prints "ready region=NAME
// http=ADDR" to stdout once the agent runs (with --standby: once it serves
// HTTP and campaigns). cmd/syncagent and rlstack both run it.
//
// "syncagent keygen FILE" writes a new report signing seed to FILE and
// prints its public key; "syncagent pubkey FILE" prints the public key of
// a seed file; "syncagent keys DIR REGION..." creates the missing keys of
// a deployment's regions (see keysInit). With -h (-help, --help) each
// prints its usage and does nothing else.
func RunCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "keygen":
			return keygen(args[1:], stdout, stderr)
		case "pubkey":
			return pubkey(args[1:], stdout, stderr)
		case "keys":
			return keysInit(args[1:], stdout, stderr)
		case "layout":
			return layoutCommand(ctx, args[1:], stdout, stderr)
		}
	}
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}

	log, err := o.log.New(stderr)
	if err != nil {
		return err
	}
	defer backend.InstallRedisLogger(log.With("component", "go-redis"))()
	log = log.With("component", "syncagent", "region", o.region)
	cfg := agent.DefaultConfig()
	cfg.Region, cfg.Interval, cfg.Lease, cfg.Rho, cfg.Logger = o.region, o.interval, o.lease, o.rho, log
	cfg.HalfLife, cfg.RecordHold, cfg.MaxUsageKeys, cfg.WireVersion = o.halfLife, o.recordHold, o.maxUsageKeys, o.wireVersion
	cfg.Heartbeat, cfg.DemandBand, cfg.WitnessLease = o.heartbeat, o.demandBand, o.witnessLease
	cfg.GiftBand, cfg.GiftWait, cfg.UsageGrace = o.giftBand, o.giftWait, o.usageGrace
	cfg.RulePrefix = o.etcd.Prefix
	cfg.InsecureUnsigned = true // the keys are checked next, once the rest is valid
	if err := cfg.Validate(); err != nil {
		return flagNames(err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	leaderGauge := prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_sync_leader",
		Help: "1 while this process acts as its region's agent.", ConstLabels: prometheus.Labels{"region": o.region}})
	ruleRevision := prometheus.NewGauge(prometheus.GaugeOpts{Name: "apportion_rule_revision",
		Help: "etcd revision of the rule set this process enforces.", ConstLabels: prometheus.Labels{"region": o.region}})
	reg.MustRegister(leaderGauge, ruleRevision)

	// Share writes are idempotent (versioned), but a retry delayed past
	// StoreTimeout could land a marker late: Options turns client retries off.
	ropts, err := o.redis.Options()
	if err != nil {
		return err
	}
	signer, peerKeys, err := o.reportKeys()
	if err != nil {
		return err
	}
	cfg.Signer, cfg.PeerKeys, cfg.InsecureUnsigned = signer, peerKeys, o.insecure
	// Another agent of this region heard: a standby that leaves its term
	// only when told (campaign) is told this way while etcd is unreachable.
	otherAgent := make(chan struct{}, 1)
	cfg.OnOtherAgent = func() {
		select {
		case otherAgent <- struct{}{}:
		default:
		}
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	switch {
	case signer == nil:
		log.Warn("INSECURE: reports are not signed (--insecure-unsigned-reports); anyone who can publish on NATS can move shares")
	case len(peerKeys) == 0 || len(peerKeys) == 1 && peerKeys[o.region] != nil:
		log.Warn("no peer public keys (--report-peer-keys): every other region's report will be refused")
	}
	if o.insecure && signer != nil {
		log.Warn("INSECURE: accepting unsigned reports from regions without a key (--insecure-unsigned-reports)")
	}
	rc := redis.NewUniversalClient(ropts)
	defer rc.Close()
	var sopts []redisstore.Option
	if o.shard.Count > 1 {
		if _, ok := rc.(*redis.ClusterClient); !ok {
			return fmt.Errorf("--shard %d/%d: more than one shard needs a Redis Cluster (a single server has one marker per rule; see docs/operations.md, Shards)", o.shard.Index, o.shard.Count)
		}
		sopts = append(sopts, redisstore.WithMarkerSlots(redisstore.ShardSlots(o.shard.Index, o.shard.Count)))
	}
	store, err := redisstore.New(rc, sopts...)
	if err != nil {
		return fmt.Errorf("redis store: %w", err)
	}
	defer store.Close()

	nc, err := o.nats.Connect("syncagent-" + o.region)
	if err != nil {
		return err
	}
	defer nc.Close()
	watchStop, watchDone := make(chan struct{}), make(chan struct{})
	go func(log *slog.Logger) { // log as it is now: RunCommand adds the shard to it later
		defer close(watchDone)
		watchNATS(watchStop, nc, o.nats.URL, log)
	}(log)
	defer func() { close(watchStop); <-watchDone }()

	ecfg, err := o.etcd.Config(5 * time.Second)
	if err != nil {
		return err
	}
	ec, err := clientv3.New(ecfg)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer ec.Close()
	if cfg.Shard, err = shardOf(ctx, ec, o.shard); err != nil {
		return err
	}
	log = log.With("shard", cfg.Shard.String())
	cfg.Logger = log

	hl, err := net.Listen("tcp", o.httpAddr)
	if err != nil {
		return fmt.Errorf("http listen: %w", err)
	}
	var current atomic.Pointer[agent.Agent]
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		a := current.Load()
		switch {
		case !nc.IsConnected():
			// Neither an agent nor a standby serves without NATS: no report
			// is sent or heard (watchNATS logs why).
			http.Error(w, "not ready: NATS not connected ("+agent.RedactURLs(strings.Split(o.nats.URL, ","))+")", http.StatusServiceUnavailable)
		case a != nil && a.Ready():
			io.WriteString(w, "ready\n")
		case o.standby && a == nil:
			// A standby is ready for its role: campaigning, able to take
			// over. Answering 503 would hold a rollout (maxUnavailable 0)
			// and a PodDisruptionBudget on the one leader forever.
			io.WriteString(w, "standby\n")
		case a == nil:
			http.Error(w, "not ready: the agent is starting", http.StatusServiceUnavailable)
		default:
			http.Error(w, "not ready: no rule set or no Redis run id yet", http.StatusServiceUnavailable)
		}
	})
	mux.Handle(agent.SharesPath, agent.SharesHandler(current.Load))
	hs := serve.NewHTTP(mux, o.httpTimeouts, nil, log)
	serveErr := make(chan error, 1)
	go func() { serveErr <- serve.HTTP(hs, hl) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		hs.Shutdown(sctx)
	}()

	// One registration of the agent's metrics for the whole process: under
	// --standby the agent is rebuilt on each term, so its collectors go
	// through a forwarding registerer that replaces the previous term's.
	fwd := newSwapRegisterer(reg)
	runAgent := func(ctx context.Context) error {
		w, err := etcdstore.NewWatcher(ec, etcdstore.WithPrefix(o.etcd.Prefix), etcdstore.WithRegistryPrefix(o.registryPrefix), etcdstore.WithLogger(log),
			etcdstore.WithRevisionGauge(ruleRevision))
		if err != nil {
			return err
		}
		acfg := cfg
		acfg.Metrics = fwd.next()
		a, err := agent.New(acfg, store, nc, agent.NewEtcdRegistry(ec, o.registryPrefix, acfg.LedgerConfig()), w)
		if err != nil {
			return err
		}
		if err := a.Start(); err != nil {
			return err
		}
		current.Store(a)
		leaderGauge.Set(1)
		<-ctx.Done()
		leaderGauge.Set(0)
		current.Store(nil)
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return a.Close(cctx)
	}

	fmt.Fprintf(stdout, "ready region=%s http=%s\n", o.region, hl.Addr())
	log.Info("running", "http", hl.Addr().String(), "standby", o.standby)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() {
		if !o.standby {
			done <- runAgent(runCtx)
			return
		}
		done <- campaign(runCtx, ec, leaderKey(o.region, cfg.Shard), log, otherAgent, runAgent)
	}()
	select {
	case err := <-done:
		if ctx.Err() == nil && err != nil {
			return err
		}
	case err := <-serveErr:
		stop()
		<-done
		return fmt.Errorf("http server stopped: %w", err)
	}
	log.Info("stopped")
	return nil
}

// configFlags names the flags of the agent's Config fields that the flags
// set, for flagNames.
var configFlags = regexp.MustCompile(`\b(Region|Lease|Interval|WitnessLease|HeartbeatEvery|DemandBand|HalfLife|GiftBand|GiftWait|RecordHold|MaxUsageKeys|UsageGrace|Rho|WireVersion)\b`)

// flagNames is a Config's validation error told in the flags that set the
// fields it names ("Lease must exceed Interval+StoreTimeout" is
// "--lease must exceed --interval+StoreTimeout").
func flagNames(err error) error {
	flags := map[string]string{"Region": "--region", "Lease": "--lease", "Interval": "--interval", "WitnessLease": "--witness-lease",
		"HeartbeatEvery": "--heartbeat", "DemandBand": "--demand-band", "HalfLife": "--demand-half-life",
		"GiftBand": "--gift-band", "GiftWait": "--gift-wait", "RecordHold": "--record-hold",
		"MaxUsageKeys": "--max-usage-keys", "UsageGrace": "--usage-grace", "Rho": "--clock-rate-bound", "WireVersion": "--wire-version"}
	msg := configFlags.ReplaceAllStringFunc(err.Error(), func(f string) string { return flags[f] })
	if msg == err.Error() {
		return err
	}
	return renamedError{msg, err}
}

// renamedError is err with another message.
type renamedError struct {
	msg string
	err error
}

func (e renamedError) Error() string { return e.msg }
func (e renamedError) Unwrap() error { return e.err }

// campaign runs fn while this process leads the election at key, and
// campaigns again when a term ends, until ctx is done.
//
// A term ends when fn returns, or when another process is known to lead.
// Losing the etcd session alone does not end it: with etcd down no standby
// can be elected either, and an agent that stepped down would leave its
// region without an agent, every coordinated key at its floor, for as long
// as etcd is down. So after the session is lost the term goes on
// (holdTerm) until etcd, reachable again, names another leader or none (then
// the term ends and this process campaigns again), or keeps this process's
// key under its lease (the session is resumed on that lease: same term), or
// until another agent of the region is heard on NATS (otherAgent: a standby
// elected while this process could not reach etcd). Two agents acting at
// once stay safe (the peers freeze the older incarnation; the ledger's
// invariants hold per incarnation), only wasteful, and only until one of
// those tells this one.
func campaign(ctx context.Context, ec *clientv3.Client, key string, log *slog.Logger, otherAgent <-chan struct{}, fn func(context.Context) error) error {
	host, _ := os.Hostname()
	id := fmt.Sprintf("%s-%d", host, os.Getpid())
	backoff := 200 * time.Millisecond
	for ctx.Err() == nil {
		err := func() error {
			sess, err := concurrency.NewSession(ec, concurrency.WithTTL(campaignTTL), concurrency.WithContext(ctx))
			if err != nil {
				return err
			}
			defer sess.Close()
			el := concurrency.NewElection(sess, key)
			log.Info("standby: campaigning", "key", key)
			if err := el.Campaign(ctx, id); err != nil {
				return err
			}
			log.Info("standby: elected; acting as the region's agent")
			for len(otherAgent) > 0 {
				<-otherAgent // heard before this term
			}
			term, cancel := context.WithCancel(ctx)
			defer cancel()
			held := make(chan []*concurrency.Session, 1)
			go func() {
				held <- holdTerm(term, ctx, ec, sess, el, log, otherAgent)
				cancel()
			}()
			err = fn(term)
			cancel()
			resumed := <-held
			rctx, rcancel := context.WithTimeout(context.Background(), 2*time.Second)
			el.Resign(rctx)
			rcancel()
			for _, s := range resumed {
				s.Close()
			}
			return err
		}()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			log.Warn("standby: campaign failed; retrying", "err", err, "retry_in", backoff.String())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, maxCampaignBackoff)
			continue
		}
		backoff = 200 * time.Millisecond
	}
	return nil
}

// campaignTTL is the election session's lease, in seconds: a leader that
// stops renewing it (gone, or cut off from etcd) is replaced by a standby
// that reaches etcd this long after.
const campaignTTL = 5

// holdRetry is how often a leader whose etcd session was lost asks etcd
// again who leads.
const holdRetry = time.Second

// holdTerm watches a term won with sess and el, and returns when the term
// is to end: term done, or another leader known (see campaign). It returns
// the sessions it resumed, for the caller to close once fn has stopped.
func holdTerm(term, ctx context.Context, ec *clientv3.Client, sess *concurrency.Session, el *concurrency.Election, log *slog.Logger, otherAgent <-chan struct{}) []*concurrency.Session {
	var resumed []*concurrency.Session
	lease := sess.Lease()
	for {
		select {
		case <-term.Done():
			return resumed
		case <-sess.Done():
		}
		log.Warn("standby: etcd session lost; acting on as the region's agent until etcd names another leader or another agent of this region is heard",
			"key", el.Key())
		t := time.NewTicker(holdRetry)
		for sess = nil; sess == nil; {
			select {
			case <-term.Done():
				t.Stop()
				return resumed
			case <-otherAgent:
				t.Stop()
				log.Warn("standby: another agent of this region is heard while etcd is unreachable; stepping down")
				return resumed
			case <-t.C:
			}
			gctx, cancel := context.WithTimeout(term, holdRetry)
			resp, err := el.Leader(gctx)
			cancel()
			switch {
			case errors.Is(err, concurrency.ErrElectionNoLeader) || err == nil && string(resp.Kvs[0].Key) != el.Key():
				t.Stop()
				log.Warn("standby: etcd is back and another process leads (or none); stepping down")
				return resumed
			case err != nil:
				continue // etcd still unreachable: act on
			}
			// Still the leader's key, under our lease: renew it.
			s, err := concurrency.NewSession(ec, concurrency.WithTTL(campaignTTL), concurrency.WithLease(lease), concurrency.WithContext(ctx))
			if err != nil {
				continue
			}
			resumed = append(resumed, s)
			sess = s
			log.Info("standby: etcd session resumed; still the region's agent")
		}
		t.Stop()
	}
}

// swapRegisterer registers one agent term's collectors at a time: next
// unregisters the previous term's.
type swapRegisterer struct {
	reg *prometheus.Registry
	cur []prometheus.Collector
}

func newSwapRegisterer(reg *prometheus.Registry) *swapRegisterer { return &swapRegisterer{reg: reg} }

// next drops the previous term's collectors. Terms do not overlap.
func (s *swapRegisterer) next() prometheus.Registerer {
	for _, c := range s.cur {
		s.reg.Unregister(c)
	}
	s.cur = nil
	return s
}

func (s *swapRegisterer) Register(c prometheus.Collector) error {
	if err := s.reg.Register(c); err != nil {
		return err
	}
	s.cur = append(s.cur, c)
	return nil
}

func (s *swapRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := s.Register(c); err != nil {
			panic(err)
		}
	}
}

func (s *swapRegisterer) Unregister(c prometheus.Collector) bool { return s.reg.Unregister(c) }
