package ledger

import (
	"testing"
	"time"
)

// TestHeartbeat: with HeartbeatEvery, a Tick with nothing changed reports
// only once the heartbeat (bounded by the lease: Config.heartbeat) has
// passed since the last report, and a changed key is reported at the next
// Tick.
func TestHeartbeat(t *testing.T) {
	c := newCluster(t, 3)
	for i := 0; i < 4; i++ {
		c.exchange()
	}
	l := c.l[0]
	l.cfg.HeartbeatEvery = time.Second
	hb := l.cfg.heartbeat()
	if want := (time.Duration(float64(l.cfg.Lease)*(1-l.cfg.Rho)/(1+l.cfg.Rho)) - l.cfg.StoreTimeout - l.cfg.Interval) / 4; hb != want || hb <= l.cfg.Interval {
		t.Fatalf("heartbeat %v, want %v (above the interval %v)", hb, want, l.cfg.Interval)
	}
	for i := range c.l {
		c.l[i].cfg.HeartbeatEvery = l.cfg.HeartbeatEvery
	}
	last, seq := l.lastSent, l.rseq
	reports := 0
	for range 30 { // every region ticks and hears the others' reports
		c.exchange()
		if l.fenced {
			t.Fatal("fenced")
		}
		if l.rseq != seq {
			reports++
			if l.lastSent-last < hb || l.rseq != seq+1 {
				t.Fatalf("report %v after the last, heartbeat %v, with nothing changed", l.lastSent-last, hb)
			}
		} else if c.now-last >= hb {
			t.Fatalf("no report %v after the last (heartbeat %v)", c.now-last, hb)
		}
		last, seq = l.lastSent, l.rseq
	}
	if reports == 0 || reports == 30 {
		t.Fatalf("%d reports in 30 ticks", reports)
	}
	// A key with usage changes: reported at the next Tick.
	now := c.now + l.cfg.Interval
	l.Usage(now, "k2", 100, 5, 0)
	r := l.Tick(now).Report
	if r == nil || len(r.Keys) == 0 || r.Keys[0].Key != "k2" {
		t.Fatalf("a changed key was not reported at once: %+v", r)
	}
}

// TestResyncAfterSilence: with a heartbeat, what a peer missed during a cut
// (here r0's new demand) reaches it in the first reports after the heal: a
// heartbeat for the two sides to hear each other, then the next Tick's full
// report (Ledger.resync; step 2 of the package doc's liveness bound), not
// at the next of every FullEvery-th report, which with nothing changed
// comes FullEvery heartbeats apart. Cuts of 10 to 24 intervals put the
// heal at every phase of the heartbeat and of the full reports.
func TestResyncAfterSilence(t *testing.T) {
	worst := 0
	for cut := 10; cut < 25; cut++ {
		worst = max(worst, resyncRun(t, cut))
	}
	c := newCluster(t, 2)
	c.cfg.HeartbeatEvery = time.Second
	bound := int(2*c.cfg.heartbeat()/c.cfg.Interval) + 2 // two heartbeats, then a Tick and its delivery
	if worst > bound {
		t.Fatalf("r1 had r0's demand %d intervals after the heal, bound %d", worst, bound)
	}
	t.Logf("r1 had r0's demand at most %d intervals after the heal (bound %d)", worst, bound)
}

// resyncRun cuts two regions apart for cut intervals, r0's demand changing
// at the start, and returns the intervals after the heal until r1 sees it.
func resyncRun(t *testing.T, cut int) int {
	c := newCluster(t, 2)
	for i := range c.l {
		c.l[i].cfg.HeartbeatEvery = time.Second
	}
	c.use[0], c.use[1] = 60, 30
	for range 10 {
		c.exchange()
	}
	seen := func() (int64, int64) {
		return c.l[1].pair(c.l[1].keys["k"], 0).peerDemand, c.l[0].keys["k"].reported()
	}
	if got, want := seen(); got != want {
		t.Fatalf("before the cut r1 sees r0's demand %d, r0 reported %d", got, want)
	}
	// The cut: both tick, their stores confirm, their reports are lost.
	c.use[0] = 20
	for range cut {
		c.now += c.cfg.Interval
		for i, l := range c.l {
			l.Usage(c.now, "k", 100, c.use[i], 0)
			c.confirm(i, l.Tick(c.now))
		}
	}
	if got, want := seen(); got == want {
		t.Fatalf("r1 saw r0's new demand %d during the cut", got)
	}
	for n := 1; n <= 100; n++ {
		c.exchange()
		if got, want := seen(); got == want {
			return n
		}
	}
	got, want := seen()
	t.Fatalf("cut of %d intervals: 100 intervals after the heal r1 sees r0's demand %d, r0 reported %d", cut, got, want)
	return 0
}

// TestOneLostReportIsNoSilence: without a heartbeat a peer reports at every
// Tick, so one lost report is a silence of two intervals give or take the
// jitter; it does not make the next report a full one (Ledger.resync: a
// full report of every key per lost message, at 1% loss, was a third of
// rlsim hot-key's full reports). Two lost reports in a row do. Either way
// the next reports that arrive bring r0 r1's state again (liveness), at
// two regions and five, for a limit of 1/s and of 10,000/s.
func TestOneLostReportIsNoSilence(t *testing.T) {
	for _, regions := range []int{2, 5} {
		for _, rate := range []float64{1, 10_000} {
			for _, tc := range []struct {
				lost   int
				jitter time.Duration
				want   bool
			}{{1, 0, false}, {1, 5 * time.Millisecond, false}, {1, 40 * time.Millisecond, false}, {2, 0, true}, {2, 5 * time.Millisecond, true}} {
				lostReportRun(t, regions, rate, tc.lost, tc.jitter, tc.want)
			}
		}
	}
}

// lostReportRun: regions ledgers exchange every report, but r1's reports to
// r0 are lost for lost ticks and the next reaches r0 jitter late; r0's
// resync must be want, and within three more ticks r0 must see the demand
// r1 reports since (it tripled when the loss began), the shares never
// summing above the limit.
func lostReportRun(t *testing.T, regions int, rate float64, lost int, jitter time.Duration, want bool) {
	t.Helper()
	c := newCluster(t, regions)
	shift := int64(1) // r1's demand triples when its reports start to be lost
	use := func(i int) int64 {
		u := int64(max(1, rate/10)) * int64(1+i%3)
		if i == 1 {
			u *= shift
		}
		return u
	}
	step := func(drop bool, late time.Duration) {
		c.now += c.cfg.Interval
		reps := make([][]*Report, regions)
		for i, l := range c.l {
			l.Usage(c.now, "k", rate, use(i), 0)
			out := l.Tick(c.now)
			reps[i] = append(reps[i], out.Report, c.confirm(i, out).Report)
		}
		for from := range c.l {
			for to := range c.l {
				if to == from || from == 1 && to == 0 {
					continue
				}
				for _, r := range reps[from] {
					c.confirm(to, c.deliver(to, r))
				}
			}
		}
		if !drop {
			c.now += late
			for _, r := range reps[1] {
				c.confirm(0, c.deliver(0, r))
			}
		}
		if s := c.sum("k"); s > c.cfg.Units {
			t.Fatalf("%d regions, %v/s: k sums to %d of %d", regions, rate, s, c.cfg.Units)
		}
	}
	for range 10 {
		step(false, 0)
	}
	seen := func() bool {
		k0, k1 := c.l[0].keys["k"], c.l[1].keys["k"]
		return k0 != nil && k1 != nil && c.l[0].pair(k0, 1).peerDemand == k1.reported()
	}
	shift = 3
	for range lost {
		step(true, 0)
	}
	if seen() {
		t.Fatalf("%d regions, %v/s: r0 saw r1's new demand %d through the loss", regions, rate, c.l[1].keys["k"].reported())
	}
	step(false, jitter)
	if c.l[0].resync != want {
		t.Errorf("%d regions, %v/s: %d report(s) lost, delivered %v late: resync %v, want %v", regions, rate, lost, jitter, c.l[0].resync, want)
	}
	for n := 0; !seen(); n++ {
		if n == 3 {
			t.Fatalf("%d regions, %v/s, %d lost: 3 ticks after the loss r0 sees r1's demand %d, r1 reports %d", regions, rate, lost,
				c.l[0].pair(c.l[0].keys["k"], 1).peerDemand, c.l[1].keys["k"].reported())
		}
		step(false, 0)
	}
}
