package stack

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	ratelimitv1 "github.com/apportion/apportion/proto/ratelimit/v1"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// partitionHealBound is how long after a partition heals the cut region,
// whose clients send all the demand, may take to serve the whole limit
// again: the gateways reconnect (the NATS servers redial a dropped gateway
// about every second), the peers hear its new incarnation (it fenced in
// the cut) and pay out the reclaim, and the gifts reach it. Measured
// 2.0-2.8 s, and 5.2-7.8 s with the race detector.
const partitionHealBound = 15 * time.Second

// TestPartitionLiveness cuts off the region that sends all the demand of a
// global limit (twice the limit; the others send nothing) for two leases,
// then heals the cut, on the real stack: redis-server, an embedded NATS
// super-cluster whose gateways go through proxies, ratelimitd and the sync
// agent per region, one etcd. The region's enforced capacity is read with
// CheckLimit from its own enforcer (the bucket's limit in the answer).
// Asserted: with two regions the cut region keeps serving the limit through
// the cut (neither side can reclaim the other by silence); with ten it
// falls to its floor during the cut (it fences: the others reclaim its
// share); either way it serves the whole limit again within
// partitionHealBound of the heal. At 1/s (burst 1) and 10,000/s (burst
// 10,000).
func TestPartitionLiveness(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	eachSize(t, partitionLiveness)
}

// eachSize runs f at 2 and 10 regions and at 1/s and 10,000/s.
func eachSize(t *testing.T, f func(t *testing.T, regions int, rate int64)) {
	for _, n := range []int{2, 10} {
		for _, rate := range []int64{1, 10_000} {
			t.Run(fmt.Sprintf("regions=%d/rate=%d", n, rate), func(t *testing.T) { f(t, n, rate) })
		}
	}
}

func partitionLiveness(t *testing.T, n int, rate int64) {
	// The agents' default lease. At 1 s, ten regions under the race
	// detector (ten agents and ten enforcers in one process on two cores)
	// heard each other late enough to fence six regions during a's cut.
	const lease = 3 * time.Second
	g := startGlobal(t, n, rate, lease)
	s, limit, serving := g.s, g.limit, g.serving

	if err := s.Partition("a", true); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	if n > 2 {
		testutil.WaitFor(t, 2*lease, "a to fall to its floor in the cut", func() bool { return limit() == 0 })
		t.Logf("a at its floor %v into the cut", time.Since(cut).Round(time.Millisecond))
	}
	least := rate
	for time.Since(cut) < 2*lease { // the cut's length, sampled
		least = min(least, limit())
		time.Sleep(50 * time.Millisecond)
	}
	last := limit()
	// The cut is real: a's agent has heard no peer for most of it.
	if lag := peerLag(t, s.Regions[0].AgentHTTPAddr, "b"); lag < lease.Seconds() {
		t.Fatalf("a's agent heard b %.1f s before the cut's end: the cut did not hold", lag)
	}
	if n == 2 && (least < serving || last < serving) {
		t.Fatalf("two regions: a enforced %d at least and %d at the end of the cut, want >= %d: a cut-off side of two keeps its position", least, last, serving)
	}
	t.Logf("cut for %v: a enforced at least %d, %d at the end (limit %d)", time.Since(cut).Round(time.Millisecond), least, last, rate)

	if err := s.Partition("a", false); err != nil {
		t.Fatal(err)
	}
	healed := time.Now()
	testutil.WaitFor(t, partitionHealBound, "a to serve the limit again after the heal", func() bool { return limit() >= serving })
	t.Logf("healed: a enforces %d of %d again after %v (bound %v)", limit(), rate, time.Since(healed).Round(time.Millisecond), partitionHealBound)
}

// TestSeveralCutLiveness cuts several regions at once, the one that sends
// all the demand of a global limit among them, for two leases, and heals
// them one after the other, on the real stack at 2 and 10 regions and at
// 1/s and 10,000/s. With two regions both are cut (the link stays cut
// while either is): healing b first leaves a cut off, still serving the
// limit (a cut-off side of two keeps its position), and healing a then
// rejoins them. With ten, a, b and c are cut and fall to their floors;
// healed first while b and c are still cut, a serves the whole limit
// within partitionHealBound (the seven regions that reclaimed the three
// give it back; no cut region's share is needed); once b and c are healed
// too and heard again, a still serves it within the same bound.
func TestSeveralCutLiveness(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts the whole stack")
	}
	testutil.RedisServerPath(t)
	eachSize(t, severalCutLiveness)
}

func severalCutLiveness(t *testing.T, n int, rate int64) {
	const lease = 3 * time.Second
	g := startGlobal(t, n, rate, lease)
	s, limit, serving := g.s, g.limit, g.serving
	agentA := s.Regions[0].AgentHTTPAddr
	others := []string{"b"} // cut with a
	if n > 2 {
		others = []string{"b", "c"}
	}
	for _, r := range append([]string{"a"}, others...) {
		if err := s.Partition(r, true); err != nil {
			t.Fatal(err)
		}
	}
	cut := time.Now()
	if n > 2 {
		testutil.WaitFor(t, 2*lease, "a to fall to its floor in the cut", func() bool { return limit() == 0 })
	}
	for time.Since(cut) < 2*lease { // the cut's length, sampled
		if l := limit(); n == 2 && l < serving {
			t.Fatalf("two regions, both cut: a enforces %d %v into the cut, want >= %d", l, time.Since(cut).Round(time.Millisecond), serving)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if lag := peerLag(t, agentA, "b"); lag < lease.Seconds() {
		t.Fatalf("a's agent heard b %.1f s before the cut's end: the cut did not hold", lag)
	}

	// Healed first: b with two regions (a stays cut), a with ten (b and
	// c stay cut).
	first := "a"
	if n == 2 {
		first = "b"
	}
	if err := s.Partition(first, false); err != nil {
		t.Fatal(err)
	}
	healed := time.Now()
	if n == 2 {
		for time.Since(healed) < lease { // a stays cut off from b, and keeps serving
			if l := limit(); l < serving {
				t.Fatalf("two regions, b healed, a still cut: a enforces %d, want >= %d", l, serving)
			}
			time.Sleep(50 * time.Millisecond)
		}
		if lag := peerLag(t, agentA, "b"); lag < lease.Seconds() {
			t.Fatalf("b healed, a still cut: a's agent heard b %.1f s ago", lag)
		}
		if err := s.Partition("a", false); err != nil {
			t.Fatal(err)
		}
		healed = time.Now()
		testutil.WaitFor(t, partitionHealBound, "a to hear b again", func() bool { return peerLag(t, agentA, "b") < 1 })
		testutil.WaitFor(t, partitionHealBound, "a to serve the limit with both healed", func() bool { return limit() >= serving })
		t.Logf("a healed last: a and b hear each other and a enforces %d of %d after %v (bound %v)", limit(), rate, time.Since(healed).Round(time.Millisecond), partitionHealBound)
		return
	}
	testutil.WaitFor(t, partitionHealBound, "a to serve the limit, healed while b and c are cut", func() bool { return limit() >= serving })
	t.Logf("a healed first: a enforces %d of %d after %v, b and c still cut (bound %v)", limit(), rate, time.Since(healed).Round(time.Millisecond), partitionHealBound)
	for _, r := range others {
		if lag := peerLag(t, agentA, r); lag < lease.Seconds() {
			t.Fatalf("a healed, %s still cut: a's agent heard %s %.1f s ago", r, r, lag)
		}
		if err := s.Partition(r, false); err != nil {
			t.Fatal(err)
		}
	}
	healed = time.Now()
	testutil.WaitFor(t, partitionHealBound, "a to hear b and c again", func() bool {
		return peerLag(t, agentA, "b") < 1 && peerLag(t, agentA, "c") < 1
	})
	testutil.WaitFor(t, partitionHealBound, "a to serve the limit with every region healed", func() bool { return limit() >= serving })
	t.Logf("b and c healed: heard again and a enforces %d of %d after %v (bound %v)", limit(), rate, time.Since(healed).Round(time.Millisecond), partitionHealBound)
}

// global is a stack of n regions (a, b, ...) with one global token bucket
// g of rate per second and a burst of rate, whose region a sends twice the
// limit for one key (the others nothing) and holds the limit.
type global struct {
	s *Stack
	// limit is the capacity a's store enforces for the key now (the
	// bucket's limit in a CheckLimit answer from a's enforcer); a
	// fail-open answer fails the test (Redis is healthy, the store
	// timeout 2 s) unless failOpenOK, when it counts as -1.
	limit      func() int64
	failOpenOK bool
	// serving is what a enforces when it holds the limit: the whole token
	// at 1/s, 90% of it above.
	serving int64
}

func startGlobal(t *testing.T, n int, rate int64, lease time.Duration) *global {
	t.Helper()
	var names, weights []string
	for i := range n {
		names = append(names, string(rune('a'+i)))
		weights = append(weights, names[i]+": 1")
	}
	rule := fmt.Sprintf(`
- id: g
  match: { resource: "GET /g" }
  algorithm: token_bucket
  capacity: %d
  refill_per_second: %d
  scope: global
  regions: { %s }
  min_share: 0
`, rate, rate, strings.Join(weights, ", "))
	ctx := context.Background()
	start := time.Now()
	s, err := Start(ctx, Config{RegionNames: names, Rules: []byte(rule), Partitionable: true,
		EnforcerTimeout: 2 * time.Second, SyncLease: lease})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	t.Logf("%d regions started in %v", n, time.Since(start).Round(time.Millisecond))
	cc, err := grpc.NewClient(s.Regions[0].GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	client := ratelimitv1.NewRateLimiterClient(cc)
	req := &ratelimitv1.CheckLimitRequest{ClientKey: "user:p", Resource: "GET /g"}
	g := &global{s: s, serving: rate} // burst 1: the whole token
	if rate > 1 {
		g.serving = rate * 9 / 10
	}
	g.limit = func() int64 {
		resp, err := client.CheckLimit(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.FailOpen {
			if g.failOpenOK {
				return -1
			}
			t.Fatal("a fail-open answer: Redis is healthy, the store timeout 2 s")
		}
		return resp.Limit
	}
	nc, err := nats.Connect(s.Regions[0].NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	usagetest.Publish(t, nc, "a", "g", redisstore.Key("user:p", "g"), 2*float64(rate)) // stopped at the test's end
	t0 := time.Now()
	testutil.WaitFor(t, 30*time.Second, "a to hold the limit", func() bool { return g.limit() >= g.serving })
	t.Logf("a holds %d of %d %v after its demand began", g.limit(), rate, time.Since(t0).Round(time.Millisecond))
	return g
}

// peerLag is the seconds since the agent at addr last accepted a report of peer.
func peerLag(t *testing.T, addr, peer string) float64 {
	mfs, err := Scrape(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	if mf := mfs["apportion_sync_peer_lag_seconds"]; mf != nil {
		for _, m := range mf.GetMetric() {
			if Label(m, "peer") == peer {
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("agent %s exports no apportion_sync_peer_lag_seconds for %s", addr, peer)
	return 0
}
