package ledger

import (
	"fmt"
	"os"
	"strconv"
	"testing"
)

func TestReplaySeed(t *testing.T) {
	seed, err := strconv.ParseInt(os.Getenv("LEDGER_SEED"), 10, 64)
	if err != nil {
		t.Skip("set LEDGER_SEED=n (and LEDGER_KEY=k0 for a per-step trace) to replay one randomized seed")
	}
	o := randomOpts(seed)
	s := newSim(t, seed, o)
	s.trace = t.Logf
	key := os.Getenv("LEDGER_KEY")
	last := ""
	s.stepHook = func() {
		if key == "" {
			return
		}
		var sum int64
		line := ""
		for _, r := range s.regions {
			u, inc := s.enforcedAt(r, key)
			sum += u
			p := int64(-1)
			if r.led != nil {
				p = r.led.Position(key).Units
			}
			line += fmt.Sprintf(" %s/%d:%d(%d)", r.name, inc, u, p)
		}
		if line != last {
			t.Logf("%8.3fs sum %d%s", float64(s.now)/1e9, sum, line)
			last = line
		}
	}
	s.at(0, s.chaos)
	s.run(int64(o.chaos))
	t.Log(s.violation)
	s.stepHook = nil
	s.heal()
	s.run(s.now + int64(o.calm))
	t.Log(s.converged(int64(o.regions)))
	for _, r := range s.regions {
		if r.led == nil {
			t.Logf("%s down", r.name)
			continue
		}
		l := r.led
		t.Logf("%s/%d base %d everOK %v markerOK %v", r.name, l.inc, l.base, l.everOK, l.markerOK)
		for i, p := range l.peers {
			if i != l.self {
				t.Logf("   peer %s inc %d seen %v age %v frozen %d mayFreeze %v", p.name, p.inc, p.seen, s.local(r)-p.heard, p.frozenInc, p.mayFreeze)
			}
		}
		for _, n := range l.Keys() {
			k := l.keys[n]
			t.Logf("   key %s active %v pos %d demand %.0f extra %d frozen %d pairs %+v", n, k.active, l.position(k), k.demand, k.extra(), k.frozen(), l.pairsOf(k))
		}
	}
}
