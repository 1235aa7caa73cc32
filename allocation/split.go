package allocation

import (
	"math"
	"sort"
)

// DefaultUnits is the number of integer units a global limit is divided
// into for ownership (the share ledger's unit): a region holding u units
// enforces floor(limit x u / DefaultUnits). The enforcer and the sync agent
// must agree on it.
const DefaultUnits int64 = 1_000_000

// SplitByWeight splits total (>= 0) into integer parts proportional to w by
// the largest-remainder method: each part gets the integer part of its
// quota, the units left over go one each to the largest fractional parts
// (ties to the lower index). The parts sum to exactly total. With no
// positive weight everything goes to the first part.
func SplitByWeight(total int64, w []float64) []int64 {
	out := make([]int64, len(w))
	if len(w) == 0 || total <= 0 {
		return out
	}
	var sum float64
	for _, x := range w {
		sum += x
	}
	if !(sum > 0) || math.IsInf(sum, 1) {
		out[0] = total
		return out
	}
	type rem struct {
		i int
		r float64
	}
	rems := make([]rem, len(w))
	var given int64
	for i, x := range w {
		exact := float64(total) * x / sum
		out[i] = int64(math.Floor(exact))
		given += out[i]
		rems[i] = rem{i, exact - float64(out[i])}
	}
	sort.SliceStable(rems, func(a, b int) bool { return rems[a].r > rems[b].r })
	for k := 0; given < total; k = (k + 1) % len(w) {
		out[rems[k].i]++
		given++
	}
	for given > total { // float error: take back from the largest
		j := 0
		for i := range out {
			if out[i] > out[j] {
				j = i
			}
		}
		out[j]--
		given--
	}
	return out
}

// Floors is the static split of a global limit over its regions, in units:
// the floors (minShare x units, never moved, split by weight) and the
// initial parts (the rest, split by weight), both in the order of names,
// which are the regions sorted by name. This is the one rule -> units
// conversion: the sync agent's ledger starts from it and the enforcer falls
// back to a region's floor while no agent lease is valid.
func Floors(units int64, minShare float64, weights map[string]float64) (names []string, floor, initial []int64) {
	names = make([]string, 0, len(weights))
	for n := range weights {
		names = append(names, n)
	}
	sort.Strings(names)
	w := make([]float64, len(names))
	for i, n := range names {
		w[i] = weights[n]
	}
	f := int64(math.Floor(minShare * float64(units)))
	return names, SplitByWeight(f, w), SplitByWeight(units-f, w)
}
