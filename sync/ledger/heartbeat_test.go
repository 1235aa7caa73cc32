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
// rlsim hot-key's full reports). Two lost reports in a row do.
func TestOneLostReportIsNoSilence(t *testing.T) {
	for _, tc := range []struct {
		lost   int
		jitter time.Duration
		want   bool
	}{{1, 0, false}, {1, 5 * time.Millisecond, false}, {1, 40 * time.Millisecond, false}, {2, 0, true}, {2, 5 * time.Millisecond, true}} {
		c := newCluster(t, 2)
		c.use[0], c.use[1] = 60, 30
		for range 10 {
			c.exchange()
		}
		l0 := c.l[0]
		// r1's reports to r0 are lost for tc.lost ticks; r0's reach r1.
		for n := 0; n <= tc.lost; n++ {
			c.now += c.cfg.Interval
			var reps [2][]*Report
			for i, l := range c.l {
				l.Usage(c.now, "k", 100, c.use[i], 0)
				out := l.Tick(c.now)
				reps[i] = append(reps[i], out.Report, c.confirm(i, out).Report)
			}
			for _, r := range reps[0] {
				c.confirm(1, c.deliver(1, r))
			}
			if n < tc.lost {
				continue
			}
			c.now += tc.jitter
			for _, r := range reps[1] {
				c.confirm(0, c.deliver(0, r))
			}
		}
		if l0.resync != tc.want {
			t.Errorf("%d report(s) lost, delivered %v late: resync %v, want %v", tc.lost, tc.jitter, l0.resync, tc.want)
		}
	}
}
