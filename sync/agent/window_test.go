package agent

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage"
	"github.com/apportion/apportion/rules"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"
)

// redisStack is the three-region stack with one redis-server per region.
func redisStack(t *testing.T, tweak ...func(*Config)) (*stack, map[string]*redisstore.Store, map[string]*testutil.Redis) {
	stores := map[string]*redisstore.Store{}
	servers := map[string]*testutil.Redis{}
	s := newStackOf(t, []string{"a", "b", "c"}, func(n string) (Store, *memStore) {
		r := testutil.StartRedis(t)
		servers[n] = r
		rc := redis.NewClient(&redis.Options{Addr: r.Addr, MaxRetries: -1})
		return storeOn(t, rc, stores, n), nil
	}, tweak...)
	return s, stores, servers
}

// TestDailyQuotaWithRedis: a global fixed window of 100 requests per day
// across three regions (weights 1, min_share 0.1), enforced by real Redis
// on the Redis clock and coordinated by the agents, while demand moves from
// a to b to c. The test is the only enforcer: it checks requests in the
// demand's region, one every 5 ms, and publishes their usage. Safety: the
// regions together never admit more than 100 in a window (counted per
// window, read from each answer's reset time). Liveness: a region with
// demand is served out of what the others have not used, far beyond its
// floor (a 60 while b and c are idle, then b 30 of the 40 left), and the
// day's quota ends up used (at least 90).
func TestDailyQuotaWithRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s, stores, _ := redisStack(t)
	rule := rules.Rule{ID: "daily", Algorithm: rules.FixedWindow, Limit: 100, Window: rules.Duration(24 * time.Hour),
		Scope: rules.Global, Regions: map[string]float64{"a": 1, "b": 1, "c": 1}, MinShare: 0.1}
	const key = "rl:{user:42}:daily"
	s.putRule(t, rule)
	spec := s.regions["a"].agent.specOf(rule)
	floors := floorsOf(spec)
	for _, n := range s.names {
		testutil.WaitFor(t, 20*time.Second, "incarnation of "+n, func() bool { return s.regions[n].agent.Incarnation(rule.ID) > 0 })
	}
	ncs := map[string]*nats.Conn{}
	for _, n := range s.names {
		ncs[n] = s.cluster[n].Connect(t)
	}
	W := (24 * time.Hour).Milliseconds()
	perWindow := map[int64]int64{} // admitted, by window index
	admitted := map[string]int64{}
	var seq uint64
	ctx := context.Background()
	// serve sends demand in region n until it has admitted want or for d.
	serve := func(n string, want int64, d time.Duration) {
		t.Helper()
		b := redisstore.Bucket{Key: key, Algorithm: rules.FixedWindow, Limit: rule.Limit, Window: time.Duration(rule.Window),
			Global: &redisstore.Global{Rule: rule.ID, Units: spec.Units, Floor: floors[n]}}
		var ok, no int64
		publish := func() {
			seq++
			p, _ := usage.Encode(usage.Batch{Region: n, Enforcer: "test", Seq: seq,
				Deltas: []usage.Delta{{Rule: rule.ID, Key: key, Admitted: ok, Rejected: no}}})
			if err := ncs[n].Publish(usage.Subject(n), p); err != nil {
				t.Fatal(err)
			}
			ok, no = 0, 0
		}
		end := time.Now().Add(d)
		for i := 0; admitted[n] < want && time.Now().Before(end); i++ {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			allowed, res, err := stores[n].Check(cctx, 1, []redisstore.Bucket{b})
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			if allowed {
				ok++
				admitted[n]++
				idx := (time.Now().UnixMilli() + res[0].ResetAfterMs + W/2) / W
				if perWindow[idx]++; perWindow[idx] > rule.Limit {
					t.Fatalf("window %d: %d admitted, above the limit %d (by region %v)", idx, perWindow[idx], rule.Limit, admitted)
				}
			} else {
				no++
			}
			if i%10 == 9 {
				publish()
			}
			time.Sleep(5 * time.Millisecond) // the request rate, not synchronisation
		}
		publish()
		t.Logf("demand in %s: admitted %d (all regions %v)", n, admitted[n], admitted)
	}
	// The floor is 10% of a third: 3 requests; the static share a third.
	serve("a", 60, 20*time.Second) // b and c are idle: a gets their excess
	if admitted["a"] < 60 {
		t.Fatalf("a admitted %d, want 60 of the day's 100 (b, c idle)", admitted["a"])
	}
	serve("b", 30, 20*time.Second) // a may give only what it has not used
	if admitted["b"] < 30 {
		t.Fatalf("b admitted %d, want 30 of the 40 a and c have not used", admitted["b"])
	}
	serve("c", 100, 3*time.Second)
	var total int64
	for _, v := range perWindow {
		total = max(total, v)
	}
	if total < 90 {
		t.Fatalf("the busiest window admitted %d of 100: the quota was not used (%v)", total, admitted)
	}
	if g := metricValue(s.regions["a"].agent.m.gifts); g < 1 {
		t.Errorf("a made no gifts: %v", g)
	}
}
