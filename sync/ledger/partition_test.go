package ledger

import (
	"fmt"
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
	in := setOf(group)
	cutWhere(s, func(i, j int) bool { return in[i] != in[j] })
}

// cutWhere cuts the link from region i to region j where cut(i, j), and
// links every other pair.
func cutWhere(s *sim, cut func(i, j int) bool) {
	for i := range s.cut {
		for j := range s.cut[i] {
			s.cut[i][j] = cut(i, j)
		}
	}
}

func setOf(group []int) map[int]bool {
	in := map[int]bool{}
	for _, g := range group {
		in[g] = true
	}
	return in
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
// It fences once, at its lease; among three regions the others then
// reclaim its share, and the reclaim pays its new incarnation its weight's
// part, which it cannot apply alone, so they reclaim that one too
// (paidUnheard) and it fences a second time; its third incarnation is paid
// nothing and holds its floor for the rest of the cut (no new life every
// lease); the registry stays small; after the heal all shares reach the
// targets.
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
		if got := s.regions[0].inc; got > 3 {
			t.Errorf("%d regions: the lone region is at incarnation %d after 3 h alone, want at most 3", n, got)
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

// isolate cuts each of the regions alone from every other region (each
// from the others too), and links every other pair.
func isolate(s *sim, alone ...int) {
	in := setOf(alone)
	cutWhere(s, func(i, j int) bool { return i != j && (in[i] || in[j]) })
}

// unapplied is what the registry paid l on key (its base part and the
// key's) that l has not applied yet: a region that no peer acknowledges
// applies no payment.
func unapplied(l *Ledger, key string) int64 {
	d := l.owed.Base - l.paid.Base
	for _, ku := range l.owed.Keys {
		if ku.Key == key {
			d += ku.Units
		}
	}
	for _, ku := range l.paid.Keys {
		if ku.Key == key {
			d -= ku.Units
		}
	}
	return d
}

// unheld is how many units of key no region holds (what the positions of
// all regions leave of Units), and how many of those the registry paid and
// their recipients have not applied.
func unheld(s *sim, key string) (nobody, parked int64) {
	nobody = s.cfg.Units
	for _, r := range s.regions {
		if r.led != nil {
			nobody -= r.led.Position(key).Units
			parked += unapplied(r.led, key)
		}
	}
	return nobody, parked
}

// untilHolds runs the sim until ok holds for two intervals in a row and
// returns how long that took from now; it fails the test if ok does not
// hold within limit.
func untilHolds(t *testing.T, s *sim, limit time.Duration, ok func() (bool, string)) time.Duration {
	t.Helper()
	start := s.now
	var since int64 = -1
	for s.now < start+int64(limit) {
		s.run(s.now + int64(10*time.Millisecond))
		if s.violation != "" {
			t.Fatal(s.violation)
		}
		if good, _ := ok(); !good {
			since = -1
			continue
		}
		if since < 0 {
			since = s.now
		}
		if s.now-since >= int64(2*s.cfg.Interval) {
			return time.Duration(since - start)
		}
	}
	_, why := ok()
	t.Fatalf("not served %v after the fault: %s", limit, why)
	return 0
}

// TestSeveralRegionsAlone: three regions, the one with all the demand
// among them, are each cut off alone at once, for long enough that every
// other region reclaims them; then the one with the demand is healed while
// the other two stay cut. Within the heal bound it must hold every unit of
// the key but the other regions' floors and what the registry paid the two
// lone regions (their weights' part of every reclaim: a region applies a
// payment only while a peer acknowledges it, so theirs wait for their
// heal), and no unit may be held by nobody. That needs every reclaim to
// complete although two regions are alone: the reclaim of what the healed
// region held before the cut needs a contribution, or a closure, from every
// incarnation whose life overlapped it, and the two lone regions started
// new lives in the cut. Each lone region must therefore contribute to the
// other's reclaim (and to the healed one's) although no peer acknowledges
// it. (Before, a region with no live peer froze nobody by silence: the two
// lone regions' reclaims each waited for the other's contribution, the
// healed region's reclaim for theirs, and the whole limit of the key was
// held by nobody until one of the two was healed: 100,000 of 1,000,000
// units held here, and 0 of 1 token enforced anywhere for 90 s on the real
// stack of ten regions, the stack's TestSeveralCutLiveness.) Then the two
// are healed too, and the shares reach the targets within the bound.
func TestSeveralRegionsAlone(t *testing.T) {
	for _, n := range []int{5, 10} {
		var worst, worstAll time.Duration
		for seed := int64(1); seed <= 10; seed++ {
			s := partitionSim(t, seed, n)
			level := make([]float64, n)
			level[0] = 0.9
			spread(s, level)
			s.run(int64(3 * time.Second))
			isolate(s, 0, 1, 2)
			s.calm = false
			s.run(s.now + int64(10*time.Second))
			isolate(s, 1, 2) // 0 healed
			s.calm = true
			bound := healBound(s.cfg)
			k := s.keys[0].name
			// Served: every unit is held, or paid to a lone region; region
			// 0 holds its demand, or all but the others' floors (within
			// 1%: the surplus over its demand is spread by weight).
			served := func() (bool, string) {
				for _, r := range s.regions {
					if r.led == nil {
						return false, r.name + " down"
					}
				}
				nobody, parked := unheld(s, k)
				if nobody < 0 || nobody-parked > s.cfg.Units/1000 {
					return false, fmt.Sprintf("%d units held by nobody, %d of them paid to the lone regions", nobody, parked)
				}
				want := s.cfg.Units - parked
				for _, r := range s.regions[1:] {
					want -= r.led.Position(k).Floor
				}
				p := s.regions[0].led.Position(k)
				if want = min(want, p.Reported); p.Units < want-s.cfg.Units/100 {
					return false, fmt.Sprintf("region 0 holds %d, wants %d", p.Units, want)
				}
				return true, ""
			}
			took := untilHolds(t, s, 3*bound, served)
			if took > bound {
				t.Errorf("%d regions seed %d: region 0 healed, 1 and 2 alone: served %v after the heal, bound %v", n, seed, took, bound)
			}
			worst = max(worst, took)
			s.heal()
			took = untilConverged(t, s, 3*bound)
			worstAll = max(worstAll, took)
			if took > bound {
				t.Errorf("%d regions seed %d: all healed: at the targets %v after the heal, bound %v", n, seed, took, bound)
			}
		}
		t.Logf("%d regions: region 0 healed, two alone: served within %v at worst; all healed: at the targets within %v (bound %v)", n, worst, worstAll, healBound(simConfig()))
	}
}

// TestFailoverFromLoneRegion: the region with all the demand of a key is
// cut off alone and its traffic moves to another region (what gateways do
// when a region is cut off), at 4 and 10 regions, for a burst of 1 and 4
// whole tokens and without whole tokens. The cut-off region fences, starts
// a new incarnation and keeps its floor; the others reclaim the old one,
// and the region now taking the traffic must get every unit the others do
// not need, with no unit held by nobody, within two reclaim waits
// (ReclaimAfter: the old incarnation's, then, if the reclaim paid the lone
// region's new incarnation its part, that one's, which it cannot apply
// with no peer to acknowledge it) plus the heal bound. (Before, the
// payment waited with the lone region for the whole cut: 12-31% of the
// limit held by nobody at 4 regions, and with a burst of 1 the whole
// token, so that no region could admit anything for the cut.)
func TestFailoverFromLoneRegion(t *testing.T) {
	for _, n := range []int{4, 10} {
		for _, burst := range []int64{0, 1, 4} {
			var worst, bound time.Duration
			for seed := int64(1); seed <= 10; seed++ {
				s := newSim(t, seed, simOpts{regions: n, keys: 1, restart: 100 * time.Millisecond,
					config: func(c *Config) {
						c.HalfLife = 0
						if burst > 0 {
							c.Quantum = c.Units / burst
							c.DemandTokens = DefaultConfig().DemandTokens
						}
					}})
				s.heal()
				level := make([]float64, n)
				level[0] = 0.9
				spread(s, level)
				s.run(int64(5 * time.Second))
				cutOff(s, 0)
				s.calm = false
				level[0], level[1] = 0, 0.9
				spread(s, level)
				bound = 2*s.cfg.ReclaimAfter() + healBound(s.cfg)
				if burst > 0 {
					bound += 2 * time.Second // whole tokens: the hold (package doc, invariant 4, step 4)
				}
				k := s.keys[0].name
				served := func() (bool, string) {
					nobody, parked := unheld(s, k)
					if nobody > s.cfg.Units/1000 || parked != 0 {
						return false, fmt.Sprintf("%d units held by nobody, %d of them paid and not applied", nobody, parked)
					}
					if p := s.regions[1].led.Position(k); p.Units <= p.Initial {
						return false, fmt.Sprintf("region 1, with the demand, holds %d, base %d", p.Units, p.Initial)
					}
					return true, ""
				}
				took := untilHolds(t, s, 3*bound, served)
				worst = max(worst, took)
				if took > bound {
					t.Errorf("%d regions burst %d seed %d: served %v after the cut and the move, bound %v", n, burst, seed, took, bound)
				}
			}
			t.Logf("%d regions burst %d: served %v at worst after the cut and the move (bound %v)", n, burst, worst, bound)
		}
	}
}
