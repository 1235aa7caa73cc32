// Package enforcerd assembles the ratelimitd daemon from its parts: flags
// and environment, Redis, the rule source (file or etcd), the enforcer, the
// gRPC, HTTP and admin servers, metrics and graceful shutdown. cmd/ratelimitd
// and cmd/rlstack both run it.
package enforcerd

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/backend"
	"github.com/apportion/apportion/internal/flagenv"
	"github.com/apportion/apportion/internal/serve"
	"github.com/apportion/apportion/internal/tlsconfig"
	"github.com/apportion/apportion/regional"
	"github.com/apportion/apportion/regional/envoy"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

type options struct {
	region        string
	redis         backend.Redis
	etcd          backend.Etcd
	nats          backend.NATS
	log           backend.Log
	envoyKeys     string
	envoyRes      string
	envoyHeaders  bool
	grpcAddr      string
	httpAddr      string
	rulesFile     string
	rulesPoll     time.Duration
	etcdCache     string
	adminAddr     string
	adminToken    string
	adminNoAuth   bool
	staticGlobal  bool
	timeout       time.Duration
	queueTimeout  time.Duration
	shedQueue     int
	shedLatency   time.Duration
	warmup        time.Duration
	maxCost       int64
	localFraction float64
	maxUsageKeys  int
	tls           serve.TLS
	httpTimeouts  serve.Timeouts
	metricsAddr   string
	adminTimeout  time.Duration
	registry      string
	shutdown      time.Duration
	shutdownDelay time.Duration
	envoy         bool
	tracing       tracingFlags
	cpuProfile    string
	pipelines     int
	streamWorkers int
	maxStreams    int
	gcPercent     int
}

// Defaults of the runtime settings that the hot path's profile asked for
// (README, Performance). The no-op server of cmd/rlload uses the same, so
// that its ceiling is a server tuned alike.
const (
	// DefaultStreamWorkers is how many goroutines the gRPC server keeps
	// for calls, reusing their grown stacks: a new goroutine per call
	// grows its stack again on every check (runtime.newstack and copystack
	// were 7% of the enforcer's CPU).
	DefaultStreamWorkers = 256
	// DefaultMaxStreams is how many calls one gRPC connection may have
	// open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): gRPC's own
	// default is unlimited, so one client that opens streams and never
	// reads their answers could hold memory without bound (about 4 KB a
	// stream: 100,000 streams on one connection took 520 MB of heap).
	DefaultMaxStreams = 1024
	// DefaultGCPercent is the GOGC the daemon runs with unless GOGC is set:
	// the live heap is small, so at 100 the collector ran many times a
	// second and shrank the workers' stacks each time (GC and stack
	// copying were about 15% of the CPU). At 400 the heap may grow to 5x
	// the live data between collections.
	DefaultGCPercent = 400
)

// SetGCPercent sets the collector's target to percent unless the GOGC
// environment variable is set (it wins); 0 leaves the runtime's default.
func SetGCPercent(percent int) {
	if percent != 0 && os.Getenv("GOGC") == "" {
		debug.SetGCPercent(percent)
	}
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("ratelimitd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := regional.DefaultConfig()
	fs.StringVar(&o.region, "region", "", "this enforcer's region (required), e.g. us-east")
	o.redis.Register(fs)
	o.log.Register(fs)
	fs.StringVar(&o.envoyKeys, "envoy-client-key-entries", "client_key,remote_address,generic_key,user_id,api_key", "Envoy descriptor entries that give the client key, first match wins")
	fs.StringVar(&o.envoyRes, "envoy-resource-entries", "path,header_match", "Envoy descriptor entries that give the resource (after a \"resource\" entry)")
	fs.BoolVar(&o.envoyHeaders, "envoy-response-headers", false, "send x-ratelimit-* headers in Envoy answers")
	fs.StringVar(&o.grpcAddr, "grpc-addr", "127.0.0.1:8081", "gRPC listen address (port 0: any free port)")
	fs.StringVar(&o.httpAddr, "http-addr", "127.0.0.1:8080", "HTTP listen address for /v1/check, /healthz, /readyz (and /metrics unless --metrics-addr)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "separate plain-HTTP listen address for /metrics, /healthz and /readyz (e.g. for probes and scrapers when --tls-client-ca is on); /metrics then leaves --http-addr (empty: off)")
	fs.StringVar(&o.rulesFile, "rules", "", "JSON or YAML file with a list of rules; reloaded when it changes")
	fs.DurationVar(&o.rulesPoll, "rules-poll", time.Second, "how often the rules file is checked for changes")
	o.etcd.Register(fs, "comma-separated etcd endpoints to watch rules from (instead of --rules)")
	fs.StringVar(&o.etcdCache, "etcd-cache", "", "file caching the last good rule set, served when the enforcer starts while etcd is down (empty: off)")
	fs.StringVar(&o.adminAddr, "admin-addr", "", "listen address of the rules admin API (needs --etcd-endpoints; empty: off)")
	fs.StringVar(&o.adminToken, "admin-token", "", "bearer token the admin API requires (prefer APPORTION_ADMIN_TOKEN)")
	fs.BoolVar(&o.adminNoAuth, "admin-no-auth", false, "serve the admin API without authentication (loopback test stacks only)")
	fs.DurationVar(&o.adminTimeout, "admin-store-timeout", admin.DefaultStoreTimeout, "longest an admin API request waits for etcd before it answers 503")
	fs.StringVar(&o.registry, "registry-prefix", etcdstore.DefaultRegistryPrefix, "etcd key prefix of the sync agents' reclaim registry (their --registry-prefix): a global rule whose split differs from the one registered for its id is refused by the admin API and skipped as invalid when found in etcd")
	o.nats.Register(fs, "", "NATS URL for usage reports to the region's sync agent (empty: off)")
	fs.BoolVar(&o.staticGlobal, "static-global", false, "global rules enforce their static share; ONLY for regions without a sync agent (see README)")
	fs.DurationVar(&o.timeout, "timeout", def.Timeout, "Redis round trip of a check, from the moment it is sent, before the failure policy answers (time queued in the enforcer does not count)")
	fs.DurationVar(&o.queueTimeout, "queue-timeout", 0, "longest a check waits in the enforcer for a pipeline to Redis; past it the check is shed (rejected, shed=true); 0: 100ms or --timeout, whichever is longer")
	fs.IntVar(&o.shedQueue, "shed-queue", def.ShedQueue, "checks waiting for Redis at which low-priority rules are shed (0: off)")
	fs.DurationVar(&o.shedLatency, "shed-latency", 0, "Redis round trip (moving average) at which low-priority rules are shed (0: half of --timeout; negative: off)")
	fs.DurationVar(&o.warmup, "warmup-timeout", 2*time.Second, "how long to wait at start for Redis (connections and scripts) before serving anyway from the failure policy")
	fs.Int64Var(&o.maxCost, "max-cost", def.MaxCost, "largest cost one request may ask for")
	fs.Float64Var(&o.localFraction, "local-fraction", def.LocalFraction, "share of a rule's limit that failure_mode local admits per process while Redis is down")
	fs.IntVar(&o.maxUsageKeys, "max-usage-keys", usage.DefaultMaxKeys, "distinct keys of global rules whose usage one flush to the sync agent carries; the usage of further keys is dropped (apportion_usage_dropped_keys_total)")
	o.tls.Register(fs, "gRPC, HTTP and the admin API")
	o.httpTimeouts.Register(fs)
	fs.BoolVar(&o.envoy, "envoy", true, "also serve Envoy's rate-limit protocol (envoy.service.ratelimit.v3.RateLimitService) on the gRPC port")
	fs.DurationVar(&o.shutdown, "shutdown-timeout", 10*time.Second, "how long a graceful shutdown waits for in-flight checks")
	fs.DurationVar(&o.shutdownDelay, "shutdown-delay", 0, "on SIGTERM, keep serving this long with /readyz 503 and the gRPC health NOT_SERVING before closing the listeners, so that load balancers stop sending first (Kubernetes: a preStop pause does it)")
	o.tracing.register(fs)
	fs.IntVar(&o.pipelines, "redis-pipelines", redisstore.DefaultWorkers, "pipelines to Redis in flight at once, at most (each sent by a worker with the checks that waited meanwhile)")
	fs.IntVar(&o.streamWorkers, "grpc-stream-workers", DefaultStreamWorkers, "gRPC goroutines kept for calls and reused (0: a new goroutine per call)")
	fs.IntVar(&o.maxStreams, "grpc-max-streams", DefaultMaxStreams, "calls one gRPC connection may have open at once; a client's further calls wait on its side (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS) or go on another connection")
	fs.IntVar(&o.gcPercent, "gc-percent", DefaultGCPercent, "the Go collector's GOGC percentage unless the GOGC variable is set (0: the runtime's default, 100)")
	fs.StringVar(&o.cpuProfile, "cpu-profile", "", "write a pprof CPU profile of the whole run to this file, for performance work (empty: off)")
	if err := flagenv.Parse(fs, args, nil); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if err := o.tracing.validate(); err != nil {
		return nil, err
	}
	switch {
	case o.region == "":
		return nil, errors.New("--region is required")
	case o.rulesFile == "" && o.etcd.Endpoints == "":
		return nil, errors.New("one of --rules FILE or --etcd-endpoints URLS is required")
	case o.rulesFile != "" && o.etcd.Endpoints != "":
		return nil, errors.New("--rules and --etcd-endpoints are exclusive")
	case o.adminTimeout <= 0:
		return nil, errors.New("--admin-store-timeout must be positive")
	case o.pipelines < 1:
		return nil, errors.New("--redis-pipelines must be at least 1")
	case o.maxUsageKeys < 1:
		return nil, errors.New("--max-usage-keys must be at least 1")
	case o.streamWorkers < 0 || o.gcPercent < 0:
		return nil, errors.New("--grpc-stream-workers and --gc-percent must not be negative")
	case o.maxStreams < 1:
		return nil, fmt.Errorf("--grpc-max-streams %d: must be at least 1", o.maxStreams)
	case o.shutdown <= 0:
		return nil, errors.New("--shutdown-timeout must be positive")
	case o.shutdownDelay < 0:
		return nil, errors.New("--shutdown-delay must not be negative")
	}
	if err := o.tls.Validate(); err != nil {
		return nil, err
	}
	if err := o.httpTimeouts.Validate(); err != nil {
		return nil, err
	}
	return o, nil
}

// dialBreaker is the Redis client's PoolSize: about 10 s of failed looks
// (one per 10 ms) before go-redis's pool stops dialing (see Run).
const dialBreaker = 1024

// Run parses the ratelimitd command line, starts the enforcer and blocks
// until ctx is done, then shuts down gracefully: it stops accepting, finishes
// in-flight checks, and closes. It prints "ready grpc=ADDR http=ADDR" to
// stdout once it serves a rule set (with " admin=ADDR" when the admin API is
// on, then " metrics=ADDR" with --metrics-addr); its ports listen before
// that, answering /readyz 503 and checks Unavailable until the first rule
// set is loaded (etcd down at start).
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	log, err := o.log.New(stderr)
	if err != nil {
		return err
	}
	// go-redis's own messages (hundreds a second while Redis is down) go
	// to the log at Debug, not raw to stderr; its logger is the process's,
	// so they are not attributed to this region.
	defer backend.InstallRedisLogger(log.With("component", "go-redis"))()
	log = log.With("component", "ratelimitd", "region", o.region)
	SetGCPercent(o.gcPercent)
	if o.cpuProfile != "" {
		stop, err := startCPUProfile(o.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	tlsSrv, err := o.tls.Server(log)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := regional.NewMetrics(reg, o.region)

	ropts, err := o.redis.Options()
	if err != nil {
		return err
	}
	// Checks are concurrent and pipelined: keep a warm pool, one
	// connection per pipelining worker at least. A round trip past its
	// budget is abandoned at the deadline (backend's options set
	// ContextTimeoutEnabled), not at the read timeout, so that a hung Redis
	// holds a worker no longer.
	//
	// PoolSize is also go-redis's dial breaker: after PoolSize failed dials
	// in a row the pool stops dialing and tries again once a second. While
	// Redis is down the breaker lets a check look every 10 ms (heardAgain),
	// so a threshold of 32 was reached a third of a second into an outage,
	// and a Redis back after that waited up to a second for the pool
	// (TestRedisFaults' refused case: 190 ms after the fault, 3 to 7 ms
	// with this). The pool's connections stay capped by MaxActiveConns; the
	// store's workers use one each.
	ropts.PoolSize, ropts.MaxActiveConns, ropts.MinIdleConns = max(dialBreaker, 2*o.pipelines), max(32, 2*o.pipelines), o.pipelines
	// The workers' pipelines go through go-redis's pipeline pool (10
	// connections by default), apart from the pool above: room for one per
	// worker, so that --redis-pipelines above 10 is not capped silently.
	ropts.PipelinePoolSize = max(redis.DefaultPipelinePoolSize, 2*o.pipelines)
	// One dial attempt per command: a Redis that refuses is a store
	// failure now (the breaker and the next checks retry), not after backoffs.
	ropts.DialerRetries = 1
	// The store hears Redis on every reply, not only per pipeline.
	act := redisstore.NewActivity()
	dial := ropts.Dialer
	if dial == nil {
		dial = redis.NewDialer(&redis.Options{DialTimeout: ropts.DialTimeout, TLSConfig: ropts.TLSConfig})
	}
	ropts.Dialer = act.Dialer(dial)
	rc := redis.NewUniversalClient(ropts)
	defer rc.Close()
	store, err := redisstore.New(rc, redisstore.WithActivity(act), redisstore.WithWorkers(o.pipelines))
	if err != nil {
		return fmt.Errorf("redis store: %w", err)
	}
	defer store.Close()
	// Warm up before serving: every worker's connection dialed and the
	// scripts loaded, so that the first checks (a burst at start) pay for
	// neither. An unreachable Redis is not fatal: after --warmup-timeout
	// the failure policy answers until it returns.
	if err := warm(ctx, store, o.warmup); err != nil {
		log.Warn("redis unreachable at start; answering from the failure policy until it returns", "addr", o.redis.Addr, "error", err)
	}
	// A Redis on this host that waits for a CPU is overload, not a failed
	// store: find its process, so that its silence is told apart; again
	// every 5 s while there is none (a Redis down at start, or restarted).
	store.KeepWatchingLocalRedis(ctx, 5*time.Second, func(pid int, err error) {
		if err == nil {
			log.Info("watching the local Redis process's scheduling: a Redis waiting for a CPU is overload, not a store failure", "pid", pid)
		} else {
			log.Debug("no local Redis process to watch", "reason", err)
		}
	})
	reg.MustRegister(regional.ScriptLoadsCollector(o.region, store.ScriptLoads))

	var rec *usage.Recorder
	if o.nats.URL != "" {
		nc, err := o.nats.Connect("ratelimitd-" + o.region)
		if err != nil {
			return err
		}
		defer nc.Close()
		host, _ := os.Hostname()
		rec = usage.NewRecorder(o.maxUsageKeys)
		pub, err := usage.NewPublisher(nc, rec, o.region, fmt.Sprintf("%s-%d-%d", host, os.Getpid(), time.Now().UnixNano()),
			usage.WithLogger(log), usage.WithMetrics(reg))
		if err != nil {
			return err
		}
		pub.Start()
		defer func() {
			cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			pub.Close(cctx)
		}()
	}

	cfg := regional.DefaultConfig()
	cfg.Region, cfg.Timeout, cfg.MaxCost, cfg.LocalFraction = o.region, o.timeout, o.maxCost, o.localFraction
	cfg.QueueTimeout, cfg.ShedQueue, cfg.ShedLatency = o.queueTimeout, o.shedQueue, o.shedLatency
	cfg.Logger, cfg.Metrics = log, metrics
	cfg.StaticGlobal = o.staticGlobal
	if rec != nil {
		cfg.Usage = rec.Add
	}
	enf, err := regional.New(cfg, store)
	if err != nil {
		return err
	}

	rsrc, err := newSource(o, log, reg)
	if err != nil {
		return err
	}
	defer rsrc.close()
	src := rsrc.src
	srcCtx, stopSrc := context.WithCancel(context.Background())
	defer stopSrc()
	first := make(chan struct{})
	var firstOnce sync.Once
	srcErr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		srcErr <- src.Run(srcCtx, func(rs []rules.Rule) {
			if err := enf.SetRules(rs); err != nil {
				log.Error("rule set refused; keeping the previous one", "error", err)
				return
			}
			firstOnce.Do(func() { close(first) })
		})
	}()
	defer wg.Wait()
	defer stopSrc()

	tp, err := o.tracing.start(ctx, o.region)
	if err != nil {
		return err
	}
	defer func() {
		if err := shutdownTracing(tp, 5*time.Second); err != nil {
			log.Warn("trace export at shutdown", "error", err)
		}
	}()

	lis, err := listen(o, rsrc.admin != nil)
	if err != nil {
		return err
	}
	// A connection that does not finish its TLS and HTTP/2 handshake within
	// the read-header timeout is dropped (gRPC's default waits 120 s).
	gopts := []grpc.ServerOption{grpc.ConnectionTimeout(o.httpTimeouts.ReadHeader), grpc.MaxConcurrentStreams(uint32(o.maxStreams))}
	if o.streamWorkers > 0 {
		gopts = append(gopts, grpc.NumStreamWorkers(uint32(o.streamWorkers)))
	}
	var tlsCfg *tls.Config
	if tlsSrv != nil {
		tlsCfg = tlsSrv.Config()
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(tlsCfg)))
	}
	if tp != nil {
		gopts = append(gopts, tracingServerOptions(tp, o.tracing.clientKeys)...)
	}
	gs, svc := regional.NewGRPCServer(enf, gopts...)
	if o.envoy {
		envoy.Register(gs, enf, envoy.WithClientKeyEntries(splitList(o.envoyKeys)...),
			envoy.WithResourceEntries(splitList(o.envoyRes)...), envoy.WithResponseHeaders(o.envoyHeaders))
		svc.AlsoServes(envoy.ServiceName)
	}
	var shuttingDown atomic.Bool
	ready := func() bool { return !shuttingDown.Load() }
	// With --metrics-addr, /metrics is served there only; /healthz and
	// /readyz on both ports.
	var checkGatherer prometheus.Gatherer = reg
	if lis.metrics != nil {
		checkGatherer = nil
	}
	hh := regional.NewHTTPHandler(enf, checkGatherer, ready)
	servers := []*http.Server{serve.NewHTTP(hh, o.httpTimeouts, tlsCfg, log)}
	listeners := []net.Listener{lis.http}
	if lis.admin != nil {
		servers = append(servers, serve.NewHTTP(rsrc.admin, o.httpTimeouts, tlsCfg, log))
		listeners = append(listeners, lis.admin)
	}
	if lis.metrics != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.Handle("/healthz", hh)
		mux.Handle("/readyz", hh)
		servers = append(servers, serve.NewHTTP(mux, o.httpTimeouts, nil, log))
		listeners = append(listeners, lis.metrics)
	}
	// Every serve goroutine is waited for before Run returns (serving
	// stops at shutdown below); serveErr has room for each one's result.
	serveErr := make(chan error, len(servers)+1)
	var serving sync.WaitGroup
	defer serving.Wait()
	for i, hs := range servers {
		serving.Go(func() { serveErr <- serve.HTTP(hs, listeners[i]) })
	}
	serving.Go(func() { serveErr <- gs.Serve(lis.grpc) })

	// The ports serve before the first rule set arrives (an enforcer that
	// starts while etcd is down): /healthz answers, /readyz is 503, checks
	// are Unavailable (regional.ErrNoRules) and the gRPC health service
	// says NOT_SERVING; the ready line and SERVING wait for the rules.
	var runErr error
	loaded := false
	select {
	case <-first:
		loaded = true
	case err := <-srcErr:
		runErr = fmt.Errorf("rules: %w", err)
	case err := <-serveErr:
		runErr = fmt.Errorf("server stopped: %w", err)
	case <-ctx.Done():
	}
	if loaded {
		runErr = serveUntilDone(ctx, log, stdout, svc, enf, lis, tlsSrv, serveErr, srcErr, srcCtx)
	}

	shuttingDown.Store(true)
	svc.SetServing(false)
	if loaded && o.shutdownDelay > 0 {
		log.Info("shutting down: unready, serving on for --shutdown-delay", "delay", o.shutdownDelay.String())
		time.Sleep(o.shutdownDelay)
	}
	log.Info("shutting down: finishing in-flight checks")
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdown)
	defer cancel()
	done := make(chan struct{})
	go func() { gs.GracefulStop(); close(done) }()
	for _, hs := range servers {
		if err := hs.Shutdown(sctx); err != nil {
			log.Warn("http shutdown", "error", err)
		}
	}
	select {
	case <-done:
	case <-sctx.Done():
		gs.Stop()
		<-done
	}
	log.Info("stopped")
	return runErr
}

// serveUntilDone announces that the enforcer serves (the gRPC health
// service, the log, the ready line on stdout) and waits until ctx ends or
// a server stops; a rule source that stops leaves the last good rule set
// serving.
func serveUntilDone(ctx context.Context, log *slog.Logger, stdout io.Writer, svc *regional.GRPCService, enf *regional.Enforcer,
	lis *listeners, tlsSrv *tlsconfig.Server, serveErr, srcErr <-chan error, srcCtx context.Context) error {
	svc.SetServing(true)
	log.Info("serving", "grpc", lis.grpc.Addr().String(), "http", lis.http.Addr().String(), "rules", len(enf.Rules()),
		"tls", tlsSrv != nil, "mutual_tls", tlsSrv != nil && tlsSrv.MutualTLS())
	line := fmt.Sprintf("ready grpc=%s http=%s", lis.grpc.Addr(), lis.http.Addr())
	if lis.admin != nil {
		log.Info("admin API serving", "addr", lis.admin.Addr().String())
		line += " admin=" + lis.admin.Addr().String()
	}
	if lis.metrics != nil {
		log.Info("metrics and health serving", "addr", lis.metrics.Addr().String())
		line += " metrics=" + lis.metrics.Addr().String()
	}
	fmt.Fprintln(stdout, line)

	select {
	case <-ctx.Done():
	case err := <-serveErr:
		return fmt.Errorf("server stopped: %w", err)
	case err := <-srcErr:
		if err != nil && srcCtx.Err() == nil {
			log.Error("rule source stopped; serving the last good rule set", "error", err)
		}
		<-ctx.Done()
	}
	return nil
}

// startCPUProfile profiles the process into path until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// warm retries store.Warm until it succeeds, ctx ends or limit passes.
func warm(ctx context.Context, store *redisstore.Store, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	backoff := 20 * time.Millisecond
	for {
		actx, acancel := context.WithTimeout(ctx, time.Second)
		err := store.Warm(actx)
		acancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// splitList splits a comma-separated flag value, dropping empty items.
func splitList(v string) []string {
	var out []string
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// listeners are the daemon's bound ports; admin and metrics may be nil.
type listeners struct {
	grpc, http, admin, metrics net.Listener
}

// listen binds every port the flags ask for, or none.
func listen(o *options, admin bool) (*listeners, error) {
	var l listeners
	var bound []net.Listener
	bind := func(what, addr string) (net.Listener, error) {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			for _, b := range bound {
				b.Close()
			}
			return nil, fmt.Errorf("%s listen: %w", what, err)
		}
		bound = append(bound, ln)
		return ln, nil
	}
	var err error
	if l.grpc, err = bind("grpc", o.grpcAddr); err != nil {
		return nil, err
	}
	if l.http, err = bind("http", o.httpAddr); err != nil {
		return nil, err
	}
	if admin {
		if l.admin, err = bind("admin", o.adminAddr); err != nil {
			return nil, err
		}
	}
	if o.metricsAddr != "" {
		if l.metrics, err = bind("metrics", o.metricsAddr); err != nil {
			return nil, err
		}
	}
	return &l, nil
}
