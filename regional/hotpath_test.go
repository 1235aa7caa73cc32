package regional

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// burst sends callers x perCaller concurrent CheckLimit calls on one key and
// counts the answers.
type burstResult struct {
	allowed, failOpen, shed, errors int
	elapsed                         time.Duration
	firstErr                        error
}

func burst(e *env, callers, perCaller int, key, resource string) burstResult {
	var mu sync.Mutex
	var r burstResult
	var wg sync.WaitGroup
	start := time.Now()
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perCaller; i++ {
				var hdr metadata.MD
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				resp, err := e.client.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: key, Resource: resource}, grpc.Header(&hdr))
				cancel()
				mu.Lock()
				switch {
				case err != nil:
					r.errors++
					if r.firstErr == nil {
						r.firstErr = err
					}
				case resp.FailOpen:
					r.failOpen++
				case len(hdr.Get(ShedHeader)) > 0:
					r.shed++
				case resp.Allowed:
					r.allowed++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	r.elapsed = time.Since(start)
	return r
}

// 1,000 concurrent callers, 3 checks each, on one key of a freshly started
// enforcer with a healthy Redis: no answer comes from the failure policy,
// and at most the bucket's bound is admitted (the queue inside the enforcer
// does not count against Redis). The store timeout is 100 ms: before the
// round trip was measured on its own, 1,000 x 3 with 100 ms still failed
// open thousands of times; the default 10 ms holds on a quiet machine, but
// this shared CI machine can starve redis-server itself for tens of ms.
func TestColdBurstNeverFailsOpen(t *testing.T) {
	e := newEnv(t, []rules.Rule{tokenBucket("burst", 100, 1)}, func(c *Config) { c.Timeout = 100 * time.Millisecond })
	r := burst(e, 1000, 3, "tenant:1", "GET /")
	t.Logf("1000 callers x 3: allowed=%d fail_open=%d shed=%d errors=%d in %v", r.allowed, r.failOpen, r.shed, r.errors, r.elapsed)
	if r.errors > 0 {
		t.Fatalf("%d errors, first %v", r.errors, r.firstErr)
	}
	if r.failOpen != 0 {
		for _, k := range []string{"timeout", "error", "breaker_open", "invalid"} {
			t.Logf("store errors %s: %v", k, counterValue(t, e.registry, MetricStoreErrors, map[string]string{"kind": k}))
		}
		t.Fatalf("%d fail-open answers with a healthy Redis", r.failOpen)
	}
	// A check shed after it was sent may have taken its token in Redis
	// (rejected, never admitted): every token went to an allowed or a shed
	// answer.
	bound := 100 + int(r.elapsed.Seconds()) + 1
	if r.allowed > bound || r.allowed+r.shed < 100 {
		t.Fatalf("allowed %d (shed %d), want at most %d and the bucket's 100 spent", r.allowed, r.shed, bound)
	}
	if st := e.enf.BreakerState(); st != "closed" {
		t.Fatalf("breaker %s after a burst on a healthy Redis", st)
	}
}

// fakeStore answers every call with err and reports load.
type fakeStore struct {
	mu    sync.Mutex
	err   error
	load  redisstore.Load
	calls atomic.Int64
	heard atomic.Bool // Load reports Redis answering now
	// delay, when set, is how long each Do takes; inFlight and maxInFlight
	// count the Do calls under way.
	delay                 atomic.Int64
	inFlight, maxInFlight atomic.Int64
}

func (f *fakeStore) set(err error, load redisstore.Load) {
	f.mu.Lock()
	f.err, f.load = err, load
	f.mu.Unlock()
}

func (f *fakeStore) Do(ctx context.Context, _ redisstore.Budget, calls []redisstore.Call, out []redisstore.Answer) {
	f.calls.Add(int64(len(calls)))
	if n := f.inFlight.Add(1); n > f.maxInFlight.Load() {
		f.maxInFlight.Store(n)
	}
	defer f.inFlight.Add(-1)
	if d := f.delay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	f.mu.Lock()
	err := f.err
	f.mu.Unlock()
	for i, c := range calls {
		if err != nil {
			out[i] = redisstore.Answer{Err: err}
			continue
		}
		res := make([]redisstore.Result, len(c.Buckets))
		for j := range res {
			res[j] = redisstore.Result{Allowed: true, Limit: 10, Remaining: 9}
		}
		out[i] = redisstore.Answer{Allowed: true, Results: res}
	}
}

func (f *fakeStore) Load() redisstore.Load {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.load
	if f.heard.Load() {
		l.Answered = time.Now()
	}
	return l
}

// redisReply is an error reply from Redis (go-redis's redis.Error).
type redisReply string

func (e redisReply) Error() string { return string(e) }
func (redisReply) RedisError()     {}

func newFakeEnforcer(t *testing.T, st Store, rs ...rules.Rule) (*Enforcer, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.Region = "us-east"
	cfg.Logger = quietLogger()
	cfg.Metrics = NewMetrics(reg, cfg.Region)
	cfg.BreakerOpen = time.Minute
	enf, err := New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := enf.SetRules(rs); err != nil {
		t.Fatal(err)
	}
	return enf, reg
}

// The breaker counts only the store failing: a caller that went away, a
// check shed by the enforcer's own queue, or a request the store refuses
// (a script error about one key, a bucket out of range) leaves it closed
// however often it happens; timeouts, refused connections and a Redis that
// is loading open it.
func TestBreakerCountsOnlyStoreFailures(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	notFailures := []struct {
		name     string
		err      error
		canceled bool
		want     string // decision
	}{
		{"caller canceled", context.Canceled, true, "error"},
		{"caller deadline", context.DeadlineExceeded, true, "error"},
		{"queued past the budget", redisstore.ErrQueueTimeout, false, "shed"},
		{"script error about one key", redisReply("WRONGTYPE Operation against a key holding the wrong kind of value script: 1234, on @user_script:12."), false, "fail_allowed"},
		{"bucket refused", fmt.Errorf("%w: buckets[0].Capacity 1000000000000 must be in [1, 274877906944] thousandths", redisstore.ErrInvalidBucket), false, "fail_allowed"},
	}
	failures := []struct {
		name    string
		err     error
		timeout bool
	}{
		{"round trip past the budget", fmt.Errorf("%w after 10ms: %w", redisstore.ErrTimeout, context.DeadlineExceeded), true},
		{"connection refused", refused, false},
		{"connection reset", reset, false},
		{"redis loading", redisReply("LOADING Redis is loading the dataset in memory"), false},
	}
	for _, tc := range notFailures {
		t.Run(tc.name, func(t *testing.T) {
			st := &fakeStore{}
			enf, _ := newFakeEnforcer(t, st, tokenBucket("r", 10, 1))
			st.set(tc.err, redisstore.Load{})
			for i := 0; i < 50; i++ {
				ctx := context.Background()
				if tc.canceled {
					c, cancel := context.WithCancel(ctx)
					cancel()
					ctx = c
				}
				resp, err := enf.Check(ctx, Request{ClientKey: "k"})
				got := "error"
				if err == nil {
					got = decision(resp)
				}
				if got != tc.want {
					t.Fatalf("check %d: %s (err %v), want %s", i, got, err, tc.want)
				}
			}
			if s := enf.BreakerState(); s != "closed" {
				t.Fatalf("breaker %s after 50 x %v", s, tc.err)
			}
			// And the store answers the next check.
			st.set(nil, redisstore.Load{})
			if resp, err := enf.Check(context.Background(), Request{ClientKey: "k"}); err != nil || resp.FailOpen || resp.Shed {
				t.Fatalf("after: %+v %v, want a store answer", resp, err)
			}
		})
	}
	for _, tc := range failures {
		t.Run(tc.name, func(t *testing.T) {
			st := &fakeStore{}
			enf, _ := newFakeEnforcer(t, st, tokenBucket("r", 10, 1))
			st.set(tc.err, redisstore.Load{})
			check := func() {
				resp, err := enf.Check(context.Background(), Request{ClientKey: "k"})
				if err != nil || !resp.FailOpen || !resp.Allowed {
					t.Fatalf("%+v %v, want a fail-open answer", resp, err)
				}
			}
			start := time.Now()
			for i := 0; i < int(DefaultConfig().BreakerFailures); i++ {
				check()
			}
			if tc.timeout {
				// The timeouts of one stalled pipeline arrive together:
				// they open the breaker only once they span a Timeout.
				if s := enf.BreakerState(); s != "closed" && time.Since(start) < DefaultConfig().Timeout {
					t.Fatalf("breaker %s after %d simultaneous timeouts", s, DefaultConfig().BreakerFailures)
				}
				testutil.WaitFor(t, 5*time.Second, "the breaker to open", func() bool {
					check()
					return enf.BreakerState() == "open"
				})
			}
			if s := enf.BreakerState(); s != "open" {
				t.Fatalf("breaker %s after %d x %v, want open", s, DefaultConfig().BreakerFailures, tc.err)
			}
			n := st.calls.Load()
			if resp, _ := enf.Check(context.Background(), Request{ClientKey: "k"}); !resp.FailOpen {
				t.Fatal("open breaker: not answered by the failure policy")
			}
			if st.calls.Load() != n {
				t.Fatal("open breaker still called the store")
			}
		})
	}
}

// A store error about one bucket (here a key holding a list, so the script
// fails on it) answers that check alone, by its rule's failure mode; every
// other check keeps its store answer and the breaker stays closed.
func TestOneBadKeyHarmsNobody(t *testing.T) {
	var logs testutil.SyncBuffer
	e := newEnv(t, []rules.Rule{tokenBucket("r", 5, 0.001)}, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	ctx := context.Background()
	if err := e.rc.LPush(ctx, redisstore.Key("bad", "r"), "x").Err(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 30; i++ {
		if r := e.check(t, "bad", "GET /", 1); !r.FailOpen || !r.Allowed {
			t.Fatalf("bad key, check %d: %+v, want its failure mode (open)", i, r)
		}
		if r := e.check(t, fmt.Sprintf("good:%d", i), "GET /", 1); r.FailOpen || !r.Allowed || r.Remaining != 4 {
			t.Fatalf("good key %d: %+v, want a store answer with 4 remaining", i, r)
		}
	}
	if s := e.enf.BreakerState(); s != "closed" {
		t.Fatalf("breaker %s", s)
	}
	if n := counterValue(t, e.registry, MetricStoreErrors, map[string]string{"kind": "invalid"}); n != 30 {
		t.Fatalf("store errors of kind invalid = %v, want 30", n)
	}
	// The log says what happened: the store refused this check, it is not
	// unavailable.
	if l := logs.String(); strings.Contains(l, "store unavailable") || !strings.Contains(l, "the store refused this check (invalid)") {
		t.Fatalf("log:\n%s\nwant the refusal of one check, not \"store unavailable\"", l)
	}
}

// A rule whose bucket the store cannot hold in this region (a static global
// share that rounds to nothing) is answered by its own failure mode without
// the store; the other rules are enforced as usual.
func TestOneBadRuleHarmsNobody(t *testing.T) {
	bad := tokenBucket("tiny", 1, 0.001) // a quarter of 0.001/s is below the store's unit
	bad.Scope, bad.Regions, bad.FailureMode = rules.Global, map[string]float64{"us-east": 1, "eu-west": 3}, rules.FailClosed
	bad.Match = map[string]string{"resource": "POST /tiny"}
	good := tokenBucket("good", 3, 0.001)
	good.Match = map[string]string{"resource": "GET /"}
	e := newEnv(t, []rules.Rule{bad, good}, func(c *Config) { c.StaticGlobal = true })
	for i := 0; i < 10; i++ {
		if r := e.check(t, "u", "POST /tiny", 1); !r.FailOpen || r.Allowed || r.RuleId != "tiny" {
			t.Fatalf("bad rule, check %d: %+v, want its failure mode (closed)", i, r)
		}
	}
	for i := 0; i < 4; i++ {
		r := e.check(t, "u", "GET /", 1)
		if r.FailOpen || r.RuleId != "good" || r.Allowed != (i < 3) {
			t.Fatalf("good rule, check %d: %+v, want a store answer (3 allowed, then rejected)", i, r)
		}
	}
	if s := e.enf.BreakerState(); s != "closed" {
		t.Fatalf("breaker %s", s)
	}
	// The example of the issue: capacity 1e9 is refused when loaded, naming the field.
	huge := tokenBucket("huge", 1_000_000_000, 1)
	var fe *rules.FieldError
	if err := e.enf.SetRules([]rules.Rule{huge}); !errors.As(err, &fe) || fe.Field != "capacity" {
		t.Fatalf("SetRules(capacity 1e9) = %v, want a FieldError naming capacity", err)
	}
}

// CheckLimits sends its items in one pipeline and answers them in order,
// each as CheckLimit would have answered it alone, in that order.
func TestCheckLimitsOnePipelineInOrder(t *testing.T) {
	a := tokenBucket("a", 3, 0.001)
	a.Match = map[string]string{"resource": "A"}
	b := tokenBucket("b", 100, 0.001)
	b.Match = map[string]string{"resource": "B"}
	e := newEnv(t, []rules.Rule{a, b}, nil)
	type want struct {
		rule      string
		allowed   bool
		remaining int64
	}
	var reqs []*ratelimitv1.CheckLimitRequest
	var wants []want
	for i := 0; i < 5; i++ {
		reqs = append(reqs, &ratelimitv1.CheckLimitRequest{ClientKey: "k1", Resource: "A"})
		wants = append(wants, want{"a", i < 3, max(0, int64(2-i))})
		reqs = append(reqs, &ratelimitv1.CheckLimitRequest{ClientKey: fmt.Sprintf("k%d", i), Resource: "B", Cost: int64(i + 1)})
		wants = append(wants, want{"b", true, int64(100 - (i + 1))})
	}
	reqs = append(reqs, &ratelimitv1.CheckLimitRequest{ClientKey: "k1", Resource: "nothing"})
	wants = append(wants, want{"", true, 0})
	p0, _ := e.store.Pipelines()
	resp, err := e.client.CheckLimits(context.Background(), &ratelimitv1.CheckLimitsRequest{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	if p, _ := e.store.Pipelines(); p-p0 != 1 {
		t.Fatalf("%d pipelines for one CheckLimits, want 1", p-p0)
	}
	if len(resp.Responses) != len(wants) {
		t.Fatalf("%d responses for %d requests", len(resp.Responses), len(wants))
	}
	for i, w := range wants {
		r := resp.Responses[i]
		if r.RuleId != w.rule || r.Allowed != w.allowed || r.Remaining != w.remaining || r.FailOpen {
			t.Fatalf("response %d: %+v, want rule %q allowed=%v remaining=%d", i, r, w.rule, w.allowed, w.remaining)
		}
	}
	// An invalid item fails the batch before anything is consumed, naming its index.
	bad := append(reqs[:2:2], &ratelimitv1.CheckLimitRequest{ClientKey: ""})
	if _, err := e.client.CheckLimits(context.Background(), &ratelimitv1.CheckLimitsRequest{Requests: bad}); status.Code(err) != codes.InvalidArgument ||
		!containsAll(status.Convert(err).Message(), "requests[2]", "client_key") {
		t.Fatalf("batch with an invalid item: %v", err)
	}
	if r := e.check(t, "k0", "B", 1); r.Remaining != 98 {
		t.Fatalf("after the refused batch k0 has %d remaining, want 98 (nothing consumed)", r.Remaining)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// While Redis is slow (here: any round trip is "slow"), checks of a
// low-priority rule are shed: answered rejected without Redis, labelled and
// counted, so a burst on one key never passes the rule's bound; a
// high-priority rule keeps going to Redis and admits exactly its bound.
func TestShedLowPriority(t *testing.T) {
	low := tokenBucket("low", 10, 0.001)
	low.Match, low.Priority = map[string]string{"resource": "L"}, rules.PriorityLow
	high := tokenBucket("high", 10, 0.001)
	high.Match = map[string]string{"resource": "H"}
	e := newEnv(t, []rules.Rule{low, high}, func(c *Config) { c.ShedLatency = time.Nanosecond })
	if r := e.check(t, "warm", "H", 1); r.FailOpen { // one round trip measured
		t.Fatalf("first check: %+v", r)
	}
	l := burst(e, 50, 2, "hot", "L")
	h := burst(e, 50, 2, "hot", "H")
	if l.errors+h.errors > 0 {
		t.Fatalf("errors: %v %v", l.firstErr, h.firstErr)
	}
	if l.shed != 100 || l.allowed != 0 || l.failOpen != 0 {
		t.Fatalf("low priority: %+v, want all 100 shed", l)
	}
	if h.shed != 0 || h.allowed != 10 || h.failOpen != 0 {
		t.Fatalf("high priority: %+v, want 10 allowed by Redis and none shed", h)
	}
	if n := counterValue(t, e.registry, MetricShed, map[string]string{"reason": "latency"}); n != 100 {
		t.Fatalf("%s{reason=latency} = %v, want 100", MetricShed, n)
	}
	if n := counterValue(t, e.registry, MetricChecks, map[string]string{"rule": "low", "decision": "shed"}); n != 100 {
		t.Fatalf("%s{rule=low,decision=shed} = %v, want 100", MetricChecks, n)
	}
	// Once Redis is fast again the low-priority rule goes back to Redis.
	e.enf.cfg.ShedLatency = time.Hour
	if r := e.check(t, "hot", "L", 1); !r.Allowed || r.FailOpen || r.Remaining != 9 {
		t.Fatalf("after shedding: %+v, want a store answer with nothing consumed by the shed checks (9 remaining)", r)
	}
}

// Low-priority checks are also shed on queue depth; high priority still goes
// to the store.
func TestShedOnQueueDepth(t *testing.T) {
	low := tokenBucket("low", 10, 1)
	low.Match, low.Priority = map[string]string{"resource": "L"}, rules.PriorityLow
	high := tokenBucket("high", 10, 1)
	high.Match = map[string]string{"resource": "H"}
	st := &fakeStore{}
	enf, reg := newFakeEnforcer(t, st, low, high)
	st.set(nil, redisstore.Load{Queued: DefaultConfig().ShedQueue})
	if r, err := enf.Check(context.Background(), Request{ClientKey: "k", Resource: "L"}); err != nil || !r.Shed || r.Allowed {
		t.Fatalf("low priority at the queue threshold: %+v %v, want shed", r, err)
	}
	if r, err := enf.Check(context.Background(), Request{ClientKey: "k", Resource: "H"}); err != nil || r.Shed || !r.Allowed {
		t.Fatalf("high priority at the queue threshold: %+v %v, want a store answer", r, err)
	}
	st.set(nil, redisstore.Load{Queued: DefaultConfig().ShedQueue - 1})
	if r, _ := enf.Check(context.Background(), Request{ClientKey: "k", Resource: "L"}); r.Shed {
		t.Fatal("low priority below the queue threshold was shed")
	}
	if n := counterValue(t, reg, MetricShed, map[string]string{"reason": "queue_depth"}); n != 1 {
		t.Fatalf("%s{reason=queue_depth} = %v, want 1", MetricShed, n)
	}
}

// local_batch: N. Three enforcers on one Redis, a burst on one key: every
// token admitted was taken from Redis (at most the bucket's 100), at most
// N-1 per enforcer are left stranded in memory, answers come from memory
// for most checks, and none fails open.
func TestLocalBatchSeveralEnforcers(t *testing.T) {
	const n = 10
	lb := tokenBucket("lb", 100, 0.001)
	lb.LocalBatch = n
	e := newEnv(t, []rules.Rule{lb}, nil)
	enfs := []*Enforcer{e.enf}
	for i := 0; i < 2; i++ {
		cfg := DefaultConfig()
		cfg.Region, cfg.Timeout, cfg.Logger = "us-east", time.Second, quietLogger()
		enf, err := New(cfg, e.store)
		if err != nil {
			t.Fatal(err)
		}
		if err := enf.SetRules([]rules.Rule{lb}); err != nil {
			t.Fatal(err)
		}
		enfs = append(enfs, enf)
	}
	_, c0 := e.store.Pipelines()
	var allowed, failOpen atomic.Int64
	var wg sync.WaitGroup
	for _, enf := range enfs {
		for g := 0; g < 20; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < 5; i++ {
					r, err := enf.Check(context.Background(), Request{ClientKey: "hot"})
					if err != nil {
						t.Error(err)
						return
					}
					if r.FailOpen {
						failOpen.Add(1)
					}
					if r.Allowed {
						allowed.Add(1)
					}
				}
			}()
		}
	}
	wg.Wait()
	_, c1 := e.store.Pipelines()
	t.Logf("300 checks over 3 enforcers: %d allowed, %d script calls", allowed.Load(), c1-c0)
	if failOpen.Load() != 0 {
		t.Fatalf("%d fail-open answers", failOpen.Load())
	}
	if a := allowed.Load(); a > 100 || a < 100-3*(n-1) {
		t.Fatalf("allowed %d, want at most the bucket's 100 and at least 100 - 3 x (N-1)", a)
	}
	if c1-c0 >= 300 {
		t.Fatalf("%d script calls for 300 checks: local batching did not batch", c1-c0)
	}
	// One caller at a time: one script call per N checks, the others
	// answered from memory (and counted: the burst above may have been
	// served from memory by the other two enforcers only, which have no
	// registry here).
	before := counterValue(t, e.registry, MetricLocalBatch, nil)
	_, c0 = e.store.Pipelines()
	for i := 0; i < 50; i++ {
		if r, err := e.enf.Check(context.Background(), Request{ClientKey: "calm"}); err != nil || !r.Allowed || r.FailOpen {
			t.Fatalf("calm check %d: %+v %v", i, r, err)
		}
	}
	if _, c1 := e.store.Pipelines(); c1-c0 != 50/n {
		t.Fatalf("%d script calls for 50 checks one at a time, want %d", c1-c0, 50/n)
	}
	if v := counterValue(t, e.registry, MetricLocalBatch, nil) - before; v != 50-50/n {
		t.Fatalf("%s grew by %v for 50 checks one at a time, want %d answered from a local batch", MetricLocalBatch, v, 50-50/n)
	}
}

// local_batch on a global token bucket: the batch comes out of the region's
// share in Redis (here the floor, 5 tokens, with no sync agent), so the
// region still admits exactly its share, and the usage reported to the
// agent is what was admitted.
func TestLocalBatchGlobalShare(t *testing.T) {
	g := tokenBucket("global", 100, 0.001)
	g.Scope, g.Regions, g.MinShare, g.LocalBatch = rules.Global, map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1}, 0.1, 4
	var admitted atomic.Int64
	e := newEnv(t, []rules.Rule{g}, func(c *Config) {
		c.Usage = func(_, _ string, a, _ int64) { admitted.Add(a) }
	})
	n := 0
	for i := 0; i < 12; i++ {
		if e.check(t, "a", "GET /", 1).Allowed {
			n++
		}
	}
	if n != 5 || admitted.Load() != 5 {
		t.Fatalf("%d of 12 allowed and %d reported, want the floor of 5 both", n, admitted.Load())
	}
}

// split: k. A hot key's checks spread over k sub-buckets, each with its own
// hash tag (its own Redis Cluster slot) and 1/k of the limit: the key never
// admits more than the rule's bound, and the accuracy cost is measured: a
// burst of exactly the capacity admits a bit less (the sub-bucket picked
// may be empty while another still has tokens).
func TestSplitHotKey(t *testing.T) {
	hot := tokenBucket("hot", 400, 0.004)
	hot.Split = 4
	other := tokenBucket("other", 1000, 0.001)
	other.Match = map[string]string{"resource": "both"}
	e := newEnv(t, []rules.Rule{hot, other}, nil)
	admitted := 0
	for i := 0; i < 400; i++ {
		if e.check(t, "tenant", "GET /", 1).Allowed {
			admitted++
		}
	}
	after := admitted
	for i := 0; i < 400; i++ {
		if e.check(t, "tenant", "GET /", 1).Allowed {
			after++
		}
	}
	t.Logf("split 4, capacity 400: a burst of 400 admitted %d (%.1f%%); 800 admitted %d", admitted, 100*float64(admitted)/400, after)
	if after > 401 { // + refill 0.004/s
		t.Fatalf("admitted %d of 800, above the bound of 400", after)
	}
	if admitted < 340 || after < 396 {
		t.Fatalf("admitted %d of the first 400 and %d of 800: too inaccurate", admitted, after)
	}
	keys, err := e.rc.Keys(context.Background(), "rl:*:hot").Result()
	if err != nil {
		t.Fatal(err)
	}
	tags := map[string]bool{}
	for _, k := range keys {
		tags[k[strings.Index(k, "{"):strings.Index(k, "}")+1]] = true
	}
	if len(tags) != 4 {
		t.Fatalf("sub-bucket keys %v: want 4 distinct hash tags", keys)
	}
	// A request that also matches another rule (on a standalone Redis:
	// any sub-bucket) finds them all spent by the burst.
	if r := e.check(t, "tenant", "both", 1); r.Allowed {
		t.Fatalf("a two-rule request on the spent key: %+v", r)
	}
	// Another client whose key looks like a sub-bucket's name has its own
	// bucket: "tenant#1" (sub-bucket 0, the plain key, as above) is not
	// tenant's sub-bucket 1, spent by the burst.
	if r := e.check(t, "tenant#1", "both", 1); !r.Allowed {
		t.Fatalf("client tenant#1 shares a bucket with tenant's sub-buckets: %+v (keys %v)", r, keys)
	}
}

// A Redis that hangs (DEBUG SLEEP: connected, silent) fails the checks
// waiting on it within the timeout plus this process's own allowance, the
// breaker opens, and enforcement resumes from Redis once it answers again.
func TestHungRedisFailsOpenAndRecovers(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts redis-server")
	}
	r := testutil.StartRedis(t, "--enable-debug-command", "yes")
	timeout := 20 * time.Millisecond
	e := newEnvOn(t, r, []rules.Rule{tokenBucket("r", 1000000, 1000000)}, func(c *Config) {
		c.Timeout, c.BreakerOpen = timeout, 100*time.Millisecond
	})
	if resp := e.check(t, "u", "GET /", 1); resp.FailOpen {
		t.Fatalf("before: %+v", resp)
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer admin.Close()
	sleeping := make(chan error, 1)
	go func() { sleeping <- admin.Do(context.Background(), "DEBUG", "SLEEP", "1.5").Err() }()
	probe := redis.NewClient(&redis.Options{Addr: r.Addr, ReadTimeout: 50 * time.Millisecond, MaxRetries: -1})
	defer probe.Close()
	testutil.WaitFor(t, 5*time.Second, "Redis to hang", func() bool { return probe.Ping(context.Background()).Err() != nil })
	var worst time.Duration
	for i := 0; i < 20; i++ {
		t0 := time.Now()
		resp := e.check(t, fmt.Sprintf("k%d", i), "GET /", 1)
		worst = max(worst, time.Since(t0))
		if !resp.FailOpen || !resp.Allowed {
			t.Fatalf("check %d while Redis hangs: %+v, want the failure policy (open)", i, resp)
		}
	}
	t.Logf("slowest of 20 answers while Redis hung: %v (timeout %v)", worst, timeout)
	if margin := 400 * time.Millisecond; worst > timeout+margin {
		t.Fatalf("slowest answer while Redis hung took %v, want within %v + %v", worst, timeout, margin)
	}
	if s := e.enf.BreakerState(); s == "closed" {
		t.Fatal("breaker still closed while Redis hangs")
	}
	if err := <-sleeping; err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "answers from Redis again", func() bool {
		resp := e.check(t, "u", "GET /", 1)
		return !resp.FailOpen && resp.Allowed
	})
}
