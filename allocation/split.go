package allocation

import (
	"cmp"
	"math"
	"slices"
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
	splitInto(out, total, w)
	return out
}

// splitInto is SplitByWeight into out (len(out) == len(w), zeroed): the
// share ledger runs it per key and tick, so it allocates nothing for up to
// smallN weights.
func splitInto(out []int64, total int64, w []float64) {
	if len(w) == 0 || total <= 0 {
		return
	}
	var sum float64
	for _, x := range w {
		sum += x
	}
	if !(sum > 0) || math.IsInf(sum, 1) {
		out[0] = total
		return
	}
	var buf [smallN]rem
	rems := buf[:0]
	if len(w) > smallN {
		rems = make([]rem, 0, len(w))
	}
	var given int64
	for i, x := range w {
		exact := float64(total) * x / sum
		out[i] = int64(math.Floor(exact))
		given += out[i]
		rems = append(rems, rem{i, exact - float64(out[i])})
	}
	slices.SortStableFunc(rems, func(a, b rem) int { return cmp.Compare(b.r, a.r) })
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
}

// smallN is how many regions the allocation's integer splits handle
// without allocating scratch space.
const smallN = 16

// rem is a part's index and the fraction its integer part left out.
type rem struct {
	i int
	r float64
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

// WaterFillUnits is max-min fair water-filling in integer units: pool is
// split by weight w among the regions with demand, each capped at its
// demand, the cap's leftover split again among the rest, until no one is
// capped; what is left once every demand is met goes to all by weight. With
// no demand at all it returns the static split by weight. The result sums to
// exactly pool. It is the share ledger's default allocator, in units; the
// float strategies (MaxMinFair, Proportional, Static) reach it through
// SplitUnits.
func WaterFillUnits(pool int64, w []float64, demand []int64) []int64 {
	n := len(w)
	out := make([]int64, n)
	if n == 0 || pool <= 0 {
		return out
	}
	// Scratch on the stack for up to smallN regions: it runs per key and
	// tick in the share ledger.
	var openB [smallN]bool
	var wsB [smallN]float64
	var idxB [smallN]int
	var partsB [smallN]int64
	open, ws, idx, parts := openB[:0], wsB[:0], idxB[:0], partsB[:0]
	if n > smallN {
		open, ws, idx, parts = make([]bool, 0, n), make([]float64, 0, n), make([]int, 0, n), make([]int64, 0, n)
	}
	left := pool
	for i := range w {
		open = append(open, demand[i] > 0)
	}
	for {
		ws, idx = ws[:0], idx[:0]
		for i := range w {
			if open[i] {
				ws = append(ws, w[i])
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 || left == 0 {
			break
		}
		parts = zeroed(parts, len(idx))
		splitInto(parts, left, ws)
		capped := false
		for k, i := range idx {
			need := demand[i] - out[i]
			if parts[k] >= need {
				out[i] += need
				left -= need
				open[i] = false
				capped = true
			}
		}
		if !capped {
			for k, i := range idx {
				out[i] += parts[k]
				left -= parts[k]
			}
			break
		}
	}
	if left > 0 {
		parts = zeroed(parts, n)
		splitInto(parts, left, w)
		for i := range out {
			out[i] += parts[i]
		}
	}
	return out
}

// zeroed is s resliced to n zeros (n <= cap(s)).
func zeroed(s []int64, n int) []int64 {
	s = s[:n]
	clear(s)
	return s
}

// Thousandths converts a rule's per-second rate (or any token amount) to the
// store's unit, thousandths of a token, rounded to the nearest (so 0.57
// becomes 570, not the 569 that float truncation gives) and at least 1 (rules
// refuse rates below 0.001). It is the one rule -> store conversion: the
// enforcer's global buckets and the sync agent's share records must state
// the same rate, or the store settles and clamps the bucket at every change
// between them.
func Thousandths(v float64) int64 {
	return max(1, int64(math.Round(v*1000)))
}
