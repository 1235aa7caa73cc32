package ledger

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"testing"
	"time"
)

// Focused tests: one per trap of the ledger protocol (gift order, lazy refill
// across a share change, data loss under the bucket, reclaim and late gifts,
// expiry and idle keys, clocks), driving Ledgers by hand.

const ms = time.Millisecond

type cluster struct {
	t    testing.TB
	cfg  Config
	spec []RegionSpec
	reg  *Registry
	l    []*Ledger
	now  time.Duration
	use  []int64 // cost per interval fed to each ledger before its Tick
	down []bool  // silent: no tick, no report in or out
	got  []Contribution
}

func newCluster(t testing.TB, n int) *cluster {
	t.Helper()
	c := &cluster{t: t, cfg: simConfig()}
	c.cfg.HalfLife = 0
	// A report at every Tick, every change reported: the tests on a
	// cluster step through exchanges report by report (those about the
	// heartbeat and the band set them).
	c.cfg.HeartbeatEvery, c.cfg.DemandBand = 0, 0
	for i := 0; i < n; i++ {
		c.spec = append(c.spec, RegionSpec{Name: "r" + string(rune('0'+i)), Weight: 1})
	}
	var err error
	if c.reg, err = NewRegistry(c.cfg, c.spec); err != nil {
		t.Fatal(err)
	}
	c.use, c.down = make([]int64, n), make([]bool, n)
	for i := 0; i < n; i++ {
		c.start(i)
	}
	return c
}

func (c *cluster) start(i int) {
	c.t.Helper()
	st, err := c.reg.Start(c.spec[i].Name)
	if err != nil {
		c.t.Fatal(err)
	}
	st.RunID = "run1"
	l, err := New(c.cfg, c.spec[i].Name, c.spec, st, c.now)
	if err != nil {
		c.t.Fatal(err)
	}
	// Boot: the marker create, confirmed.
	out := l.Tick(c.now)
	for _, w := range out.Writes {
		if w.Create() {
			l.ShareApplied(c.now, MarkerKey, w.Version)
		}
	}
	if len(c.l) <= i {
		c.l = append(c.l, l)
	} else {
		c.l[i] = l
	}
}

// confirm applies every write of out to a perfect store.
func (c *cluster) confirm(i int, out Output) Output {
	var more Output
	for _, w := range out.Writes {
		o := c.l[i].ShareApplied(c.now, w.Key, w.Version)
		if o.Report != nil {
			more.Report = o.Report
		}
	}
	return more
}

func (c *cluster) deliver(to int, r *Report) Output {
	c.t.Helper()
	if r == nil {
		return Output{}
	}
	out, err := c.l[to].Receive(c.now, *r)
	if err != nil {
		c.t.Fatalf("r%d rejects %+v: %v", to, r, err)
	}
	return out
}

func (c *cluster) sum(key string) int64 {
	var s int64
	for _, l := range c.l {
		s += l.Position(key).Units
	}
	return s
}

// exchange runs one round: every ledger ticks, all writes are confirmed, all
// reports are delivered everywhere.
func (c *cluster) exchange() {
	c.now += c.cfg.Interval
	var reps []*Report
	for i, l := range c.l {
		if c.down[i] {
			continue
		}
		if c.use[i] > 0 {
			l.Usage(c.now, "k", 100, c.use[i], 0)
		}
		out := l.Tick(c.now)
		c.got = append(c.got, out.Contributions...)
		reps = append(reps, out.Report)
		if r := c.confirm(i, out).Report; r != nil {
			reps = append(reps, r)
		}
	}
	for from, r := range reps {
		if r == nil {
			continue
		}
		for to := range c.l {
			if !c.down[to] && c.l[to].names[c.l[to].self] != r.From {
				c.confirm(to, c.deliver(to, r))
			}
		}
		_ = from
	}
}

func gaveTo(r *Report, key, to string) int64 {
	if r == nil {
		return 0
	}
	for _, k := range r.Keys {
		if k.Key == key {
			for _, g := range k.Gave {
				if g.Region == to {
					return g.Units
				}
			}
		}
	}
	return 0
}

func TestTraps(t *testing.T) {
	t.Run("order_of_gift", func(t *testing.T) {
		c := newCluster(t, 2)
		// r1 has all the demand; r0 learns it.
		c.l[1].Usage(c.now, "k", 100, 100, 0)
		out1 := c.l[1].Tick(c.now + 10*ms)
		c.deliver(0, out1.Report)
		before := c.l[1].Position("k").Units
		c.now += c.cfg.Interval
		out0 := c.l[0].Tick(c.now)
		var lowered *Write
		for i, w := range out0.Writes {
			if w.Key == "k" {
				lowered = &out0.Writes[i]
			}
		}
		if lowered == nil || lowered.Units >= c.l[0].Base() {
			t.Fatalf("the giver must emit its lowered share first, got %+v", out0.Writes)
		}
		if g := gaveTo(out0.Report, "k", "r1"); g != 0 {
			t.Fatalf("counter %d published before the lowering is durable", g)
		}
		c.deliver(1, out0.Report)
		if got := c.l[1].Position("k").Units; got != before {
			t.Fatalf("receiver raised to %d before the giver's write was confirmed", got)
		}
		// Durable: now the counter goes out and the receiver raises at once.
		rep := c.l[0].ShareApplied(c.now, "k", lowered.Version).Report
		if g := gaveTo(rep, "k", "r1"); g == 0 {
			t.Fatalf("confirmed gift not published: %+v", rep)
		}
		out := c.deliver(1, rep)
		if len(out.Writes) == 0 || c.l[1].Position("k").Units <= before {
			t.Fatalf("receiver did not raise: %+v", out)
		}
		if s := c.sum("k"); s > c.cfg.Units {
			t.Fatalf("sum %d > %d", s, c.cfg.Units)
		}
	})

	t.Run("lazy_refill_across_share_change", func(t *testing.T) {
		s := newSim(t, 1, simOpts{regions: 2, keys: 1})
		r, k := s.regions[0], s.keys[0]
		s.now = int64(time.Second)
		r.st.marker = &marker{ver: Version{1, 1}, units: 500_000, leaseUntil: math.MaxInt64}
		r.demand[0] = 0
		s.settle(r)
		b := r.st.buckets[k.name]
		b.tokens = b.capcity // full at the old share
		oldRate := b.rate
		s.now += int64(100 * ms)
		// Lower the share to the floor of nothing: 1% of the limit.
		s.applyWrite(r, Write{Key: k.name, Version: Version{1, 2}, Units: 10_000})
		want := math.Floor(k.cap * 0.01)
		if b.capcity != want || b.tokens > want {
			t.Fatalf("after lowering: capacity %v tokens %v, want capacity %v and tokens clamped", b.capcity, b.tokens, want)
		}
		if b.rate >= oldRate {
			t.Fatalf("rate %v not lowered from %v", b.rate, oldRate)
		}
		// Raising again: the tokens refilled so far accrued at the low rate.
		b.tokens = 0
		s.now += int64(time.Second)
		s.applyWrite(r, Write{Key: k.name, Version: Version{1, 3}, Units: 500_000})
		if b.tokens > math.Floor(k.rate*0.01)+1e-9 {
			t.Fatalf("refill across the raise used the new rate: %v tokens", b.tokens)
		}
	})

	t.Run("data_loss_under_bucket", func(t *testing.T) {
		c := newCluster(t, 2)
		c.use[1] = 50
		for i := 0; i < 4; i++ {
			c.exchange()
		}
		if p := c.l[0].Position("k"); p.Units >= p.Initial {
			t.Fatalf("setup: r0 should have given, position %d base %d", p.Units, p.Initial)
		}
		// The store of r0 restarts empty: it enforces floors (no marker) until
		// the ledger has re-asserted every key and only then re-creates the marker.
		s := newSim(t, 1, simOpts{regions: 2, keys: 1})
		s.regions[0].st = &store{runID: 2, recs: map[string]*rec{}, buckets: map[string]*bucket{}}
		if u := s.enforced(s.regions[0], s.keys[0].name); u != s.floor[0] {
			t.Fatalf("empty store enforces %d, want the floor %d", u, s.floor[0])
		}
		out := c.l[0].StoreReset(c.now, "2")
		var re *Write
		for i, w := range out.Writes {
			if w.Key == "k" {
				re = &out.Writes[i]
			}
		}
		if re == nil || re.Units != c.l[0].Position("k").Units {
			t.Fatalf("StoreReset must re-assert the share of k, got %+v", out.Writes)
		}
		c.now += c.cfg.Interval
		for _, w := range c.l[0].Tick(c.now).Writes {
			if w.Create() {
				t.Fatalf("marker re-created before the re-asserted share is confirmed")
			}
		}
		c.l[0].ShareApplied(c.now, "k", re.Version)
		c.now += c.cfg.Interval
		var create *Write
		for _, w := range c.l[0].Tick(c.now).Writes {
			if w.Create() {
				create = &w
			}
		}
		if create == nil || create.Marker.RunID != "2" || create.Units != c.l[0].Base() {
			t.Fatalf("want a marker create for run 2 at the base, got %+v", create)
		}
	})

	t.Run("reclaim_and_late_gifts", func(t *testing.T) {
		for _, applied := range []bool{false, true} {
			c := newCluster(t, 3)
			c.l[1].Usage(c.now, "k", 100, 100, 0)
			c.exchange() // demand known
			// r0 gives; its confirmed counter is the late gift.
			c.now += c.cfg.Interval
			out0 := c.l[0].Tick(c.now)
			late := c.confirm(0, out0).Report
			if gaveTo(late, "k", "r1") == 0 {
				t.Fatalf("setup: no gift from r0")
			}
			if applied {
				c.deliver(1, late)
			}
			// r0 falls silent. r1 and r2 keep each other alive and freeze r0.
			c.down[0] = true
			for c.now < c.cfg.ReclaimAfter()+2*time.Second {
				c.exchange()
			}
			var rec Record
			for _, x := range c.got {
				r, err := c.reg.Contribute(x)
				if err != nil {
					t.Fatal(err)
				}
				rec = r
			}
			if !rec.Complete {
				t.Fatalf("reclaim of r0 not complete: %+v", rec)
			}
			for _, x := range c.reg.Records() {
				c.l[1].ReclaimRecorded(c.now, x)
				c.l[2].ReclaimRecorded(c.now, x)
			}
			if c.l[1].Fenced() || c.l[2].Fenced() {
				t.Fatalf("survivor fenced: %v %v told %v %v rec %+v", c.l[1].Fenced(), c.l[2].Fenced(), c.l[1].told, c.l[2].told, rec)
			}
			// The late gift arrives after the freeze: ignored.
			before := c.l[1].Position("k").Units
			if _, err := c.l[1].Receive(c.now, *late); !errors.Is(err, ErrFrozenIncarnation) {
				t.Fatalf("late report from the reclaimed incarnation: err %v", err)
			}
			if got := c.l[1].Position("k").Units; got != before {
				t.Fatalf("late gift counted: %d -> %d", before, got)
			}
			f0 := c.l[0].floor[0]
			if s := c.l[1].Position("k").Units + c.l[2].Position("k").Units + f0; s != c.cfg.Units {
				t.Fatalf("applied=%v: survivors %d + floor %d = %d, want exactly %d", applied,
					c.l[1].Position("k").Units+c.l[2].Position("k").Units, f0, s, c.cfg.Units)
			}
		}
	})

	t.Run("expiry_and_idle_keys", func(t *testing.T) {
		c := newCluster(t, 2)
		c.use[1] = 50
		for i := 0; i < 4; i++ {
			c.exchange()
		}
		c.use[1] = 0
		if p := c.l[0].Position("k"); !p.Active || p.Units == p.Initial {
			t.Fatalf("setup: want an active key away from its base, got %+v", p)
		}
		// Demand stops. While anyone is away from its base, the key stays
		// coordinated and its record must not be a Release (expiring) one.
		var released bool
		for i := 0; i < 100 && !released; i++ {
			c.now += c.cfg.Interval
			for j, l := range c.l {
				out := l.Tick(c.now)
				for _, w := range out.Writes {
					if w.Key == "k" && w.Release {
						p := l.Position("k")
						if p.Units != p.Initial {
							t.Fatalf("r%d released k at %d, base %d", j, p.Units, p.Initial)
						}
						if j == 0 {
							released = true
						}
					}
				}
				rep := out.Report
				if r := c.confirm(j, out).Report; r != nil {
					rep = r
				}
				if rep != nil {
					c.confirm(1-j, c.deliver(1-j, rep))
				}
			}
		}
		if !released {
			t.Fatalf("key never left coordination: %+v %+v", c.l[0].Position("k"), c.l[1].Position("k"))
		}
		// Model TTL expiry: once the Release record expires the store's
		// default (the base) applies, which equals the released share.
		s := newSim(t, 1, simOpts{regions: 2, keys: 1})
		r := s.regions[0]
		r.st.marker = &marker{ver: Version{1, 1}, units: 333, leaseUntil: math.MaxInt64}
		s.applyWrite(r, Write{Key: s.keys[0].name, Version: Version{1, 2}, Units: 333, Release: true})
		s.now += int64(time.Hour)
		if u := s.enforced(r, s.keys[0].name); u != 333 {
			t.Fatalf("after expiry the key enforces %d, want the base 333", u)
		}
		s.applyWrite(r, Write{Key: s.keys[0].name, Version: Version{1, 3}, Units: 100})
		s.now += int64(time.Hour)
		if u := s.enforced(r, s.keys[0].name); u != 100 {
			t.Fatalf("a coordinated record expired: %d", u)
		}
	})

	t.Run("clocks", func(t *testing.T) {
		s := newSim(t, 1, simOpts{regions: 2, keys: 1})
		r, k := s.regions[0], s.keys[0]
		r.st.marker = &marker{ver: Version{1, 1}, units: 500_000, leaseUntil: math.MaxInt64}
		r.demand[0] = 0
		s.now = int64(time.Hour)
		s.settle(r)
		b := r.st.buckets[k.name]
		b.tokens = 1
		s.now -= int64(10 * time.Second) // backward step
		s.settle(r)
		if b.tokens != 1 {
			t.Fatalf("a backward step minted: %v tokens", b.tokens)
		}
		s.now += int64(1000 * time.Hour) // forward step
		s.settle(r)
		if b.tokens > b.capcity {
			t.Fatalf("a forward step minted %v > one capacity %v", b.tokens, b.capcity)
		}
		// The store lease ends, in real time, no later than the agent's own
		// deadline, for any clock rates within rho.
		l := newCluster(t, 3).l[0] // with two regions the deadline never comes
		rho := l.cfg.Rho
		for _, left := range []time.Duration{100 * ms, 500 * ms, 900 * ms, 1000 * ms} {
			now := l.leaseDeadline() - left
			v := l.storeLease(now)
			// worst case: write applied StoreTimeout late, store slow, agent fast
			real := float64(l.cfg.StoreTimeout) + float64(v)/(1-rho)
			if real > float64(left)/(1+rho)+1 {
				t.Fatalf("left %v: store lease %v outlives the agent deadline (%v > %v)", left, v, time.Duration(real), time.Duration(float64(left)/(1+rho)))
			}
		}
	})
}

func TestRejectedReportsChangeNothing(t *testing.T) {
	c := newCluster(t, 3)
	c.l[1].Usage(c.now, "k", 100, 100, 0)
	for i := 0; i < 3; i++ {
		c.exchange()
	}
	// A genuine report from r0, then variants of it.
	c.now += c.cfg.Interval
	out := c.l[0].Tick(c.now)
	good := *c.confirm(0, out).Report
	if gaveTo(&good, "k", "r1") == 0 {
		t.Fatal("setup: r0 should have given to r1")
	}
	c.deliver(1, &good)
	mut := func(f func(r *Report)) Report {
		r := good
		r.Acks = append([]Ack(nil), good.Acks...)
		r.Keys = append([]KeyReport(nil), good.Keys...)
		for i := range r.Keys {
			r.Keys[i].Gave = append([]Counter(nil), good.Keys[i].Gave...)
		}
		f(&r)
		return r
	}
	cases := []struct {
		name string
		r    Report
		err  error
	}{
		{"unknown_sender", mut(func(r *Report) { r.From = "mars" }), ErrUnknownRegion},
		{"self_as_sender", mut(func(r *Report) { r.From = "r1" }), ErrUnknownRegion},
		{"zero_incarnation", mut(func(r *Report) { r.Inc = 0 }), ErrMalformed},
		{"zero_seq", mut(func(r *Report) { r.Seq = 0 }), ErrMalformed},
		{"unknown_region_in_counter", mut(func(r *Report) { r.Keys[0].Gave[0].Region = "mars" }), ErrMalformed},
		{"negative_counter", mut(func(r *Report) { r.Keys[0].Gave[0].Units = -1 }), ErrMalformed},
		{"unsorted_keys", mut(func(r *Report) { r.Keys = append(r.Keys, KeyReport{Key: "a"}) }), ErrMalformed},
		{"unknown_region_in_ack", mut(func(r *Report) { r.Acks = append(r.Acks, Ack{Region: "zz", Inc: 1}) }), ErrUnknownRegion},
		{"counter_backwards", mut(func(r *Report) {
			r.Seq += 10
			for i := range r.Keys[0].Gave {
				r.Keys[0].Gave[i].Units = 1
			}
		}), ErrBackwards},
		{"stale_incarnation", mut(func(r *Report) { r.Inc = 0 }), ErrMalformed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := c.l[1]
			before := snapshot(l)
			if _, err := l.Receive(c.now, tc.r); !errors.Is(err, tc.err) {
				t.Fatalf("err %v, want %v", err, tc.err)
			}
			after := snapshot(l)
			after.stats = before.stats
			if !reflect.DeepEqual(before, after) {
				t.Fatalf("state changed")
			}
		})
	}
	t.Run("stale_and_frozen_incarnations", func(t *testing.T) {
		l := c.l[1]
		newer := mut(func(r *Report) { r.Inc = 2; r.Keys = nil })
		if _, err := l.Receive(c.now, newer); err != nil {
			t.Fatal(err)
		}
		before := snapshot(l)
		if _, err := l.Receive(c.now, good); !errors.Is(err, ErrFrozenIncarnation) {
			t.Fatalf("old incarnation after a newer one: err %v", err)
		}
		after := snapshot(l)
		after.stats = before.stats
		if !reflect.DeepEqual(before, after) {
			t.Fatalf("state changed")
		}
	})
	t.Run("duplicate_and_reordered_change_nothing", func(t *testing.T) {
		l := c.l[2]
		c.deliver(2, &good)
		before := snapshot(l)
		c.deliver(2, &good)
		older := mut(func(r *Report) { r.Seq-- })
		c.deliver(2, &older)
		after := snapshot(l)
		after.peers, before.peers = nil, nil // heard time moves; nothing else
		if !reflect.DeepEqual(before, after) {
			t.Fatalf("duplicate or older report changed the ledger")
		}
	})
}

// ledgerSnap is a ledger's comparable state (snapshot): its keys' pairs
// apart, as a key points to its first pair only (reflect.DeepEqual would
// compare that one alone).
type ledgerSnap struct {
	Ledger
	pairs map[string][]pair
}

// snapshot deep-copies the comparable state of a ledger.
func snapshot(l *Ledger) ledgerSnap {
	s := ledgerSnap{Ledger: *l, pairs: map[string][]pair{}}
	s.cfg.Allocate = nil
	s.keys = map[string]*key{}
	s.sorted, s.added = nil, nil // the keys in name order: derived from keys
	for n, k := range l.keys {
		kk := *k
		kk.pairs = nil
		s.pairs[n] = append([]pair(nil), l.pairsOf(k)...)
		if k.pend != nil {
			ps := append([]int64(nil), *k.pend...)
			kk.pend = &ps
		}
		s.keys[n] = &kk
	}
	s.peers = append([]peer(nil), l.peers...)
	for i := range s.peers {
		s.peers[i].pending = map[uint64]Contribution{}
		for k, v := range l.peers[i].pending {
			s.peers[i].pending[k] = v
		}
	}
	s.sent = map[uint64]sentReport{}
	for k, v := range l.sent {
		s.sent[k] = v
	}
	return s
}

// A later incarnation that we hear but that has not acknowledged any of our
// reports (a restarted region behind a one-way or flapping link) gets no
// gifts: it could not apply them, and they would sit in flight until its
// reclaim. Once it acknowledges us, gifts flow.
func TestNoGiftsToANewIncarnationThatCannotHearUs(t *testing.T) {
	c := newCluster(t, 2)
	for i := 0; i < 3; i++ {
		c.exchange()
	}
	c.start(1) // r1 restarts under a new incarnation, with its floor only
	c.now += c.cfg.Interval
	c.l[1].Usage(c.now, "k", 100, 100, 0)
	out1 := c.l[1].Tick(c.now)
	if out1.Report == nil || out1.Report.Inc < 2 {
		t.Fatalf("the new incarnation did not report: %+v", out1.Report)
	}
	c.deliver(0, out1.Report) // r0 hears r1's new incarnation; r1 has not heard r0
	before := c.l[0].Position("k").Units
	for i := 0; i < 3; i++ {
		c.now += c.cfg.Interval
		c.confirm(0, c.l[0].Tick(c.now))
	}
	if after := c.l[0].Position("k").Units; after != before {
		t.Fatalf("r0 gave %d units to an incarnation that never acknowledged it", before-after)
	}
	// Two-way again: r1 hears r0 and acknowledges it; then r0 gives.
	for i := 0; i < 4; i++ {
		c.use[1] = 100
		c.exchange()
	}
	if after := c.l[0].Position("k").Units; after >= before {
		t.Fatalf("r0 still gives nothing once r1 acknowledges it: position %d, before %d", after, before)
	}
}

// TestFrozenAckOfSupersededIncarnation: a report of an incarnation we froze
// that says it froze us too ends our incarnation while it is the newest of
// its region we know of (neither would take the other's gifts again), but
// not once we heard its successor: the report is late or replayed, we pair
// with the successor, and a replay must not fence a live region. After
// the replay the regions keep exchanging and the key's shares still move
// to the demand. Two regions, three and ten.
func TestFrozenAckOfSupersededIncarnation(t *testing.T) {
	// r0/1's report saying it froze r1's incarnation.
	freezing := func(t *testing.T, c *cluster) Report {
		c.now += c.cfg.Interval
		rep := *c.l[0].Tick(c.now).Report
		rep.Acks = append([]Ack(nil), rep.Acks...)
		found := false
		for i := range rep.Acks {
			if rep.Acks[i].Region == "r1" {
				rep.Acks[i].Frozen, found = true, true
			}
		}
		if !found {
			t.Fatalf("setup: r0's report acknowledges no r1: %+v", rep.Acks)
		}
		return rep
	}
	for _, n := range []int{2, 3, 10} {
		t.Run(fmt.Sprintf("current/%d", n), func(t *testing.T) {
			c := newCluster(t, n)
			for i := 0; i < 3; i++ {
				c.exchange()
			}
			rep := freezing(t, c)
			c.l[1].freeze(0, 1, c.now) // r1 froze r0/1 too (by silence)
			out, err := c.l[1].Receive(c.now, rep)
			if !errors.Is(err, ErrFrozenIncarnation) || !out.Fenced {
				t.Fatalf("mutual freeze with r0's newest incarnation: err %v, fenced %v; want both", err, out.Fenced)
			}
		})
		t.Run(fmt.Sprintf("superseded/%d", n), func(t *testing.T) {
			c := newCluster(t, n)
			for i := 0; i < 3; i++ {
				c.exchange()
			}
			rep := freezing(t, c)
			c.start(0) // r0/2
			c.now += c.cfg.Interval
			succ := c.l[0].Tick(c.now).Report
			if succ == nil || succ.Inc != 2 {
				t.Fatalf("setup: r0's successor did not report: %+v", succ)
			}
			c.deliver(1, succ) // r1 freezes r0/1 on hearing r0/2
			before := snapshot(c.l[1])
			out, err := c.l[1].Receive(c.now, rep)
			if !errors.Is(err, ErrFrozenIncarnation) || out.Fenced || c.l[1].fenced {
				t.Fatalf("r0/1's freeze heard after r0/2: err %v, fenced %v; want ErrFrozenIncarnation and no fence", err, out.Fenced)
			}
			after := snapshot(c.l[1])
			after.stats = before.stats
			if !reflect.DeepEqual(before, after) {
				t.Fatal("state changed")
			}
			// Liveness: r1 still takes part. Demand moves to r1; every
			// report is accepted (exchange fails on a rejection), r0/2
			// hears r1 acknowledge it, and with a third region r1 ends
			// above its base. (With two, r0/2 holds only its floor until
			// r0/1's reclaim, which this harness does not record; the
			// randomized adversary runs that end to end, LEDGER_REGIONS=2.)
			c.use[1] = 100
			for i := 0; i < 60; i++ {
				c.exchange()
			}
			if c.l[1].fenced {
				t.Fatal("r1 fenced after the replay")
			}
			if c.l[0].peers[1].ackedSend == 0 {
				t.Fatal("r1 never acknowledged r0/2 after the replay")
			}
			if p := c.l[1].Position("k"); n > 2 && p.Units <= p.Initial {
				t.Fatalf("r1's share did not follow its demand after the replay: %d units, base %d", p.Units, p.Initial)
			}
		})
		// r1 restarts after r0/2 registered: r1/2 starts with r0/1 frozen
		// and has not heard r0/2 (freeze alone would not tell it exists);
		// the registry does (Start.Live). A zombie r0/1 then says it froze
		// r1/2: no fence. Without Live, r1/2 would fence (the control).
		for _, live := range []bool{true, false} {
			t.Run(fmt.Sprintf("registry/live=%v/%d", live, n), func(t *testing.T) {
				c := newCluster(t, n)
				for i := 0; i < 3; i++ {
					c.exchange()
				}
				zombie := c.l[0]
				c.start(0) // r0/2
				succ := c.l[0]
				if !live {
					// r1's registry view without r0/2: a Start by hand
					st, err := c.reg.Start("r1")
					if err != nil {
						t.Fatal(err)
					}
					st.RunID, st.Live = "run1", nil
					l, err := New(c.cfg, "r1", c.spec, st, c.now)
					if err != nil {
						t.Fatal(err)
					}
					c.l[1] = l
				} else {
					c.start(1) // r1/2
				}
				if got := c.l[1].Incarnation().Inc; got != 2 {
					t.Fatalf("setup: r1 at incarnation %d, want 2", got)
				}
				if p := c.l[1].peers[0]; p.frozenInc != 1 || p.seen {
					t.Fatalf("setup: r1/2's view of r0: frozen up to %d, seen %v; want 1 and not seen", p.frozenInc, p.seen)
				}
				c.now += c.cfg.Interval
				rep := *zombie.Tick(c.now).Report
				rep.Acks = append([]Ack(nil), rep.Acks...)
				found := false
				for i := range rep.Acks {
					if rep.Acks[i].Region == "r1" {
						rep.Acks[i] = Ack{Region: "r1", Inc: 2, Frozen: true}
						found = true
					}
				}
				if !found {
					t.Fatalf("setup: r0/1's report acknowledges no r1: %+v", rep.Acks)
				}
				before := snapshot(c.l[1])
				out, err := c.l[1].Receive(c.now, rep)
				if !errors.Is(err, ErrFrozenIncarnation) {
					t.Fatalf("r0/1's report to r1/2: err %v, want ErrFrozenIncarnation", err)
				}
				if !live {
					if !out.Fenced {
						t.Fatal("control: without the registry's r0/2, r1/2 did not fence")
					}
					return
				}
				if out.Fenced || c.l[1].fenced {
					t.Fatal("r1/2 fenced on a freeze from r0/1, which the registry shows superseded by r0/2")
				}
				after := snapshot(c.l[1])
				after.stats = before.stats
				if !reflect.DeepEqual(before, after) {
					t.Fatal("state changed")
				}
				// Liveness: r0/2 and r1/2 pair (every report accepted).
				c.l[0] = succ
				c.use[1] = 100
				for i := 0; i < 60; i++ {
					c.exchange()
				}
				if c.l[1].fenced || c.l[0].fenced {
					t.Fatal("a region fenced after the zombie's report")
				}
				if c.l[0].peers[1].ackedSend == 0 || c.l[1].peers[0].ackedSend == 0 {
					t.Fatal("r0/2 and r1/2 never acknowledged each other")
				}
			})
		}
	}
}

// TestMarkerLostUnderSameRun: a renewal of r0's confirmed marker answered
// with no marker (the store's data flushed, or the marker deleted or
// evicted, its run id unchanged) resets the ledger as a restart does:
// every key is written again, and once those are confirmed the marker is
// created anew for the same run (not as a boot). Before, the ledger kept
// sending renewals that could never apply, and the region enforced its
// floors for good. A zero answer while no marker is confirmed (a Create
// in flight) changes nothing.
func TestMarkerLostUnderSameRun(t *testing.T) {
	c := newCluster(t, 2)
	c.use[1] = 50
	for range 4 {
		c.exchange()
	}
	l := c.l[0]
	if p := l.Position("k"); p.Units >= p.Initial {
		t.Fatalf("setup: r0 should have given, position %d base %d", p.Units, p.Initial)
	}
	c.now += c.cfg.Interval
	var renewal *Write
	for _, w := range l.Tick(c.now).Writes {
		if w.Key == MarkerKey {
			renewal = &w
		}
	}
	if renewal == nil || renewal.Create() {
		t.Fatalf("setup: want a marker renewal, got %+v", renewal)
	}
	out := l.SharesApplied(c.now, []Confirmation{{Key: MarkerKey, Version: Version{}}})
	var re *Write
	for i, w := range out.Writes {
		if w.Key == "k" {
			re = &out.Writes[i]
		}
	}
	if re == nil || re.Units != l.Position("k").Units {
		t.Fatalf("a lost marker must re-assert k's share, got %+v", out.Writes)
	}
	if n := l.Stats().MarkerLost; n != 1 {
		t.Fatalf("Stats.MarkerLost %d, want 1", n)
	}
	// A second zero answer (the renewals in flight) resets nothing more.
	if out := l.ShareApplied(c.now, MarkerKey, Version{}); len(out.Writes) != 0 || l.Stats().MarkerLost != 1 {
		t.Fatalf("a later zero answer: %+v, MarkerLost %d", out.Writes, l.Stats().MarkerLost)
	}
	c.now += c.cfg.Interval
	for _, w := range l.Tick(c.now).Writes {
		if w.Create() {
			t.Fatal("marker re-created before the re-asserted share is confirmed")
		}
	}
	l.ShareApplied(c.now, "k", re.Version)
	c.now += c.cfg.Interval
	var create *Write
	for _, w := range l.Tick(c.now).Writes {
		if w.Create() {
			create = &w
		}
	}
	if create == nil || create.Marker.RunID != "run1" || create.Marker.Boot {
		t.Fatalf("want a marker Create for the same run, not a boot, got %+v", create)
	}
	if out := l.ShareApplied(c.now, MarkerKey, Version{}); len(out.Writes) != 0 || l.Stats().MarkerLost != 1 {
		t.Fatalf("a zero answer while the Create is in flight reset the ledger: %+v", out.Writes)
	}
	l.ShareApplied(c.now, MarkerKey, create.Version)
	c.now += c.cfg.Interval
	for _, w := range l.Tick(c.now).Writes {
		if w.Key == MarkerKey && w.Create() {
			t.Fatalf("the marker is confirmed: want renewals, got a Create %+v", w)
		}
	}
}
