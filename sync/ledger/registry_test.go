package ledger

import (
	"errors"
	"math/rand"
	"testing"
)

func TestRegistry(t *testing.T) {
	cfg := DefaultConfig()
	spec := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 2}}
	r, err := NewRegistry(cfg, spec)
	if err != nil {
		t.Fatal(err)
	}
	_, initial := Split(cfg, spec)
	start := func(n string) Start {
		st, err := r.Start(n)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	a1, b1, c1 := start("a"), start("b"), start("c")
	if a1.Inc != 1 || b1.Inc != 1 || c1.Inc != 1 {
		t.Fatalf("first incarnations: %v %v %v", a1, b1, c1)
	}
	A1, B1, C1 := Incarnation{"a", 1}, Incarnation{"b", 1}, Incarnation{"c", 1}

	// a/1 froze b/1 (a gave b 10 units on k, confirmed).
	if _, err := r.Contribute(Contribution{Of: B1, From: A1, Q: []KeyUnits{{"k", 10}}}); err != nil {
		t.Fatal(err)
	}
	// Reclaim of a/1 needs b/1 and c/1.
	rec, _ := r.Contribute(Contribution{Of: A1, From: B1, Q: []KeyUnits{{"k", -4}}})
	if rec.Complete {
		t.Fatal("complete without c/1")
	}
	rec, _ = r.Contribute(Contribution{Of: A1, From: C1})
	if !rec.Complete || rec.Base != initial[0] {
		t.Fatalf("want complete with base %d: %+v", initial[0], rec)
	}
	if len(rec.Keys) != 1 || rec.Keys[0] != (KeyUnits{"k", -4}) {
		t.Fatalf("b/1 is not reclaimed: its Q counts, a's own term does not: %+v", rec)
	}
	if len(rec.Recipients) != 2 {
		t.Fatalf("recipients %v", rec.Recipients)
	}
	// a/1 is reclaimed: its contributions are refused from now on.
	if _, err := r.Contribute(Contribution{Of: C1, From: A1}); !errors.Is(err, ErrFrozenIncarnation) {
		t.Fatalf("contribution from a reclaimed incarnation: %v", err)
	}
	// New lives know a/1 is gone.
	b2 := start("b")
	for _, k := range b2.Known {
		if k.Region == "a" && k.Inc != 2 {
			t.Fatalf("b/2 may pair with %v", k)
		}
	}
	// b/1 is reclaimed next: a/1 (complete) is no longer required, and the
	// pair (a/1, b/1) is not counted again: b's Q in a's record took it.
	// What a/1's reclaim paid b/1 counts in b/1's reclaim, applied or not.
	paid := r.Record(B1).Paid
	if paid == nil || paid.Base <= 0 {
		t.Fatalf("b/1 was not paid: %+v", r.Record(B1))
	}
	var paidK int64
	for _, x := range paid.Keys {
		if x.Key == "k" {
			paidK = x.Units
		}
	}
	rec, _ = r.Contribute(Contribution{Of: B1, From: C1, Q: []KeyUnits{{"k", 3}}})
	if !rec.Complete {
		t.Fatalf("b/1 not complete: %+v", rec)
	}
	if rec.Base != initial[1]+paid.Base {
		t.Fatalf("b/1's record frees %d on every key, want its initial %d plus its payment %d: %+v", rec.Base, initial[1], paid.Base, rec)
	}
	var q int64
	for _, x := range rec.Keys {
		if x.Key == "k" {
			q = x.Units
		}
	}
	if q != 3+4+paidK {
		t.Fatalf("b/1's record counts %d units on k, want c's 3 plus b's own 4 plus its payment %d", q, paidK)
	}
	if _, err := r.Start("mars"); !errors.Is(err, ErrUnknownRegion) {
		t.Fatalf("unknown region: %v", err)
	}
}

func TestWaterFill(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 2000; i++ {
		n := 1 + rng.Intn(6)
		pool := rng.Int63n(2_000_000)
		wants := make([]Want, n)
		for j := range wants {
			wants[j] = Want{Weight: float64(1 + rng.Intn(4)), Demand: rng.Int63n(600_000) * int64(rng.Intn(2))}
		}
		out := WaterFill(pool, wants)
		var sum, want int64
		for j, x := range out {
			if x < 0 {
				t.Fatalf("negative target %v", out)
			}
			sum += x
			want += wants[j].Demand
		}
		if sum != pool {
			t.Fatalf("targets %v sum %d, pool %d", out, sum, pool)
		}
		if want >= pool {
			for j, x := range out {
				if x > wants[j].Demand {
					t.Fatalf("pool %d short but region %d gets %d > demand %d (%v)", pool, j, x, wants[j].Demand, wants)
				}
			}
		}
	}
	// No demand: the static split by weight, i.e. the initial parts.
	if got := WaterFill(900, []Want{{1, 0}, {2, 0}}); got[0] != 300 || got[1] != 600 {
		t.Fatalf("idle split %v", got)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func(*Config){
		"units":     func(c *Config) { c.Units = 0 },
		"min_share": func(c *Config) { c.MinShare = 2 },
		"rho":       func(c *Config) { c.Rho = 0.7 },
		"lease":     func(c *Config) { c.Lease = c.Interval },
		"allocate":  func(c *Config) { c.Allocate = nil },
		"half-life": func(c *Config) { c.HalfLife = -1 },
		"gift band": func(c *Config) { c.GiftBand = 1 },
		"gift wait": func(c *Config) { c.GiftWait = 256 * c.Interval }, // beyond the key's one-byte count
	} {
		c := DefaultConfig()
		f(&c)
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestRegistryCohort: both sides of a two-region pair died at once, neither
// froze the other. Once their successors close them (and the successor that
// overlapped the other side's dead life froze it), they are reclaimed
// together (their pair counted by nobody) and the successors are paid both
// initial parts; an incarnation nobody found silent is never reclaimed.
func TestRegistryCohort(t *testing.T) {
	cfg := DefaultConfig()
	spec := []RegionSpec{{"a", 1}, {"b", 3}}
	r, err := NewRegistry(cfg, spec)
	if err != nil {
		t.Fatal(err)
	}
	_, initial := Split(cfg, spec)
	for _, n := range []string{"a", "b", "a", "b"} {
		if _, err := r.Start(n); err != nil {
			t.Fatal(err)
		}
	}
	A1, B1, A2, B2 := Incarnation{"a", 1}, Incarnation{"b", 1}, Incarnation{"a", 2}, Incarnation{"b", 2}
	if err := r.Close(A2); err != nil {
		t.Fatal(err)
	}
	if rec := r.Record(A1); rec.Complete {
		t.Fatalf("a/1 reclaimed while b/1, which overlapped it, may be alive: %+v", rec)
	}
	if err := r.Close(B2); err != nil {
		t.Fatal(err)
	}
	// a/2 started before b/1 ended: it must freeze b/1 first (it does when
	// it hears b/2, or after b/1's silence once a peer acknowledges it).
	if rec := r.Record(A1); rec.Complete {
		t.Fatalf("reclaimed before a/2 froze b/1: %+v", rec)
	}
	if _, err := r.Contribute(Contribution{Of: B1, From: A2}); err != nil {
		t.Fatal(err)
	}
	rec := r.Record(A1)
	if !rec.Complete || len(rec.Cohort) != 2 || rec.Cohort[1] != B1 || rec.Base != initial[0]+initial[1] {
		t.Fatalf("a/1 and b/1 not reclaimed together: %+v", rec)
	}
	pa, pb := r.Record(A2).Paid, r.Record(B2).Paid
	if pa == nil || pb == nil || pa.Base+pb.Base != initial[0]+initial[1] || pb.Base != 3*pa.Base {
		t.Fatalf("payments %+v %+v, want the initial parts %v split 1:3", pa, pb, initial)
	}
	if r.Record(A2).Complete || r.Record(B2).Complete {
		t.Fatal("a live incarnation was reclaimed")
	}
	if err := r.Close(Incarnation{"a", 9}); !errors.Is(err, ErrUnknownRegion) {
		t.Fatalf("close by an unknown incarnation: %v", err)
	}
}

// With whole tokens (Quantum), a reclaim pays out whole tokens: the token
// a reclaimed incarnation held on a key goes to one recipient, not half
// to each (half a token in each region admits nothing); without Quantum
// it is split by weight. Either way the payouts sum to what was freed.
func TestRegistryPaysWholeTokens(t *testing.T) {
	for _, quantum := range []int64{0, DefaultConfig().Units} {
		cfg := DefaultConfig()
		cfg.MinShare, cfg.Quantum = 0, quantum
		spec := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 1}}
		r, err := NewRegistry(cfg, spec)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"a", "b", "c"} {
			if _, err := r.Start(n); err != nil {
				t.Fatal(err)
			}
		}
		_, initial := Split(cfg, spec)
		A1, B1, C1 := Incarnation{"a", 1}, Incarnation{"b", 1}, Incarnation{"c", 1}
		// a/1 held the whole token on k: its part plus what b/1 gave it.
		if _, err := r.Contribute(Contribution{Of: A1, From: B1, Q: []KeyUnits{{"k", cfg.Units - initial[0]}}}); err != nil {
			t.Fatal(err)
		}
		rec, err := r.Contribute(Contribution{Of: A1, From: C1})
		if err != nil || !rec.Complete {
			t.Fatalf("reclaim of a/1: %+v %v", rec, err)
		}
		paid := map[Incarnation]int64{}
		for _, x := range r.Records() {
			if x.Paid == nil || (x.Of != B1 && x.Of != C1) {
				continue
			}
			paid[x.Of] = x.Paid.Base
			for _, ku := range x.Paid.Keys {
				if ku.Key == "k" {
					paid[x.Of] += ku.Units
				}
			}
		}
		if paid[B1]+paid[C1] != cfg.Units {
			t.Fatalf("quantum %d: paid on k %v, want %d in all", quantum, paid, cfg.Units)
		}
		whole := paid[B1] == cfg.Units || paid[C1] == cfg.Units
		if quantum > 0 && !whole || quantum == 0 && whole {
			t.Errorf("quantum %d: paid on k %v: want the whole token in one region only with a quantum", quantum, paid)
		}
	}
}
