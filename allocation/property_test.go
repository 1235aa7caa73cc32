package allocation

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

const propertyRuns = 5000

var strategies = []struct {
	name string
	f    Func
}{
	{"max_min_fair", MaxMinFair},
	{"proportional", Proportional},
	{"static", Static},
}

// randomPool returns a pool spanning many magnitudes.
func randomPool(rng *rand.Rand) float64 {
	return math.Pow(10, rng.Float64()*12-3) // 1e-3 .. 1e9
}

// randomRegions returns 1..16 regions whose demands are around pool, so that
// both the fitting and the contested regimes are common. If bad, some inputs
// are NaN, Inf or negative.
func randomRegions(rng *rand.Rand, pool float64, bad bool) []Region {
	n := 1 + rng.IntN(16)
	rs := make([]Region, n)
	for i := range rs {
		rs[i] = Region{
			Weight: 0.1 + rng.Float64()*10,
			Floor:  rng.Float64() * pool / float64(n),
			Demand: rng.Float64() * 2 * pool / float64(n),
		}
		if rng.IntN(4) == 0 {
			rs[i].Demand = 0
		}
		if rng.IntN(8) == 0 {
			rs[i].Demand *= 100
		}
		if bad && rng.IntN(3) == 0 {
			specials := []float64{math.NaN(), math.Inf(1), math.Inf(-1), -1, 0, math.MaxFloat64, math.SmallestNonzeroFloat64}
			x := specials[rng.IntN(len(specials))]
			switch rng.IntN(3) {
			case 0:
				rs[i].Weight = x
			case 1:
				rs[i].Floor = x
			default:
				rs[i].Demand = x
			}
		}
	}
	return rs
}

// checkShares verifies the invariants every Func promises.
func checkShares(tb testing.TB, pool float64, regions []Region, got []float64) {
	tb.Helper()
	if len(got) != len(regions) {
		tb.Fatalf("len = %d, want %d (pool %v, regions %v)", len(got), len(regions), pool, regions)
	}
	var sum float64
	for i, s := range got {
		if !(s >= 0) || math.IsInf(s, 0) {
			tb.Fatalf("share[%d] = %v, want finite >= 0 (pool %v, regions %v)", i, s, pool, regions)
		}
		sum += s
	}
	wantSum := pool
	if !validPool(pool) || len(regions) == 0 {
		wantSum = 0
	}
	if math.Abs(sum-wantSum) > 1e-9*wantSum {
		tb.Fatalf("sum = %v, want %v (off by %g; pool %v, regions %v)", sum, wantSum, sum-wantSum, pool, regions)
	}
}

func TestPropertyInvariants(t *testing.T) {
	for _, s := range strategies {
		t.Run(s.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			for range propertyRuns {
				pool := randomPool(rng)
				regions := randomRegions(rng, pool, rng.IntN(2) == 0)
				got := s.f(pool, regions)
				checkShares(t, pool, regions, got)
				// Deterministic: the same input gives bit-identical output.
				again := s.f(pool, slices.Clone(regions))
				for i := range got {
					if math.Float64bits(got[i]) != math.Float64bits(again[i]) {
						t.Fatalf("not deterministic: %v then %v", got, again)
					}
				}
				// A target is never below its floor.
				for i, tg := range Targets(s.f, pool, regions) {
					if fl := nonNegative(regions[i].Floor); tg < fl {
						t.Fatalf("target[%d] = %v below floor %v", i, tg, fl)
					}
				}
			}
		})
	}
}

func TestPropertyMonotoneInDemand(t *testing.T) {
	for _, s := range strategies[:2] {
		t.Run(s.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(3, 4))
			for range propertyRuns {
				pool := randomPool(rng)
				regions := randomRegions(rng, pool, false)
				i := rng.IntN(len(regions))
				before := s.f(pool, regions)[i]
				raised := slices.Clone(regions)
				raised[i].Demand += rng.Float64() * pool * float64(1+rng.IntN(3))
				after := s.f(pool, raised)[i]
				if after < before-1e-9*pool {
					t.Fatalf("raising demand of region %d from %v to %v lowered its share from %v to %v (pool %v, regions %v)",
						i, regions[i].Demand, raised[i].Demand, before, after, pool, regions)
				}
			}
		})
	}
}

// TestPropertyMaxMinFair checks the max-min fair definition directly: if the
// wants fit, everyone gets at least its want; otherwise nobody gets more than
// it wants, and nobody gets more per unit of weight than a region left short.
func TestPropertyMaxMinFair(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	contested := 0
	for range propertyRuns {
		pool := randomPool(rng)
		regions := randomRegions(rng, pool, false)
		got := MaxMinFair(pool, regions)
		tol := 1e-9 * pool
		var total float64
		for _, r := range regions {
			total += r.Want()
		}
		if total <= pool {
			for i, r := range regions {
				if got[i] < r.Want()-tol {
					t.Fatalf("wants fit but region %d got %v < want %v", i, got[i], r.Want())
				}
			}
			continue
		}
		contested++
		level := math.Inf(1) // lowest share per weight among short regions
		for i, r := range regions {
			if got[i] > r.Want()+tol {
				t.Fatalf("contested pool but region %d got %v > want %v (regions %v)", i, got[i], r.Want(), regions)
			}
			if got[i] < r.Want()-tol {
				level = min(level, got[i]/r.Weight)
			}
		}
		if math.IsInf(level, 1) {
			t.Fatalf("contested pool but nobody is short: %v (pool %v, regions %v)", got, pool, regions)
		}
		for i, r := range regions {
			if got[i]/r.Weight > level+tol/r.Weight {
				t.Fatalf("region %d has %v per weight, above the short regions' %v (regions %v)", i, got[i]/r.Weight, level, regions)
			}
		}
	}
	if contested < propertyRuns/10 {
		t.Errorf("only %d of %d inputs were contested; the generator is too gentle", contested, propertyRuns)
	}
}

func TestPropertyProportional(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for range propertyRuns {
		pool := randomPool(rng)
		regions := randomRegions(rng, pool, false)
		got := Proportional(pool, regions)
		var total float64
		for _, r := range regions {
			total += r.Want()
		}
		if total <= pool {
			continue
		}
		for i, r := range regions {
			if want := pool * r.Want() / total; math.Abs(got[i]-want) > 1e-9*pool {
				t.Fatalf("region %d got %v, want %v", i, got[i], want)
			}
		}
	}
}

func TestPropertyStaticIgnoresDemand(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	for range propertyRuns {
		pool := randomPool(rng)
		regions := randomRegions(rng, pool, true)
		other := slices.Clone(regions)
		for i := range other {
			other[i].Demand, other[i].Floor = rng.Float64()*pool, rng.Float64()*pool
		}
		if a, b := Static(pool, regions), Static(pool, other); !slices.Equal(a, b) {
			t.Fatalf("Static depends on demand: %v vs %v", a, b)
		}
	}
}

func TestPropertySplitUnits(t *testing.T) {
	for _, s := range strategies {
		t.Run(s.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(11, 12))
			for range propertyRuns {
				var pool int64
				switch rng.IntN(4) {
				case 0:
					pool = rng.Int64N(100)
				case 1:
					pool = rng.Int64N(1 << 20)
				case 2:
					pool = rng.Int64N(1 << 53)
				default:
					pool = math.MaxInt64 - rng.Int64N(1<<20)
				}
				regions := randomRegions(rng, float64(pool), rng.IntN(2) == 0)
				got := SplitUnits(s.f, pool, regions)
				var sum int64
				for i, u := range got {
					if u < 0 {
						t.Fatalf("units[%d] = %d < 0", i, u)
					}
					sum += u
				}
				if sum != pool {
					t.Fatalf("units sum to %d, want %d (%v)", sum, pool, got)
				}
				if again := SplitUnits(s.f, pool, slices.Clone(regions)); !slices.Equal(got, again) {
					t.Fatalf("not deterministic: %v then %v", got, again)
				}
				// Largest remainder: each region is within one unit of its
				// quota (where float64 represents every unit).
				if pool < 1<<53 {
					for i, q := range s.f(float64(pool), regions) {
						if math.Abs(float64(got[i])-q) >= 1+1e-6 {
							t.Fatalf("units[%d] = %d, quota %v (pool %d)", i, got[i], q, pool)
						}
					}
				}
			}
		})
	}
}

func FuzzMaxMinFair(f *testing.F) {
	f.Add(120.0, 1000.0, 60.0, 10.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)
	f.Add(100.0, 5.0, 0.0, 0.0, 1.0, 2.0, 3.0, 10.0, 20.0, 30.0)
	f.Add(1e-300, 1e300, math.NaN(), -1.0, 0.0, math.Inf(1), 1e-300, math.NaN(), -5.0, 1e308)
	f.Fuzz(func(t *testing.T, pool, d0, d1, d2, w0, w1, w2, f0, f1, f2 float64) {
		regions := []Region{{w0, f0, d0}, {w1, f1, d1}, {w2, f2, d2}}
		for _, s := range strategies {
			got := s.f(pool, regions)
			checkShares(t, pool, regions, got)
		}
		if validPool(pool) && pool < 1<<62 {
			units := SplitUnits(MaxMinFair, int64(pool), regions)
			if sum := units[0] + units[1] + units[2]; sum != int64(pool) {
				t.Fatalf("SplitUnits sums to %d, want %d", sum, int64(pool))
			}
		}
	})
}

func BenchmarkStrategies(b *testing.B) {
	for _, n := range []int{3, 16} {
		rng := rand.New(rand.NewPCG(13, 14))
		regions := make([]Region, n)
		for i := range regions {
			// Wants total at least 1.5x the pool: the contested (costlier) case.
			regions[i] = Region{Weight: 1 + rng.Float64(), Floor: 1, Demand: (1.5 + rng.Float64()) * 1000 / float64(n)}
		}
		for _, s := range strategies {
			b.Run(fmt.Sprintf("%s/regions=%d", s.name, n), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					s.f(1000, regions)
				}
			})
		}
		b.Run(fmt.Sprintf("split_units/regions=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				SplitUnits(MaxMinFair, 1000000, regions)
			}
		})
	}
}
