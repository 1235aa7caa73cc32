package agent

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func byUnits(x, y KeyShare) int {
	return cmp.Or(cmp.Compare(y.Units, x.Units), cmp.Compare(x.Key, y.Key))
}

// topN returns what sorting every key and keeping the first n returns, for
// keys in random, ascending and descending order, ties included.
func TestTopN(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, total := range []int{0, 1, 5, 100, 1000} {
		all := make([]KeyShare, total)
		for i := range all {
			all[i] = KeyShare{Key: fmt.Sprintf("k%04d", i), Units: int64(r.IntN(50))}
		}
		want := slices.Clone(all)
		slices.SortFunc(want, byUnits)
		asc := slices.Clone(want)
		slices.Reverse(asc)
		shuffled := slices.Clone(all)
		r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		for _, n := range []int{0, 1, 3, 100, 2000} {
			for name, in := range map[string][]KeyShare{"random": shuffled, "ascending": asc, "descending": want} {
				tp := topN{n: n, cmp: byUnits}
				for _, k := range in {
					tp.add(k)
				}
				got := tp.result()
				if w := want[:min(n, total)]; !slices.Equal(got, w) {
					t.Fatalf("%d keys %s, n %d: got %v, want %v", total, name, n, got, w)
				}
			}
		}
	}
}

// BenchmarkTopN selects the first 20 (the hottest-keys metrics' default,
// at every scrape), 100 (the shares view's default) and 10,000 (its most)
// of 1,000,000 keys by units, in random order, as the agent's loop does.
//
//	go test -run '^$' -bench TopN -benchtime 5x ./sync/agent/
func BenchmarkTopN(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	ks := make([]KeyShare, 1_000_000)
	for i := range ks {
		ks[i] = KeyShare{Rule: "r", Key: fmt.Sprintf("rl:{user:%d}:r", i), Units: r.Int64N(1_000_000)}
	}
	for _, n := range []int{20, 100, 10_000} {
		b.Run(fmt.Sprintf("first=%d", n), func(b *testing.B) {
			for range b.N {
				tp := topN{n: n, cmp: byUnits}
				for _, k := range ks {
					tp.add(k)
				}
				if len(tp.result()) != n {
					b.Fatal("short")
				}
			}
		})
	}
}
