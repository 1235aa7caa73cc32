package ledger

import (
	"testing"
	"time"
)

func TestTwoRegionPartitionRepro(t *testing.T) {
	s := newSim(t, 1, simOpts{regions: 2, keys: 3, config: func(c *Config) { c.Alpha = 1 }})
	s.heal()
	s.trace = t.Logf
	for _, r := range s.regions {
		for k := range s.keys {
			r.demand[k] = s.keys[k].rate * 0.4
		}
	}
	s.run(int64(5 * time.Second))
	for i := range s.cut {
		for j := range s.cut[i] {
			s.cut[i][j] = i != j
		}
	}
	s.run(s.now + int64(10*time.Second))
	s.heal()
	s.run(s.now + int64(10*time.Second))
	if s.violation != "" {
		t.Fatal(s.violation)
	}
	for _, r := range s.regions {
		for _, k := range s.keys {
			p := Share{}
			if r.led != nil {
				p = r.led.Position(k.name)
			}
			t.Logf("%s inc %d %s %+v", r.name, r.inc, k.name, p)
		}
	}
	if ok, why := s.converged(2); !ok {
		t.Fatal(why)
	}
}
