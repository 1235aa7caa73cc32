// Package stack runs a complete local multi-region apportion stack in one
// process tree: one embedded etcd, and per region an embedded NATS server
// (the regions joined by gateways into a super-cluster), a redis-server child
// process, an enforcer (regional/enforcerd) and a sync agent (sync/agent),
// both in-process. cmd/rlstack is
// its command line. Faults can be injected one region at a time: its
// gateways cut (Partition), its Redis restarted empty (RestartRedis), its
// sync agent stopped and started again (StopAgent, StartAgent), from Go or
// over HTTP (Config.FaultsAddr, faults.go).
//
// Invariant: Close stops everything Start started — child processes are
// killed and waited for (and get SIGKILL if this process dies first), the
// temporary directory is removed — whether Start succeeded or not.
package stack

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/apportion/apportion/deploy"
	"github.com/apportion/apportion/internal/launch"
	"github.com/apportion/apportion/regional/enforcerd"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/agentd"
	"github.com/nats-io/nats-server/v2/server"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultRegions names the regions of a stack, in order (Config.Regions
// runs the first ones: at most ten).
var DefaultRegions = []string{"us-east", "eu-west", "ap-south", "sa-east", "af-south", "me-central",
	"us-west", "ca-central", "ap-east", "au-east"}

// Config configures a Stack.
type Config struct {
	// Regions is how many regions to run (default 3, at most len(DefaultRegions)).
	Regions int
	// Rules is the rule set loaded into etcd (default: deploy/rules.yaml).
	Rules []byte
	// Logger receives the components' logs (default: discard).
	Logger *slog.Logger
	// LogWriter receives the enforcers' own log output (default: discard).
	LogWriter io.Writer
	// EnforcerTimeout is the enforcers' Redis call timeout (default 50ms).
	EnforcerTimeout time.Duration
	// EmbeddedRedis uses an in-process miniredis even when redis-server is on
	// PATH (it is used anyway when it is not).
	EmbeddedRedis bool
	// RegionNames names the regions, in order (default: the first Regions of
	// DefaultRegions). When set, Regions is len(RegionNames) (or must equal it).
	RegionNames []string
	// Delay is the one-way delay from one region to another, [from][to]
	// (default: none). The NATS gateway connection from `from` to `to`
	// goes through a loopback TCP proxy that forwards the bytes of both
	// directions after the delay. Give both orders for a symmetric WAN
	// (each region dials its own connection). When any delay is given,
	// every gateway connection goes through a proxy of its own, with no
	// delay where Delay gives none (startNATS says why), and Partition can
	// cut any region.
	Delay map[string]map[string]time.Duration
	// Partitionable puts every gateway connection through a proxy (with no
	// delay where Delay gives none), so that Partition can cut any region.
	Partitionable bool
	// SyncInterval and SyncLease are the sync agents' --interval and
	// --lease (default: the agent's defaults).
	SyncInterval, SyncLease time.Duration
	// SyncWitnessLease is the sync agents' --witness-lease, if set
	// (default: the agent's); NoWitness passes --witness-lease 0.
	SyncWitnessLease time.Duration
	NoWitness        bool
	// FaultsAddr, when set, is where the fault control listens (an HTTP
	// API to cut a region's gateways, restart its Redis, stop and start its
	// sync agent: faults.go); "127.0.0.1:0" picks a free port. Cutting
	// needs Partitionable.
	FaultsAddr string
}

// Region is one running region.
type Region struct {
	Name      string
	NATSURL   string
	RedisAddr string
	GRPCAddr  string
	HTTPAddr  string
	AdminAddr string // only the first region serves the admin API
	// AgentHTTPAddr is the sync agent's /metrics address ("" without an agent).
	AgentHTTPAddr string
}

// Stack is a running local stack.
type Stack struct {
	Regions       []Region
	EtcdEndpoint  string
	AdminToken    string
	Dir           string
	RedisEmbedded bool // true when no redis-server was on PATH
	// FaultsAddr is the fault control's address (Config.FaultsAddr; "" without).
	FaultsAddr string

	cfg         Config
	log         *slog.Logger
	etcd        *launch.Etcd
	nats        []*server.Server // the running servers, in region order (for tests)
	natsServers []*launch.NATS
	natsURL     map[string]string
	runCtx      context.Context // the daemons' context, cancelled by Close
	cancel      context.CancelFunc
	faultSrv    *http.Server
	wg          sync.WaitGroup
	redis       []*launch.Redis
	minis       []*miniredis.Miniredis
	proxies     []*link // fixed once Start returns
	mu          sync.Mutex
	errs        []error // guarded by mu
	closed      sync.Once
	// stopAgent stops a region's sync agent and waits for it (StopAgent).
	stopAgent map[string]func()
	// cutMu guards cut, the regions cut off (Partition), and orders the
	// proxies' cuts: a link is cut while either of its regions is.
	cutMu sync.Mutex
	cut   map[string]bool
}

// Start brings the stack up and returns once every enforcer serves. On error
// it has already stopped whatever it started.
func Start(ctx context.Context, cfg Config) (*Stack, error) {
	if err := resolveRegions(&cfg); err != nil {
		return nil, err
	}
	if cfg.EnforcerTimeout <= 0 {
		cfg.EnforcerTimeout = 50 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.LogWriter == nil {
		cfg.LogWriter = io.Discard
	}
	example := cfg.Rules == nil
	if example {
		cfg.Rules = deploy.ExampleRules
	}
	rs, err := rules.ParseRules(cfg.Rules)
	if err != nil {
		return nil, fmt.Errorf("stack: example rules: %w", err)
	}
	if example {
		fitRegions(rs, cfg.RegionNames)
	}
	dir, err := os.MkdirTemp("", "rlstack-")
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	s := &Stack{Dir: dir, cfg: cfg, log: cfg.Logger, runCtx: runCtx, cancel: cancel, AdminToken: randomToken(), natsURL: map[string]string{}}
	if err := s.start(ctx, runCtx, rs); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// fitRegions makes each global example rule list exactly the stack's
// regions (a region keeps its example weight, a new one weighs 1): a
// global rule admits nothing in a region it does not list, and a listed
// region that does not run holds a share nobody uses.
func fitRegions(rs []rules.Rule, names []string) {
	for i := range rs {
		if rs[i].Scope != rules.Global {
			continue
		}
		regions := make(map[string]float64, len(names))
		for _, n := range names {
			regions[n] = 1
			if w, ok := rs[i].Regions[n]; ok {
				regions[n] = w
			}
		}
		rs[i].Regions = regions
	}
}

func randomToken() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func (s *Stack) start(ctx, runCtx context.Context, rs []rules.Rule) error {
	if err := s.startEtcd(); err != nil {
		return err
	}
	if err := s.loadRules(ctx, rs); err != nil {
		return err
	}
	if err := s.startNATS(s.cfg.RegionNames); err != nil {
		return err
	}
	if err := s.writeKeys(s.cfg.RegionNames); err != nil {
		return err
	}
	for i, name := range s.cfg.RegionNames {
		r := Region{Name: name, NATSURL: s.natsURL[name]}
		addr, err := s.startRedis(r.Name)
		if err != nil {
			return err
		}
		r.RedisAddr = addr
		if err := s.startEnforcer(ctx, runCtx, &r, i == 0); err != nil {
			return err
		}
		if err := s.startAgent(ctx, runCtx, &r); err != nil {
			return err
		}
		s.Regions = append(s.Regions, r)
	}
	if s.cfg.FaultsAddr != "" {
		return s.serveFaults(s.cfg.FaultsAddr)
	}
	return nil
}

// startEtcd starts the embedded etcd (launch.StartEtcd).
func (s *Stack) startEtcd() error {
	e, err := launch.StartEtcd(filepath.Join(s.Dir, "etcd"))
	if err != nil {
		return fmt.Errorf("stack: %w", err)
	}
	s.etcd = e
	s.EtcdEndpoint = e.Endpoint
	return nil
}

func (s *Stack) etcdClient() (*clientv3.Client, error) {
	return s.etcd.Client()
}

func (s *Stack) loadRules(ctx context.Context, rs []rules.Rule) error {
	cli, err := s.etcdClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	st, err := etcdstore.New(cli)
	if err != nil {
		return err
	}
	for _, r := range rs {
		if _, err := st.Put(ctx, r, etcdstore.Unconditional); err != nil {
			return fmt.Errorf("stack: load rule %s: %w", r.ID, err)
		}
	}
	return nil
}

// startRedis starts a redis-server child on a free port, or, when there is
// no redis-server on PATH (or Config.EmbeddedRedis), an in-process
// miniredis: enough to try things out, not to measure anything.
func (s *Stack) startRedis(region string) (string, error) {
	if _, err := launch.RedisServerPath(); err != nil || s.cfg.EmbeddedRedis {
		m := miniredis.NewMiniRedis()
		m.ClockTTL(true) // expire keys in real time, as Redis does
		if err := m.StartAddr("127.0.0.1:0"); err != nil {
			return "", fmt.Errorf("stack: embedded redis: %w", err)
		}
		s.minis = append(s.minis, m)
		s.RedisEmbedded = true
		return m.Addr(), nil
	}
	r, err := launch.StartRedis(filepath.Join(s.Dir, "redis-"+region))
	if err != nil {
		return "", fmt.Errorf("stack: redis for %s: %w", region, err)
	}
	s.redis = append(s.redis, r)
	return r.Addr, nil
}

var (
	readyRE      = regexp.MustCompile(`ready grpc=(\S+) http=(\S+)(?: admin=(\S+))?`)
	agentReadyRE = regexp.MustCompile(`ready region=(\S+) http=(\S+)`)
)

// startEnforcer runs an enforcer in-process and waits for its ready line.
func (s *Stack) startEnforcer(ctx, runCtx context.Context, r *Region, admin bool) error {
	args := []string{"--region", r.Name, "--redis-addr", r.RedisAddr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--etcd-endpoints", s.EtcdEndpoint, "--timeout", s.cfg.EnforcerTimeout.String(), "--nats-url", r.NATSURL}
	if admin {
		args = append(args, "--admin-addr", "127.0.0.1:0", "--admin-token", s.AdminToken)
	}
	m, err := s.runDaemon(ctx, runCtx, "enforcer "+r.Name, r.Name, readyRE, args, enforcerd.Run)
	if err != nil {
		return err
	}
	r.GRPCAddr, r.HTTPAddr, r.AdminAddr = m[1], m[2], m[3]
	return nil
}

// startAgent runs the region's sync agent in-process and waits for its
// ready line. An agent started again (StartAgent) serves on the address
// its first life had.
func (s *Stack) startAgent(ctx, runCtx context.Context, r *Region) error {
	httpAddr := r.AgentHTTPAddr
	if httpAddr == "" {
		httpAddr = "127.0.0.1:0"
	}
	args := []string{"--region", r.Name, "--redis-addr", r.RedisAddr, "--nats-url", r.NATSURL,
		"--etcd-endpoints", s.EtcdEndpoint, "--http-addr", httpAddr,
		"--report-seed-file", s.seedFile(r.Name), "--report-peer-keys", "@" + s.peersFile()}
	if s.cfg.SyncInterval > 0 {
		args = append(args, "--interval", s.cfg.SyncInterval.String())
	}
	if s.cfg.SyncLease > 0 {
		args = append(args, "--lease", s.cfg.SyncLease.String())
	}
	if s.cfg.SyncWitnessLease > 0 || s.cfg.NoWitness {
		args = append(args, "--witness-lease", s.cfg.SyncWitnessLease.String())
	}
	agentCtx, cancel := context.WithCancel(runCtx)
	stopped := make(chan struct{})
	run := func(ctx context.Context, args []string, stdout, stderr io.Writer) error {
		defer close(stopped)
		return agentd.RunCommand(ctx, args, stdout, stderr)
	}
	m, err := s.runDaemon(ctx, agentCtx, "sync agent "+r.Name, r.Name+"/agent", agentReadyRE, args, run)
	if err != nil {
		cancel()
		return err
	}
	s.mu.Lock()
	if s.stopAgent == nil {
		s.stopAgent = map[string]func(){}
	}
	s.stopAgent[r.Name] = func() { cancel(); <-stopped }
	s.mu.Unlock()
	if r.AgentHTTPAddr == "" {
		r.AgentHTTPAddr = m[2]
	}
	return nil
}

// runDaemon runs a daemon's Run function in-process until runCtx is done and
// returns the submatches of its ready line.
func (s *Stack) runDaemon(ctx, runCtx context.Context, name, logPrefix string, ready *regexp.Regexp, args []string,
	run func(context.Context, []string, io.Writer, io.Writer) error) ([]string, error) {
	pr, pw := io.Pipe()
	readyc := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if m := ready.FindStringSubmatch(sc.Text()); m != nil {
				readyc <- m
			}
		}
	}()
	done := make(chan error, 1)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		err := run(runCtx, args, pw, prefixWriter(s.cfg.LogWriter, logPrefix))
		pw.Close()
		if err != nil {
			s.mu.Lock()
			s.errs = append(s.errs, fmt.Errorf("%s: %w", name, err))
			s.mu.Unlock()
		}
		done <- err
	}()
	select {
	case m := <-readyc:
		return m, nil
	case err := <-done:
		return nil, fmt.Errorf("stack: %s stopped before it was ready: %w", name, err)
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(30 * time.Second):
		return nil, fmt.Errorf("stack: %s not ready within 30s", name)
	}
}

// prefixWriter prefixes every line with the region's name.
func prefixWriter(w io.Writer, region string) io.Writer {
	if w == io.Discard {
		return w
	}
	pr, pw := io.Pipe()
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Fprintf(w, "[%s] %s\n", region, sc.Text())
		}
	}()
	return pw
}

// Close stops everything and removes the temporary directory. It returns the
// errors the components stopped with. Safe to call twice.
func (s *Stack) Close() error {
	s.closed.Do(func() {
		s.cancel()
		if s.faultSrv != nil {
			s.faultSrv.Close()
		}
		s.wg.Wait()
		s.mu.Lock()
		for _, r := range s.redis {
			r.Stop()
		}
		s.mu.Unlock()
		for _, m := range s.minis {
			m.Close()
		}
		for _, n := range s.natsServers {
			n.Shutdown()
		}
		for _, p := range s.proxies {
			p.Close()
		}
		if s.etcd != nil {
			s.etcd.Stop()
		}
		if err := os.RemoveAll(s.Dir); err != nil {
			s.errs = append(s.errs, err)
		}
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(s.errs...)
}

// Summary is the text rlstack prints once the stack is up.
func (s *Stack) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "apportion local stack: %d regions, etcd %s\n\n", len(s.Regions), s.EtcdEndpoint)
	fmt.Fprintf(&b, "%-10s %-20s %-20s %-20s %-26s %s\n", "region", "grpc", "http", "redis", "nats", "sync agent")
	for _, r := range s.Regions {
		agent := r.AgentHTTPAddr
		if agent == "" {
			agent = "-"
		}
		fmt.Fprintf(&b, "%-10s %-20s %-20s %-20s %-26s %s\n", r.Name, r.GRPCAddr, r.HTTPAddr, r.RedisAddr, r.NATSURL, agent)
	}
	r0 := s.Regions[0]
	if s.RedisEmbedded {
		fmt.Fprintf(&b, "note: no redis-server on PATH, so each region uses an in-process miniredis: fine for trying\n"+
			"things out, not for measuring anything. Install redis-server (apt-get install redis-server) for the real thing.\n")
	}
	fmt.Fprintf(&b, "temp dir: %s\n", s.Dir)
	fmt.Fprintf(&b, "\nadmin API: http://%s  (token %s)\n\n", r0.AdminAddr, s.AdminToken)
	fmt.Fprintf(&b, "try:\n")
	fmt.Fprintf(&b, "  grpcurl -plaintext -d '{\"client_key\":\"user:42\",\"resource\":\"POST /orders\",\"attributes\":{\"tier\":\"free\"}}' %s ratelimit.v1.RateLimiter/CheckLimit\n", r0.GRPCAddr)
	fmt.Fprintf(&b, "  curl -i -d '{\"client_key\":\"user:42\",\"resource\":\"POST /orders\",\"attributes\":{\"tier\":\"free\"}}' http://%s/v1/check\n", r0.HTTPAddr)
	fmt.Fprintf(&b, "  go run ./cmd/rlctl --admin-url http://%s --token %s rules list\n", r0.AdminAddr, s.AdminToken)
	if cmd := s.LimitsShowCommand(); cmd != "" {
		fmt.Fprintf(&b, "  %s\n", cmd)
	}
	if s.FaultsAddr != "" {
		fmt.Fprintf(&b, "faults (one region each; GET http://%s%s shows them):\n", s.FaultsAddr, FaultsPath)
		fmt.Fprintf(&b, "  curl -X POST 'http://%s%s/cut?region=%s'   (then heal; also restart-redis, stop-agent, start-agent)\n",
			s.FaultsAddr, FaultsPath, s.Regions[len(s.Regions)-1].Name)
	}
	return b.String()
}

// LimitsShowCommand is a ready command line that shows the global demo
// rule's limit and each region's live share from its sync agent ("" when
// no region runs an agent).
func (s *Stack) LimitsShowCommand() string {
	var agents []string
	for _, r := range s.Regions {
		if r.AgentHTTPAddr != "" {
			agents = append(agents, r.Name+"=http://"+r.AgentHTTPAddr)
		}
	}
	if len(agents) == 0 || len(s.Regions) == 0 {
		return ""
	}
	return fmt.Sprintf("go run ./cmd/rlctl --admin-url http://%s --token %s limits show %s --agents %s",
		s.Regions[0].AdminAddr, s.AdminToken, GlobalRule, strings.Join(agents, ","))
}

// ErrAgentRunning and ErrAgentStopped: StartAgent found the region's sync
// agent running, StopAgent found it stopped (or the region runs none).
var (
	ErrAgentRunning = errors.New("stack: the sync agent is running")
	ErrAgentStopped = errors.New("stack: no sync agent is running")
)

// StopAgent stops region's sync agent for good (as in a region lost: its
// reports and its witness renewals stop; its Redis and enforcer keep
// running) and returns once it has stopped.
func (s *Stack) StopAgent(region string) error {
	s.mu.Lock()
	stop := s.stopAgent[region]
	delete(s.stopAgent, region)
	s.mu.Unlock()
	if stop == nil {
		return fmt.Errorf("%w: region %q", ErrAgentStopped, region)
	}
	stop()
	return nil
}

// StartAgent starts region's sync agent again after StopAgent, with no
// state of its former life (a new process would have none), on the same
// HTTP address, and returns once it is ready. Not to be called
// concurrently with Close.
func (s *Stack) StartAgent(ctx context.Context, region string) error {
	i := s.regionIndex(region)
	if i < 0 {
		return fmt.Errorf("stack: start agent: no region %q", region)
	}
	s.mu.Lock()
	running := s.stopAgent[region] != nil
	s.mu.Unlock()
	if running {
		return fmt.Errorf("%w: region %q", ErrAgentRunning, region)
	}
	if s.runCtx.Err() != nil {
		return fmt.Errorf("stack: start agent %s: the stack is closed", region)
	}
	return s.startAgent(ctx, s.runCtx, &s.Regions[i])
}

// ErrEmbeddedRedis: RestartRedis needs a redis-server child process, and
// the stack runs the in-process miniredis (Config.EmbeddedRedis, or no
// redis-server on PATH).
var ErrEmbeddedRedis = errors.New("stack: restarting Redis needs redis-server (the stack runs the embedded miniredis)")

// RestartRedis kills region's redis-server and starts an empty one on the
// same port, as a Redis restart without persistence does: every bucket,
// share record and marker is gone and the run id is new. The enforcer and
// the sync agent reconnect by themselves; checks sent while it is down
// are answered by the rule's failure policy. Returns once the new server
// answers.
func (s *Stack) RestartRedis(region string) error {
	i := s.regionIndex(region)
	if i < 0 {
		return fmt.Errorf("stack: restart redis: no region %q", region)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.RedisEmbedded || i >= len(s.redis) {
		return ErrEmbeddedRedis
	}
	if s.runCtx.Err() != nil {
		return fmt.Errorf("stack: restart redis %s: the stack is closed", region)
	}
	return s.redis[i].Restart()
}

// regionIndex is the position of the region called name, or -1.
func (s *Stack) regionIndex(name string) int {
	for i, r := range s.Regions {
		if r.Name == name {
			return i
		}
	}
	return -1
}

// ErrNoProxy: Partition was asked to cut a gateway link that has no proxy
// (the stack has none: no Config.Delay and Config.Partitionable not set).
var ErrNoProxy = errors.New("stack: gateway link has no proxy to cut")

// Partition cuts region off from every other region (cut) or heals it: the
// proxies of the NATS gateway connections between region and each other
// region, both directions, close their connections and refuse new ones
// until healed; the gateways then reconnect by themselves. Only the
// gateways are cut: etcd, Redis and the enforcers stay reachable.
//
// Several regions can be cut at once, and a link is cut while either of
// its regions is: healing a region restores its links to the regions that
// are not cut, and those to a region still cut once that one is healed
// too. Safe to call concurrently with itself, with Close and after it (a
// no-op on a closed stack).
func (s *Stack) Partition(region string, cut bool) error {
	known := false
	for _, n := range s.cfg.RegionNames {
		known = known || n == region
	}
	if !known {
		return fmt.Errorf("stack: partition: no region %q", region)
	}
	var links []*link
	for _, other := range s.cfg.RegionNames {
		if other == region {
			continue
		}
		for _, pair := range [][2]string{{region, other}, {other, region}} {
			found := s.proxy(pair[0], pair[1])
			if found == nil {
				return fmt.Errorf("%w: %s -> %s (set Config.Partitionable)", ErrNoProxy, pair[0], pair[1])
			}
			links = append(links, found)
		}
	}
	s.cutMu.Lock()
	defer s.cutMu.Unlock()
	if s.cut == nil {
		s.cut = map[string]bool{}
	}
	s.cut[region] = cut
	for _, p := range links {
		p.SetCut(s.cut[p.from] || s.cut[p.to])
	}
	return nil
}
