package ledger

import (
	"testing"
	"time"
)

// TestLateFirstLife: the last region's first life starts from half a lease
// to three leases after the others' (a rule reaching one region's agent
// late, or an agent deployed later), cut off from every peer until 10 s.
// Its peers never heard it, and it was allocated after them, so they do
// not freeze it by silence: it fences by itself when its lease lapses
// (holding its initial part), and its next life, once heard, closes it and
// the others reclaim what it held. Before the fix the peers froze it
// ReclaimAfter after their own start, and reclaimed its initial part while
// its store still enforced it (for a start 500 ms late: "reclaim of {r2 1}
// applied by {r1 1} while its store enforces it"). Safety at every step;
// after the heal the shares reach their targets within randomHealBound.
func TestLateFirstLife(t *testing.T) {
	for _, n := range []int{3, 5} {
		for seed := int64(1); seed <= 10; seed++ {
			for _, late := range []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second, 3 * time.Second} {
				last := n - 1
				s := newSim(t, seed, simOpts{regions: n, keys: 3, lateStart: map[int]time.Duration{last: late},
					restart: 500 * time.Millisecond, config: func(c *Config) { c.HalfLife = 0 }})
				for j := range s.regions {
					if j != last {
						s.cut[last][j], s.cut[j][last] = true, true
					}
				}
				s.run(int64(10 * time.Second))
				if s.violation != "" {
					t.Fatalf("regions %d seed %d late %v: %s", n, seed, late, s.violation)
				}
				if _, ok := s.fencedAt[Incarnation{"r" + string(rune('0'+last)), 1}]; !ok {
					t.Fatalf("regions %d seed %d late %v: the late first life never fenced (fenced %v)", n, seed, late, s.fencedAt)
				}
				s.heal()
				at := s.calmPhase(randomHealBound(s.cfg)+time.Second, func(time.Duration) {})
				if s.violation != "" {
					t.Fatalf("regions %d seed %d late %v after the heal: %s", n, seed, late, s.violation)
				}
				if at < 0 || at > randomHealBound(s.cfg) {
					_, why := s.converged(int64(n))
					t.Fatalf("regions %d seed %d late %v: at the targets %v after the heal (bound %v): %s", n, seed, late, at, randomHealBound(s.cfg), why)
				}
			}
		}
	}
}

// TestSlowStartAnswer: r0's first life is allocated first, but the
// registry's answer reaches its agent half a lease to two leases later,
// while r0 is cut off; the others, allocated after it, count its silence
// from their own start. Its lease counts from its request (Start.Sent),
// so it has lapsed when they freeze it: safety at every step (counted from
// the answer instead, its store enforced its initial part after they had
// reclaimed it).
func TestSlowStartAnswer(t *testing.T) {
	for seed := int64(1); seed <= 10; seed++ {
		for _, slow := range []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second} {
			s := newSim(t, seed, simOpts{regions: 3, keys: 3, slowStart: map[int]time.Duration{0: slow},
				restart: 500 * time.Millisecond, config: func(c *Config) { c.HalfLife = 0 }})
			for j := 1; j < 3; j++ {
				s.cut[0][j], s.cut[j][0] = true, true
			}
			s.run(int64(8 * time.Second))
			if s.violation != "" {
				t.Fatalf("seed %d slow %v: %s", seed, slow, s.violation)
			}
			if _, ok := s.reclaimedAt[Incarnation{"r0", 1}]; !ok {
				t.Fatalf("seed %d slow %v: r0's first life not reclaimed (reclaimed %v)", seed, slow, s.reclaimedAt)
			}
		}
	}
}
