package stack

import (
	"context"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const globalRule = `
- id: g300
  match: { resource: "GET /g" }
  algorithm: token_bucket
  capacity: 300
  refill_per_second: 300
  scope: global
  regions: { us-east: 1, eu-west: 1, ap-south: 1 }
  min_share: 0.1
`

type decision struct {
	at      time.Duration
	region  int
	allowed bool
}

// End to end with real parts: 3 regions (a redis-server, an embedded NATS
// server joined by gateways, an enforcer and a sync agent each), one etcd, a
// global rule of 300/s with burst 300. Load of 600/s moves from us-east to
// eu-west. Admitted over every 1 s window stays <= burst + rate x 1 s, and
// within 2 s of the move eu-west admits at least 90% of what it can hold
// (the global rate less the other regions' floors).
func TestGlobalLimitFollowsDemandWithoutOvershoot(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	ctx := context.Background()
	// A generous store timeout: the test is about the ledger, and on a busy
	// 2-core machine a 50 ms timeout answers some checks from the failure policy.
	s, err := Start(ctx, Config{Regions: 3, Rules: []byte(globalRule), EnforcerTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	clients := make([]ratelimitv1.RateLimiterClient, len(s.Regions))
	for i, r := range s.Regions {
		cc, err := grpc.NewClient(r.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		clients[i] = ratelimitv1.NewRateLimiterClient(cc)
	}
	// Wait until every agent holds a marker: the regions enforce their base
	// shares (a third each) rather than their floors.
	testutil.WaitFor(t, 30*time.Second, "the agents' markers", func() bool {
		for i, c := range clients {
			resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "probe", Resource: "GET /g"})
			if err != nil || resp.Limit < 90 {
				return false
			}
			_ = i
		}
		return true
	})

	const (
		rate     = 600 // offered load, requests per second
		phase    = 5 * time.Second
		capacity = 300
		limit    = 300
	)
	var mu sync.Mutex
	var ds []decision
	var wg sync.WaitGroup
	start := time.Now()
	tick := time.NewTicker(time.Second / rate)
	req := &ratelimitv1.CheckLimitRequest{ClientKey: "user:moving", Resource: "GET /g"}
	for time.Since(start) < 2*phase {
		<-tick.C
		region := 0
		if time.Since(start) >= phase {
			region = 1
		}
		wg.Add(1)
		go func(region int, at time.Duration) {
			defer wg.Done()
			resp, err := clients[region].CheckLimit(ctx, req)
			if err != nil {
				t.Error(err)
				return
			}
			if resp.FailOpen {
				t.Error("a fail-open answer: the test machine is too slow for the store timeout")
			}
			mu.Lock()
			ds = append(ds, decision{at: at, region: region, allowed: resp.Allowed})
			mu.Unlock()
		}(region, time.Since(start))
	}
	tick.Stop()
	wg.Wait()
	sort.Slice(ds, func(i, j int) bool { return ds[i].at < ds[j].at })

	// Every 1 s window (by send time, in 10 ms steps): admitted <= burst + rate x 1 s.
	// The tolerance covers only the test's own clock: send times are taken
	// before the call, so a request sent just before a window may be decided
	// inside it; allow the requests sent in one extra 20 ms.
	bound := capacity + limit + rate*20/1000
	worst := 0
	for w := time.Duration(0); w+time.Second <= 2*phase; w += 10 * time.Millisecond {
		n := 0
		for _, d := range ds {
			if d.allowed && d.at >= w && d.at < w+time.Second {
				n++
			}
		}
		if n > worst {
			worst = n
		}
	}
	t.Logf("%d decisions; worst 1 s window admitted %d (bound %d)", len(ds), worst, bound)
	if worst > bound {
		t.Fatalf("admitted %d in a 1 s window, above burst + rate x 1 s = %d", worst, bound)
	}
	// Within 2 s of the move, eu-west admits >= 90% of what it can hold:
	// the global rate less the other two regions' floors (min_share 0.1
	// split over 3 regions: 10/s each), 280/s. (Converged, it admits 280;
	// 90% of the whole 300 left 10 requests of margin, which a CI run with
	// other packages on the same 2 cores used up.) If the load generator
	// fell behind on a busy machine and offered eu-west less than that in
	// that second, everything it offered must pass.
	n, sent := 0, 0
	for _, d := range ds {
		if d.region == 1 && d.at >= phase+2*time.Second && d.at < phase+3*time.Second {
			sent++
			if d.allowed {
				n++
			}
		}
	}
	t.Logf("eu-west admitted %d of %d in the second [move+2s, move+3s)", n, sent)
	holdable := limit - 2*limit/30
	if n < holdable*9/10 && !(sent < holdable && n == sent) {
		t.Fatalf("eu-west admitted %d of %d two seconds after the move, want >= %d (90%% of the %d it can hold)", n, sent, holdable*9/10, holdable)
	}
}

// Without redis-server the stack runs on an in-process miniredis per region:
// regional rules enforce and the agents take over the global rule.
func TestEmbeddedRedisStack(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	ctx := context.Background()
	s, err := Start(ctx, Config{Regions: 2, EmbeddedRedis: true, EnforcerTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if !s.RedisEmbedded {
		t.Fatal("RedisEmbedded is false")
	}
	cc, err := grpc.NewClient(s.Regions[0].GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	c := ratelimitv1.NewRateLimiterClient(cc)
	// orders-free: capacity 20 for tier free.
	allowed := 0
	for i := 0; i < 25; i++ {
		resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "u", Resource: "POST /orders", Attributes: map[string]string{"tier": "free"}})
		if err != nil {
			t.Fatal(err)
		}
		if resp.FailOpen {
			t.Fatal("fail-open answer from the embedded store")
		}
		if resp.Allowed {
			allowed++
		}
	}
	if allowed < 20 || allowed > 22 {
		t.Fatalf("allowed %d of 25 on a capacity-20 bucket refilling 10/s", allowed)
	}
	// The agent's marker lifts the global rule from the floor to the base share.
	testutil.WaitFor(t, 30*time.Second, "the agent's marker on the embedded store", func() bool {
		resp, err := c.CheckLimit(ctx, &ratelimitv1.CheckLimitRequest{ClientKey: "probe", Resource: DemoResource})
		return err == nil && resp.RuleId == GlobalRule && resp.Limit >= 50
	})
}
