package agent

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testutil"
	"github.com/apportion/apportion/regional/usage/usagetest"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/sync/ledger"
)

// capacityBound is how long after a rule's capacity changes the agents may
// take to hold whole tokens of the new one: every agent reads the rule
// from etcd (a watch event), the next tick rounds the targets, and the
// gifts (a tick, a store write, a report each) reach them; with the
// hold of whole-token gifts while the regions' views disagree
// (sync/ledger doc, invariant 4, step 4), a few rounds. Measured 0.10 s in
// four runs (one with the race detector).
const capacityBound = 15 * time.Second

// TestCapacityChangeWholeTokens: three regions whose clients all want more
// than a global limit of 2/s with a burst of 4; the rule then changes live
// to 1/s with a burst of 2 (rlctl limits set user-global --rate 1 --burst
// 2). Within capacityBound every region's store enforces whole tokens of
// the new burst (0, 500,000 or 1,000,000 units of 1,000,000) and together
// two: the whole limit is admitted. Before the agents followed the
// capacity, the ledgers kept the whole tokens of the burst they started
// with (250,000 units): at the static split each region kept 333,333
// units, 0.67 of a token of the new burst, and none admitted anything
// (with uneven demand, 1/2, 1/4 and 1/4 of the limit: 0.5/s admitted). At
// every sample the stores together enforce at most the limit. Real agents
// on an embedded NATS super-cluster and etcd, the in-memory contract store.
func TestCapacityChangeWholeTokens(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts a NATS super-cluster, etcd and the agents")
	}
	names := []string{"a", "b", "c"}
	s := memStack(t, names)
	rule := rules.Rule{ID: testRule, Match: map[string]string{"resource": "POST /orders"}, Key: []string{"client_key"},
		Algorithm: rules.TokenBucket, Capacity: 4, RefillPerSecond: 2, Scope: rules.Global,
		Regions: map[string]float64{"a": 1, "b": 1, "c": 1}}
	s.putRule(t, rule)
	s.waitIncarnations(t)
	spec := s.regions["a"].agent.specOf(rule)
	U := spec.ledgerConfig(ledger.DefaultConfig()).Units
	s.probe = memProbe{s: s, floors: floorsOf(spec)}
	sm := startSampler(t, s, U)
	for _, n := range names {
		usagetest.Publish(t, s.cluster[n].Connect(t), n, testRule, testKey, 10)
	}
	testutil.WaitFor(t, 20*time.Second, "the key coordinated in every region", func() bool {
		for _, n := range names {
			if _, ok := s.regions[n].agent.Shares(testRule)[testKey]; !ok {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second) // shares settled at the burst of 4
	enforced := func() []int64 {
		var us []int64
		for _, n := range names {
			us = append(us, s.enforced(n, testKey))
		}
		return us
	}
	t.Logf("burst 4: the stores enforce %v", enforced())

	rule.Capacity, rule.RefillPerSecond = 2, 1
	s.putRule(t, rule)
	q := ledger.QuantumOf(U, 2)
	changed := time.Now()
	whole := func() (bool, string) {
		us := enforced()
		var tokens int64
		for _, u := range us {
			if u%q != 0 {
				return false, fmt.Sprintf("%v: a fraction of a token of %d units", us, q)
			}
			tokens += u * 2 / U
		}
		return tokens == 2, fmt.Sprintf("%v: %d whole tokens", us, tokens)
	}
	deadline := time.Now().Add(capacityBound)
	for {
		ok, why := whole()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after the capacity changed to 2, the stores enforce %s of 2 (want whole tokens of the new burst, two in all)", capacityBound, why)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(changed)
	// Whole tokens that stay: the targets of the new burst, not a pass
	// through them.
	time.Sleep(2 * time.Second)
	if ok, why := whole(); !ok {
		t.Fatalf("2 s after reaching whole tokens, the stores enforce %s", why)
	}
	for _, n := range names {
		if got := s.regions[n].agent.quantumOf(testRule); got != q {
			t.Errorf("%s's ledger has Quantum %d, want %d", n, got, q)
		}
	}
	sm.finish()
	t.Logf("burst 2: whole tokens %v after the change (bound %v): %v; %d samples, worst sum %d", took.Round(time.Millisecond), capacityBound,
		enforced(), sm.samples.Load(), sm.worst.Load())
	if v := sm.violations.Load(); v > 0 {
		t.Fatalf("sum of enforced units exceeded %d in %d of %d samples (worst %d)", U, v, sm.samples.Load(), sm.worst.Load())
	}
}

// quantumOf is the Quantum of rule's ledger (0: none), read on the loop.
func (a *Agent) quantumOf(rule string) int64 {
	var q int64
	_ = a.onLoop(context.Background(), func() {
		if st := a.rules[rule]; st != nil && st.Led != nil {
			q = st.Led.Quantum()
		}
	})
	return q
}

// TestRegistryPaysTokensOfCurrentCapacity: a rule's registry document made
// while its burst was 4 (whole tokens of 250,000 units) pays a reclaim out
// in whole tokens of the burst the agent has now (2: 500,000 units), and
// records that Quantum in the document's Spec. Region a's first
// incarnation held one token of the new burst on key k; reclaimed, the
// token goes whole to b or c. With the document's Quantum of the old
// burst, each got 250,000 units: half a token, admitting nothing.
func TestRegistryPaysTokensOfCurrentCapacity(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: starts etcd")
	}
	ctx := context.Background()
	ec := testutil.StartEtcd(t).Client(t)
	reg := NewEtcdRegistry(ec, "", ledger.DefaultConfig())
	const U = 1_000_000
	spec := Spec{Units: U, Regions: []ledger.RegionSpec{{Name: "a", Weight: 1}, {Name: "b", Weight: 1}, {Name: "c", Weight: 1}},
		Quantum: ledger.QuantumOf(U, 4)}
	reg.setLimit("r", 4)
	for _, n := range []string{"a", "b", "c"} {
		if _, _, err := reg.Start(ctx, "r", spec, n); err != nil {
			t.Fatal(err)
		}
	}
	reg.setLimit("r", 2) // the rule's burst changed
	q := ledger.QuantumOf(U, 2)
	_, initial := ledger.Split(spec.ledgerConfig(ledger.DefaultConfig()), spec.Regions)
	a1, b1, c1 := ledger.Incarnation{Region: "a", Inc: 1}, ledger.Incarnation{Region: "b", Inc: 1}, ledger.Incarnation{Region: "c", Inc: 1}
	// a/1 held a whole token of the new burst on k: its initial part and
	// what b/1 gave it.
	if _, err := reg.Contribute(ctx, "r", ledger.Contribution{Of: a1, From: b1, Q: []ledger.KeyUnits{{Key: "k", Units: q - initial[0]}}}); err != nil {
		t.Fatal(err)
	}
	if rec, err := reg.Contribute(ctx, "r", ledger.Contribution{Of: a1, From: c1}); err != nil || !rec.Complete {
		t.Fatalf("reclaim of a/1: %+v %v", rec, err)
	}
	recs, err := reg.Records(ctx)
	if err != nil {
		t.Fatal(err)
	}
	paid := map[ledger.Incarnation]int64{}
	for _, x := range recs["r"].Records {
		if x.Paid == nil || x.Of != b1 && x.Of != c1 {
			continue
		}
		paid[x.Of] = x.Paid.Base
		for _, ku := range x.Paid.Keys {
			if ku.Key == "k" {
				paid[x.Of] += ku.Units
			}
		}
	}
	if paid[b1]+paid[c1] != q || paid[b1] != q && paid[c1] != q {
		t.Errorf("paid on k %v: want the whole token (%d units) in one region", paid, q)
	}
	_, used, err := reg.Start(ctx, "r", spec, "a")
	if err != nil {
		t.Fatal(err)
	}
	if used.Quantum != q {
		t.Errorf("the document's Quantum is %d, want %d (the burst of 2)", used.Quantum, q)
	}
}
