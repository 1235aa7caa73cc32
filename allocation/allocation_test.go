package allocation

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

var (
	nan  = math.NaN()
	inf  = math.Inf(1)
	ninf = math.Inf(-1)
)

// demands builds equal-weight regions with no floor and the given demands.
func demands(d ...float64) []Region {
	rs := make([]Region, len(d))
	for i, x := range d {
		rs[i] = Region{Weight: 1, Demand: x}
	}
	return rs
}

type allocCase struct {
	name    string
	pool    float64
	regions []Region
	want    []float64
}

func runCases(t *testing.T, f Func, cases []allocCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := f(c.pool, c.regions)
			if !approxEqual(got, c.want, 1e-9) {
				t.Errorf("got %v, want %v", got, c.want)
			}
		})
	}
}

// approxEqual reports whether got and want have the same length and agree
// within rel relative to the larger of 1 and |want[i]|.
func approxEqual(got, want []float64, rel float64) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > rel*max(1, math.Abs(want[i])) {
			return false
		}
	}
	return true
}

// commonCases hold for every strategy.
var commonCases = []allocCase{
	{"no regions", 100, nil, []float64{}},
	{"zero pool", 0, demands(10, 20), []float64{0, 0}},
	{"negative pool", -5, demands(10, 20), []float64{0, 0}},
	{"NaN pool", nan, demands(10, 20), []float64{0, 0}},
	{"infinite pool", inf, demands(10, 20), []float64{0, 0}},
	{"one region gets the pool", 100, demands(1000), []float64{100}},
	{"no demand is the static split", 100, []Region{{Weight: 2}, {Weight: 1}, {Weight: 1}}, []float64{50, 25, 25}},
	{"bad weights are tiny", 100, []Region{{Weight: nan}, {Weight: 1}, {Weight: -3}, {Weight: 0}, {Weight: inf}},
		[]float64{1e-7, 100 - 4e-7, 1e-7, 1e-7, 1e-7}},
	{"all weights bad weigh the same", 90, []Region{{Weight: nan}, {Weight: 0}, {Weight: -1}}, []float64{30, 30, 30}},
}

// fitCases: the wants fit in the pool, so every demand-aware strategy gives
// each region its want plus the spare by weight.
var fitCases = []allocCase{
	{"wants fit, spare by weight", 100, demands(10, 30), []float64{40, 60}},
	{"wants exactly fill the pool", 100, demands(25, 75), []float64{25, 75}},
	{"spare by unequal weight", 100, []Region{{Weight: 3, Demand: 10}, {Weight: 1, Demand: 10}}, []float64{70, 30}},
	{"floor covers demand", 100, []Region{{Weight: 1, Floor: 50, Demand: 40}, {Weight: 1, Floor: 10, Demand: 30}}, []float64{40, 60}},
	{"bad demand counts as 0", 100, demands(nan, inf, -7, ninf), []float64{25, 25, 25, 25}},
	{"bad floor counts as 0", 100, []Region{{Weight: 1, Floor: nan, Demand: 20}, {Weight: 1, Floor: -5, Demand: 0}}, []float64{60, 40}},
}

func TestMaxMinFair(t *testing.T) {
	runCases(t, MaxMinFair, commonCases)
	runCases(t, MaxMinFair, fitCases)
	runCases(t, MaxMinFair, []allocCase{
		// Doorman's TestFairShare and TestFairShareLowerExtra.
		{"contested, equal weights", 120, demands(1000, 60, 10), []float64{55, 55, 10}},
		{"contested, one short", 120, demands(1000, 50, 10), []float64{60, 50, 10}},
		{"contested, all short", 90, demands(1000, 500, 200), []float64{30, 30, 30}},
		// Doorman's TestFairShareWithMultipleSubclients, subclients as weights.
		{"contested, weights 6:4:2", 120, []Region{{Weight: 6, Demand: 1000}, {Weight: 4, Demand: 500}, {Weight: 2, Demand: 200}}, []float64{60, 40, 20}},
		{"contested, weights 10:10:30", 1000, []Region{{Weight: 10, Demand: 2000}, {Weight: 10, Demand: 500}, {Weight: 30, Demand: 700}}, []float64{200, 200, 600}},
		{"contested, small heavy region satisfied", 100, []Region{{Weight: 10, Demand: 5}, {Weight: 1, Demand: 100}, {Weight: 1, Demand: 100}}, []float64{5, 47.5, 47.5}},
		{"contested after floors", 100, []Region{{Weight: 1, Floor: 10, Demand: 210}, {Weight: 1, Floor: 10, Demand: 30}}, []float64{80, 20}},
		{"huge finite demands", 100, demands(math.MaxFloat64, math.MaxFloat64), []float64{50, 50}},
		{"huge pool", math.MaxFloat64, demands(math.MaxFloat64, 0), []float64{math.MaxFloat64, 0}},
	})
}

func TestProportional(t *testing.T) {
	runCases(t, Proportional, commonCases)
	runCases(t, Proportional, fitCases)
	runCases(t, Proportional, []allocCase{
		{"contested, in proportion to wants", 120, demands(60, 60, 10), []float64{120 * 60.0 / 130, 120 * 60.0 / 130, 120 * 10.0 / 130}},
		{"contested, big want dominates", 120, demands(1000, 60, 10), []float64{120 * 1000.0 / 1070, 120 * 60.0 / 1070, 120 * 10.0 / 1070}},
		{"contested, weights ignored", 100, []Region{{Weight: 9, Demand: 100}, {Weight: 1, Demand: 300}}, []float64{25, 75}},
		{"contested after floors", 100, []Region{{Weight: 1, Floor: 50, Demand: 200}, {Weight: 1, Demand: 50}}, []float64{75, 25}},
		{"huge finite demands", 100, demands(math.MaxFloat64, math.MaxFloat64/3), []float64{75, 25}},
	})
}

func TestStatic(t *testing.T) {
	runCases(t, Static, commonCases)
	runCases(t, Static, []allocCase{
		{"demand ignored", 100, []Region{{Weight: 2, Demand: 0}, {Weight: 1, Demand: 1e9}, {Weight: 1, Demand: nan}}, []float64{50, 25, 25}},
		{"floor ignored", 60, []Region{{Weight: 1, Floor: 100}, {Weight: 2}}, []float64{20, 40}},
		{"huge weights", 100, []Region{{Weight: math.MaxFloat64}, {Weight: math.MaxFloat64}}, []float64{50, 50}},
		{"tiny weights", 100, []Region{{Weight: 1e-300}, {Weight: 3e-300}}, []float64{25, 75}},
	})
}

func TestTargets(t *testing.T) {
	for _, c := range []struct {
		name    string
		f       Func
		pool    float64
		regions []Region
		want    []float64
	}{
		{"floor plus share", MaxMinFair, 100, []Region{{Weight: 1, Floor: 10, Demand: 40}, {Weight: 1, Floor: 20, Demand: 20}}, []float64{10 + 30 + 35, 20 + 0 + 35}},
		{"zero pool leaves floors", MaxMinFair, 0, []Region{{Weight: 1, Floor: 10, Demand: 40}, {Weight: 1, Floor: 20}}, []float64{10, 20}},
		{"bad floor counts as 0", Static, 10, []Region{{Weight: 1, Floor: nan}, {Weight: 1, Floor: inf}}, []float64{5, 5}},
		{"short Func result", func(float64, []Region) []float64 { return []float64{7} }, 10, []Region{{Floor: 1}, {Floor: 2}}, []float64{8, 2}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := Targets(c.f, c.pool, c.regions); !approxEqual(got, c.want, 1e-9) {
				t.Errorf("Targets = %v, want %v", got, c.want)
			}
		})
	}
}

func TestByName(t *testing.T) {
	regions := []Region{{Weight: 1, Demand: 100}, {Weight: 3, Demand: 10}}
	for _, c := range []struct {
		name string
		want Func
	}{
		{"", MaxMinFair},
		{"max_min_fair", MaxMinFair},
		{"proportional", Proportional},
		{"static", Static},
	} {
		t.Run(fmt.Sprintf("%q", c.name), func(t *testing.T) {
			f, err := ByName(c.name)
			if err != nil {
				t.Fatalf("ByName: %v", err)
			}
			if got, want := f(50, regions), c.want(50, regions); !slices.Equal(got, want) {
				t.Errorf("ByName(%q) computes %v, want %v", c.name, got, want)
			}
		})
	}
	for _, name := range []string{"x", "MaxMinFair", "max-min-fair", " static"} {
		t.Run(fmt.Sprintf("unknown %q", name), func(t *testing.T) {
			f, err := ByName(name)
			if f != nil || !errors.Is(err, ErrUnknownStrategy) {
				t.Fatalf("ByName(%q) = %v, %v; want nil, ErrUnknownStrategy", name, f != nil, err)
			}
			if want := fmt.Sprintf("allocation: unknown strategy %q", name); err.Error() != want {
				t.Errorf("error = %q, want %q", err, want)
			}
		})
	}
}

func TestSplitUnits(t *testing.T) {
	garbage := func(out ...float64) Func {
		return func(float64, []Region) []float64 { return out }
	}
	for _, c := range []struct {
		name    string
		f       Func
		pool    int64
		regions []Region
		want    []int64
	}{
		{"no regions", MaxMinFair, 10, nil, []int64{}},
		{"zero pool", MaxMinFair, 0, demands(1, 2), []int64{0, 0}},
		{"negative pool", MaxMinFair, -10, demands(1, 2), []int64{0, 0}},
		{"exact", Static, 100, []Region{{Weight: 2}, {Weight: 1}, {Weight: 1}}, []int64{50, 25, 25}},
		{"ties go to the lower index", Static, 10, demands(0, 0, 0), []int64{4, 3, 3}},
		{"two left over, ties by index", Static, 11, demands(0, 0, 0), []int64{4, 4, 3}},
		{"largest remainder wins", MaxMinFair, 10, demands(1.2, 3.7, 5.1), []int64{1, 4, 5}},
		{"largest remainder beats index", MaxMinFair, 10, demands(3.2, 3.3, 3.5), []int64{3, 3, 4}},
		{"one region", MaxMinFair, 7, demands(100), []int64{7}},
		{"huge pool", Static, math.MaxInt64, demands(0, 0), []int64{math.MaxInt64/2 + 1, math.MaxInt64 / 2}},
		{"huge pool, one region", MaxMinFair, math.MaxInt64, demands(1), []int64{math.MaxInt64}},
		{"garbage Func falls back to static", garbage(nan, -1), 9, []Region{{Weight: 2}, {Weight: 1}}, []int64{6, 3}},
		{"garbage entries count as 0", garbage(nan, 5, inf), 9, demands(0, 0, 0), []int64{0, 9, 0}},
		{"short Func result", garbage(1), 4, demands(0, 0), []int64{4, 0}},
		{"overflowing Func result", garbage(math.MaxFloat64, math.MaxFloat64), 4, demands(0, 0), []int64{2, 2}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := SplitUnits(c.f, c.pool, c.regions); !slices.Equal(got, c.want) {
				t.Errorf("SplitUnits = %v, want %v", got, c.want)
			}
		})
	}
}

func TestRegionWant(t *testing.T) {
	for _, c := range []struct {
		name string
		r    Region
		want float64
	}{
		{"demand above floor", Region{Floor: 10, Demand: 25}, 15},
		{"demand below floor", Region{Floor: 10, Demand: 5}, 0},
		{"NaN demand", Region{Demand: nan}, 0},
		{"infinite demand", Region{Demand: inf}, 0},
		{"negative demand", Region{Demand: -1}, 0},
		{"NaN floor", Region{Floor: nan, Demand: 3}, 3},
		{"infinite floor", Region{Floor: inf, Demand: 3}, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := c.r.Want(); got != c.want {
				t.Errorf("Want() = %v, want %v", got, c.want)
			}
		})
	}
}

func TestInputsNotModified(t *testing.T) {
	regions := []Region{{Weight: nan, Floor: -1, Demand: inf}, {Weight: 2, Floor: 3, Demand: 40}}
	orig := slices.Clone(regions)
	for _, f := range []Func{MaxMinFair, Proportional, Static} {
		f(10, regions)
		SplitUnits(f, 10, regions)
		Targets(f, 10, regions)
	}
	for i := range regions {
		if math.Float64bits(regions[i].Weight) != math.Float64bits(orig[i].Weight) ||
			regions[i].Floor != orig[i].Floor || regions[i].Demand != orig[i].Demand {
			t.Fatalf("regions modified: %v, was %v", regions, orig)
		}
	}
}

func ExampleMaxMinFair() {
	regions := []Region{
		{Weight: 2, Floor: 10, Demand: 500}, // us-east: busy
		{Weight: 1, Floor: 5, Demand: 25},   // eu-west: wants 20 beyond its floor
		{Weight: 1, Floor: 5, Demand: 300},  // ap-south: busy
	}
	fmt.Println(MaxMinFair(80, regions))
	fmt.Println(Targets(MaxMinFair, 80, regions))
	fmt.Println(SplitUnits(MaxMinFair, 80, regions))
	// Output:
	// [40 20 20]
	// [50 25 25]
	// [40 20 20]
}

func TestWholeTokens(t *testing.T) {
	const U = 1_000_000
	for _, tc := range []struct {
		name            string
		targets, floors []int64
		quantum         int64
		want, out       []int64
	}{
		{"burst 4, even demand with noise: one token each",
			[]int64{235000, 225000, 225000, 215000}, []int64{25000, 25000, 25000, 25000}, U / 4,
			[]int64{1, 1, 1, 1}, []int64{225000, 225000, 225000, 225000}},
		{"burst 1, no floors: the region with the largest want gets the token",
			[]int64{400000, 350000, 250000}, []int64{0, 0, 0}, U,
			[]int64{2, 3, 2}, []int64{0, 1000000, 0}},
		{"burst 1 with floors: no region can be whole, the rest stays with the top",
			[]int64{300000, 300000, 300000}, []int64{33334, 33333, 33333}, U,
			[]int64{1, 1, 1}, []int64{900000, 0, 0}},
		{"no token for a region that wants none",
			[]int64{700000, 100000, 200000}, []int64{0, 0, 0}, U / 2,
			[]int64{7, 0, 2}, []int64{500000, 0, 500000}},
		{"quantum 1: unchanged",
			[]int64{600, 300, 100}, []int64{0, 0, 0}, 1,
			[]int64{1, 1, 1}, []int64{600, 300, 100}},
		{"burst 10: every region above a token, unchanged",
			[]int64{260000, 250000, 250000, 240000}, []int64{0, 0, 0, 0}, U / 10,
			[]int64{1, 1, 1, 1}, []int64{260000, 250000, 250000, 240000}},
		{"burst 10: a region below a token borrows from the largest",
			[]int64{850000, 80000, 70000}, []int64{0, 0, 0}, U / 10,
			[]int64{9, 1, 1}, []int64{800000, 100000, 100000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := WholeTokens(tc.targets, tc.floors, tc.quantum, tc.want)
			if !slices.Equal(got, tc.out) {
				t.Fatalf("got %v, want %v", got, tc.out)
			}
		})
	}
}

func TestWholeTokensHeld(t *testing.T) {
	const U = 1_000_000
	zero := []int64{0, 0, 0}
	for _, tc := range []struct {
		name            string
		targets, floors []int64
		want, held, out []int64
		plain           []int64 // WholeTokens without held, where it differs
	}{
		{"the holder keeps its token against up to keep times its demand",
			[]int64{300000, 350000, 350000}, zero,
			[]int64{300000, 350000, 350000}, []int64{U, 0, 0}, []int64{U, 0, 0}, []int64{0, U, 0}},
		{"a region that wants more than keep times the holder's demand gets it",
			[]int64{100000, 450000, 450000}, zero,
			[]int64{100000, 450000, 400000}, []int64{U, 0, 0}, []int64{0, U, 0}, nil},
		{"a holder that wants nothing gives it to a region that wants one",
			[]int64{300000, 700000, 0}, zero,
			[]int64{0, 50000, 0}, []int64{U, 0, 0}, []int64{0, U, 0}, nil},
		// Seen in TestRandomized: the holder's view of the pool is short
		// (a gift between two others in flight), its continuous target falls
		// below a token; without held it gave its token to a region that
		// already held three.
		{"a holder with no demand keeps its token rather than feed one that holds several",
			[]int64{200000, 200000, 500000}, []int64{33333, 33333, 33334},
			[]int64{0, 0, 196175}, []int64{267943, 33333, 698724}, []int64{216667, 0, 683333}, []int64{0, 0, 900000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := int64(U)
			if tc.floors[0] > 0 {
				q = U / 4
			}
			got := WholeTokensHeld(tc.targets, tc.floors, q, tc.want, tc.held, 3)
			if !slices.Equal(got, tc.out) {
				t.Fatalf("got %v, want %v", got, tc.out)
			}
			if tc.plain != nil {
				if plain := WholeTokens(tc.targets, tc.floors, q, tc.want); !slices.Equal(plain, tc.plain) {
					t.Fatalf("WholeTokens: got %v, want %v", plain, tc.plain)
				}
			}
		})
	}
}

func TestWholeTokensProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for it := 0; it < 5000; it++ {
		n := 1 + rng.IntN(8)
		U := int64(1 + rng.IntN(2_000_000))
		q := int64(1 + rng.IntN(int(U)))
		tg, fl, w := make([]int64, n), make([]int64, n), make([]int64, n)
		var sum int64
		for i := range tg {
			tg[i] = rng.Int64N(U/int64(n) + 1)
			fl[i] = rng.Int64N(U/int64(n)/10 + 1)
			w[i] = rng.Int64N(3)
			sum += tg[i]
		}
		got := WholeTokens(tg, fl, q, w)
		if it%2 == 1 { // the hysteresis keeps the same properties
			held := make([]int64, n)
			for i := range held {
				held[i] = fl[i] + rng.Int64N(2*q+1)
			}
			got = WholeTokensHeld(tg, fl, q, w, held, 1+3*rng.Float64())
		}
		var s int64
		whole := 0
		for i, x := range got {
			if x < 0 {
				t.Fatalf("negative target %v from %v", got, tg)
			}
			s += x
			if (fl[i]+x)%q == 0 && fl[i]+x > 0 {
				whole++
			}
		}
		if s != sum {
			t.Fatalf("sum %d, want %d: %v from %v", s, sum, got, tg)
		}
		// Never fewer regions holding at least one whole token than before,
		// and no region left between its floor and one token.
		before, after := 0, 0
		for i := range tg {
			if fl[i]+tg[i] >= q {
				before++
			}
			if fl[i]+got[i] >= q {
				after++
			} else if got[i] > 0 && q > 1 && s == sum && fl[i]+tg[i] >= q {
				t.Fatalf("region %d dropped below a token: %v -> %v (q %d floors %v)", i, tg, got, q, fl)
			}
		}
		if after < before && q > 1 {
			t.Fatalf("regions with a whole token: %d before, %d after: %v -> %v (q %d floors %v)", before, after, tg, got, q, fl)
		}
	}
}

func TestFloorsSplitByName(t *testing.T) {
	names, floor, initial := Floors(1000, 0.1, map[string]float64{"us-east": 2, "eu-west": 1, "ap-south": 1})
	if want := []string{"ap-south", "eu-west", "us-east"}; !slices.Equal(names, want) {
		t.Fatalf("names %v, want %v", names, want)
	}
	if want := []int64{25, 25, 50}; !slices.Equal(floor, want) {
		t.Fatalf("floors %v, want %v", floor, want)
	}
	if want := []int64{225, 225, 450}; !slices.Equal(initial, want) {
		t.Fatalf("initial parts %v, want %v", initial, want)
	}
	var sum int64
	for _, p := range SplitByWeight(7, []float64{1, 1, 1}) {
		sum += p
	}
	if sum != 7 {
		t.Fatalf("SplitByWeight(7) sums to %d", sum)
	}
	if got := SplitByWeight(5, []float64{math.MaxFloat64, math.MaxFloat64}); got[0] != 5 {
		t.Fatalf("an infinite weight sum: %v, want all to the first part", got)
	}
}

func TestWaterFillUnits(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pool   int64
		w      []float64
		demand []int64
		want   []int64
	}{
		{"no demand: static split", 100, []float64{1, 3}, []int64{0, 0}, []int64{25, 75}},
		{"one capped, the rest to the other", 100, []float64{1, 1}, []int64{10, 500}, []int64{10, 90}},
		{"all met, spare by weight", 100, []float64{1, 1}, []int64{10, 20}, []int64{45, 55}},
		{"demand above pool: by weight", 90, []float64{1, 2}, []int64{500, 500}, []int64{30, 60}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := WaterFillUnits(tc.pool, tc.w, tc.demand)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("WaterFillUnits(%d, %v, %v) = %v, want %v", tc.pool, tc.w, tc.demand, got, tc.want)
			}
		})
	}
}

func TestThousandths(t *testing.T) {
	for _, tc := range []struct {
		in   float64
		want int64
	}{{0.57, 570}, {0.001, 1}, {0.0004, 1}, {12.5, 12500}, {100, 100000}, {1.0005, 1001}} {
		if got := Thousandths(tc.in); got != tc.want {
			t.Errorf("Thousandths(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
}
