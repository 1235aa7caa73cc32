package allocation

import (
	"cmp"
	"math"
	"math/bits"
	"slices"
)

// SplitUnits divides pool integer units (the ledger's unit of ownership)
// among regions in proportion to f's shares of float64(pool), by the
// largest-remainder (Hamilton) method: each region gets the integer part of
// its quota, and the units left over go one each to the largest fractional
// parts, ties to the lower index (fractional parts are compared on a 2^-32
// grid, so that rounding noise does not break ties).
//
// The result sums to exactly pool and every entry is >= 0; pool <= 0 or no
// regions yields all zeros. It is deterministic. Entries that f gets wrong
// (missing, NaN, Inf, negative) count as 0; if nothing usable is left the
// Static split is used. For pools above 2^53, where float64 cannot represent
// every unit, the float rounding can leave more units over than there are
// regions (or too many handed out); they are then given (or taken back) one
// per region per pass in the same order.
func SplitUnits(f Func, pool int64, regions []Region) []int64 {
	n := len(regions)
	out := make([]int64, n)
	if pool <= 0 || n == 0 {
		return out
	}
	fp := float64(pool)
	// Scratch on the stack for up to smallN regions: the share ledger runs
	// this per key and tick.
	var vB [smallN]float64
	var remB [smallN]uint64
	var orderB [smallN]int
	v, rem, order := vB[:0], remB[:0], orderB[:0]
	if n > smallN {
		v, rem, order = make([]float64, 0, n), make([]uint64, 0, n), make([]int, 0, n)
	}
	if v = usableSharesInto(v, f(fp, regions), n); v == nil {
		v = Static(fp, regions)
	}
	var sum float64
	for _, x := range v {
		sum += x
	}

	// rem holds each quota's fractional part in units of 2^-32: rounding it
	// to that grid keeps float noise in f's result (a few ulps) from
	// deciding what are really ties, which then go by index.
	rem = rem[:n]
	var given uint64 // sum of out, about pool; saturating for safety
	for i, x := range v {
		quota := x / sum * fp
		fl := math.Floor(quota)
		switch {
		case fl >= 0x1p63:
			out[i] = pool
		default:
			out[i] = min(int64(fl), pool)
		}
		rem[i] = uint64(math.Round((quota - fl) * 0x1p32))
		var carry uint64
		given, carry = bits.Add64(given, uint64(out[i]), 0)
		if carry != 0 {
			given = math.MaxUint64
		}
	}

	for i := range n {
		order = append(order, i)
	}
	switch want := uint64(pool); {
	case given < want:
		// Hand out the deficit: largest remainder first, ties by index,
		// only to regions with a positive quota.
		slices.SortFunc(order, func(a, b int) int {
			if c := cmp.Compare(rem[b], rem[a]); c != 0 {
				return c
			}
			return cmp.Compare(a, b)
		})
		eligible := order[:0:0]
		for _, i := range order {
			if v[i] > 0 {
				eligible = append(eligible, i)
			}
		}
		deficit := want - given
		base, extra := deficit/uint64(len(eligible)), deficit%uint64(len(eligible))
		for k, i := range eligible {
			out[i] += int64(base)
			if uint64(k) < extra {
				out[i]++
			}
		}
	case given > want:
		// Rounding handed out too much: take units back from the smallest
		// remainders first, ties to the higher index (the mirror image).
		slices.SortFunc(order, func(a, b int) int {
			if c := cmp.Compare(rem[a], rem[b]); c != 0 {
				return c
			}
			return cmp.Compare(b, a)
		})
		excess := given - want
		for excess > 0 {
			for _, i := range order {
				if excess == 0 {
					break
				}
				if out[i] > 0 {
					out[i]--
					excess--
				}
			}
		}
	}
	return out
}

// usableSharesInto returns shares[:n], in v (cap(v) >= n), with entries
// that are not finite and >= 0 replaced by 0, rescaled if their sum would
// overflow, or nil if nothing positive is left.
func usableSharesInto(v, shares []float64, n int) []float64 {
	v = v[:n]
	var sum, maxV float64
	for i := range v {
		if i < len(shares) {
			v[i] = nonNegative(shares[i])
		}
		sum += v[i]
		maxV = max(maxV, v[i])
	}
	if maxV == 0 {
		return nil
	}
	if math.IsInf(sum, 1) {
		for i := range v {
			v[i] /= maxV
		}
	}
	return v
}

// WholeTokens adjusts integer targets so that no region is left with a
// fraction of one token: a store enforcing u of U units gets floor(C*u/U)
// of the capacity C, and a region whose capacity is below one token can
// admit nothing, so for small limits (a burst of one to a few tokens over
// several regions) a continuous split starves everyone. quantum is the
// number of units per token (U/C), floors are the regions' floors, and want
// orders the regions competing for a token (the caller's priority: demand).
//
// A region whose position (floor + target) is below one token but above its
// floor gives its target up; then, in order of the larger want (then the
// larger position, then the lower index), each of them that wants any is raised to
// exactly one token if the units given up, plus what the regions holding
// more than one token hold above it, cover the difference (taken from those
// holding the most first); what is left goes to the region whose target was
// the largest. Positions of one token or more change only when they lend.
// The result sums to exactly the sum of targets, and every entry is >= 0.
// A quantum <= 1 returns targets unchanged.
func WholeTokens(targets, floors []int64, quantum int64, want []int64) []int64 {
	return WholeTokensHeld(targets, floors, quantum, want, nil, 1)
}

// WholeTokensHeld is WholeTokens with hysteresis. held are the regions'
// current positions (floors included); a region that holds at least one
// whole token now (held >= quantum) competes for a token with its want
// multiplied by keep (>= 1), and keeps one token even if it wants none, as
// long as no region that wants one needs it. A token then moves only to a
// region that wants keep times more than its holder: moving one costs what
// the holder had banked (its bucket is clamped to the lower capacity) and
// the receiver starts empty, so with a few requests per token a move on
// noise in the demand estimates loses more than it gains. And a holder
// whose own view of the pool is short (gifts between two other regions in
// flight) does not hand its token to a region that already holds whole
// ones. held nil is WholeTokens.
func WholeTokensHeld(targets, floors []int64, quantum int64, want, held []int64, keep float64) []int64 {
	n := len(targets)
	out := slices.Clone(targets)
	if quantum <= 1 || n == 0 || len(floors) != n || len(want) != n {
		return out
	}
	holds := func(i int) bool { return len(held) == n && held[i] >= quantum }
	rank := make([]float64, n)
	for i := range rank {
		rank[i] = float64(want[i])
		if keep > 1 && holds(i) {
			rank[i] *= keep
		}
	}
	pos := make([]int64, n)
	var pot, spare int64
	var small []int
	for i := range out {
		pos[i] = floors[i] + out[i]
		switch {
		case pos[i] >= quantum:
			spare += pos[i] - quantum
		case out[i] > 0:
			small = append(small, i)
			pot += out[i]
			out[i] = 0
		}
	}
	slices.SortStableFunc(small, func(a, b int) int {
		if c := cmp.Compare(rank[b], rank[a]); c != 0 {
			return c
		}
		return cmp.Compare(pos[b], pos[a])
	})
	for _, i := range small {
		need := quantum - floors[i]
		if want[i] <= 0 && !holds(i) || need > pot+spare {
			continue
		}
		out[i] = need
		if need <= pot {
			pot -= need
			continue
		}
		borrow := need - pot
		pot = 0
		spare -= borrow
		for borrow > 0 { // from the largest lender first
			top := -1
			for j := range out {
				if floors[j]+out[j] > quantum && (top < 0 || floors[j]+out[j] > floors[top]+out[top]) {
					top = j
				}
			}
			take := min(borrow, floors[top]+out[top]-quantum)
			out[top] -= take
			borrow -= take
		}
	}
	if pot > 0 {
		top := 0
		for i := range pos {
			if pos[i] > pos[top] || pos[i] == pos[top] && want[i] > want[top] {
				top = i
			}
		}
		out[top] += pot
	}
	return out
}
