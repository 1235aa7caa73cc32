package ledger

import (
	"testing"
	"time"
)

// Liveness after partitions (invariant 4): while the harness checks safety at
// every step (the stores never enforce more than the limit), a partition
// ends and every key's shares must reach the allocator's targets, with every
// unit held by a live region, within a stated bound.

// healBound is how long after a heal the shares may take to reach their
// targets in the harness (the bound of the package doc, Liveness): a
// reclaim still open at the heal completes (a peer that sees the newer
// incarnation freezes the old one and contributes, and the record reaches
// everyone: two registry delays); the new incarnations' reports cross and
// are acknowledged (two report periods and round trips: the interval, or
// the heartbeat when it is longer, since a Tick with nothing changed waits
// for it), which gives them a lease and lets peers gift to them; then
// three rounds of gifts (an interval, a store write and a round trip each)
// bring every position within 0.1% of its target. The harness's network is
// 5-25 ms one way and its registry up to 200 ms each way.
func healBound(c Config) time.Duration {
	return c.HealBound(200*time.Millisecond, 50*time.Millisecond)
}

func cutOff(s *sim, group ...int) {
	in := map[int]bool{}
	for _, g := range group {
		in[g] = true
	}
	for i := range s.cut {
		for j := range s.cut[i] {
			s.cut[i][j] = in[i] != in[j]
		}
	}
}

func spread(s *sim, level []float64) {
	for i, r := range s.regions {
		for k := range s.keys {
			r.demand[k] = s.keys[k].rate * level[i]
		}
	}
}

// untilConverged runs the sim until every key is at its targets within 0.1%
// of the limit (and stays there for two intervals), and returns how long
// that took from now. (The last units approach the targets geometrically:
// a giver projects its peers' positions from reports a round trip old.)
func untilConverged(t *testing.T, s *sim, limit time.Duration) time.Duration {
	t.Helper()
	start := s.now
	var since int64 = -1
	for s.now < start+int64(limit) {
		s.run(s.now + int64(10*time.Millisecond))
		if s.violation != "" {
			t.Fatal(s.violation)
		}
		if ok, _ := s.converged(s.cfg.Units / 1000); ok {
			if since < 0 {
				since = s.now
			}
			if s.now-since >= int64(2*s.cfg.Interval) {
				return time.Duration(since - start)
			}
		} else {
			since = -1
		}
	}
	_, why := s.converged(s.cfg.Units / 1000)
	t.Fatalf("not at the targets %v after the heal: %s", limit, why)
	return 0
}

func partitionSim(t *testing.T, seed int64, regions int) *sim {
	return partitionSimHB(t, seed, regions, 0)
}

// partitionSimHB is partitionSim with Config.HeartbeatEvery hb.
func partitionSimHB(t *testing.T, seed int64, regions int, hb time.Duration) *sim {
	s := newSim(t, seed, simOpts{regions: regions, keys: 3, restart: 100 * time.Millisecond,
		config: func(c *Config) { c.HalfLife, c.HeartbeatEvery = 0, hb }})
	s.heal()
	return s
}

// TestTwoRegionPartition: two regions cut apart for less and for more than
// the reclaim wait. Neither side can be frozen by silence (its only peer is
// the other side, which has no live peer to acknowledge it), so neither
// fences: each keeps enforcing the position it held once the gifts in
// flight at the cut have settled, above its floor, for the whole cut (the
// harness checks at every step that the stores never enforce more than the
// limit in sum), in its first incarnation; after the heal the shares reach
// the targets within healBound. (Before, both fenced to their floors at the
// lease: 74.41% utilization in two-region-partition against 99.69% now.)
func TestTwoRegionPartition(t *testing.T) {
	for _, cut := range []time.Duration{2 * time.Second, 10 * time.Second} {
		var worst time.Duration
		for seed := int64(1); seed <= 20; seed++ {
			s := partitionSim(t, seed, 2)
			spread(s, []float64{0.5, 0.3})
			s.run(int64(3 * time.Second))
			at := s.now
			cutOff(s, 1)
			s.run(at + int64(time.Second)) // gifts in flight at the cut settle (or stay lowered)
			held := map[string][]int64{}
			for _, r := range s.regions {
				for _, k := range s.keys {
					u := s.enforced(r, k.name)
					if u <= s.floor[r.idx] {
						t.Fatalf("seed %d: %s enforces its floor %d on %s after the cut", seed, r.name, u, k.name)
					}
					held[k.name] = append(held[k.name], u)
				}
			}
			s.run(at + int64(cut))
			for _, r := range s.regions {
				if _, ok := s.fencedAt[Incarnation{r.name, 1}]; ok || r.inc != 1 {
					t.Fatalf("seed %d: %s fenced during a two-region cut (incarnation %d)", seed, r.name, r.inc)
				}
				for _, k := range s.keys {
					if u := s.enforced(r, k.name); u != held[k.name][r.idx] {
						t.Fatalf("seed %d: %s enforces %d on %s at the end of the cut, %d after its start", seed, r.name, u, k.name, held[k.name][r.idx])
					}
				}
			}
			s.heal()
			took := untilConverged(t, s, 10*time.Second)
			worst = max(worst, took)
			if b := healBound(s.cfg); took > b {
				t.Errorf("seed %d cut %v: at the targets %v after the heal, bound %v", seed, cut, took, b)
			}
		}
		t.Logf("cut %v: worst %v from the heal to the targets (bound %v)", cut, worst, healBound(simConfig()))
	}
}

// TestRegionAloneForHours: one region of three is cut off for three hours.
// It fences once, then holds its floor in one new incarnation for the whole
// cut (no new life every lease); the others reclaim its share once; the
// registry stays small; after the heal all shares reach the targets.
func TestRegionAloneForHours(t *testing.T) {
	for _, n := range []int{2, 3} {
		s := newSim(t, 7, simOpts{regions: n, keys: 1, restart: 100 * time.Millisecond,
			config: func(c *Config) { c.HalfLife = 0 }})
		s.heal()
		level := []float64{0.3, 0.3, 0.3}
		spread(s, level)
		s.run(int64(3 * time.Second))
		cutOff(s, 0)
		s.run(s.now + int64(3*time.Hour))
		if got := s.regions[0].inc; got > 2 {
			t.Errorf("%d regions: the lone region is at incarnation %d after 3 h alone, want at most 2", n, got)
		}
		if s.fences > n {
			t.Errorf("%d regions: %d fences in 3 h", n, s.fences)
		}
		if s.regSize > 2000 {
			t.Errorf("%d regions: registry state grew to %d bytes", n, s.regSize)
		}
		s.heal()
		took := untilConverged(t, s, 10*time.Second)
		if b := healBound(s.cfg); took > b {
			t.Errorf("%d regions: at the targets %v after the heal, bound %v", n, took, b)
		}
		t.Logf("%d regions: after 3 h alone: %d fences, registry at most %d bytes, targets %v after the heal", n, s.fences, s.regSize, took)
	}
}

// TestPartitionDuringShift: demand moves from the cut-off region to another
// while the partition lasts; after the heal the shares follow the new demand.
//
// With a heartbeat (HeartbeatEvery above the interval, 207 ms here: the
// harness's lease of 1 s bounds it) the acknowledgements wait for it, and
// healBound says so: three-region cuts took up to 1.39 s against the
// interval's bound of 1.305 s.
func TestPartitionDuringShift(t *testing.T) {
	for _, hb := range []time.Duration{0, time.Second} {
		partitionDuringShift(t, hb)
	}
}

func partitionDuringShift(t *testing.T, hb time.Duration) {
	for _, n := range []int{2, 3, 5} {
		var worst time.Duration
		var bound time.Duration
		for seed := int64(1); seed <= 10; seed++ {
			s := partitionSimHB(t, seed, n, hb)
			level := make([]float64, n)
			level[0] = 0.8
			spread(s, level)
			s.run(int64(3 * time.Second))
			cutOff(s, 0)
			s.run(s.now + int64(time.Second))
			level[0], level[n-1] = 0, 0.9
			spread(s, level)
			s.run(s.now + int64(8*time.Second))
			s.heal()
			took := untilConverged(t, s, 10*time.Second)
			worst = max(worst, took)
			bound = healBound(s.cfg)
			if took > bound {
				t.Errorf("heartbeat %v, %d regions seed %d: at the targets %v after the heal, bound %v", hb, n, seed, took, bound)
			}
			hot := s.regions[n-1].led.Position(s.keys[0].name)
			if hot.Units <= hot.Initial && n > 2 || hot.Units <= hot.Floor {
				t.Errorf("heartbeat %v, %d regions seed %d: the region with the demand holds %+v", hb, n, seed, hot)
			}
		}
		t.Logf("heartbeat %v, %d regions: worst %v from the heal to the targets, bound %v", hb, n, worst, bound)
	}
}

// TestRegistryBoundedOverAWeek: a simulated week of faults (every six hours
// one region is cut off for two hours, in turn; every day every agent
// crashes and restarts) with a coarse interval so the week runs in seconds.
// The registry document stays within a few kilobytes however long the run,
// and at the end every share is at its target.
func TestRegistryBoundedOverAWeek(t *testing.T) {
	if testing.Short() {
		t.Skip("a week of virtual time")
	}
	s := newSim(t, 3, simOpts{regions: 3, keys: 2, restart: time.Second, config: func(c *Config) {
		c.HalfLife = 0
		c.Interval = 10 * time.Second
		c.Lease = time.Minute
		c.Margin = 10 * time.Second
		c.StoreTimeout = 200 * time.Millisecond
		c.RetryWrite = 20 * time.Second
		c.IdleAfter = 5 * time.Minute
	}})
	s.heal()
	spread(s, []float64{0.5, 0.3, 0.4})
	week := int64(7 * 24 * time.Hour)
	sizes := []int{}
	for h := int64(0); s.now < week; h++ {
		switch {
		case h%6 == 0:
			cutOff(s, int(h/6)%3)
		case h%6 == 2:
			s.heal()
		}
		if h%24 == 12 {
			for _, r := range s.regions {
				r := r
				r.led = nil // crash: state lost
				s.at(int64(5*time.Second), func() {
					if r.led == nil {
						s.start(r)
					}
				})
			}
		}
		s.run(s.now + int64(time.Hour))
		if s.violation != "" {
			t.Fatal(s.violation)
		}
		if h%24 == 23 {
			sizes = append(sizes, registrySize(t, s.reg))
		}
	}
	s.heal()
	s.run(s.now + int64(5*time.Minute))
	if ok, why := s.converged(s.cfg.Units / 1000); !ok {
		t.Fatalf("after the week: %s", why)
	}
	if s.regSize > 4000 {
		t.Errorf("registry state reached %d bytes", s.regSize)
	}
	t.Logf("registry state at the end of each day (bytes): %v; largest %d; %d fences, %d regions' incarnations %v",
		sizes, s.regSize, s.fences, len(s.regions), []uint64{s.regions[0].inc, s.regions[1].inc, s.regions[2].inc})
}

// TestTwoRegionPartitionSmallLimit: the two-region cut of
// TestTwoRegionPartition for small limits (whole tokens of a burst of 1 and
// of 4, the default demand smoothing), with the demand uneven. Neither
// side fences, each keeps what it enforced once the gifts in flight at the
// cut have settled, for the whole 10 s cut, and the two together keep
// enforcing at least one whole token (the limit stays served on one side);
// after the heal the shares reach the targets within smallHealBound, the
// figure observed for small limits (the package doc, Liveness: with whole
// tokens the bound is not proven).
func TestTwoRegionPartitionSmallLimit(t *testing.T) {
	const smallHealBound = 5 * time.Second
	for _, burst := range []int64{1, 4} {
		var worst time.Duration
		for seed := int64(1); seed <= 10; seed++ {
			s := newSim(t, seed, simOpts{regions: 2, keys: 3, restart: 100 * time.Millisecond,
				config: func(c *Config) {
					c.Quantum = c.Units / burst
					c.DemandTokens = DefaultConfig().DemandTokens
				}})
			s.heal()
			spread(s, []float64{0.6, 0.2})
			s.run(int64(10 * time.Second))
			at := s.now
			cutOff(s, 1)
			s.run(at + int64(time.Second))
			held := map[string][]int64{}
			for _, k := range s.keys {
				var sum int64
				for _, r := range s.regions {
					u := s.enforced(r, k.name)
					held[k.name] = append(held[k.name], u)
					sum += u
				}
				if sum < s.cfg.Quantum {
					t.Fatalf("burst %d seed %d: the regions enforce %d units on %s after the cut, less than a token (%d)", burst, seed, sum, k.name, s.cfg.Quantum)
				}
			}
			s.run(at + int64(10*time.Second))
			for _, r := range s.regions {
				if _, ok := s.fencedAt[Incarnation{r.name, 1}]; ok || r.inc != 1 {
					t.Fatalf("burst %d seed %d: %s fenced during a two-region cut (incarnation %d)", burst, seed, r.name, r.inc)
				}
				for _, k := range s.keys {
					if u := s.enforced(r, k.name); u != held[k.name][r.idx] {
						t.Fatalf("burst %d seed %d: %s enforces %d on %s at the end of the cut, %d after its start", burst, seed, r.name, u, k.name, held[k.name][r.idx])
					}
				}
			}
			s.heal()
			took := untilConverged(t, s, 15*time.Second)
			worst = max(worst, took)
			if took > smallHealBound {
				t.Errorf("burst %d seed %d: at the targets %v after the heal, bound %v", burst, seed, took, smallHealBound)
			}
		}
		t.Logf("burst %d: worst %v from the heal to the targets (bound %v)", burst, worst, smallHealBound)
	}
}
