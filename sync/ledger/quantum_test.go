package ledger

import (
	"fmt"
	"testing"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
)

// TestQuantumAdmitsAToken: a region that holds exactly one Quantum of a
// limit of 1 to WholeTokensUpTo tokens admits a request of one token, as
// the store enforces it (the store's reference model: a global token
// bucket and a global fixed window under a marker of that many units), and
// units/Quantum regions can each hold one. With units/capacity rounded
// down, a capacity that does not divide the units (3 of 1,000,000) left a
// region 0.999 of a token: in a 3/s scenario over four regions (burst 3,
// even demand) the ledger admitted 18% of the ideal, 47% rounded up.
func TestQuantumAdmitsAToken(t *testing.T) {
	const units = allocation.DefaultUnits
	g := redisstore.Global{Rule: "r", Units: units}
	// admits reports whether a region holding u units (its marker's
	// default) admits one request of b in a fresh store.
	admits := func(u int64, b redisstore.Bucket) bool {
		t.Helper()
		m := redisstore.NewModel(0)
		if _, err := m.WriteMarker(0, "r", redisstore.Marker{Inc: 1, Seq: 1, Units: u, Lease: time.Minute, Create: true, RunID: m.RunID()}); err != nil {
			t.Fatal(err)
		}
		ok, _, err := m.Check(1, 1, []redisstore.Bucket{b})
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for c := int64(1); c <= WholeTokensUpTo; c++ {
		q := QuantumOf(units, float64(c))
		if q <= 0 || q > units {
			t.Fatalf("capacity %d: Quantum %d outside (0, %d]", c, q, units)
		}
		// Rounded up, one token fewer than the capacity may be held whole
		// when the capacity does not divide the units, none when it does.
		if holders, want := units/q, c-min(units%c, 1); holders < want {
			t.Errorf("capacity %d: %d regions can hold a whole token, want %d", c, holders, want)
		}
		for _, b := range []redisstore.Bucket{
			{Key: "tb", Algorithm: rules.TokenBucket, Capacity: c * 1000, Rate: c * 1000, Global: &g},
			{Key: "fw", Algorithm: rules.FixedWindow, Limit: c, Window: time.Minute, Global: &g},
		} {
			if !admits(q, b) {
				t.Errorf("capacity %d, %s: one Quantum (%d units) admits no request", c, b.Algorithm, q)
			}
		}
	}
	// The rounding it replaces: at 3, a region of 333,333 units admits nothing.
	if admits(units/3, redisstore.Bucket{Key: "tb", Algorithm: rules.TokenBucket, Capacity: 3000, Rate: 3000, Global: &g}) {
		t.Errorf("%d units of a capacity of 3 admitted a token: the store rounds up, and this test no longer shows the case", units/3)
	}
}

// TestQuantumFollowsCapacity: a rule's capacity changes live from a
// larger one (beyond whole tokens, 10 and 4 tokens) to a burst of 2 over
// three regions that all want more than the limit, with and without
// floors. The regions' ledgers and the registry get the new Quantum
// (SetQuantum, as the agent does when the rule changes), and within
// capacityHealBound every key is at the whole-token targets of the new
// capacity, those of ledgers started with it. Without floors that is two
// whole tokens: every region's store enforces 0, 1 or 2 tokens' worth,
// and together two (sum of floor(2u/Units) = 2: the whole limit
// admitted). With floors (min_share 0.1) one region at least holds a
// whole token. (With floors the whole-token rounding,
// allocation.WholeTokensHeld, may leave the pool's remainder, less than
// a token, to a region without one: ledgers started with the Quantum of
// the burst of 2 do it too, in 6 of seeds 1 to 12 of this setup, e.g.
// 457,143/500,000/42,857 with floors of 42,857/14,286/42,857.) Before
// SetQuantum, the Quantum of the capacity a ledger started
// with stayed: from 4 tokens the regions kept whole tokens of 250,000
// units (1/2, 1/4, 1/4 of the limit: two regions below one token of the
// new burst, admitting nothing). Invariant 1 is checked at every step
// (sim.check).
func TestQuantumFollowsCapacity(t *testing.T) {
	const capacityHealBound = 5 * time.Second // as TestTwoRegionPartitionSmallLimit's: measured, not proven, for whole tokens
	units := DefaultConfig().Units
	to := QuantumOf(units, 2)
	var worst time.Duration
	for _, from := range []int64{0, QuantumOf(units, 10), QuantumOf(units, 4)} {
		for _, minShare := range []float64{0, 0.1} {
			for seed := int64(1); seed <= 4; seed++ {
				name := fmt.Sprintf("from quantum %d, min_share %v, seed %d", from, minShare, seed)
				s := newSim(t, seed, simOpts{regions: 3, keys: 2, restart: 100 * time.Millisecond,
					config: func(c *Config) {
						c.MinShare, c.Quantum = minShare, from
						c.DemandTokens = DefaultConfig().DemandTokens
					}})
				s.heal()
				level := []float64{2, 2, 2} // even: the static split (EvenBand)
				if seed%2 == 0 {
					level = []float64{3, 2, 1.5}
				}
				spread(s, level)
				s.run(int64(5 * time.Second))
				untilConverged(t, s, 15*time.Second)

				s.cfg.Quantum = to // the harness's convergence check, and any restart, with the new capacity
				s.reg.SetQuantum(to)
				for _, r := range s.regions {
					if r.led == nil {
						continue
					}
					if err := r.led.SetQuantum(to); err != nil {
						t.Fatal(err)
					}
				}
				took := untilConverged(t, s, 15*time.Second)
				worst = max(worst, took)
				if took > capacityHealBound {
					t.Errorf("%s: at the targets of burst 2 %v after the change, bound %v", name, took, capacityHealBound)
				}
				for _, k := range s.keys {
					var tokens int64
					var held []int64
					holder := false
					for _, r := range s.regions {
						u := s.enforced(r, k.name)
						held = append(held, u)
						tokens += u * 2 / units
						holder = holder || u >= to
						if minShare == 0 && u%to != 0 {
							t.Errorf("%s: %s enforces %d units on %s, a fraction of a token (%d)", name, r.name, u, k.name, to)
						}
					}
					if minShare == 0 && tokens != 2 || !holder {
						t.Errorf("%s: the stores enforce %v units on %s: %d whole tokens of 2", name, held, k.name, tokens)
					}
				}
				if s.violation != "" {
					t.Fatalf("%s: %s", name, s.violation)
				}
			}
		}
	}
	t.Logf("worst %v from the change of capacity to the whole-token targets (bound %v)", worst, capacityHealBound)
}
