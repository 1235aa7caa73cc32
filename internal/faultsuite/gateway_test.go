package faultsuite

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/apportion/apportion/internal/launch"
	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/apportion/apportion/sync/agentd"
	"github.com/apportion/apportion/sync/wire"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/rs/zerolog"
)

// The global rule of the gateway fault case: a token bucket of gwLimit
// tokens per second and burst gwLimit, shared by two regions.
const (
	gwLimit = 100
	gwRule  = `
- id: g
  match: { resource: "GET /g" }
  algorithm: token_bucket
  capacity: 100
  refill_per_second: 100
  scope: global
  regions: { %s }
  min_share: 0.1
`
	// gwRate is the offered load, requests per second, spread evenly over
	// the regions: 2.4 times the global limit.
	gwRate = 240
	// gwLease and gwInterval are the sync agents' --lease and --interval.
	gwLease    = 2 * time.Second
	gwInterval = 100 * time.Millisecond
	// gwFaultFor is how long each gateway fault lasts: longer than the
	// lease, so that a cut outlives it (two regions keep their positions
	// through it; a region cut off from two others falls back to its
	// floor).
	gwFaultFor = gwLease + 1500*time.Millisecond
	// gwRecoverBound: after a fault ends, a 1 s window in which the regions
	// together admit at least gwRecoverShare of the limit ends within this.
	gwRecoverBound = gwLease + 5*time.Second
	gwRecoverShare = 0.85
	// gwFloor is what the regions together admit per second at their
	// floors (min_share 0.1 of the limit, split between them): where a
	// region cut off from its peers falls once its lease has expired, in
	// a rule of three regions or more.
	gwFloor = gwLimit / 10
)

// gwCase is one gateway fault: toxics added to (or, with none, the
// disabling of) the proxies of every link, or only of the links to and from
// isolate. For a fault on every link, hard means the links are down for
// longer than the lease and not hard that they are only slow; with two
// regions the global rule must stay served in both (a pair cut apart keeps
// its positions: neither can be reclaimed by silence, see the sync/ledger
// package doc, Partitions).
type gwCase struct {
	faultCase
	isolate string
	// etcd: the isolated region's sync agent loses etcd too (its proxy to
	// etcd refuses connections for the fault's duration), as a region
	// whose network is cut off from everything else.
	etcd bool
	// faultFor is how long the fault lasts (default gwFaultFor).
	faultFor time.Duration
}

// gwDecision is one check of the load: when it was sent (since the load
// started), in which region, and the answer.
type gwDecision struct {
	at      time.Duration
	region  int
	allowed bool
}

// TestGatewayFaults runs two regions (a redis-server, an embedded NATS
// server, ratelimitd and the sync agent each, reports signed, one etcd)
// whose NATS gateway connections each go through a toxiproxy proxy, with
// load on one key of a global rule in both regions throughout. The proxies
// delay (300 ms each way), jitter, reset, swallow (half-open) and refuse (a
// cut longer than the agents' lease). Throughout, no check fails or is
// answered by the failure policy, and the regions together never admit more
// than burst + rate x 1 s in any 1 s window. While the links are only slow
// (latency, jitter) the global rule stays served, and so it does once they
// have been down for longer than the lease (reset, half-open, cut): two
// regions cut apart keep their positions, neither fences (before, both fell
// to their floors). After each fault ends, they admit at least
// gwRecoverShare of the limit again within gwRecoverBound.
func TestGatewayFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts etcd, two redis-servers, NATS, ratelimitd and syncagent")
	}
	runGatewayFaults(t, []string{"us-east", "eu-west"}, 0, []gwCase{
		{faultCase: faultCase{name: "latency", toxics: []string{
			toxic("lat-up", "latency", "upstream", `"latency":300`),
			toxic("lat-down", "latency", "downstream", `"latency":300`)}}},
		{faultCase: faultCase{name: "jitter", toxics: []string{
			toxic("jit-up", "latency", "upstream", `"latency":200,"jitter":200`),
			toxic("jit-down", "latency", "downstream", `"latency":200,"jitter":200`)}}},
		{faultCase: faultCase{name: "reset_peer", hard: true, toxics: []string{toxic("reset", "reset_peer", "upstream", `"timeout":0`)}}},
		{faultCase: faultCase{name: "half-open", hard: true, toxics: []string{
			toxic("hole-up", "timeout", "upstream", `"timeout":0`),
			toxic("hole-down", "timeout", "downstream", `"timeout":0`)}}},
		{faultCase: faultCase{name: "cut", hard: true}}, // the proxies disabled: connections closed and refused
	})
}

// TestGatewayPartitionThreeRegions cuts one region of three off from the
// other two (its four gateway links refused, the other two untouched) for
// longer than the survivors take to reclaim its share, with load in all
// three: the three together never admit more than burst + rate x 1 s, no
// check fails, and after the heal the global rule is served again within
// gwRecoverBound.
func TestGatewayPartitionThreeRegions(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts etcd, three redis-servers, NATS, ratelimitd and syncagent")
	}
	runGatewayFaults(t, []string{"us-east", "eu-west", "ap-south"}, 0, []gwCase{
		{faultCase: faultCase{name: "ap-south-cut", hard: true}, isolate: "ap-south"},
	})
}

// gwEtcdCutFor is how long TestCutFromEverything cuts a region off: long
// enough for its sync agent's starts to fail and back off (each start
// sent in the cut is given up after the agent's etcd timeout, 5 s, and
// the next waits a backoff that doubles) and its registry reads to back
// off to one every 2 s.
const gwEtcdCutFor = 20 * time.Second

// TestCutFromEverything cuts one region off from its peers and from etcd
// (its gateway links and its sync agent's etcd connection refused) for
// gwEtcdCutFor, with load in every region, at two regions (a witness lease
// of 2 leases, so that the other takes the cut one's witness key in etcd
// and reclaims its share within the cut) and at three: the cut region
// falls to its floor, its agent cannot start a new incarnation until etcd
// answers again, and once the cut ends it serves its base share again
// within gwRecoverBound; the global bound holds throughout, no check
// fails. Measured 1.65-1.75 s after the heal: the etcd client reconnects
// within EtcdReconnectMaxDelay (internal/backend) and a start sent in the
// cut is then answered. (Here the heal finds a start in flight; the
// agent's registryBack, which starts at once a rule whose start is
// waiting out its backoff when etcd answers again, is shown by the agent's
// TestStartWhenRegistryBack and the simulator's TestCutServesAgainSoon.)
func TestCutFromEverything(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts etcd, redis-servers, NATS, ratelimitd and syncagent")
	}
	for _, regions := range [][]string{{"us-east", "eu-west"}, {"us-east", "eu-west", "ap-south"}} {
		t.Run(fmt.Sprintf("regions=%d", len(regions)), func(t *testing.T) {
			cut := regions[len(regions)-1]
			runGatewayFaults(t, regions, 2*gwLease, []gwCase{
				{faultCase: faultCase{name: cut + "-cut-from-all", hard: true}, isolate: cut, etcd: true, faultFor: gwEtcdCutFor},
			})
		})
	}
}

// runGatewayFaults starts the regions, runs the load and the cases one after
// the other, and checks them (see TestGatewayFaults). witness, when not
// zero, is the sync agents' --witness-lease. Each agent reaches etcd
// through a proxy of its own.
func runGatewayFaults(t *testing.T, regions []string, witness time.Duration, cases []gwCase) {
	testutil.RedisServerPath(t)
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	ctx := context.Background()

	etcd := testutil.StartEtcd(t)
	weights := make([]string, len(regions))
	for i, r := range regions {
		weights[i] = r + ": 1"
	}
	rs, err := rules.ParseRules(fmt.Appendf(nil, gwRule, strings.Join(weights, ", ")))
	if err != nil {
		t.Fatal(err)
	}
	st, err := etcdstore.New(etcd.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if _, err := st.Put(ctx, r, etcdstore.Unconditional); err != nil {
			t.Fatal(err)
		}
	}

	// Every gateway connection (from -> to) dials its own proxy. Short
	// pings let a gateway notice a half-open link within a second.
	var pmu sync.Mutex
	proxies := map[string]*toxiproxy.Proxy{}
	cluster, err := launch.StartSuperCluster(regions, launch.SuperClusterOptions{
		Dial: func(from, to, addr string) (string, error) {
			p := newProxy(t, "gw-"+from+"-"+to, addr)
			pmu.Lock()
			proxies[from+"->"+to] = p // a retried start replaces the pair's proxy
			pmu.Unlock()
			// toxiproxy does not read the NATS protocol: in front of it,
			// a filter keeps the link's connections on the link (gateway
			// gossip would let a cut region redial through another
			// region's proxy: a one-way cut; launch/gateway.go).
			fp, err := launch.NewGatewayProxy(p.Listen, 0)
			if err != nil {
				return "", err
			}
			t.Cleanup(fp.Close)
			return fp.Addr(), nil
		},
		Configure: []func(*server.Options){func(o *server.Options) {
			o.PingInterval = 400 * time.Millisecond
			o.MaxPingsOut = 3
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range cluster {
		t.Cleanup(s.Shutdown)
	}

	keys := t.TempDir()
	var peers strings.Builder
	for _, r := range regions {
		seed, pub, err := wire.GenerateSeed()
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(keys, r+".nk"), append(seed, '\n'), 0o600); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&peers, "%s=%s\n", r, pub)
	}
	if err := os.WriteFile(filepath.Join(keys, "peers"), []byte(peers.String()), 0o644); err != nil {
		t.Fatal(err)
	}

	clients := make([]ratelimitv1.RateLimiterClient, len(regions))
	etcdProxy := map[string]*toxiproxy.Proxy{}
	for i, r := range regions {
		redis := testutil.StartRedis(t)
		nurl := cluster[r].ClientURL()
		etcdProxy[r] = newProxy(t, "etcd-"+r, strings.TrimPrefix(etcd.Endpoint, "http://"))
		var extra []string
		if witness > 0 {
			extra = []string{"--witness-lease", witness.String()}
		}
		// A generous store timeout: this case is about the gateways, not Redis.
		g := runEnforcer(t, "--region", r, "--redis-addr", redis.Addr, "--etcd-endpoints", etcd.Endpoint,
			"--nats-url", nurl, "--timeout", "2s")
		clients[i] = g.client
		runAgent(t, append([]string{"--region", r, "--redis-addr", redis.Addr, "--nats-url", nurl, "--etcd-endpoints", "http://" + etcdProxy[r].Listen,
			"--http-addr", "127.0.0.1:0", "--interval", gwInterval.String(), "--lease", gwLease.String(),
			"--report-seed-file", filepath.Join(keys, r+".nk"), "--report-peer-keys", "@" + filepath.Join(keys, "peers")}, extra...)...)
	}
	// Every agent holds a marker: each region enforces its base share.
	testutil.WaitFor(t, 30*time.Second, "the agents' markers", func() bool {
		for _, c := range clients {
			resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "probe", Resource: "GET /g"})
			if err != nil || resp.Limit < gwLimit*8/10/int64(len(regions)) {
				return false
			}
		}
		return true
	})

	// The load: gwRate checks per second of one key in each region, from
	// now until the test's last case ends.
	var (
		mu     sync.Mutex
		ds     []gwDecision
		failed int
		wg     sync.WaitGroup
	)
	loadCtx, stopLoad := context.WithCancel(ctx)
	start := time.Now()
	req := &ratelimitv1.CheckLimitRequest{ClientKey: "user:gw", Resource: "GET /g"}
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		tick := time.NewTicker(time.Second / gwRate)
		defer tick.Stop()
		for n := 0; ; n++ {
			select {
			case <-loadCtx.Done():
				return
			case <-tick.C:
			}
			region := n % len(regions)
			at := time.Since(start)
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				resp, err := clients[region].CheckLimit(cctx, req)
				mu.Lock()
				defer mu.Unlock()
				if err != nil || resp.FailOpen {
					failed++
					if failed <= 3 {
						t.Errorf("check in %s at %v: err %v, fail_open %v", regions[region], at, err, resp.GetFailOpen())
					}
					return
				}
				ds = append(ds, gwDecision{at: at, region: region, allowed: resp.Allowed})
			}()
		}
	}()
	stopped := false
	stop := func() []gwDecision {
		if !stopped {
			stopped = true
			stopLoad()
			<-loopDone
			wg.Wait()
		}
		mu.Lock()
		defer mu.Unlock()
		out := append([]gwDecision(nil), ds...)
		sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
		return out
	}
	t.Cleanup(func() { stop() })

	// admitted counts the allowed checks sent in [from, from+1s), among
	// those answered so far.
	admitted := func(from time.Duration) (n, sent int) {
		mu.Lock()
		defer mu.Unlock()
		for _, d := range ds {
			if d.at >= from && d.at < from+time.Second {
				sent++
				if d.allowed {
					n++
				}
			}
		}
		return n, sent
	}

	perRegion := func(from time.Duration) []int {
		mu.Lock()
		defer mu.Unlock()
		out := make([]int, len(regions))
		for _, d := range ds {
			if d.allowed && d.at >= from && d.at < from+time.Second {
				out[d.region]++
			}
		}
		return out
	}

	all := func(isolate string, f func(p *toxiproxy.Proxy)) {
		pmu.Lock()
		defer pmu.Unlock()
		for pair, p := range proxies {
			from, to, _ := strings.Cut(pair, "->")
			if isolate == "" || from == isolate || to == isolate {
				f(p)
			}
		}
	}
	addToxics := func(isolate string, tx []string) {
		all(isolate, func(p *toxiproxy.Proxy) {
			for _, x := range tx {
				if _, err := p.Toxics.AddToxicJson(strings.NewReader(x)); err != nil {
					t.Fatalf("add toxic %s: %v", x, err)
				}
			}
		})
	}
	removeToxics := func(isolate string, tx []string) {
		all(isolate, func(p *toxiproxy.Proxy) {
			for _, x := range tx {
				name := x[len(`{"name":"`):strings.Index(x, `","type"`)]
				if err := p.Toxics.RemoveToxic(ctx, name); err != nil {
					t.Fatalf("remove toxic %s: %v", name, err)
				}
			}
		})
	}

	// Let the load settle before the first fault.
	testutil.WaitFor(t, 10*time.Second, "a second of load", func() bool { return time.Since(start) > time.Second })
	type mark struct {
		name       string
		from, to   time.Duration
		recovered  time.Duration
		admitDurng int   // admitted in the fault's last full second
		perRegion  []int // the same, by region
		what       string
	}
	var marks []mark
	for _, c := range cases {
		m := mark{name: c.name, from: time.Since(start), what: "the limit"}
		if c.isolate != "" {
			m.what = c.isolate + "'s base share"
		}
		if len(c.toxics) == 0 {
			all(c.isolate, func(p *toxiproxy.Proxy) { p.Stop() })
		}
		if c.etcd {
			etcdProxy[c.isolate].Stop()
		}
		addToxics(c.isolate, c.toxics)
		faultFor := cmp.Or(c.faultFor, gwFaultFor)
		testutil.WaitFor(t, faultFor+5*time.Second, "the fault's duration", func() bool {
			return time.Since(start) >= m.from+faultFor
		})
		removeToxics(c.isolate, c.toxics)
		if len(c.toxics) == 0 {
			all(c.isolate, func(p *toxiproxy.Proxy) {
				if err := p.Start(); err != nil {
					t.Fatalf("restart proxy: %v", err)
				}
			})
		}
		if c.etcd {
			if err := etcdProxy[c.isolate].Start(); err != nil {
				t.Fatalf("restart etcd proxy: %v", err)
			}
		}
		m.to = time.Since(start)
		m.admitDurng, _ = admitted(m.to - time.Second)
		m.perRegion = perRegion(m.to - time.Second)
		switch {
		case c.isolate == "" && c.hard && len(regions) == 2 && float64(m.admitDurng) < gwRecoverShare*gwLimit:
			t.Errorf("%s: admitted %d in the fault's last second, a lease after the link went down; two regions cut apart keep their positions (want at least %.0f)", c.name, m.admitDurng, gwRecoverShare*gwLimit)
		case c.isolate == "" && c.hard && len(regions) > 2 && m.admitDurng > 2*gwFloor:
			t.Errorf("%s: admitted %d in the fault's last second, a lease after the links went down; want the floors (%d, at most %d)", c.name, m.admitDurng, gwFloor, 2*gwFloor)
		}
		iso, target := -1, gwRecoverShare*gwLimit // what must recover: every region, or the isolated one
		for i, r := range regions {
			if r == c.isolate {
				iso, target = i, gwRecoverShare*gwLimit/float64(len(regions))
				if most := 2 * gwFloor / len(regions); m.perRegion[i] > most {
					t.Errorf("%s: %s admitted %d in the cut's last second, a lease after it was cut off; want its floor (at most %d)", c.name, r, m.perRegion[i], most)
				}
			}
		}
		if c.isolate == "" && !c.hard && float64(m.admitDurng) < gwRecoverShare*gwLimit {
			t.Errorf("%s: admitted %d in the fault's last second; a slow link must keep the global rule served (at least %.0f)", c.name, m.admitDurng, gwRecoverShare*gwLimit)
		}
		// Recovered: some 1 s window starting after the fault ended, whose
		// checks have all been answered (sent 300 ms ago or more), admitted
		// at least gwRecoverShare of the limit (of the isolated region's
		// base share, when one region was cut off).
		w := m.to
		testutil.WaitFor(t, gwRecoverBound+time.Second, fmt.Sprintf("the global rule served again after %s (%.0f%% of %d/s in 1 s)", c.name, gwRecoverShare*100, gwLimit), func() bool {
			for ; w+time.Second+300*time.Millisecond <= time.Since(start); w += 10 * time.Millisecond {
				n, _ := admitted(w)
				if iso >= 0 {
					n = perRegion(w)[iso]
				}
				if float64(n) >= target {
					return true
				}
			}
			return false
		})
		m.recovered = w + time.Second - m.to
		if m.recovered > gwRecoverBound {
			t.Errorf("after %s: %.0f%% of the limit admitted again only %v after the fault ended, above %v", c.name, gwRecoverShare*100, m.recovered, gwRecoverBound)
		}
		marks = append(marks, m)
	}
	ds2 := stop()
	end := time.Since(start)

	// The global invariant: in every 1 s window (by send time, 10 ms steps)
	// the regions together admit at most burst + rate x 1 s. As in the
	// stack's test, the slack covers only the test's own clock: a check
	// sent just before a window may be decided inside it, so the checks
	// sent in one extra 20 ms are allowed.
	bound := gwLimit + gwLimit + gwRate*20/1000
	worst, worstAt := gwWorstWindow(ds2, 0, end)
	mu.Lock()
	nfailed := failed
	mu.Unlock()
	total := 0
	for _, d := range ds2 {
		if d.allowed {
			total++
		}
	}
	t.Logf("gateway faults: %d checks in %v (%.0f/s offered over %d regions), %d admitted, %d failed; worst 1 s window admitted %d at %v (bound %d = burst %d + rate %d x 1 s + clock slack)",
		len(ds2), end.Round(time.Millisecond), float64(len(ds2))/end.Seconds(), len(regions), total, nfailed, worst, worstAt.Round(10*time.Millisecond), bound, gwLimit, gwLimit)
	for _, m := range marks {
		// The worst window from the fault's start to a second after the
		// recovery: the shares given back after a heal must not overshoot.
		w, _ := gwWorstWindow(ds2, m.from, m.to+m.recovered+time.Second)
		t.Logf("gateway fault %-10s %v..%v: admitted %d in its last second (by region %v); %.0f%% of %s again %v after it ended (bound %v); worst 1 s window from its start to 1 s after recovery %d",
			m.name, m.from.Round(time.Millisecond), m.to.Round(time.Millisecond), m.admitDurng, m.perRegion, gwRecoverShare*100, m.what, m.recovered.Round(10*time.Millisecond), gwRecoverBound, w)
	}
	if nfailed > 0 {
		t.Errorf("%d checks failed or answered by the failure policy", nfailed)
	}
	if worst > bound {
		t.Errorf("the regions admitted %d in the 1 s window from %v, above burst + rate x 1 s = %d", worst, worstAt, bound)
	}
}

// gwWorstWindow returns the most checks admitted in a 1 s window (by send
// time, in 10 ms steps) starting in [from, to-1s], and that window's
// start; ds is sorted by send time.
func gwWorstWindow(ds []gwDecision, from, to time.Duration) (int, time.Duration) {
	worst, worstAt := 0, from
	lo, hi, n := 0, 0, 0 // n: admitted among ds[lo:hi]
	for w := from; w+time.Second <= to; w += 10 * time.Millisecond {
		for ; hi < len(ds) && ds[hi].at < w+time.Second; hi++ {
			if ds[hi].allowed {
				n++
			}
		}
		for ; lo < hi && ds[lo].at < w; lo++ {
			if ds[lo].allowed {
				n--
			}
		}
		if n > worst {
			worst, worstAt = n, w
		}
	}
	return worst, worstAt
}

var agentReady = regexp.MustCompile(`ready region=(\S+) http=(\S+)`)

// runAgent runs the sync agent in-process with args until the test ends
// and waits for its ready line.
func runAgent(t *testing.T, args ...string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		once := sync.Once{}
		for sc.Scan() {
			if agentReady.MatchString(sc.Text()) {
				once.Do(func() { close(ready) })
			}
		}
	}()
	stderr := &testutil.SyncBuffer{}
	done := make(chan error, 1)
	go func() {
		err := agentd.RunCommand(ctx, append(args, "--log-level", "warn"), pw, stderr)
		pw.Close()
		done <- err
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("syncagent: %v\n%s", err, stderr.String())
		}
	})
	select {
	case <-ready:
	case err := <-done:
		done <- err
		t.Fatalf("syncagent stopped before it was ready: %v\n%s", err, stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("syncagent not ready within 30s\n%s", stderr.String())
	}
}
