package agent

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/rules/etcdstore"
	"github.com/redis/go-redis/v9"
)

// markerGone is the most a deleted rule's marker may stay in a region
// whose agent runs: a rule set's delivery, a tick, the delete (on a
// Cluster 16384 copies).
const markerGone = 15 * time.Second

func (s *stack) deleteRule(t testing.TB, id string) {
	t.Helper()
	st, err := etcdstore.New(s.etcd)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(context.Background(), id, 0); err != nil {
		t.Fatal(err)
	}
}

func ruleWithID(id string) rules.Rule {
	r := globalRule()
	r.ID, r.Match = id, map[string]string{"resource": "POST /" + id}
	return r
}

// markerKeys counts the marker keys of rule in rc: on a Cluster, on every
// master (slot copies).
func markerKeys(t testing.TB, rc redis.UniversalClient, rule string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	count := func(ctx context.Context, c redis.UniversalClient) (int, error) {
		n := 0
		it := c.Scan(ctx, 0, "rl:marker:*", 1000).Iterator()
		for it.Next(ctx) {
			k := it.Val()
			if k == redisstore.MarkerKey(rule) || (strings.HasPrefix(k, "rl:marker:{") && strings.HasSuffix(k, "}:"+rule)) {
				n++
			}
		}
		return n, it.Err()
	}
	if cc, ok := rc.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		total := 0
		err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			n, err := count(ctx, c)
			mu.Lock()
			total += n
			mu.Unlock()
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return total
	}
	n, err := count(ctx, rc)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestDeletedRuleMarkers: the marker of a global rule deleted goes from
// every region's Redis within markerGone, the live rule's stays; a marker
// left while a region's agent was down is deleted when it starts again;
// and a rule re-created under a deleted id gets a new marker and works
// (its region enforces above the floor again). Before, every rule id ever
// created left its marker for good (PTTL -1).
func TestDeletedRuleMarkers(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s, stores, servers := redisStack(t)
	clients := map[string]redis.UniversalClient{}
	for n, srv := range servers {
		rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { rc.Close() })
		clients[n] = rc
	}
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	deletedRuleMarkers(t, s, clients, stores)
}

// TestDeletedRuleMarkersCluster is TestDeletedRuleMarkers with region a's
// store on a Redis Cluster of 3 masters: every one of the 16384 slot
// copies of a deleted rule's marker goes.
func TestDeletedRuleMarkersCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	s, stores, clients := clusterStack(t)
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	deletedRuleMarkers(t, s, clients, stores)
}

func deletedRuleMarkers(t *testing.T, s *stack, clients map[string]redis.UniversalClient, stores map[string]*redisstore.Store) {
	perRegion := func(n string) int {
		if _, ok := clients[n].(*redis.ClusterClient); ok {
			return redisstore.Slots
		}
		return 1
	}
	waitMarkers := func(rule string, want func(n string) int, what string) {
		t.Helper()
		t0 := time.Now()
		for _, n := range s.names {
			testutil.WaitFor(t, markerGone, what+" in "+n, func() bool { return markerKeys(t, clients[n], rule) == want(n) })
		}
		t.Logf("%s: %v", what, time.Since(t0).Round(time.Millisecond))
	}
	none := func(string) int { return 0 }
	waitIncs := func(rule string) {
		t.Helper()
		for _, n := range s.names {
			testutil.WaitFor(t, 20*time.Second, rule+"'s incarnation in "+n, func() bool { return s.regions[n].agent.Incarnation(rule) > 0 })
		}
	}

	// A rule created and deleted: its markers go, testRule's stay.
	gone := ruleWithID("gone")
	s.putRule(t, gone)
	waitIncs(gone.ID)
	waitMarkers(gone.ID, perRegion, "gone's markers written")
	s.deleteRule(t, gone.ID)
	waitMarkers(gone.ID, none, "gone's markers deleted")
	for _, n := range s.names {
		if got := markerKeys(t, clients[n], testRule); got != perRegion(n) {
			t.Errorf("region %s: %d marker keys of the live rule %s, want %d", n, got, testRule, perRegion(n))
		}
	}

	// Re-created under the same id: a new marker, and the region enforces
	// its share again (above the floor), also after the delete's recheck.
	s.putRule(t, gone)
	waitIncs(gone.ID)
	waitMarkers(gone.ID, perRegion, "gone's markers written again")
	spec := s.regions["a"].agent.specOf(gone)
	floors := floorsOf(spec)
	key := "rl:{user:42}:gone"
	enforced := func(n string) int64 {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, res, err := stores[n].Check(ctx, redisstore.MaxCost, []redisstore.Bucket{{Key: key, Algorithm: rules.TokenBucket,
			Capacity: gone.Capacity * 1000, Rate: int64(gone.RefillPerSecond * 1000),
			Global: &redisstore.Global{Rule: gone.ID, Units: spec.Units, Floor: floors[n]}}})
		if err != nil || len(res) != 1 {
			return -1
		}
		return res[0].Limit
	}
	for _, n := range s.names {
		testutil.WaitFor(t, 20*time.Second, "re-created gone enforced above the floor in "+n, func() bool { return enforced(n) > floors[n] })
	}

	// A rule deleted while a's agent is down: its marker stays in a until
	// a's agent starts again, which deletes it.
	left := ruleWithID("left")
	s.putRule(t, left)
	waitIncs(left.ID)
	waitMarkers(left.ID, perRegion, "left's markers written")
	a := s.regions["a"]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.agent.Close(ctx); err != nil {
		t.Fatal(err)
	}
	s.deleteRule(t, left.ID)
	for _, n := range []string{"b", "c"} {
		testutil.WaitFor(t, markerGone, "left's marker deleted in "+n, func() bool { return markerKeys(t, clients[n], left.ID) == 0 })
	}
	if got := markerKeys(t, clients["a"], left.ID); got != perRegion("a") {
		t.Fatalf("a's agent is down, yet %d of left's marker keys in a, want %d", got, perRegion("a"))
	}
	a.start(t, s.etcd, func(c *Config) {
		if _, ok := clients["a"].(*redis.ClusterClient); ok {
			c.Lease = 5 * time.Second
		}
	})
	t0 := time.Now()
	testutil.WaitFor(t, markerGone, "left's marker deleted in a after its agent's start", func() bool { return markerKeys(t, clients["a"], left.ID) == 0 })
	t.Logf("left's marker in a deleted %v after a's agent started", time.Since(t0).Round(time.Millisecond))
	// The live rules keep theirs, and gone's recheck (30 s after its
	// first delete) left the re-created marker alone.
	testutil.WaitFor(t, 20*time.Second, "a's incarnations after its restart", func() bool {
		return a.agent.Incarnation(testRule) > 0 && a.agent.Incarnation(gone.ID) > 0
	})
	for _, n := range s.names {
		for _, r := range []string{testRule, gone.ID} {
			if got := markerKeys(t, clients[n], r); got != perRegion(n) {
				t.Errorf("region %s: %d marker keys of the live rule %s, want %d", n, got, r, perRegion(n))
			}
		}
	}
}
