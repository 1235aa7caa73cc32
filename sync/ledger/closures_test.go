package ledger

import (
	"fmt"
	"testing"
)

// TestClosuresOnePerPeer: with room for one closure in a report
// (MaxClosureBytes), a report still carries one closure to each peer
// that has one waiting, since each peer acknowledges its own on its own;
// a carried closure stays in every report until its peer acknowledges it,
// and then that peer's next closure goes out. Before, the one closure of
// a report went to one peer at a time, and a region closing retirements of
// nine peers drained them one acknowledgement round trip after another.
func TestClosuresOnePerPeer(t *testing.T) {
	regions := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 1}, {"d", 1}}
	cfg := simConfig()
	cfg.MaxClosureBytes = closureBytes("k0") // room for one
	l, err := New(cfg, "a", regions, Start{Inc: 1, RunID: "run"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	l.closing = map[closeID]closing{}
	for peer := 1; peer <= 3; peer++ {
		l.peers[peer].inc = 1
		for k := 0; k < 2; k++ {
			l.closing[closeID{fmt.Sprintf("k%d", k), peer}] = closing{inc: 1, retire: 7}
		}
	}
	carried := func(cs []Closure) string {
		s := ""
		for _, c := range cs {
			s += c.Key + ">" + c.Region + " "
		}
		return s
	}
	if got, want := carried(l.closures(10)), "k0>b k0>c k0>d "; got != want {
		t.Fatalf("first report carries %q, want %q (one per peer)", got, want)
	}
	if got, want := carried(l.closures(11)), "k0>b k0>c k0>d "; got != want {
		t.Fatalf("second report carries %q, want %q (the same until acknowledged)", got, want)
	}
	delete(l.closing, closeID{"k0", 2}) // c acknowledged it (retireAcks)
	if got, want := carried(l.closures(12)), "k0>b k0>d k1>c "; got != want {
		t.Fatalf("after c's acknowledgement the report carries %q, want %q", got, want)
	}
	// With room for everything, everything goes at once.
	l.cfg.MaxClosureBytes = 1 << 20
	if got, want := carried(l.closures(13)), "k0>b k0>d k1>b k1>c k1>d "; got != want {
		t.Fatalf("with room the report carries %q, want %q", got, want)
	}
}
