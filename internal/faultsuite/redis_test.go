package faultsuite

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/enforcerd"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const (
	// storeTimeout is the enforcer's --timeout: a Redis round trip longer
	// than this is answered by the failure policy. The queue timeout
	// defaults to max(100ms, --timeout), so a check waits at most about
	// twice this in the enforcer.
	storeTimeout = 100 * time.Millisecond
	// latencySlack is added to the bound on latency during a fault: the
	// machine running CI is small and shared.
	latencySlack = 400 * time.Millisecond
	// recoverBound is how long after a fault ends both rules must be
	// answered from Redis again: the breaker stays open one second, then
	// probes, and a refused or reset connection is dialed again.
	recoverBound = 5 * time.Second

	capacity = 20 // both rules' bucket
	refill   = 40 // tokens per second

	workers    = 4
	healthyFor = 400 * time.Millisecond
	faultFor   = 900 * time.Millisecond
	// steadyFor is how long Redis must answer every check, without one
	// from the failure policy, for the enforcer to count as recovered.
	steadyFor = 300 * time.Millisecond
)

// sample is one check: which rule, when it was answered, how long it took,
// and what the enforcer said.
type sample struct {
	rule              string
	sent, done        time.Time
	allowed, failOpen bool
	err               error
}

func (s sample) latency() time.Duration { return s.done.Sub(s.sent) }

// rig is a redis-server behind a toxiproxy proxy, and ratelimitd (run
// in-process) talking to Redis through the proxy.
type rig struct {
	proxy  *toxiproxy.Proxy
	client ratelimitv1.RateLimiterClient
	http   string // ratelimitd's HTTP address, for /metrics
	stderr *testutil.SyncBuffer
	// rules are the resources ("GET /<rule>") load sends checks for, in
	// turn; nil means open and closed.
	rules []string
}

// metrics returns ratelimitd's apportion_ metrics about the store and the
// breaker, for a failure message.
func (g *rig) metrics() string {
	resp, err := http.Get("http://" + g.http + "/metrics")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var keep []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "apportion_") && (strings.Contains(l, "store") || strings.Contains(l, "breaker") || strings.Contains(l, "fail") || strings.Contains(l, "shed")) {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

func startRig(t *testing.T) *rig {
	t.Helper()
	r := testutil.StartRedis(t)
	proxy := newProxy(t, "redis", r.Addr)

	rulesFile := filepath.Join(t.TempDir(), "rules.json")
	bucket := fmt.Sprintf(`"algorithm":"token_bucket","capacity":%d,"refill_per_second":%d`, capacity, refill)
	if err := os.WriteFile(rulesFile, []byte(`[`+
		`{"id":"open","match":{"resource":"GET /open"},`+bucket+`,"failure_mode":"open"},`+
		`{"id":"closed","match":{"resource":"GET /closed"},`+bucket+`,"failure_mode":"closed"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	g := runEnforcer(t, "--redis-addr", proxy.Listen, "--rules", rulesFile)
	g.proxy = proxy
	return g
}

// runEnforcer runs ratelimitd in-process (region us-east, free ports, the
// suite's store timeout) with args added, until the test ends.
func runEnforcer(t *testing.T, args ...string) *rig {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var stdout testutil.SyncBuffer
	stderr := &testutil.SyncBuffer{}
	done := make(chan error, 1)
	args = append([]string{"--region", "us-east", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--log-level", "warn",
		"--timeout", storeTimeout.String(), "--shutdown-timeout", "2s"}, args...)
	go func() { done <- enforcerd.Run(ctx, args, &stdout, stderr) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ratelimitd: %v\n%s", err, stderr.String())
		}
	})
	ready := regexp.MustCompile(`ready grpc=(\S+) http=(\S+)`)
	testutil.WaitFor(t, 20*time.Second, "ratelimitd ready", func() bool { return ready.MatchString(stdout.String()) })
	m := ready.FindStringSubmatch(stdout.String())
	cc, err := grpc.NewClient(m[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return &rig{client: ratelimitv1.NewRateLimiterClient(cc), http: m[2], stderr: stderr}
}

// newProxy starts a toxiproxy proxy from a free loopback port to upstream,
// stopped when the test ends.
func newProxy(t *testing.T, name, upstream string) *toxiproxy.Proxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	proxy := toxiproxy.NewProxy(srv, name, "127.0.0.1:0", upstream)
	if err := proxy.Start(); err != nil {
		t.Fatalf("toxiproxy: %v", err)
	}
	t.Cleanup(proxy.Stop)
	return proxy
}

// load runs workers that alternate checks of g.rules (default the open and
// the closed rule) for key until stop returns true (it is given every sample as it
// arrives, under a lock) or limit passes, and returns the samples in the
// order they were answered.
func (g *rig) load(key string, limit time.Duration, stop func(sample) bool) []sample {
	var (
		mu      sync.Mutex
		samples []sample
		wg      sync.WaitGroup
	)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	rules := g.rules
	if rules == nil {
		rules = []string{"open", "closed"}
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ctx.Err() == nil; i++ {
				rule := rules[i%len(rules)]
				s := sample{rule: rule, sent: time.Now()}
				cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
				resp, err := g.client.CheckLimit(cctx, &ratelimitv1.CheckLimitRequest{ClientKey: key, Resource: "GET /" + rule})
				ccancel()
				s.done, s.err = time.Now(), err
				if err == nil {
					s.allowed, s.failOpen = resp.GetAllowed(), resp.GetFailOpen()
				}
				mu.Lock()
				samples = append(samples, s)
				if stop != nil && stop(s) {
					cancel()
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return samples
}

// healthy runs load on a fresh key and checks that Redis answers every
// check and that no rule admits more than its bucket allows.
func (g *rig) healthy(t *testing.T, key string) {
	t.Helper()
	samples := g.load(key, healthyFor, nil)
	first, last := samples[0].sent, samples[0].done
	admitted := map[string]int{}
	bad := 0
	for _, s := range samples {
		if s.err != nil || s.failOpen {
			bad++
			if bad <= 3 {
				t.Errorf("healthy %s: %s check %v into the phase: err %v, fail_open %v; want an answer from Redis", key, s.rule, s.sent.Sub(samples[0].sent), s.err, s.failOpen)
			}
			continue
		}
		if s.allowed {
			admitted[s.rule]++
		}
		if s.sent.Before(first) {
			first = s.sent
		}
		if s.done.After(last) {
			last = s.done
		}
	}
	span := last.Sub(first)
	if bad > 0 {
		t.Errorf("healthy %s: %d of %d checks not answered from Redis", key, bad, len(samples))
	}
	bound := capacity + int(refill*span.Seconds()) + 1
	for _, rule := range []string{"open", "closed"} {
		if admitted[rule] > bound {
			t.Errorf("healthy %s: rule %s admitted %d in %v, above its bucket's bound %d", key, rule, admitted[rule], span.Round(time.Millisecond), bound)
		}
		if admitted[rule] < capacity {
			t.Errorf("healthy %s: rule %s admitted %d in %v, below its capacity %d", key, rule, admitted[rule], span.Round(time.Millisecond), capacity)
		}
	}
	t.Logf("healthy %s: %d checks in %v (%.0f/s), admitted open %d closed %d, bound %d",
		key, len(samples), span.Round(time.Millisecond), float64(len(samples))/span.Seconds(), admitted["open"], admitted["closed"], bound)
}

type faultCase struct {
	name string
	// toxics are added at the start of the fault and removed at its end;
	// none means the proxy is disabled (connections refused).
	toxics []string
	// hard faults make every Redis round trip fail: the failure policy
	// must answer some checks.
	hard bool
}

func toxic(name, typ, stream, attrs string) string {
	return fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":{%s}}`, name, typ, stream, attrs)
}

// TestRedisFaults runs load through ratelimitd while toxiproxy injects
// faults between it and Redis, and checks the failure policy, the latency
// during the fault, the recovery after it and the bucket bound while healthy.
func TestRedisFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("fault suite: starts redis-server and ratelimitd")
	}
	// Some toxics log through zerolog's global logger: quiet it.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	t.Cleanup(func() { zerolog.SetGlobalLevel(zerolog.TraceLevel) })
	g := startRig(t)
	cases := []faultCase{
		{name: "latency", toxics: []string{toxic("lat", "latency", "downstream", `"latency":500`)}, hard: true},
		{name: "jitter", toxics: []string{toxic("jit", "latency", "downstream", fmt.Sprintf(`"latency":%d,"jitter":%d`, storeTimeout.Milliseconds(), storeTimeout.Milliseconds()))}},
		{name: "bandwidth", toxics: []string{toxic("bw-down", "bandwidth", "downstream", `"rate":1`), toxic("bw-up", "bandwidth", "upstream", `"rate":1`)}},
		{name: "slicer", toxics: []string{toxic("slice", "slicer", "downstream", `"average_size":2,"size_variation":1,"delay":2000`)}},
		{name: "reset_peer", toxics: []string{toxic("reset", "reset_peer", "upstream", `"timeout":0`)}, hard: true},
		{name: "blackhole", toxics: []string{toxic("hole", "timeout", "upstream", `"timeout":0`)}, hard: true},
		{name: "refused", hard: true},
	}
	var report []string
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g.healthy(t, c.name+"-before")
			if t.Failed() {
				return
			}

			// The fault, with load running.
			start := time.Now()
			if len(c.toxics) == 0 {
				g.proxy.Stop()
			}
			for _, tx := range c.toxics {
				if _, err := g.proxy.Toxics.AddToxicJson(strings.NewReader(tx)); err != nil {
					t.Fatalf("add toxic %s: %v", tx, err)
				}
			}
			during := g.load(c.name+"-during", faultFor, nil)
			failed, openPolicy, closedPolicy, closedAdmitted, fromRedis, rejected, openShed := 0, 0, 0, 0, 0, 0, 0
			var lat []time.Duration
			for _, s := range during {
				lat = append(lat, s.latency())
				switch {
				case s.err != nil:
					failed++
					if failed <= 3 {
						t.Errorf("%s rule: check failed during the fault: %v", s.rule, s.err)
					}
				case s.rule == "open" && !s.allowed && s.failOpen:
					failed++
					t.Errorf("open rule: rejected by the failure policy during the fault")
				case !s.allowed && !s.failOpen:
					// Rejected by the bucket in Redis, or shed by the
					// enforcer's own queue (overload, not a store
					// failure): counted apart.
					rejected++
					if s.rule == "open" {
						openShed++
					}
				case s.failOpen && s.rule == "open":
					openPolicy++
				case s.failOpen && s.rule == "closed":
					closedPolicy++
					if s.allowed {
						closedAdmitted++
					}
				default:
					fromRedis++
				}
			}
			if closedAdmitted > 0 {
				t.Errorf("closed rule: %d checks admitted by the failure policy during the fault, want 0", closedAdmitted)
			}
			if c.hard && (openPolicy == 0 || closedPolicy == 0) {
				t.Errorf("no answer from the failure policy during the fault (open %d, closed %d): the fault was not seen", openPolicy, closedPolicy)
			}
			slices.Sort(lat)
			p50, p99, worst := lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
			if bound := 2*storeTimeout + latencySlack; p99 > bound {
				t.Errorf("latency during the fault: p99 %v, above the bound %v (twice the store timeout plus slack)", p99, bound)
			}
			if bound := 2*storeTimeout + 4*latencySlack; worst > bound {
				t.Errorf("latency during the fault: max %v, above the bound %v", worst, bound)
			}

			// Remove the fault; time until Redis answers both rules again.
			end := time.Now()
			for _, tx := range c.toxics {
				name := tx[len(`{"name":"`):strings.Index(tx, `","type"`)]
				if err := g.proxy.Toxics.RemoveToxic(context.Background(), name); err != nil {
					t.Fatalf("remove toxic %s: %v", name, err)
				}
			}
			if len(c.toxics) == 0 {
				if err := g.proxy.Start(); err != nil {
					t.Fatalf("restart proxy: %v", err)
				}
			}
			streak := map[string]int{}
			var recovered time.Time
			g.load(c.name+"-recover", recoverBound+5*time.Second, func(s sample) bool {
				if s.err != nil || s.failOpen {
					streak = map[string]int{}
					recovered = time.Time{}
					return false
				}
				if recovered.IsZero() {
					recovered = s.done
				}
				streak[s.rule]++
				return streak["open"] >= 10 && streak["closed"] >= 10 && s.done.Sub(recovered) >= steadyFor
			})
			if recovered.IsZero() || streak["open"] < 10 || streak["closed"] < 10 {
				t.Fatalf("not recovered %v after the fault ended: Redis does not answer both rules steadily\n%s\n%s", recoverBound+5*time.Second, g.metrics(), g.stderr.String())
			}
			took := recovered.Sub(end)
			if took > recoverBound {
				t.Errorf("recovered %v after the fault ended, above the bound %v", took, recoverBound)
			}
			dur := end.Sub(start)
			line := fmt.Sprintf("| %s | %.0f/s | %d | %d / %d | %d / %d (%d open) | %v / %v / %v | %v |", c.name,
				float64(len(during))/dur.Seconds(), failed, openPolicy, closedPolicy, fromRedis, rejected, openShed,
				p50.Round(time.Millisecond), p99.Round(time.Millisecond), worst.Round(time.Millisecond), took.Round(time.Millisecond))
			t.Logf("fault %s: %d checks in %v; failed %d; failure policy open %d closed %d (closed admitted %d); from Redis: admitted %d, rejected or shed %d (open rule %d); latency p50 %v p99 %v max %v; recovered in %v",
				c.name, len(during), dur.Round(time.Millisecond), failed, openPolicy, closedPolicy, closedAdmitted, fromRedis, rejected, openShed,
				p50, p99, worst, took)
			report = append(report, line)

			g.healthy(t, c.name+"-after")
		})
	}
	t.Log("| fault | load held | checks failed | failure policy (open / closed) | from Redis (admitted / rejected or shed) | latency p50 / p99 / max | time to recover |\n" + strings.Join(report, "\n"))
}
