package ledger

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"
)

// The adversary of the randomized test sits on the network. It sees every
// report, replays any of them at any later time to any region (long after
// the incarnation that sent it died, after its reclaim, in any order), and
// injects arbitrary decodable reports: mutations of real ones (counters,
// incarnations, sequences, positions, frozen acknowledgements) and random
// ones. Reports travel signed (sync/wire): a report reaches a ledger only if
// the region it names sent exactly it at some time, so the channel here
// delivers a report iff it was genuinely sent, and drops the rest. The
// signature's side of that (every bit flip, truncation and forgery refused)
// is tested in sync/wire and sync/agent; this test shows that what a
// signature cannot stop, replay, never breaks invariant 1, and that the
// plausibility checks never refuse an honest report.

type adversary struct {
	s       *sim
	rng     *rand.Rand
	seen    []Report
	genuine map[string]bool // reportID of every report a ledger sent
	every   time.Duration

	injected, replayed, refused int
	replayRejected              int
	honestImplausible           []string
}

func reportID(r Report) string { return fmt.Sprintf("%+v", r) }

func newAdversary(s *sim, seed int64, every time.Duration) *adversary {
	a := &adversary{s: s, rng: rand.New(rand.NewSource(seed)), genuine: map[string]bool{}, every: every}
	s.recvHook = func(to *region, rep Report, err error) {
		if errors.Is(err, ErrImplausible) {
			a.honestImplausible = append(a.honestImplausible, fmt.Sprintf("%s got %+v: %v", to.name, rep, err))
		}
		id := reportID(rep)
		if !a.genuine[id] {
			a.genuine[id] = true
			a.seen = append(a.seen, rep)
		}
	}
	s.at(0, a.act)
	return a
}

// act injects one report and schedules the next.
func (a *adversary) act() {
	a.s.at(int64(a.every), a.act)
	if len(a.seen) == 0 {
		return
	}
	to := a.s.regions[a.rng.Intn(len(a.s.regions))]
	base := a.seen[a.rng.Intn(len(a.seen))]
	var rep Report
	if a.rng.Intn(2) == 0 {
		rep = base
		a.replayed++
	} else {
		rep = a.mutate(base, to)
		a.injected++
	}
	// The authenticated channel: only what a region sent verifies.
	if !a.genuine[reportID(rep)] {
		a.refused++
		return
	}
	if to.led == nil {
		return
	}
	inc := to.inc
	out, err := to.led.Receive(a.s.local(to), rep)
	if err != nil {
		a.replayRejected++
	}
	a.s.handle(to, inc, out)
}

// mutate returns an arbitrary decodable variant of r aimed at region to.
func (a *adversary) mutate(r Report, to *region) Report {
	rng, units := a.rng, a.s.cfg.Units
	m := r
	m.Acks = slices.Clone(r.Acks)
	m.Keys = make([]KeyReport, len(r.Keys))
	for i, k := range r.Keys {
		k.Gave, k.Applied = slices.Clone(k.Gave), slices.Clone(k.Applied)
		m.Keys[i] = k
	}
	victim := Counter{Region: to.name, Inc: to.inc}
	for n := 1 + rng.Intn(3); n > 0; n-- {
		switch rng.Intn(9) {
		case 0:
			m.Inc += uint64(rng.Intn(3)) + 1
		case 1:
			m.Seq += uint64(rng.Intn(100)) + 1
		case 2:
			m.Base = rng.Int63n(units + 1)
		case 3: // a frozen acknowledgement of the victim
			m.Acks = append(m.Acks, Ack{Region: to.name, Inc: to.inc, Frozen: true})
		case 4: // a large gift to the victim
			for i := range m.Keys {
				c := victim
				c.Units = rng.Int63n(2 * units)
				m.Keys[i].Gave = []Counter{c}
			}
		case 5:
			for i := range m.Keys {
				m.Keys[i].Position = rng.Int63n(units + 1)
				m.Keys[i].Demand = rng.Int63n(10 * units)
			}
		case 6:
			c := victim
			c.Units = math.MaxInt64
			m.Keys = append(m.Keys, KeyReport{Key: "k0", Position: units, Gave: []Counter{c}, Applied: []Counter{c}})
		case 7:
			m.From = a.s.regions[rng.Intn(len(a.s.regions))].name
		case 8: // entirely random
			m = Report{From: r.From, Inc: uint64(rng.Intn(5)), Seq: uint64(rng.Intn(1000)), Base: rng.Int63n(units)}
		}
	}
	return m
}

type advResult struct {
	simResult
	injected, replayed, refused, replayRejected int
	honestImplausible                           []string
}

func runAdversarySim(tb testing.TB, seed int64, o simOpts) advResult {
	s := newSim(tb, seed, o)
	a := newAdversary(s, seed*31, 50*time.Millisecond)
	s.at(0, s.chaos)
	s.run(int64(o.chaos))
	s.heal() // the network heals; the adversary keeps replaying
	healedIn := s.calmPhase(o.calm, nil)
	res := advResult{simResult: simResult{steps: s.steps, fences: s.fences, reclaims: s.reclaims, rejected: s.rejected,
		raises: s.raises, violation: s.violation, healedIn: healedIn},
		injected: a.injected, replayed: a.replayed, refused: a.refused, replayRejected: a.replayRejected,
		honestImplausible: a.honestImplausible}
	if s.violation == "" {
		if ok, why := s.converged(int64(o.regions)); !ok {
			res.liveness = why
		}
	}
	return res
}

// TestRandomizedAdversary is TestRandomized with the adversary on the
// network: invariant 1 holds at every step, no honest report is refused as
// implausible, and once the network heals the shares reach the targets
// within TestRandomized's bound (randomHealBound) and are there at the end
// of the calm phase; a quarter of the seeds have a burst of 1 to 4 whole
// tokens (smallLimit: their time is measured, as in TestRandomized).
// (A replayed report of a dead incarnation that had frozen a live one used
// to fence the live one whenever it came: seed 141 of 300 at the targets
// 3.2 s after the heal, fenced at 13.2 s, off them at 15 s. Receive now
// ignores such a freeze once the sender's successor is known:
// TestFrozenAckOfSupersededIncarnation.)
func TestRandomizedAdversary(t *testing.T) {
	seeds := 60
	if testing.Short() {
		seeds = 10
	}
	if n, err := strconv.Atoi(os.Getenv("LEDGER_SEEDS")); err == nil {
		seeds = n
	}
	// LEDGER_REGIONS=10 runs every seed with that many regions, as for
	// TestRandomized.
	regions, _ := strconv.Atoi(os.Getenv("LEDGER_REGIONS"))
	var tot advResult
	var worst, worstTokens time.Duration
	for seed := int64(1); seed <= int64(seeds); seed++ {
		rng := rand.New(rand.NewSource(seed * 104729))
		o := simOpts{
			regions:    2 + rng.Intn(4),
			keys:       3,
			loss:       rng.Float64() * 0.3,
			dup:        rng.Float64() * 0.2,
			maxDelay:   time.Duration(rng.Int63n(int64(2 * time.Second))),
			writeFail:  rng.Float64() * 0.2,
			partitions: rng.Intn(3) != 0,
			restarts:   rng.Intn(2) == 0,
			resets:     rng.Intn(3) == 0,
			chaos:      20 * time.Second,
			calm:       15 * time.Second,
			config:     withEnv(smallLimit(rng)), // a burst of 1 to 4 in a quarter of the seeds; LEDGER_BAND, LEDGER_HEARTBEAT
		}
		if regions >= 2 {
			o.regions = regions
		}
		res := runAdversarySim(t, seed, o)
		if res.violation != "" {
			t.Fatalf("seed %d %+v: SAFETY: %s", seed, o, res.violation)
		}
		if len(res.honestImplausible) > 0 {
			t.Fatalf("seed %d: %d honest reports refused as implausible, first: %s", seed, len(res.honestImplausible), res.honestImplausible[0])
		}
		if res.liveness != "" {
			t.Errorf("seed %d %+v: LIVENESS under replay: %s", seed, o, res.liveness)
		}
		if s0cfg(o).Quantum > 0 {
			// Whole tokens: measured, not bounded (TestRandomized); at the
			// targets by the end of the calm phase (res.liveness).
			worstTokens = max(worstTokens, res.healedIn)
		} else if b := randomHealBound(s0cfg(o)); res.healedIn < 0 || res.healedIn > b {
			t.Errorf("seed %d %+v: LIVENESS under replay: at the targets %v after the heal, bound %v", seed, o, res.healedIn, b)
		} else {
			worst = max(worst, res.healedIn)
		}
		tot.steps += res.steps
		tot.fences += res.fences
		tot.injected += res.injected
		tot.replayed += res.replayed
		tot.refused += res.refused
		tot.replayRejected += res.replayRejected
	}
	if tot.refused == 0 || tot.replayed == 0 {
		t.Fatalf("the adversary did nothing: %+v", tot)
	}
	t.Logf("from the heal to the targets: worst %v, bound %v; small limits (whole tokens): worst %v", worst, randomHealBound(simConfig()), worstTokens)
	t.Logf("%d seeds, %d steps, %d fences; adversary: %d replays and %d forgeries (%d refused by the authenticated channel), %d replays rejected by the ledgers",
		seeds, tot.steps, tot.fences, tot.replayed, tot.injected, tot.refused, tot.replayRejected)
}

// TestPlausibility: reports from a verified sender whose counters it could
// not hold are rejected whole, change no share and fence no one.
func TestPlausibility(t *testing.T) {
	cfg := simConfig()
	regions := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 2}}
	floor, initial := Split(cfg, regions)
	maxHold := func(i int) int64 {
		var o int64
		for j := range floor {
			if j != i {
				o += floor[j]
			}
		}
		return cfg.Units - o
	}
	good := func() Report {
		return Report{From: "b", Inc: 1, Seq: 1, Base: floor[1] + initial[1],
			Keys: []KeyReport{{Key: "k", Position: floor[1] + initial[1]}}}
	}
	me := Counter{Region: "a", Inc: 1}
	tests := []struct {
		name string
		mod  func(*Report)
	}{
		{"base below floor", func(r *Report) { r.Base = floor[1] - 1 }},
		{"base above what it could hold", func(r *Report) { r.Base = maxHold(1) + 1 }},
		{"position below floor", func(r *Report) { r.Keys[0].Position = floor[1] - 1 }},
		{"position above what it could hold", func(r *Report) { r.Keys[0].Position = maxHold(1) + 1 }},
		{"gift raising us above what we could hold", func(r *Report) {
			c := me
			c.Units = maxHold(0) - (floor[0] + initial[0]) + 1
			r.Keys[0].Gave = []Counter{c}
		}},
		{"gift near MaxInt64", func(r *Report) { c := me; c.Units = math.MaxInt64; r.Keys[0].Gave = []Counter{c} }},
		{"applied more of our gifts than we gave", func(r *Report) { c := me; c.Units = 1; r.Keys[0].Applied = []Counter{c} }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, err := New(cfg, "a", regions, Start{Inc: 1, RunID: "1"}, 0)
			if err != nil {
				t.Fatal(err)
			}
			before := l.Position("k")
			r := good()
			tc.mod(&r)
			out, err := l.Receive(time.Millisecond, r)
			if !errors.Is(err, ErrImplausible) {
				t.Fatalf("got %v, want ErrImplausible", err)
			}
			if out.Fenced || l.Fenced() || len(out.Writes) > 0 || l.Position("k") != before || l.Stats().Rejected != 1 {
				t.Fatalf("rejected report changed something: out %+v, position %+v -> %+v", out, before, l.Position("k"))
			}
			// The honest report is accepted, and a gift up to the bound too.
			ok := good()
			c := me
			c.Units = maxHold(0) - (floor[0] + initial[0])
			ok.Keys[0].Gave = []Counter{c}
			if _, err := l.Receive(2*time.Millisecond, ok); err != nil {
				t.Fatalf("largest plausible gift refused: %v", err)
			}
			if got := l.Position("k").Units; got != maxHold(0) {
				t.Fatalf("position %d after the largest gift, want %d", got, maxHold(0))
			}
		})
	}
}
