package agent

import (
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
)

// TestUnlistedPeerSeriesRemoved: region c is taken out of every rule (the
// rule over a, b and c is replaced by one over a and b, and c's agent
// stops). a's and b's series of peer c (apportion_sync_peer_lag_seconds,
// apportion_sync_peer_unacknowledged) go, and peers b and a keep theirs.
// Before, c's lag grew until the agents restarted, and
// ApportionSyncPeerLag fired for a region no rule lists.
func TestUnlistedPeerSeriesRemoved(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts NATS and etcd")
	}
	s := memStack(t, []string{"a", "b", "c"})
	s.putRule(t, globalRule())
	s.waitIncarnations(t)
	a, b := s.regions["a"], s.regions["b"]
	has := func(r *testRegion, name, peer string) bool {
		_, found := testutil.Metric(t, r.reg, name, map[string]string{"peer": peer})
		return found
	}
	names := []string{"apportion_sync_peer_lag_seconds", "apportion_sync_peer_unacknowledged"}
	for _, r := range []*testRegion{a, b} {
		for _, n := range names {
			testutil.WaitFor(t, 10*time.Second, r.name+"'s "+n+" of c", func() bool { return has(r, n, "c") })
		}
	}

	ab := ruleWithID("ab")
	ab.Regions = map[string]float64{"a": 1, "b": 1}
	s.putRule(t, ab)
	s.deleteRule(t, testRule)
	for _, r := range []*testRegion{a, b} {
		testutil.WaitFor(t, 20*time.Second, r.name+"'s incarnation of ab", func() bool { return r.agent.Incarnation(ab.ID) > 0 })
	}
	t0 := time.Now()
	for _, r := range []*testRegion{a, b} {
		for _, n := range names {
			testutil.WaitFor(t, 10*time.Second, r.name+"'s "+n+" of c removed", func() bool { return !has(r, n, "c") })
		}
	}
	t.Logf("c's series gone %v after its rule went", time.Since(t0).Round(time.Millisecond))
	// c's agent goes on publishing (it still runs): its reports of a rule
	// a and b no longer coordinate are dropped and bring nothing back.
	time.Sleep(10 * a.agent.cfg.Interval)
	for _, r := range []*testRegion{a, b} {
		for _, n := range names {
			if has(r, n, "c") {
				t.Errorf("%s's %s of c came back", r.name, n)
			}
		}
		peer := map[string]string{"a": "b", "b": "a"}[r.name]
		for _, n := range names {
			if !has(r, n, peer) {
				t.Errorf("%s's %s of %s, still listed, is gone", r.name, n, peer)
			}
		}
		if v, _ := testutil.Metric(t, r.reg, "apportion_sync_peer_lag_seconds", map[string]string{"peer": peer}); v > 1 {
			t.Errorf("%s's lag of %s is %v s", r.name, peer, v)
		}
	}
}
