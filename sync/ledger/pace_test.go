package ledger

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// slowLinkRun is shiftOverSlowLinks' outcome: the time from the shift to
// the targets (-1: not within the wait), the largest backlog of any link
// seen (the time it needed to carry what it had been given), fences, and
// the reports the ledgers cut short.
type slowLinkRun struct {
	took, backlog time.Duration
	fences        int
	paced         uint64
}

// shiftOverSlowLinks runs n regions whose every link carries link key
// reports a second, in order (a report's header counting as one), all
// demand in region 0 for warm, then in region 1, and waits up to wait for
// every key's shares to reach the targets.
func shiftOverSlowLinks(t *testing.T, n, keys int, link float64, paceKeys int, warm, wait time.Duration, adjust ...func(*Config)) slowLinkRun {
	t.Helper()
	s := newSim(t, 1, simOpts{regions: n, keys: keys, noRestart: true, link: link,
		config: func(c *Config) {
			c.HalfLife = 0
			c.Lease = 3 * time.Second // the default: an acknowledgement waits behind the reports in flight each way
			c.PaceKeys = paceKeys
			for _, f := range adjust {
				f(c)
			}
		}})
	s.heal()
	var out slowLinkRun
	step := func(d time.Duration) {
		if s.q.Len() == 0 {
			t.Fatalf("every region down at %v (%d fences)", time.Duration(s.now), s.fences)
		}
		s.run(s.now + int64(d))
		if s.violation != "" {
			t.Fatalf("%s", s.violation)
		}
		for _, free := range s.linkFree {
			out.backlog = max(out.backlog, time.Duration(free-s.now))
		}
	}
	setDemand(s, 0)
	for s.now < int64(warm) {
		step(100 * time.Millisecond)
	}
	setDemand(s, 1)
	shift := s.now
	out.took = -1
	for s.now < shift+int64(wait) {
		step(100 * time.Millisecond)
		if ok, _ := s.converged(int64(n)); ok {
			out.took = time.Duration(s.now - shift)
			break
		}
	}
	out.fences = s.fences
	for _, r := range s.regions {
		if r.led != nil {
			out.paced += r.led.Stats().Paced
		}
	}
	return out
}

// TestSlowLinkPaced: every link carries 100 key reports a second, where
// 200 keys report several times that (full reports, and every key once its
// demand moves): a gateway link throttled. With the reports paced to the
// acknowledgements (PaceKeys), no link's backlog passes a few seconds,
// nothing fences, and after the demand of every key moves from region 0 to
// region 1 the shares reach the targets within slowLinkBound, at 2, 3 and
// 10 regions (measured on 7 December 2026: 9.7 s, 7.5 s and 13.1 s; one
// key report of every key takes the link 2 s), and so they do when every
// key's limit is one token moved whole (a limit of 1/s, burst 1: 9.6 s at
// 2 regions, 10.7 s at 10); the other keys' limits are 10 to 1,000/s. Without pacing (the
// control) the backlog grows for as long as the link is slow (57 s of it
// at the end), and the shares have not reached the targets within twice
// the bound.
func TestSlowLinkPaced(t *testing.T) {
	const (
		keys          = 200
		link          = 100
		warm          = 20 * time.Second
		slowLinkBound = 25 * time.Second
		backlogBound  = 5 * time.Second
	)
	// oneToken: every key's limit is a single token (Quantum: a limit of
	// 1/s with a burst of 1), moved whole between regions.
	oneToken := func(c *Config) { c.Quantum, c.DemandTokens = c.Units, DefaultConfig().DemandTokens }
	type slowCase struct {
		n      int
		tokens bool
	}
	for _, tc := range []slowCase{{2, false}, {3, false}, {10, false}, {2, true}, {10, true}} {
		name := fmt.Sprintf("regions=%d", tc.n)
		var adjust []func(*Config)
		if tc.tokens {
			name += "/one-token"
			adjust = append(adjust, oneToken)
		}
		t.Run(name, func(t *testing.T) {
			r := shiftOverSlowLinks(t, tc.n, keys, link, 64, warm, 2*slowLinkBound, adjust...)
			t.Logf("paced: targets %v after the shift, largest backlog %v, %d fences, %d reports cut short", r.took, r.backlog.Round(time.Millisecond), r.fences, r.paced)
			if r.took < 0 || r.took > slowLinkBound {
				t.Errorf("shares reached the targets %v after the shift (-1: not within %v), want within %v", r.took, 2*slowLinkBound, slowLinkBound)
			}
			if r.backlog > backlogBound {
				t.Errorf("a link's backlog reached %v, want at most %v", r.backlog, backlogBound)
			}
			if r.fences > 0 {
				t.Errorf("%d fences, want none: the links deliver every report", r.fences)
			}
			if r.paced == 0 {
				t.Errorf("no report was cut short: the links are not slower than the reports")
			}
		})
	}
	t.Run("regions=2/control", func(t *testing.T) {
		r := shiftOverSlowLinks(t, 2, keys, link, 0, warm, 2*slowLinkBound)
		t.Logf("unpaced: targets %v after the shift, largest backlog %v, %d fences", r.took, r.backlog.Round(time.Millisecond), r.fences)
		if r.backlog < warm/2 || r.took >= 0 && r.took <= slowLinkBound {
			t.Errorf("without pacing: backlog %v, targets %v after the shift; the harness's links are not slower than the reports", r.backlog, r.took)
		}
	})
}

// TestPacedReportsRotate: with room for 7 keys a report (a peer's window,
// everything before acknowledged) and 23 keys changing at every Tick, each
// report carries 7 keys in name order (in parts of at most 3, as the
// driver asks), starting after the last key the report before carried and
// wrapping round, so every key is carried every 4 reports; the reports
// cut short are counted.
func TestPacedReportsRotate(t *testing.T) {
	const keys, room, part = 23, 7, 3
	c := newCluster(t, 2)
	for range 4 {
		c.exchange()
	}
	l := c.l[0]
	l.DeferReports()
	last := map[string]int{} // key -> the last report that carried it
	var prev []string
	for rep := range 12 {
		c.now += c.cfg.Interval
		for i := range keys {
			l.Usage(c.now, fmt.Sprintf("k%02d", i), 100, int64(10+1000*(rep%2)+i), 0)
		}
		c.confirm(0, l.Tick(c.now))
		p := &l.peers[1]
		p.window, p.ackedKeys, p.heard = room, l.keysSent, c.now
		var got []string
		for r, more := range l.OwedReportParts(c.now, part) {
			if len(r.Keys) > part || more && len(r.Keys) != part {
				t.Fatalf("report %d: a part of %d keys, more %v", rep, len(r.Keys), more)
			}
			for _, k := range r.Keys {
				got = append(got, k.Key)
			}
		}
		if !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != len(got) {
			t.Fatalf("report %d: keys %v not in name order or repeated", rep, got)
		}
		if len(got) != room {
			t.Fatalf("report %d carried %d keys %v, want %d", rep, len(got), got, room)
		}
		if prev != nil {
			// The rotation: the keys after the last one carried (in name
			// order, wrapping round) come next. prev is a run of keys in
			// the order k00..k22, k00..., so its last is the one before a
			// gap in it, if any.
			idx := func(k string) (n int) { fmt.Sscanf(k, "k%d", &n); return n }
			end := idx(prev[len(prev)-1])
			for i := 0; i+1 < len(prev); i++ {
				if idx(prev[i+1]) != idx(prev[i])+1 {
					end = idx(prev[i])
					break
				}
			}
			want := []string{}
			for i := 1; len(want) < room; i++ {
				want = append(want, fmt.Sprintf("k%02d", (end+i)%keys))
			}
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("report %d carried %v after %v, want %v", rep, got, prev, want)
			}
		}
		for _, k := range got {
			if at, ok := last[k]; ok && rep-at > (keys+room-1)/room {
				t.Fatalf("report %d: %s carried again after %d reports, want at most %d", rep, k, rep-at, (keys+room-1)/room)
			}
			last[k] = rep
		}
		prev = got
	}
	if len(last) != keys {
		t.Fatalf("%d keys carried, want %d", len(last), keys)
	}
	if n := l.Stats().Paced; n != 12 {
		t.Fatalf("Stats().Paced %d, want 12 (every report cut short)", n)
	}
}

// TestPaceWindow: a peer's window grows by the keys it acknowledges while
// its acknowledgements come within the target (up to twice the keys in
// flight), is halved once a round trip when they come later, and never
// falls below PaceKeys.
func TestPaceWindow(t *testing.T) {
	c := newCluster(t, 2)
	l := c.l[0]
	l.cfg.PaceKeys = 10
	p := &l.peers[1]
	p.window = 10
	now := c.now
	send := func(keys int64) sentReport {
		l.keysSent += keys
		return sentReport{now, l.keysSent}
	}
	target := l.paceTarget()
	s := send(10)
	now += target / 2
	l.ackedReport(p, s, now)
	if p.window != 20 {
		t.Fatalf("window %d after 10 keys acknowledged in time, want 20", p.window)
	}
	s = send(100)
	now += target / 2
	l.ackedReport(p, s, now)
	if p.window != 120 {
		t.Fatalf("window %d after 100 more, want 120", p.window)
	}
	s = send(5)
	now += target / 2
	l.ackedReport(p, s, now)
	if p.window != 10 {
		t.Fatalf("window %d after 5 keys in flight, want 10 (twice the 5 in flight, at least PaceKeys)", p.window)
	}
	p.window = 400
	s1, s2 := send(50), send(50)
	now += 2 * target
	l.ackedReport(p, s1, now)
	if p.window != 200 {
		t.Fatalf("window %d after a late acknowledgement, want 200", p.window)
	}
	now += target / 4
	l.ackedReport(p, s2, now)
	if p.window != 200 {
		t.Fatalf("window %d after a second late acknowledgement within the round trip, want 200", p.window)
	}
	for range 10 {
		s := send(50)
		now += 3 * target
		l.ackedReport(p, s, now)
	}
	if p.window != 10 {
		t.Fatalf("window %d after ten late rounds, want PaceKeys 10", p.window)
	}
}

// TestPacingPeers: which peers' windows bound a report. A peer heard
// within the lease does; one never heard does for the first lease of the
// ledger only; one silent for a lease, and one we froze (a region lost),
// do not, whatever their windows hold: otherwise a lost region's full
// window would hold back every survivor's keys for good.
func TestPacingPeers(t *testing.T) {
	c := newCluster(t, 3)
	l := c.l[0]
	now := c.now
	l.keysSent = 1000
	for i := range l.peers {
		l.peers[i].window, l.peers[i].ackedKeys = 100, 1000
	}
	p := &l.peers[2]
	p.ackedKeys = 950 // 50 of its 100 in flight: room 50
	set := func(seen bool, heard time.Duration, frozen uint64) {
		p.seen, p.heard, p.frozenInc = seen, heard, frozen
	}
	cases := []struct {
		name   string
		seen   bool
		heard  time.Duration
		frozen uint64
		room   int
	}{
		{"heard within the lease", true, now - l.cfg.Lease/2, 0, 50},
		{"silent for a lease", true, now - l.cfg.Lease - 1, 0, 100},
		{"never heard, within a lease of the start", false, now - l.cfg.Lease/2, 0, 50},
		{"never heard, a lease after the start", false, now - l.cfg.Lease - 1, 0, 100},
		{"frozen (its successor not heard)", false, now, 1, 100},
	}
	for _, tc := range cases {
		set(tc.seen, tc.heard, tc.frozen)
		l.peers[1].seen, l.peers[1].heard = true, now
		if got := l.paceRoom(now); got != tc.room {
			t.Errorf("%s: room %d, want %d", tc.name, got, tc.room)
		}
	}
}
