package regional

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/prometheus/client_golang/prometheus"
)

// domainStore is a partitioned fake store: a key containing "bad" is in
// domain 2, "slot" in domain 3, any other in domain 1; each domain's calls
// fail with its error (none: answered allowed).
type domainStore struct {
	mu    sync.Mutex
	errs  map[int]error
	calls map[int]int
}

func (f *domainStore) Domain(key string) int {
	switch {
	case strings.Contains(key, "bad"):
		return 2
	case strings.Contains(key, "slot"):
		return 3
	}
	return 1
}

func (f *domainStore) Do(_ context.Context, _ redisstore.Budget, calls []redisstore.Call, out []redisstore.Answer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, c := range calls {
		d := f.Domain(c.Buckets[0].Key)
		f.calls[d]++
		if err := f.errs[d]; err != nil {
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

func (f *domainStore) callsOf(d int) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[d]
}

func (f *domainStore) Load() redisstore.Load          { return redisstore.Load{} }
func (f *domainStore) Partitioned() bool              { return true }
func (f *domainStore) DomainLoad(int) redisstore.Load { return redisstore.Load{} }
func (f *domainStore) DomainName(d int) string        { return fmt.Sprintf("10.0.0.%d:6379", d) }

// gaugeValue is the value of name's series matching want in reg (there
// must be one).
func gaugeValue(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	v, ok := testutil.Metric(t, reg, name, want)
	if !ok {
		t.Fatalf("no %s%v", name, want)
	}
	return v
}

// With a partitioned store (a Redis Cluster) each failure domain has its
// own breaker: a domain that refuses connections opens its own, and only
// its keys' checks are answered by the failure policy, alone or in a
// CheckBatch with others, which go on to the store; a Cluster's refusal
// about one slot (TRYAGAIN) opens none. apportion_breaker_state is the
// worst domain's state and apportion_breakers_open counts the open ones,
// leaving out a domain no check has reached for idleGuard (a master whose
// keys a failover gave to its promoted replica).
func TestBreakerPerDomain(t *testing.T) {
	defer func(d time.Duration) { idleGuard = d }(idleGuard)
	idleGuard = 300 * time.Millisecond
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	st := &domainStore{errs: map[int]error{2: refused, 3: redisReply("TRYAGAIN Multiple keys request during rehashing of slot")}, calls: map[int]int{}}
	enf, reg := newFakeEnforcer(t, st, tokenBucket("r", 10, 1))
	check := func(key string) Response {
		t.Helper()
		resp, err := enf.Check(context.Background(), Request{ClientKey: key})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for i := range 50 {
		if resp := check("good"); resp.FailOpen {
			t.Fatalf("check %d of a healthy domain: %+v, want the store's answer", i, resp)
		}
		if resp := check("bad"); !resp.FailOpen {
			t.Fatalf("check %d of the failing domain: %+v, want the failure policy", i, resp)
		}
		if resp := check("slot"); !resp.FailOpen {
			t.Fatalf("check %d of a slot refused: %+v, want the failure policy", i, resp)
		}
	}
	for d, want := range map[int]string{1: "closed", 2: "open", 3: "closed"} {
		if got := enf.guardFor(d).breaker.State().String(); got != want {
			t.Errorf("domain %d's breaker %s, want %s", d, got, want)
		}
	}
	if got := enf.BreakerState(); got != "open" {
		t.Errorf("BreakerState %s, want open (the worst)", got)
	}
	if v := gaugeValue(t, reg, MetricBreakerState, map[string]string{"state": "open"}); v != 1 {
		t.Errorf("%s{state=open} = %v, want 1", MetricBreakerState, v)
	}
	if v := gaugeValue(t, reg, MetricBreakersOpen, nil); v != 1 {
		t.Errorf("%s = %v, want 1", MetricBreakersOpen, v)
	}
	// A batch over the domains: the healthy one's requests go to the
	// store, the open domain's do not.
	bad := st.callsOf(2)
	resps, err := enf.CheckBatch(context.Background(), []Request{{ClientKey: "good"}, {ClientKey: "bad"}, {ClientKey: "good2"}})
	if err != nil {
		t.Fatal(err)
	}
	if resps[0].FailOpen || !resps[1].FailOpen || resps[2].FailOpen {
		t.Fatalf("batch: fail_open %v %v %v, want false true false", resps[0].FailOpen, resps[1].FailOpen, resps[2].FailOpen)
	}
	if n := st.callsOf(2) - bad; n > 1 {
		t.Fatalf("%d calls to the open domain in a batch, want at most a look", n)
	}
	// No more checks reach domain 2 (its keys moved away): once it is
	// idle, it no longer counts.
	testutil.WaitFor(t, 5*time.Second, "the idle domain's breaker not counted", func() bool {
		check("good")
		return enf.BreakerState() == "closed" && gaugeValue(t, reg, MetricBreakersOpen, nil) == 0 &&
			gaugeValue(t, reg, MetricBreakerState, map[string]string{"state": "closed"}) == 1
	})
	// Its keys back (a failback): its breaker counts again, and answers
	// from the store once it does.
	st.mu.Lock()
	delete(st.errs, 2)
	st.mu.Unlock()
	testutil.WaitFor(t, 5*time.Second, "domain 2 answered by the store again", func() bool { return !check("bad").FailOpen })
}
