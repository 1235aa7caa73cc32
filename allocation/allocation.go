package allocation

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
)

// Region is one region's input.
type Region struct {
	// Weight is the region's relative weight (> 0); spare capacity is handed
	// out in proportion to it. Weights are taken relative to the largest
	// valid one; see MinWeightRatio for invalid and tiny weights.
	Weight float64
	// Floor is the region's floor (min_share x its static share), owned and
	// never moved (>= 0). NaN, Inf and negative floors count as 0.
	Floor float64
	// Demand is the estimated demand rate in tokens/s (>= 0). NaN, Inf and
	// negative demands count as 0: a broken estimator must not grab the pool.
	Demand float64
}

// MinWeightRatio is the smallest weight a region can have relative to the
// largest valid weight. A valid weight (finite and > 0) below
// MinWeightRatio times the largest valid weight is raised to it, and an
// invalid weight (NaN, <= 0, +Inf) is set to it: such a region still gets
// its want when capacity is plentiful, and almost nothing of the spare or of
// a contested pool. If no weight is valid, all regions weigh the same.
const MinWeightRatio = 1e-9

// Want returns the demand that r's floor does not already cover,
// max(0, Demand-Floor), with invalid Demand and Floor counted as 0.
func (r Region) Want() float64 {
	return max(0, nonNegative(r.Demand)-nonNegative(r.Floor))
}

// Func computes each region's dynamic target: how much of pool each region
// should own on top of its floor. The result has len(regions) entries, each
// >= 0, summing to pool within 1e-9*pool. A Func must not modify regions.
type Func func(pool float64, regions []Region) []float64

// Strategy names accepted by ByName.
const (
	NameMaxMinFair   = "max_min_fair"
	NameProportional = "proportional"
	NameStatic       = "static"
)

// ErrUnknownStrategy is returned (wrapped) by ByName for an unknown name.
var ErrUnknownStrategy = errors.New("allocation: unknown strategy")

// ByName returns the strategy called name: NameMaxMinFair (also ""),
// NameProportional or NameStatic. Any other name yields an error wrapping
// ErrUnknownStrategy.
func ByName(name string) (Func, error) {
	switch name {
	case "", NameMaxMinFair:
		return MaxMinFair, nil
	case NameProportional:
		return Proportional, nil
	case NameStatic:
		return Static, nil
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownStrategy, name)
}

// Targets returns floor + f's dynamic share for each region: the share each
// region should enforce. Invalid floors count as 0, as in Region.
func Targets(f Func, pool float64, regions []Region) []float64 {
	shares := f(pool, regions)
	out := make([]float64, len(regions))
	for i, r := range regions {
		var s float64
		if i < len(shares) {
			s = nonNegative(shares[i])
		}
		out[i] = nonNegative(r.Floor) + s
	}
	return out
}

// Static splits pool by weight and ignores demand:
// share[i] = pool * weight[i] / sum(weights).
func Static(pool float64, regions []Region) []float64 {
	out := make([]float64, len(regions))
	if !validPool(pool) || len(regions) == 0 {
		return out
	}
	w, sumW := weights(regions)
	for i := range out {
		out[i] = w[i] / sumW * pool
	}
	return absorb(out, pool)
}

// MaxMinFair is weighted max-min fair water-filling, the default strategy.
//
// If the wants fit in pool, every region gets its want and the spare
// (pool - sum of wants) is handed out by weight; with no wants at all that is
// the Static split. Otherwise a common water level L per unit of weight is
// raised until the pool is used up, and region i gets min(want[i], L*weight[i]):
// no region gets more than it wants while another with unmet want could take
// more, and the short regions all get the same share per unit of weight.
func MaxMinFair(pool float64, regions []Region) []float64 {
	n := len(regions)
	out := make([]float64, n)
	if !validPool(pool) || n == 0 {
		return out
	}
	// Scratch on the stack for up to smallN regions: the share ledger runs
	// this per key and tick.
	var wB, wantB [smallN]float64
	var orderB [smallN]int
	var suffixB [smallN + 1]float64
	w, want, order, suffixW := wB[:0], wantB[:0], orderB[:0], suffixB[:0]
	if n > smallN {
		w, want, order, suffixW = make([]float64, 0, n), make([]float64, 0, n), make([]int, 0, n), make([]float64, 0, n+1)
	}
	w, sumW := weightsInto(w, regions)
	// No region can use more than pool, so capping wants at pool changes
	// nothing and keeps every sum below n*pool.
	want = want[:n]
	var total float64
	for i, r := range regions {
		want[i] = min(r.Want(), pool)
		total += want[i]
	}
	if total <= pool {
		return absorb(spread(out, want, pool-total, w, sumW), pool)
	}

	// Water-filling: visit regions by want per unit of weight, ascending
	// (ties by index). While the region's want is below the level that the
	// remaining pool would give everyone left, grant it and raise the level;
	// the first region above the level caps all remaining regions at it.
	for i := range n {
		order = append(order, i)
	}
	slices.SortFunc(order, func(a, b int) int {
		if c := cmp.Compare(want[a]/w[a], want[b]/w[b]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	suffixW = suffixW[:n+1] // suffixW[k] = weight of order[k:]
	suffixW[n] = 0
	for k := n - 1; k >= 0; k-- {
		suffixW[k] = w[order[k]] + suffixW[k+1]
	}
	rem := pool
	for k, i := range order {
		level := rem / suffixW[k]
		if want[i] <= level*w[i] {
			out[i] = want[i]
			rem = max(0, rem-want[i])
			continue
		}
		for _, j := range order[k:] {
			out[j] = level * w[j]
		}
		rem = 0
		break
	}
	if rem > 0 {
		// Only reachable through rounding: everyone is satisfied.
		for i := range out {
			out[i] += rem * w[i] / sumW
		}
	}
	return absorb(out, pool)
}

// Proportional is Doorman-style proportional share: if the wants fit in pool,
// every region gets its want and the spare is handed out by weight (as in
// MaxMinFair); otherwise region i gets pool * want[i] / sum(wants).
//
// Unlike MaxMinFair, a region may get less than its want while another gets
// more than a fair level. (Doorman's own ProportionalShare first guarantees
// each client an equal share; this is the plain proportional rule.)
func Proportional(pool float64, regions []Region) []float64 {
	n := len(regions)
	out := make([]float64, n)
	if !validPool(pool) || n == 0 {
		return out
	}
	w, sumW := weights(regions)
	want := make([]float64, n)
	var total, maxWant float64
	for i, r := range regions {
		want[i] = r.Want()
		total += want[i]
		maxWant = max(maxWant, want[i])
	}
	if total <= pool {
		return absorb(spread(out, want, pool-total, w, sumW), pool)
	}
	if math.IsInf(total, 1) {
		// Huge finite wants: only their ratios matter, so rescale.
		total = 0
		for i := range want {
			want[i] /= maxWant
			total += want[i]
		}
	}
	for i := range out {
		out[i] = want[i] / total * pool
	}
	return absorb(out, pool)
}

// spread sets out[i] = want[i] + spare*w[i]/sumW and returns out.
func spread(out, want []float64, spare float64, w []float64, sumW float64) []float64 {
	for i := range out {
		// The explicit conversion forbids fusing into an FMA.
		out[i] = want[i] + float64(spare*w[i])/sumW
	}
	return out
}

// absorb makes out sum to pool (up to the rounding of the final sum) by
// adding the residue to the largest entry (ties by lowest index). The largest
// entry is at least pool/len(out), far above any rounding residue, so it stays
// >= 0; the last entry might be 0 and could not absorb a negative residue.
func absorb(out []float64, pool float64) []float64 {
	var sum float64
	largest := 0
	for i, v := range out {
		sum += v
		if v > out[largest] {
			largest = i
		}
	}
	if r := pool - sum; r != 0 && !math.IsInf(r, 0) && !math.IsNaN(r) {
		out[largest] = max(0, out[largest]+r)
	}
	return out
}

// weights returns the normalized weights of regions (see MinWeightRatio), in
// (0, 1] with the largest equal to 1, and their sum.
func weights(regions []Region) ([]float64, float64) {
	return weightsInto(make([]float64, 0, len(regions)), regions)
}

// weightsInto is weights into w (cap(w) >= len(regions)).
func weightsInto(w []float64, regions []Region) ([]float64, float64) {
	var maxW float64
	for _, r := range regions {
		if validWeight(r.Weight) {
			maxW = max(maxW, r.Weight)
		}
	}
	w = w[:len(regions)]
	var sum float64
	for i, r := range regions {
		switch {
		case maxW == 0:
			w[i] = 1
		case validWeight(r.Weight):
			w[i] = max(r.Weight/maxW, MinWeightRatio)
		default:
			w[i] = MinWeightRatio
		}
		sum += w[i]
	}
	return w, sum
}

func validWeight(x float64) bool { return x > 0 && !math.IsInf(x, 1) }

func validPool(x float64) bool { return x > 0 && !math.IsInf(x, 1) }

// nonNegative returns x if it is finite and >= 0, else 0.
func nonNegative(x float64) float64 {
	if x >= 0 && !math.IsInf(x, 1) {
		return x
	}
	return 0
}
