package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/admin"
	"github.com/apportion/apportion/rules/etcdstore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var adminRE = regexp.MustCompile(`admin=(\S+)`)

type etcdStack struct {
	etcd  *testutil.Etcd
	redis *testutil.Redis
	a, b  *server
	admin *admin.Client
}

// startEtcdStack runs two enforcers watching one embedded etcd; the first
// also serves the admin API.
func startEtcdStack(t *testing.T) *etcdStack {
	t.Helper()
	integration(t)
	et := testutil.StartEtcd(t)
	r := testutil.StartRedis(t)
	common := []string{"--region", "us-east", "--redis-addr", r.Addr, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--etcd-endpoints", et.Endpoint, "--timeout", "1s"}
	a := startInProcess(t, append(common, "--admin-addr", "127.0.0.1:0", "--admin-token", "s3cret")...)
	b := startInProcess(t, common...)
	m := adminRE.FindStringSubmatch(a.readyLine)
	if m == nil {
		t.Fatalf("no admin address in %q", a.readyLine)
	}
	cl, err := admin.NewClient("http://"+m[1], "s3cret", nil)
	if err != nil {
		t.Fatal(err)
	}
	return &etcdStack{etcd: et, redis: r, a: a, b: b, admin: cl}
}

func limitOf(t *testing.T, c ratelimitv1.RateLimiterClient, key string) (string, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: key, Resource: "POST /orders"})
	if err != nil {
		t.Fatal(err)
	}
	return resp.RuleId, resp.Limit
}

// A rule put through the admin API is enforced by two running enforcers
// within 2 seconds; a changed limit applies and a delete stops enforcement
// within 2 seconds, without restarting anything.
func TestRulesFromEtcdApplyWithinSeconds(t *testing.T) {
	s := startEtcdStack(t)
	clients := []ratelimitv1.RateLimiterClient{dial(t, s.a.grpc), dial(t, s.b.grpc)}
	ctx := context.Background()
	waitAll := func(what string, want func(rule string, limit int64) bool) time.Duration {
		t.Helper()
		start := time.Now()
		for i, c := range clients {
			testutil.WaitFor(t, 2*time.Second, what+" on enforcer "+strconv.Itoa(i), func() bool {
				return want(limitOf(t, c, "k"+strconv.Itoa(i)))
			})
		}
		return time.Since(start)
	}
	rule := rules.Rule{ID: "orders", Match: map[string]string{"resource": "POST /orders"}, Algorithm: rules.TokenBucket, Capacity: 10, RefillPerSecond: 1}
	rev, err := s.admin.Put(ctx, rule, etcdstore.MustNotExist)
	if err != nil {
		t.Fatal(err)
	}
	d := waitAll("the new rule", func(id string, l int64) bool { return id == "orders" && l == 10 })
	t.Logf("put applied on both enforcers in %v", d)

	rule.Capacity = 25
	if _, err := s.admin.Put(ctx, rule, rev); err != nil {
		t.Fatal(err)
	}
	d = waitAll("the changed limit", func(id string, l int64) bool { return l == 25 })
	t.Logf("change applied on both enforcers in %v", d)

	if err := s.admin.Delete(ctx, "orders", 0); err != nil {
		t.Fatal(err)
	}
	d = waitAll("the delete", func(id string, l int64) bool { return id == "" })
	t.Logf("delete applied on both enforcers in %v", d)
}

// etcd stopped for 10 seconds under load: no check fails or slows, rules
// stay enforced; after the restart, a change arrives.
func TestEtcdOutageUnderLoad(t *testing.T) {
	s := startEtcdStack(t)
	ctx := context.Background()
	rule := rules.Rule{ID: "orders", Match: map[string]string{"resource": "POST /orders"}, Algorithm: rules.TokenBucket, Capacity: 5, RefillPerSecond: 0.001}
	if _, err := s.admin.Put(ctx, rule, etcdstore.MustNotExist); err != nil {
		t.Fatal(err)
	}
	c := dial(t, s.a.grpc)
	testutil.WaitFor(t, 2*time.Second, "the rule", func() bool { id, _ := limitOf(t, c, "warm"); return id == "orders" })

	type stats struct {
		n, errs, failOpen, rejected int
		worst                       time.Duration
		lat                         []time.Duration
	}
	load := func(stop <-chan struct{}) stats {
		var st stats
		var mu sync.Mutex
		var wg sync.WaitGroup
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					t0 := time.Now()
					resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "load:" + strconv.Itoa(w*1000+i%50), Resource: "POST /orders"})
					d := time.Since(t0)
					mu.Lock()
					st.n++
					st.lat = append(st.lat, d)
					if d > st.worst {
						st.worst = d
					}
					switch {
					case err != nil:
						st.errs++
					case resp.FailOpen:
						st.failOpen++
					case !resp.Allowed:
						st.rejected++
					}
					mu.Unlock()
				}
			}(w)
		}
		<-stop
		wg.Wait()
		return st
	}
	p99 := func(l []time.Duration) time.Duration {
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		return l[len(l)*99/100]
	}
	measure := func(d time.Duration, during func()) stats {
		stop := make(chan struct{})
		res := make(chan stats, 1)
		go func() { res <- load(stop) }()
		during()
		timer := time.NewTimer(d) // the length of the run is the subject of the test
		<-timer.C
		close(stop)
		return <-res
	}
	base := measure(3*time.Second, func() {})
	st := measure(10*time.Second, s.etcd.Stop)
	t.Logf("before the etcd outage: %d checks, p99 %v; during the 10 s outage: %d checks, p99 %v, worst %v, %d rejected",
		base.n, p99(base.lat), st.n, p99(st.lat), st.worst, st.rejected)
	if st.errs > 0 || st.failOpen > 0 {
		t.Fatalf("during the etcd outage: %d errors, %d fail-open answers", st.errs, st.failOpen)
	}
	if st.rejected == 0 {
		t.Fatal("the rule stopped being enforced during the etcd outage")
	}
	// A check that waited on etcd would take the client's dial timeout
	// (seconds); the slack only absorbs the shared machine's noise.
	if a, b := p99(st.lat), p99(base.lat); a > 3*b+20*time.Millisecond {
		t.Fatalf("p99 latency rose from %v to %v during the etcd outage", b, a)
	}
	s.etcd.Restart(t)
	rule.Capacity = 9
	cli := s.etcd.Client(t)
	st2, err := etcdstore.New(cli)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st2.Put(ctx, rule, 0); err != nil {
		t.Fatal(err)
	}
	for i, cl := range []ratelimitv1.RateLimiterClient{c, dial(t, s.b.grpc)} {
		testutil.WaitFor(t, 15*time.Second, "the change made after etcd returned, on enforcer "+strconv.Itoa(i), func() bool {
			_, l := limitOf(t, cl, "after")
			return l == 9
		})
	}
}

// Shadow mode end to end: would-be rejections show in metrics and logs;
// flipping shadow off makes the rule enforce.
func TestShadowModeEndToEnd(t *testing.T) {
	s := startEtcdStack(t)
	ctx := context.Background()
	rule := rules.Rule{ID: "orders-shadow", Match: map[string]string{"resource": "POST /orders"}, Algorithm: rules.TokenBucket,
		Capacity: 2, RefillPerSecond: 0.001, Shadow: true}
	rev, err := s.admin.Put(ctx, rule, etcdstore.MustNotExist)
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, s.a.grpc)
	testutil.WaitFor(t, 2*time.Second, "the shadow rule", func() bool { id, _ := limitOf(t, c, "probe"); return id == "orders-shadow" })
	for i := 0; i < 5; i++ {
		resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "sh", Resource: "POST /orders"})
		if err != nil || !resp.Allowed {
			t.Fatalf("call %d: a shadow rule rejected (err=%v)", i, err)
		}
	}
	resp, err := http.Get("http://" + s.a.http + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !regexp.MustCompile(`apportion_checks_total\{decision="shadow_rejected",region="us-east",rule="orders-shadow"\} 3`).Match(body) {
		t.Fatalf("metrics lack 3 shadow rejections:\n%s", grepLines(string(body), "apportion_checks_total"))
	}
	if !strings.Contains(s.a.stderr.String(), "shadow rule would have rejected") {
		t.Fatal("no shadow log line")
	}
	rule.Shadow = false
	if _, err := s.admin.Put(ctx, rule, rev); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 2*time.Second, "enforcement after shadow off", func() bool {
		resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "sh", Resource: "POST /orders"})
		return err == nil && !resp.Allowed
	})
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// An enforcer started while etcd is down listens at once: /healthz 200,
// /readyz 503, checks Unavailable, no ready line; once etcd is back it
// loads the rules, prints the ready line and enforces them.
func TestStartsWhileEtcdDown(t *testing.T) {
	integration(t)
	et := testutil.StartEtcd(t)
	r := testutil.StartRedis(t)
	st, err := etcdstore.New(et.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	rule := rules.Rule{ID: "orders", Match: map[string]string{"resource": "POST /orders"}, Algorithm: rules.TokenBucket, Capacity: 7, RefillPerSecond: 1}
	if _, err := st.Put(context.Background(), rule, etcdstore.MustNotExist); err != nil {
		t.Fatal(err)
	}
	et.Stop()

	grpcAddr := "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t))
	httpAddr := "127.0.0.1:" + strconv.Itoa(testutil.FreePort(t))
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--region", "us-east", "--redis-addr", r.Addr, "--grpc-addr", grpcAddr, "--http-addr", httpAddr,
			"--etcd-endpoints", et.Endpoint, "--timeout", "1s"}, stdout, stderr)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Errorf("run did not return within 15s of cancel")
		}
	})
	get := func(path string) int {
		resp, err := http.Get("http://" + httpAddr + path)
		if err != nil {
			return 0
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	testutil.WaitFor(t, 10*time.Second, "/healthz while etcd is down", func() bool { return get("/healthz") == http.StatusOK })
	if code := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz with no rule set: %d, want 503", code)
	}
	c := dial(t, grpcAddr)
	cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
	_, err = c.CheckLimit(cctx, &ratelimitv1.CheckLimitRequest{ClientKey: "k", Resource: "POST /orders"})
	ccancel()
	if status.Code(err) != codes.Unavailable {
		t.Errorf("check with no rule set: %v, want Unavailable", err)
	}
	if readyRE.MatchString(stdout.String()) {
		t.Errorf("ready line printed with no rule set: %q", stdout.String())
	}

	et.Restart(t)
	testutil.WaitFor(t, 30*time.Second, "the ready line after etcd's return", func() bool { return readyRE.MatchString(stdout.String()) })
	if code := get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz with the rules loaded: %d, want 200", code)
	}
	if id, limit := limitOf(t, c, "k"); id != "orders" || limit != 7 {
		t.Errorf("after etcd's return: rule %q limit %d, want orders 7", id, limit)
	}
}
