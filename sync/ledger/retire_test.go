package ledger

import (
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"testing"
	"time"
)

// Key churn in the randomized harness (simOpts.churn): keys die (no demand
// anywhere) and come back, so every retirement protocol path runs through
// loss, duplication, reordering, partitions, restarts and store resets, and
// a key is re-created after it was forgotten while old reports about it are
// still in flight. sim.check asserts invariant 1 at every step as usual;
// checkHeld and forgotten assert the memory bound.

// heldStats summarises the keys the ledgers held during churn runs.
type heldStats struct {
	runs, maxHeld, maxRetiring, forgets, retirements int
	maxLingering                                     int // held, neither active nor retiring nor paid
	cycles                                           int // held at the end for a pair's net (three regions or more)
}

func (h *heldStats) add(o heldStats) {
	h.runs += o.runs
	h.maxHeld = max(h.maxHeld, o.maxHeld)
	h.maxRetiring = max(h.maxRetiring, o.maxRetiring)
	h.maxLingering = max(h.maxLingering, o.maxLingering)
	h.forgets += o.forgets
	h.retirements += o.retirements
	h.cycles += o.cycles
}

func (h heldStats) String() string {
	return fmt.Sprintf("%d runs, %d retirements, %d keys forgotten; per ledger at most %d keys held, %d retiring, %d idle not yet forgotten; at the ends %d keys held for a pair's net",
		h.runs, h.retirements, h.forgets, h.maxHeld, h.maxRetiring, h.maxLingering, h.cycles)
}

// churn kills or revives one key, half the time.
func (s *sim) churn() {
	if s.rng.Intn(2) != 0 {
		return
	}
	k := s.rng.Intn(len(s.keys))
	s.alive[k] = !s.alive[k]
	for _, r := range s.regions {
		r.demand[k] = 0
		if s.alive[k] && s.rng.Intn(4) != 0 {
			r.demand[k] = s.keys[k].rate * s.rng.Float64() * 1.2
		}
	}
}

// checkHeld records, after every step, how many keys each ledger holds.
func (s *sim) checkHeld() {
	for _, r := range s.regions {
		l := r.led
		if l == nil {
			continue
		}
		var retiring, lingering int
		for _, k := range l.keys {
			switch {
			case k.retiring():
				retiring++
			case !k.active && k.extra() == 0:
				lingering++
			}
		}
		s.held.maxHeld = max(s.held.maxHeld, len(l.keys))
		s.held.maxRetiring = max(s.held.maxRetiring, retiring)
		s.held.maxLingering = max(s.held.maxLingering, lingering)
	}
}

// forgotten checks, at the end of a run's calm phase, that every ledger
// has forgotten every key without demand, except the keys the protocol
// keeps (see "Idle keys" in the package doc): paid by a reclaim somewhere
// (the cumulative payment names them for good), holding reclaim terms
// (frozen), or with a pair whose units did not come back the way they went
// (a cycle among three regions or more that could not settle yet, see
// settle.go), or settled lately; and that no retirement or closure
// is pending. It returns what is wrong, or "".
func (s *sim) forgotten() string {
	s.held.runs = 1
	keep := map[string]bool{} // paid, or still estimated to have demand somewhere
	for _, r := range s.regions {
		if r.led != nil {
			for n, k := range r.led.keys {
				keep[n] = keep[n] || k.extra() != 0 || k.demand > 0
			}
		}
	}
	var bad []string
	for _, r := range s.regions {
		l := r.led
		if l == nil {
			continue
		}
		s.held.retirements += int(l.retires)
		s.held.forgets += l.stats.Forgotten
		for n, k := range l.keys {
			cycle := false
			for _, pr := range l.pairsOf(k) {
				cycle = cycle || pr.recv != pr.give
			}
			if cycle && !k.retiring() {
				s.held.cycles++
			}
			// A key whose settlement ended lately waits out IdleAfter from
			// the payments' reports (which moved a position off its base)
			// before it leaves coordination, then the idle reports.
			recent := s.local(r)-k.lastUse < 2*s.cfg.IdleAfter+l.idleReported()
			if k.retiring() || !keep[n] && k.frozen() == 0 && !cycle && !recent {
				bad = append(bad, fmt.Sprintf("%s/%d holds %s (active %v, retiring %v, pairs %+v)", r.name, r.inc, n, k.active, k.retiring(), l.pairsOf(k)))
			}
		}
		if len(l.closing) > 0 {
			bad = append(bad, fmt.Sprintf("%s/%d: %d closures not acknowledged", r.name, r.inc, len(l.closing)))
		}
	}
	sort.Strings(bad)
	return strings.Join(bad, "; ")
}

// twoRegions drives two ledgers by hand over a perfect network and store,
// keeping every report either sends, for replays.
type twoRegions struct {
	*cluster
	sent []Report
}

func (c *twoRegions) round(key string, use []int64) {
	c.roundWith(func(i int, l *Ledger) {
		if use[i] > 0 {
			l.Usage(c.now, key, 100, use[i], 0)
		}
	})
}

// roundWith runs one interval: usage(i, ledger) feeds each ledger's usage,
// then both tick and every report (and the reports their confirmations
// bring) is delivered, in order.
func (c *twoRegions) roundWith(usage func(i int, l *Ledger)) {
	c.now += c.cfg.Interval
	var reps []*Report
	for i, l := range c.l {
		usage(i, l)
		out := l.Tick(c.now)
		reps = append(reps, out.Report)
		if r := c.confirm(i, out).Report; r != nil {
			reps = append(reps, r)
		}
	}
	for len(reps) > 0 {
		r := reps[0]
		reps = reps[1:]
		if r == nil {
			continue
		}
		c.sent = append(c.sent, *r)
		to := 1 - c.l[0].index(r.From)
		out, err := c.l[to].Receive(c.now, *r)
		if err != nil {
			c.t.Fatalf("r%d rejects %+v: %v", to, r, err)
		}
		if more := c.confirm(to, out).Report; more != nil {
			reps = append(reps, more)
		}
	}
}

// settleUntilForgotten runs rounds without usage until neither ledger
// holds key, and returns the number of rounds.
func (c *twoRegions) settleUntilForgotten(key string) int {
	for n := 1; n <= 300; n++ {
		c.round(key, []int64{0, 0})
		if c.l[0].keys[key] == nil && c.l[1].keys[key] == nil {
			return n
		}
	}
	c.t.Fatalf("%s never forgotten: %+v / %+v", key, c.l[0].keys[key], c.l[1].keys[key])
	return 0
}

func activeWithGifts(t *testing.T, c *twoRegions, key string, use []int64) {
	t.Helper()
	for i := 0; i < 20; i++ {
		c.round(key, use)
	}
	if p := c.l[1].Position(key); !p.Active || p.Units <= p.Initial {
		t.Fatalf("setup: want r1 above its base on %s, got %+v", key, p)
	}
	gifts := false
	for i := range c.sent {
		gifts = gifts || gaveTo(&c.sent[i], key, "r1") > 0
	}
	if !gifts {
		t.Fatalf("setup: no gift counter sent")
	}
}

// TestLateDuplicateAfterForget replays every report of a key's active life
// (gift counters in them), duplicated and shuffled, after both regions have
// forgotten the key, then again after the key came back and moved units the
// other way: no counter is applied twice, nothing is lost.
func TestLateDuplicateAfterForget(t *testing.T) {
	c := &twoRegions{cluster: newCluster(t, 2)}
	activeWithGifts(t, c, "k", []int64{0, 80})
	old := append([]Report(nil), c.sent...)
	n := c.settleUntilForgotten("k")
	if c.l[0].retires+c.l[1].retires == 0 {
		t.Fatal("the key was forgotten without a retirement: its counters were not zero")
	}
	t.Logf("forgotten by both regions %d intervals after the demand stopped (%d reports replayed)", n, len(old))
	rng := rand.New(rand.NewSource(1))
	replay := func(reps []Report) {
		t.Helper()
		dup := append(append([]Report(nil), reps...), reps...)
		rng.Shuffle(len(dup), func(a, b int) { dup[a], dup[b] = dup[b], dup[a] })
		for _, r := range dup {
			to := 1 - c.l[0].index(r.From)
			out, _ := c.l[to].Receive(c.now, r) // a rejection is fine; an application is not
			c.confirm(to, out)
			if s := c.sum("k"); s > c.cfg.Units {
				t.Fatalf("late report applied twice: sum of positions %d > %d", s, c.cfg.Units)
			}
		}
	}
	replay(old)
	for i, l := range c.l {
		if p := l.Position("k"); p.Units != p.Initial {
			t.Fatalf("r%d at %d after the replay, base %d", i, p.Units, p.Initial)
		}
	}
	// The old reports left nothing behind for long: both forget k again.
	c.settleUntilForgotten("k")
	// The key comes back, the other way round; the old reports again.
	mark := len(c.sent)
	activeWithGiftsReversed(t, c)
	replay(old)
	replay(c.sent[:mark])
	for i := 0; i < 3*c.cfg.FullEvery; i++ {
		c.round("k", []int64{80, 0})
	}
	if s := c.sum("k"); s != c.cfg.Units {
		t.Fatalf("after the replays the regions hold %d of %d units", s, c.cfg.Units)
	}
	c.settleUntilForgotten("k")
	if s := c.sum("k"); s != c.cfg.Units {
		t.Fatalf("forgotten, the regions hold %d of %d units", s, c.cfg.Units)
	}
}

func activeWithGiftsReversed(t *testing.T, c *twoRegions) {
	t.Helper()
	for i := 0; i < 20; i++ {
		c.round("k", []int64{80, 0})
	}
	if p := c.l[0].Position("k"); !p.Active || p.Units <= p.Initial {
		t.Fatalf("setup: want r0 above its base, got %+v", p)
	}
}

// TestRetireWithAGiftInFlight: a region retires while its peer's gift to
// it is still in flight (lowered and confirmed by the giver, not applied).
// The closure carries the gift into the new counters, so it is applied
// after the retirement instead of being lost.
func TestRetireWithAGiftInFlight(t *testing.T) {
	c := &twoRegions{cluster: newCluster(t, 2)}
	activeWithGifts(t, c, "k", []int64{0, 80})
	// Settle until r1 retires; r0 keeps k active meanwhile (as if it had
	// seen a request just now), so r0 does not retire first.
	var held []Report
	for i := 0; i < 300 && c.l[1].keys["k"] != nil && !c.l[1].keys["k"].retiring(); i++ {
		if k0 := c.l[0].keys["k"]; k0 != nil {
			k0.lastUse = c.now
		}
		c.round("k", []int64{0, 0})
	}
	k1 := c.l[1].keys["k"]
	if k1 == nil || !k1.retiring() {
		t.Fatalf("r1 never retired k: %+v", k1)
	}
	// r0 gives r1 more by hand (as a late decision of its allocator would):
	// lowered, written and confirmed, published in a report r1 never gets.
	k0 := c.l[0].keys["k"]
	if k0 == nil || k0.retiring() {
		t.Fatalf("setup: r0 should still coordinate k: %+v", k0)
	}
	c.l[0].pair(k0, 1).give += 1000
	k0.gifted, k0.active = true, true
	c.now += c.cfg.Interval
	w, ok := c.l[0].write(k0, c.now)
	if !ok {
		t.Fatal("no write for the gift")
	}
	rep := c.l[0].ShareApplied(c.now, "k", w.Version).Report
	if gaveTo(rep, "k", "r1") == 0 {
		t.Fatalf("gift not published: %+v", rep)
	}
	held = append(held, *rep)
	// Now r1's retirement reaches r0, which closes with the gift in flight.
	for i := 0; i < 100 && (c.l[0].keys["k"] != nil || c.l[1].keys["k"] != nil); i++ {
		c.round("k", []int64{0, 0})
	}
	if s := c.sum("k"); s != c.cfg.Units {
		t.Fatalf("after the retirement the regions hold %d of %d units", s, c.cfg.Units)
	}
	// The held-back report is late and must change nothing now.
	for _, r := range held {
		out, _ := c.l[1].Receive(c.now, r)
		c.confirm(1, out)
	}
	if s := c.sum("k"); s != c.cfg.Units {
		t.Fatalf("the late report moved units: %d of %d", s, c.cfg.Units)
	}
}

// TestChurnHeldKeysBounded: two regions, 3,000 distinct keys over the run,
// 100 with demand at any time (a sliding window, all of it in r1, so r0
// gives and every key's pair moves units both ways before it goes idle).
// Every ledger holds at most the keys in use plus those idle within the
// last IdleAfter and the idle reports' time, and nothing at the end.
func TestChurnHeldKeysBounded(t *testing.T) {
	c := &twoRegions{cluster: newCluster(t, 2)}
	const active, total = 100, 3000
	name := func(i int) string { return fmt.Sprintf("k%05d", i) }
	window := int((c.cfg.IdleAfter + c.l[0].idleReported()) / c.cfg.Interval)
	bound := active + window + 10 // the retirement itself: a few intervals
	maxHeld := 0
	for t0 := 0; t0 < total; t0++ {
		c.roundWith(func(i int, l *Ledger) {
			if i == 1 {
				for k := t0; k < t0+active && k < total; k++ {
					l.Usage(c.now, name(k), 100, 40, 0)
				}
			}
		})
		for i, l := range c.l {
			maxHeld = max(maxHeld, len(l.keys))
			if len(l.keys) > bound {
				t.Fatalf("interval %d: r%d holds %d keys, bound %d (%d in use)", t0, i, len(l.keys), bound, active)
			}
		}
	}
	for i := 0; i < window+50; i++ {
		c.round("none", []int64{0, 0})
	}
	for i, l := range c.l {
		if len(l.keys) != 0 || len(l.closing) != 0 {
			t.Fatalf("r%d still holds %d keys, %d closures", i, len(l.keys), len(l.closing))
		}
	}
	t.Logf("%d keys seen, %d in use at a time: at most %d held per region (bound %d); r0 retired %d, forgot %d; r1 retired %d, forgot %d",
		total, active, maxHeld, bound, c.l[0].retires, c.l[0].stats.Forgotten, c.l[1].retires, c.l[1].stats.Forgotten)
	if c.l[0].retires == 0 || c.l[1].retires == 0 {
		t.Fatal("no retirement: the keys' pairs never moved units")
	}
}

// TestClosuresWaitForRoom: 500 keys go idle at once, so both regions
// retire them together and each closes 500 of the other's retirements,
// with room for 10 closures per report (Config.MaxClosureBytes). Every
// report stays within it, the closures beyond it wait, and every key is
// still forgotten by both, never above the limit and back at the bases.
func TestClosuresWaitForRoom(t *testing.T) {
	c := &twoRegions{cluster: newCluster(t, 2)}
	const keys, room = 500, 10
	name := func(i int) string { return fmt.Sprintf("k%05d", i) }
	budget := room * closureBytes(name(0))
	for _, l := range c.l {
		l.cfg.MaxClosureBytes = budget
	}
	for r := 0; r < 20; r++ { // demand in r1 only: r0 gives every key
		c.roundWith(func(i int, l *Ledger) {
			if i == 1 {
				for k := 0; k < keys; k++ {
					l.Usage(c.now, name(k), 100, 40, 0)
				}
			}
		})
	}
	moved := c.l[0].Position(name(0)).Units < c.l[0].base
	if !moved {
		t.Fatalf("setup: r0 gave nothing: %d at base %d", c.l[0].Position(name(0)).Units, c.l[0].base)
	}
	mostWaiting, rounds := 0, 0
	busy := func() bool {
		return len(c.l[0].keys)+len(c.l[1].keys)+len(c.l[0].closing)+len(c.l[1].closing) > 0
	}
	for ; rounds < 2000 && busy(); rounds++ {
		c.sent = c.sent[:0]
		c.round("none", []int64{0, 0})
		for _, r := range c.sent {
			size := 0
			for _, cl := range r.Closes {
				size += closureBytes(cl.Key)
			}
			if size > budget {
				t.Fatalf("round %d: a report of %s carries %d closures, %d bytes, room %d", rounds, r.From, len(r.Closes), size, budget)
			}
		}
		for _, l := range c.l {
			carried, waiting := l.Closures()
			if carried+waiting != len(l.closing) || carried > room {
				t.Fatalf("round %d: Closures() = %d carried, %d waiting, of %d held (room %d)", rounds, carried, waiting, len(l.closing), room)
			}
			mostWaiting = max(mostWaiting, waiting)
		}
		for _, k := range []int{0, keys / 2, keys - 1} {
			if s := c.sum(name(k)); s > c.cfg.Units {
				t.Fatalf("round %d: %s sums to %d of %d units", rounds, name(k), s, c.cfg.Units)
			}
		}
	}
	for k := 0; k < keys; k++ {
		if s := c.sum(name(k)); s != c.cfg.Units {
			t.Fatalf("forgotten, %s sums to %d of %d units", name(k), s, c.cfg.Units)
		}
	}
	for i, l := range c.l {
		if len(l.keys) != 0 || len(l.closing) != 0 {
			t.Fatalf("after %d rounds r%d still holds %d keys, %d closures", rounds, i, len(l.keys), len(l.closing))
		}
	}
	if mostWaiting <= 0 {
		t.Fatalf("no closure ever waited for room: the test tests nothing")
	}
	t.Logf("%d keys retired with room for %d closures per report: forgotten in %d rounds, at most %d closures waiting; r0 retired %d, r1 %d",
		keys, room, rounds, mostWaiting, c.l[0].retires, c.l[1].retires)
}

// TestIdleKeyInThreeFullReports: an idle key is carried by the next
// idleFullReports full reports and then dropped from them (and, its pairs
// zero, forgotten), however often reports go out. Here reports go out at
// every Tick (another key's demand moves each one) while the heartbeat is
// 1 s: counted in heartbeat periods, as before, the idle key rode 3
// FullEvery heartbeats of full reports, 30 of them.
func TestIdleKeyInThreeFullReports(t *testing.T) {
	cfg := simConfig()
	cfg.HeartbeatEvery, cfg.DemandBand, cfg.HalfLife = time.Second, 0, 0
	specs := []RegionSpec{{"a", 1}, {"b", 1}}
	reg, err := NewRegistry(cfg, specs)
	if err != nil {
		t.Fatal(err)
	}
	st, err := reg.Start("a")
	if err != nil {
		t.Fatal(err)
	}
	st.RunID = "run1"
	l, err := New(cfg, "a", specs, st, 0)
	if err != nil {
		t.Fatal(err)
	}
	full, idleAt := 0, time.Duration(-1)
	for i := 1; i <= 2000 && l.keys["idle"] != nil || i < 10; i++ {
		now := time.Duration(i) * cfg.Interval
		l.Usage(now, "busy", 100, int64(5+10*(i%2)), 0) // moves every Tick
		if i < 5 {
			l.Usage(now, "idle", 100, 5, 0)
		}
		out := l.Tick(now)
		for _, w := range out.Writes {
			l.ShareApplied(now, w.Key, w.Version)
		}
		if k := l.keys["idle"]; k != nil && !k.active && idleAt < 0 {
			idleAt = now
		}
		if idleAt < 0 || now == idleAt {
			continue
		}
		if out.Report == nil {
			t.Fatalf("tick %d: no report, though a key moved", i)
		}
		busy := false
		for _, kr := range out.Report.Keys {
			busy = busy || kr.Key == "busy"
			if kr.Key == "idle" {
				full++
			}
		}
		if !busy {
			t.Fatalf("tick %d: busy key not reported", i)
		}
	}
	if idleAt < 0 {
		t.Fatal("the key never went idle")
	}
	if l.keys["idle"] != nil {
		t.Fatalf("the idle key is still held %v after it went idle", 2000*cfg.Interval-idleAt)
	}
	if full != idleFullReports {
		t.Fatalf("the idle key rode %d reports after going idle, want %d (full reports)", full, idleFullReports)
	}
}
