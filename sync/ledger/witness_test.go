package ledger

import (
	"testing"
	"time"
)

// witnessModel is the harness's etcd for the witness keys (witness.go):
// one key per region with a mod revision, compare-and-swap, reached after
// witnessDelay each way, by regions not cut off from it (cut). Each
// region's agent renews its key every WitnessLease/4 and reads every key
// with it (a poll standing for the agent's watch, which the model also
// gives: a change reaches the regions not cut off after the delay).
type witnessModel struct {
	rev      int64
	key      []int64         // per region: its key's revision (0: none)
	mine     []int64         // per region: the revision its agent wrote last
	lastSent []time.Duration // per region: its last successful renewal's send time (agent clock)
	cut      []bool          // per region: cannot reach etcd
	seen     [][]witnessSeen // per observer, per region
	taking   []bool
	takes    int // keys taken
}

type witnessSeen struct {
	rev int64
	at  time.Duration // observer's clock, first seen
}

const witnessDelay = 20 * time.Millisecond

// withWitness gives the sim a witness model and starts every region's
// renewals. Call before running.
func (s *sim) withWitness() *witnessModel {
	n := len(s.regions)
	w := &witnessModel{key: make([]int64, n), mine: make([]int64, n), lastSent: make([]time.Duration, n),
		cut: make([]bool, n), seen: make([][]witnessSeen, n), taking: make([]bool, n)}
	for i := range w.seen {
		w.seen[i] = make([]witnessSeen, n)
	}
	s.wit = w
	for _, r := range s.regions {
		s.renewWitness(r)
	}
	return w
}

// feedWitness gives a new ledger of region r what its agent knows.
func (s *sim) feedWitness(r *region) {
	w := s.wit
	if w == nil {
		return
	}
	if w.lastSent[r.idx] > 0 {
		r.led.WitnessRenewed(w.lastSent[r.idx])
	}
	for j, sn := range w.seen[r.idx] {
		if j != r.idx && sn.rev > 0 {
			r.led.WitnessSeen(sn.at, s.specs[j].Name, sn.rev)
		}
	}
}

// witnessChanged tells every region that reaches etcd of region i's new
// revision, after the delay.
func (s *sim) witnessChanged(i int) {
	for _, o := range s.regions {
		if o.idx != i {
			s.at(int64(witnessDelay), func() { s.observeWitness(o, i, s.wit.key[i]) })
		}
	}
}

func (s *sim) observeWitness(o *region, i int, rev int64) {
	w := s.wit
	if w.cut[o.idx] || rev == 0 {
		return
	}
	if sn := &w.seen[o.idx][i]; sn.rev != rev {
		sn.rev, sn.at = rev, s.local(o)
	}
	if o.led != nil {
		o.led.WitnessSeen(w.seen[o.idx][i].at, s.specs[i].Name, rev)
	}
}

// renewWitness runs region r's renewal now and every WitnessLease/4.
func (s *sim) renewWitness(r *region) {
	w := s.wit
	defer s.at(int64(s.cfg.WitnessLease/4), func() { s.renewWitness(r) })
	if w.cut[r.idx] {
		return
	}
	sent := s.local(r)
	s.at(int64(witnessDelay), func() {
		if w.cut[r.idx] {
			return
		}
		lost := w.key[r.idx] != w.mine[r.idx]
		w.rev++
		w.key[r.idx], w.mine[r.idx] = w.rev, w.rev // renewed, or taken back
		s.witnessChanged(r.idx)
		keys := append([]int64(nil), w.key...)
		s.at(int64(witnessDelay), func() {
			if w.cut[r.idx] {
				return
			}
			if lost {
				s.logf("%s: witness key was taken", r.name)
				w.lastSent[r.idx] = 0
				if r.led != nil {
					r.led.WitnessLost()
				}
			}
			w.lastSent[r.idx] = sent
			if r.led != nil && !lost {
				r.led.WitnessRenewed(sent)
			}
			for j, rev := range keys {
				if j != r.idx {
					s.observeWitness(r, j, rev)
				}
			}
		})
	})
}

// takeWitness carries out region r's Output.Take.
func (s *sim) takeWitness(r *region, inc uint64, t Take) {
	w := s.wit
	if w == nil || w.taking[r.idx] || w.cut[r.idx] {
		return
	}
	w.taking[r.idx] = true
	i := s.index(t.Region)
	s.at(int64(witnessDelay), func() {
		ok := !w.cut[r.idx] && w.key[i] == t.Rev
		if ok {
			w.rev++
			w.key[i] = w.rev
			w.takes++
			s.logf("%s takes %s's witness key at %d", r.name, t.Region, t.Rev)
			s.witnessChanged(i)
		}
		s.at(int64(witnessDelay), func() {
			w.taking[r.idx] = false
			if ok && r.led != nil && r.inc == inc && !w.cut[r.idx] {
				s.handle(r, inc, r.led.WitnessTaken(s.local(r), t.Region, t.Rev))
			}
		})
	})
}

// witnessSim is calmSim with two regions and a witness of lease w.
func witnessSim(t *testing.T, seed int64, w time.Duration) *sim {
	s := newSim(t, seed, simOpts{regions: 2, keys: 3, noRestart: true,
		config: func(c *Config) { c.HalfLife, c.WitnessLease = 0, w }})
	s.heal()
	s.withWitness()
	for _, r := range s.regions { // both want the whole limit
		for k := range s.keys {
			r.demand[k] = s.keys[k].rate
		}
	}
	return s
}

const testWitnessLease = 3 * time.Second

// TestTwoRegionLossReclaimedByWitness: r0 is cut off from r1 and from
// etcd for good. It fences by itself once its witness lease has lapsed
// (holding more than its floor), and r1 takes its witness key and
// reclaims what it held, after the fence: r1 then owns all but r0's
// floor. When r0 comes back (a new incarnation), the shares follow the
// demand again.
func TestTwoRegionLossReclaimedByWitness(t *testing.T) {
	for seed := int64(1); seed <= 8; seed++ {
		s := witnessSim(t, seed, testWitnessLease)
		s.run(int64(5 * time.Second))
		cut := s.now
		s.cut[0][1], s.cut[1][0] = true, true
		s.wit.cut[0] = true
		if testing.Verbose() && seed == 1 {
			s.trace = t.Logf
		}
		s.run(cut + int64(s.cfg.WitnessReclaimAfter()+s.cfg.WitnessLease/4+5*time.Second))
		if s.violation != "" {
			t.Fatalf("seed %d: %s", seed, s.violation)
		}
		fenced, reclaimed := fencedThenReclaimed(t, s, seed, Incarnation{"r0", 1})
		// r0 fences within its witness lease of the cut (its last renewal
		// was at most a quarter of it earlier), r1 reclaims within the
		// reclaim wait, a renewal period (the last one seen) and a second.
		if d := time.Duration(fenced - cut); d > time.Duration(float64(s.cfg.WitnessLease)*1.02)+s.cfg.Interval {
			t.Errorf("seed %d: fenced %v after the cut, witness lease %v", seed, d, s.cfg.WitnessLease)
		}
		bound := s.cfg.WitnessReclaimAfter() + s.cfg.WitnessLease/4 + time.Second
		if d := time.Duration(reclaimed - cut); d > bound {
			t.Errorf("seed %d: reclaimed %v after the cut, bound %v", seed, d, bound)
		}
		for _, k := range s.keys {
			if u := s.regions[1].led.Position(k.name).Units; u+s.floor[0] != s.cfg.Units {
				t.Errorf("seed %d key %s: r1 holds %d + r0's floor %d, want %d", seed, k.name, u, s.floor[0], s.cfg.Units)
			}
		}
		if seed == 1 {
			t.Logf("witness lease %v: r0 fenced %v after the cut, r1 reclaimed at %v (bound %v)",
				s.cfg.WitnessLease, time.Duration(fenced-cut), time.Duration(reclaimed-cut), bound)
		}
		// r0 comes back with all the demand.
		setDemand(s, 0)
		s.heal()
		s.wit.cut[0] = false
		s.start(s.regions[0])
		back := s.now
		at := s.reachTargets(back + int64(twoRegionReturnBound))
		if s.violation != "" {
			t.Fatalf("seed %d after the return: %s", seed, s.violation)
		}
		if at < 0 {
			_, why := s.converged(2)
			t.Fatalf("seed %d: not at the targets %v after r0's return: %s", seed, twoRegionReturnBound, why)
		}
		if seed == 1 {
			t.Logf("at the targets %v after r0's return", time.Duration(at-back))
		}
	}
}

// reachTargets runs until the shares are at the targets (r1 at its floor:
// setDemand(s, 0)) or until, and returns when they got there (-1: never).
func (s *sim) reachTargets(until int64) int64 {
	var at int64 = -1
	s.stepHook = func() {
		if at >= 0 {
			return
		}
		for _, k := range s.keys {
			if s.regions[1].led == nil || s.regions[1].led.Position(k.name).Units > s.floor[1]+2 {
				return
			}
		}
		if ok, _ := s.converged(2); ok {
			at = s.now
		}
	}
	s.run(until)
	s.stepHook = nil
	return at
}

// TestTwoRegionCutWithWitnessKeepsPositions: while both regions reach
// etcd, a cut between them, however long, leaves both at the positions
// they held (as without a witness); a region cut off from etcd too keeps
// its position for a cut shorter than the witness lease.
func TestTwoRegionCutWithWitnessKeepsPositions(t *testing.T) {
	for seed := int64(1); seed <= 6; seed++ {
		s := witnessSim(t, seed, testWitnessLease)
		s.run(int64(5 * time.Second))
		held := map[string][2]int64{}
		for _, k := range s.keys {
			held[k.name] = [2]int64{s.regions[0].led.Position(k.name).Units, s.regions[1].led.Position(k.name).Units}
		}
		cut := s.now
		s.cut[0][1], s.cut[1][0] = true, true
		s.wit.cut[0] = seed%2 == 0 // even seeds: r0 loses etcd too, for less than the witness lease
		end := cut + 10*int64(s.cfg.WitnessReclaimAfter())
		if s.wit.cut[0] {
			end = cut + int64(s.cfg.WitnessLease/2)
		}
		s.run(end)
		if s.violation != "" {
			t.Fatalf("seed %d: %s", seed, s.violation)
		}
		if len(s.fencedAt) != 0 || len(s.reclaimedAt) != 0 {
			t.Fatalf("seed %d: fenced %v, reclaimed %v", seed, s.fencedAt, s.reclaimedAt)
		}
		for _, k := range s.keys {
			a, b := s.regions[0].led.Position(k.name).Units, s.regions[1].led.Position(k.name).Units
			if a != held[k.name][0] || b != held[k.name][1] {
				t.Errorf("seed %d key %s: positions %d, %d after the cut, %d, %d at it", seed, k.name, a, b, held[k.name][0], held[k.name][1])
			}
		}
		// Healed, with the demand all r0's, the shares follow.
		setDemand(s, 0)
		s.heal()
		s.wit.cut[0] = false
		back := s.now
		if at := s.reachTargets(back + int64(twoRegionReturnBound)); at < 0 {
			_, why := s.converged(2)
			t.Fatalf("seed %d: not at the targets %v after the heal: %s", seed, twoRegionReturnBound, why)
		}
		if s.violation != "" {
			t.Fatalf("seed %d after the heal: %s", seed, s.violation)
		}
	}
}

func TestWitnessLeaseValidated(t *testing.T) {
	c := DefaultConfig()
	c.WitnessLease = c.Lease / 2
	if err := c.Validate(); err == nil {
		t.Fatal("a witness lease shorter than the lease was accepted")
	}
	c.WitnessLease = -time.Second
	if err := c.Validate(); err == nil {
		t.Fatal("a negative witness lease was accepted")
	}
	c.WitnessLease = c.Lease
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}
