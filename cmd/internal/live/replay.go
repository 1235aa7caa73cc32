package live

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/apportion/apportion/cmd/internal/stack"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/sync/agent"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The rule the live stack enforces: every scenario key is a client key of it.
const (
	ruleID   = "live"
	resource = "GET /live"
	probeKey = "live:probe"
	// probeIdleWait bounds waitProbeIdle: the agent's IdleAfter and a
	// retirement's round trips, with room for a loaded machine.
	probeIdleWait = 90 * time.Second
	// inFlight bounds the concurrent CheckLimit calls.
	inFlight = 512
	// callTimeout bounds one CheckLimit call.
	callTimeout = 2 * time.Second
	// framing is what the simulator adds per NATS message (sim.Env.Send).
	framing = 40
)

// rulesYAML is the one global rule of sc: a token bucket of capacity
// burst refilled at rate or, with rule.window, a fixed window of burst
// requests per window (the store script's global fixed window, the one the
// simulator models); it fails closed when a region's Redis restarts in the
// run (restartsRedis), so that no check is admitted by the failure policy
// while it is down.
func rulesYAML(sc *scenario.Scenario) []byte {
	var w strings.Builder
	wts := sc.Weights()
	for i, r := range sc.Regions {
		if i > 0 {
			w.WriteString(", ")
		}
		fmt.Fprintf(&w, "%q: %g", r.Name, wts[i])
	}
	alg := fmt.Sprintf("algorithm: token_bucket\n  capacity: %d\n  refill_per_second: %g", int64(sc.Rule.Burst), sc.Rule.Rate)
	if w := sc.Rule.Window.D(); w > 0 {
		alg = fmt.Sprintf("algorithm: fixed_window\n  limit: %d\n  window: %s", int64(sc.Rule.Burst), rules.Duration(w))
	}
	return fmt.Appendf(nil, `- id: %s
  match: { resource: %q }
  key: [client_key]
  %s
  scope: global
  regions: { %s }
  min_share: %g
  failure_mode: %s
`, ruleID, resource, alg, w.String(), sc.Rule.MinShare, failureMode(sc))
}

// failureMode is the live rule's failure_mode for sc: closed when a
// region's Redis restarts in the run, else the default, open.
func failureMode(sc *scenario.Scenario) string {
	if restartsRedis(sc) {
		return "closed"
	}
	return "open"
}

// decision is one request's answer; written once by the call's goroutine.
type decision struct {
	sent, recv time.Duration // since the replay's start
	allowed    bool
	failOpen   bool
	err        error
}

type replayed struct {
	dec        []decision
	start      time.Time // the replay's start (time 0 of sent and recv), on the machine's clock
	wall       time.Duration
	conv       [][]float64 // shares of the tracked key per ConvergeSample (nil: not sampled)
	syncBytes  int64
	activeMean float64
	activeMax  int
	redis      string
}

// replay starts the stack, waits until every agent holds a marker, and sends
// reqs at their times.
func replay(ctx context.Context, sc *scenario.Scenario, reqs []request, keys []string, sampleShares bool, opt Options) (*replayed, error) {
	names := make([]string, len(sc.Regions))
	delay := map[string]map[string]time.Duration{}
	for i, r := range sc.Regions {
		names[i] = r.Name
		delay[r.Name] = map[string]time.Duration{}
		for j, o := range sc.Regions {
			if i != j {
				delay[r.Name][o.Name] = sc.Delay(i, j)
			}
		}
	}
	st, err := stack.Start(ctx, stack.Config{RegionNames: names, Delay: delay, Rules: rulesYAML(sc),
		SyncInterval: sc.Sync.Interval.D(), SyncLease: sc.Sync.Lease.D(), LogWriter: opt.LogWriter,
		SyncWitnessLease: sc.Sync.WitnessLease.D(), NoWitness: sc.Sync.WitnessLease.D() == 0,
		Partitionable: len(sc.Events) > 0,
		// The run measures the ledger, not a busy machine's latency: a
		// generous store timeout keeps failure-policy answers out of it.
		EnforcerTimeout: time.Second})
	if err != nil {
		return nil, err
	}
	defer st.Close()
	if st.RedisEmbedded && restartsRedis(sc) {
		return nil, fmt.Errorf("%w: the scenario restarts a region's Redis, which needs redis-server on PATH (the stack runs the embedded miniredis)", ErrUnsupported)
	}
	rp := &replayed{dec: make([]decision, len(reqs)), redis: "redis-server"}
	if st.RedisEmbedded {
		rp.redis = "miniredis"
	}
	clients := make([]ratelimitv1.RateLimiterClient, len(st.Regions))
	for i, r := range st.Regions {
		cc, err := grpc.NewClient(r.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer cc.Close()
		clients[i] = ratelimitv1.NewRateLimiterClient(cc)
	}
	if err := waitMarkers(ctx, sc, clients); err != nil {
		return nil, err
	}
	if err := waitProbeIdle(ctx, st); err != nil {
		return nil, err
	}

	var samplerWG sync.WaitGroup
	defer samplerWG.Wait()
	runCtx, cancel := context.WithCancel(ctx) // ends the sampler; deferred after Wait, so it runs first
	defer cancel()
	if err := alignWindow(ctx, sc.Rule.Window.D()); err != nil {
		return nil, err
	}
	bytes := newMeter(runCtx, st)
	t0 := time.Now()
	rp.start = t0
	var activeSum float64
	var activeN int
	var partErr error
	samplerWG.Add(2)
	go func() { // owned by replay like the sampler: ends with runCtx
		defer samplerWG.Done()
		partErr = playEvents(runCtx, st, sc.Events, t0, bytes, opt.Progress)
	}()
	go func() { // owned by replay: ends with runCtx, waited for before returning
		defer samplerWG.Done()
		rp.conv, activeSum, activeN, rp.activeMax = sampleAgents(runCtx, st, sc, keys[0], t0, sampleShares)
	}()
	var wg sync.WaitGroup
	sem := make(chan struct{}, inFlight)
	nextProgress := 10 * time.Second
	for i := 0; i < len(reqs); {
		now := time.Since(t0)
		for ; i < len(reqs) && reqs[i].at <= now; i++ {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				wg.Wait()
				return nil, ctx.Err()
			}
			wg.Add(1)
			go func(i int) {
				defer func() { <-sem; wg.Done() }()
				q := &reqs[i]
				d := &rp.dec[i]
				cctx, ccancel := context.WithTimeout(ctx, callTimeout)
				defer ccancel()
				d.sent = time.Since(t0)
				resp, err := clients[q.region].CheckLimit(cctx, &ratelimitv1.CheckLimitRequest{ClientKey: keys[q.key], Resource: resource, Cost: q.cost})
				d.recv = time.Since(t0)
				if err != nil {
					d.err = err
					return
				}
				d.allowed, d.failOpen = resp.Allowed, resp.FailOpen
			}(i)
		}
		if opt.Progress != nil && now >= nextProgress {
			fmt.Fprintf(opt.Progress, "live: %v of %v, %d requests sent\n", nextProgress, sc.Duration.D(), i)
			nextProgress += 10 * time.Second
		}
		if i < len(reqs) {
			if d := reqs[i].at - time.Since(t0); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
				}
			}
		}
	}
	wg.Wait()
	if end := sc.Duration.D(); time.Since(t0) < end { // sample shares to the scenario's end
		select {
		case <-time.After(end - time.Since(t0)):
		case <-ctx.Done():
		}
	}
	rp.wall = time.Since(t0)
	rp.syncBytes = bytes.total(ctx)
	cancel()
	samplerWG.Wait()
	if partErr != nil {
		return nil, partErr
	}
	if activeN > 0 {
		rp.activeMean = activeSum / float64(activeN)
	}
	if !sampleShares {
		rp.conv = nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return rp, nil
}

// maxAlignWait is the longest rule window whose start the replay waits
// for (alignWindow).
const maxAlignWait = time.Minute

// alignWindow waits, for a fixed-window rule of window w up to
// maxAlignWait, until the next start of a window of the stores' clock
// (Unix milliseconds over w, as the store script counts), so the live
// windows are the simulator's, which start with the scenario. A longer
// window is not waited for (unsupported says so).
func alignWindow(ctx context.Context, w time.Duration) error {
	if w <= 0 || w > maxAlignWait {
		return nil
	}
	ms := w.Milliseconds()
	wait := time.Duration(ms-time.Now().UnixMilli()%ms) * time.Millisecond
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(wait):
		return nil
	}
}

// action is what playEvents does to a region at a time.
type action int

const (
	cut action = iota
	heal
	stopAgent
	startAgent
	restartRedis
)

var actionText = [...]string{
	cut:          "cut off from the other regions",
	heal:         "healed",
	stopAgent:    "sync agent stopped",
	startAgent:   "sync agent started again",
	restartRedis: "redis-server restarted empty",
}

// playEvents plays the events at their times (since t0) until ctx is
// done, with a line to progress (if not nil) for each step: a partition
// cuts the region's gateways and heals them after For (none: at the end);
// a region_loss cuts them and stops its sync agent, and after For (none:
// never) restarts its Redis empty, heals them and starts its agent again;
// an agent_restart stops the agent and starts it again after For; a
// store_reset restarts its Redis empty. Only events of one region reach it
// (unsupported refuses the rest). What a stopped agent received is added
// to m before it stops.
func playEvents(ctx context.Context, st *stack.Stack, events []scenario.Event, t0 time.Time, m *meter, progress io.Writer) error {
	type change struct {
		at     time.Duration
		region string
		do     action
	}
	var todo []change
	add := func(at time.Duration, region string, do ...action) {
		for _, d := range do {
			todo = append(todo, change{at, region, d})
		}
	}
	for _, e := range events {
		at, end, r := e.At.D(), e.At.D()+e.For.D(), e.Regions[0]
		switch e.Kind {
		case "partition":
			add(at, r, cut)
			if e.For > 0 {
				add(end, r, heal)
			}
		case "region_loss":
			add(at, r, cut, stopAgent)
			if e.For > 0 {
				add(end, r, restartRedis, heal, startAgent)
			}
		case "agent_restart":
			add(at, r, stopAgent)
			add(end, r, startAgent)
		case "store_reset":
			add(at, r, restartRedis)
		}
	}
	slices.SortStableFunc(todo, func(a, b change) int { return cmp.Compare(a.at, b.at) })
	for _, c := range todo {
		if d := c.at - time.Since(t0); d > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(d):
			}
		}
		var err error
		switch c.do {
		case cut, heal:
			err = st.Partition(c.region, c.do == cut)
		case stopAgent:
			m.stopping(ctx, c.region)
			err = st.StopAgent(c.region)
		case startAgent:
			err = st.StartAgent(ctx, c.region)
		case restartRedis:
			err = st.RestartRedis(c.region)
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return fmt.Errorf("live: %w", err)
		}
		if progress != nil {
			fmt.Fprintf(progress, "live: %v: %s %s\n", time.Since(t0).Round(time.Millisecond), c.region, actionText[c.do])
		}
	}
	return nil
}

// waitProbeIdle waits until no agent holds a key of the rule: the probe
// key of waitMarkers has left coordination. Its usage makes every agent
// coordinate it, and left running into the replay its decaying demand,
// retirement and reports were counted with the scenario's (in shift's
// first minute, 8 to 10 demand reports per region, and 1.1 keys
// coordinated on average instead of 1). It first waits, up to a few
// seconds, for the probe's usage to reach every agent (waitMarkers may
// return before it does); the wait is about 30 s (IdleAfter, then the
// key's retirement).
func waitProbeIdle(ctx context.Context, st *stack.Stack) error {
	held := func() (all, none bool) {
		all, none = true, true
		for _, r := range st.Regions {
			n, err := heldKeys(ctx, r.AgentHTTPAddr)
			if err != nil || n > 0 {
				none = false
			}
			if err != nil || n == 0 {
				all = false
			}
		}
		return all, none
	}
	seen := time.Now().Add(5 * time.Second)
	deadline := time.Now().Add(probeIdleWait)
	for {
		all, none := held()
		if all {
			seen = time.Time{} // every agent has it: now wait for none
		}
		if none && time.Now().After(seen) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("live: the agents still hold the probe key %q after %v", probeKey, probeIdleWait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// heldKeys is how many keys of the rule the agent at addr holds state for
// (its /v1/shares total_keys).
func heldKeys(ctx context.Context, addr string) (int, error) {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(cctx, http.MethodGet, "http://"+addr+agent.SharesPath+"?rule="+ruleID+"&limit=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("live: %s: %s", req.URL, resp.Status)
	}
	var rs agent.RuleShares
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&rs); err != nil {
		return 0, err
	}
	return rs.TotalKeys, nil
}

// waitMarkers waits until every region enforces at least 90% of its base
// share (its weight) rather than its floor: the agents hold their markers.
func waitMarkers(ctx context.Context, sc *scenario.Scenario, clients []ratelimitv1.RateLimiterClient) error {
	wts := sc.Weights()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ok := true
		for i, c := range clients {
			cctx, cancel := context.WithTimeout(ctx, callTimeout)
			resp, err := c.CheckLimit(cctx, &ratelimitv1.CheckLimitRequest{ClientKey: probeKey, Resource: resource})
			cancel()
			if err != nil || float64(resp.Limit) < math.Floor(0.9*wts[i]*sc.Rule.Burst) {
				ok = false
				break
			}
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("live: the agents did not hold their markers within 60s")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// meter counts what the simulator counts as sync bytes over a run: every
// report as received by each peer, plus framing per message, from the
// agents' counters, which start again at zero when an agent does.
type meter struct {
	st   *stack.Stack
	mu   sync.Mutex
	base map[string]int64 // per region: its agent's count when the run began (0 for a restarted one)
	sum  int64            // what agents stopped during the run received in it
}

func newMeter(ctx context.Context, st *stack.Stack) *meter {
	m := &meter{st: st, base: map[string]int64{}}
	for _, r := range st.Regions {
		m.base[r.Name], _ = agentBytes(ctx, r.AgentHTTPAddr)
	}
	return m
}

// stopping counts what region's agent received in the run, before it stops.
func (m *meter) stopping(ctx context.Context, region string) {
	for _, r := range m.st.Regions {
		if r.Name != region {
			continue
		}
		n, err := agentBytes(ctx, r.AgentHTTPAddr)
		m.mu.Lock()
		if err == nil {
			m.sum += n - m.base[region]
		}
		m.base[region] = 0
		m.mu.Unlock()
	}
}

// total is what every agent received in the run: the stopped ones' as
// counted when they stopped, the running ones' now. (An agent stopped for
// good is counted once: a second scrape of it fails.)
func (m *meter) total(ctx context.Context) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.sum
	for _, r := range m.st.Regions {
		if c, err := agentBytes(ctx, r.AgentHTTPAddr); err == nil {
			n += c - m.base[r.Name]
		}
	}
	return n
}

// agentBytes is what the agent at addr has received: report bytes plus
// framing per message.
func agentBytes(ctx context.Context, addr string) (int64, error) {
	mfs, err := stack.Scrape(ctx, addr)
	if err != nil {
		return 0, err
	}
	var n float64
	for name, per := range map[string]float64{"apportion_sync_report_bytes_total": 1, "apportion_sync_reports_total": framing} {
		if mf := mfs[name]; mf != nil {
			for _, m := range mf.GetMetric() {
				if stack.Label(m, "direction") == "received" {
					n += per * m.GetCounter().GetValue()
				}
			}
		}
	}
	return int64(n), nil
}

// sampleAgents scrapes every agent each sim.ConvergeSample until ctx is
// done: the tracked key's share per region (a region whose agent does not
// coordinate the key enforces its base share, its weight; one whose agent
// does not answer, its floor) and, once per second, the most keys any
// region coordinates.
func sampleAgents(ctx context.Context, st *stack.Stack, sc *scenario.Scenario, key string, t0 time.Time, shares bool) (conv [][]float64, activeSum float64, activeN, activeMax int) {
	wts := sc.Weights()
	want := redisstore.Key(key, ruleID) // the store key the agent's ledger names
	period := sim.ConvergeSample
	if !shares {
		period = time.Second
	}
	tick := time.NewTicker(period)
	defer tick.Stop()
	for k := 0; ; k++ {
		row := make([]float64, len(st.Regions))
		active := 0
		for r, reg := range st.Regions {
			row[r] = wts[r]
			mfs, err := stack.Scrape(ctx, reg.AgentHTTPAddr)
			if err != nil {
				// Its agent is stopped (a region lost, an agent
				// restarting): once its marker's lease ends its store
				// enforces the floor.
				row[r] = sc.Rule.MinShare * wts[r]
				continue
			}
			if mf := mfs["apportion_sync_share_units"]; mf != nil {
				for _, m := range mf.GetMetric() {
					if stack.Label(m, "rule") == ruleID && stack.Label(m, "key") == want {
						row[r] = m.GetGauge().GetValue() / 1e6
					}
				}
			}
			if mf := mfs["apportion_sync_keys_coordinated"]; mf != nil && len(mf.GetMetric()) > 0 {
				active = max(active, int(mf.GetMetric()[0].GetGauge().GetValue()))
			}
		}
		if ctx.Err() != nil {
			return
		}
		// Index by time, so a slow scrape leaves no hole: repeat the last row.
		idx := int(time.Since(t0) / period)
		for len(conv) < idx {
			if len(conv) == 0 {
				conv = append(conv, row)
			} else {
				conv = append(conv, conv[len(conv)-1])
			}
		}
		conv = append(conv, row)
		if !shares || k%int(time.Second/period) == 0 {
			activeSum += float64(active)
			activeN++
			activeMax = max(activeMax, active)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
