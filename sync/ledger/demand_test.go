package ledger

import (
	"testing"
	"time"
)

// demandLedger returns a ledger of region "a" of four, for a limit of 1/s
// with a burst of 1 (quantum: a whole token is the whole limit) if tokens.
// It runs alone: with the whole limit as floors (MinShare 1) it holds only
// its floor and keeps ticking without a peer's acknowledgement.
func demandLedger(t *testing.T, tokens bool) *Ledger {
	t.Helper()
	cfg := DefaultConfig()
	cfg.MinShare = 1
	if tokens {
		cfg.Quantum = cfg.Units
	}
	regions := []RegionSpec{{"a", 1}, {"b", 1}, {"c", 1}, {"d", 1}}
	l, err := New(cfg, "a", regions, Start{Inc: 1, RunID: "r"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestDemandStartsAtTheMean: a key's first estimate is the mean of its
// samples, not an EWMA rising from 0 over DemandTokens requests' worth.
func TestDemandStartsAtTheMean(t *testing.T) {
	l := demandLedger(t, true)
	const iv = 250 * time.Millisecond
	l.Usage(iv, "k", 1, 0, 1) // one stray request is not a rate of 4/s
	l.Tick(iv)
	if got, most := l.Position("k").Demand, l.cfg.Units/10; got > most {
		t.Fatalf("estimate %d after one request, want at most %d", got, most)
	}
	l.Usage(2*iv, "k", 1, 1, SilenceTokens-2) // SilenceTokens in 500 ms
	l.Tick(2 * iv)
	if got, want := l.Position("k").Demand, 2*SilenceTokens*l.cfg.Units; got < want*99/100 || got > want*101/100 {
		t.Fatalf("estimate %d after %d requests in 500 ms, want about %d (their mean rate)", got, SilenceTokens, want)
	}
	// Then one request a second: the estimate tends to it.
	for i := 3; i <= 800; i++ {
		now := time.Duration(i) * iv
		if i%4 == 0 {
			l.Usage(now, "k", 1, 1, 0)
		}
		l.Tick(now)
	}
	if l.Fenced() {
		t.Fatal("fenced")
	}
	if got := l.Position("k").Demand; got < l.cfg.Units*9/10 || got > l.cfg.Units*11/10 {
		t.Fatalf("estimate %d after 200 s at 1/s, want about %d", got, l.cfg.Units)
	}
}

// TestDemandSilence: for a small limit, a region whose clients have left
// loses its estimate within seconds (SilenceTokens), and all of it after
// DemandTokens requests' worth of quiet.
func TestDemandSilence(t *testing.T) {
	const iv = 250 * time.Millisecond
	l := demandLedger(t, true)
	i := 1
	for ; i <= 400; i++ { // 100 s at 1 request per second
		if i%4 == 0 {
			l.Usage(time.Duration(i)*iv, "k", 1, 1, 0)
		}
		l.Tick(time.Duration(i) * iv)
	}
	busy := l.Position("k").Demand
	at := func(quiet time.Duration) int64 {
		for ; time.Duration(i-400)*iv <= quiet; i++ {
			l.Tick(time.Duration(i) * iv)
		}
		return l.Position("k").Demand
	}
	ten, forty := at(10*time.Second), at(41*time.Second)
	if l.Fenced() {
		t.Fatal("fenced")
	}
	// The EWMA alone would still be at exp(-10/40) = 78% of busy.
	if bound := l.cfg.Units * SilenceTokens / 10; ten > bound || ten == 0 {
		t.Fatalf("%d after 10 s of quiet, from %d: want in (0, %d]", ten, busy, bound)
	}
	if forty != 0 {
		t.Fatalf("%d after 41 s of quiet (DemandTokens %v at 1/s): want 0", forty, l.cfg.DemandTokens)
	}
	// Requests resume: the estimate is the EWMA's again, not a fresh start.
	l.Usage(time.Duration(i)*iv, "k", 1, 1, 0)
	l.Tick(time.Duration(i) * iv)
	if got := l.Position("k").Demand; got <= 0 || got >= busy {
		t.Fatalf("%d after one request, from %d before the quiet: want the EWMA's", got, busy)
	}
}

// TestDemandFastLimitUnchanged: a limit fast enough for the EWMA to run at
// its half-life's weight (0.5 for an interval of one half-life) has neither the division nor the silence cap.
func TestDemandFastLimitUnchanged(t *testing.T) {
	l := demandLedger(t, false)
	const iv = 250 * time.Millisecond
	l.Usage(iv, "k", 1000, 100, 0) // 400/s of a 1000/s limit: 0.4 of it
	l.Tick(iv)
	if got, want := l.Position("k").Demand, l.cfg.Units*4/10/2; got != want {
		t.Fatalf("first estimate %d, want %d (half the first sample: one half-life)", got, want)
	}
}

// TestEvenBand: with a Quantum, wants that all lie within EvenBand below
// their fair shares (or above) become the split by weight; one want below
// the band, or no Quantum, leaves them to the allocator as they are.
func TestEvenBand(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Quantum = cfg.Units / 10 // 10 tokens
	const pool = 1_000_000
	w := func(d ...int64) []Want {
		out := make([]Want, len(d))
		for i, x := range d {
			out[i] = Want{Weight: 1, Demand: x}
		}
		return out
	}
	split := func(c Config, ws []Want) []int64 {
		c.evenBand(pool, ws, 10) // 10/s: the estimate is slowed
		return c.Allocate(pool, ws)
	}
	// Four regions each asking about 0.4 of the limit, one estimate dipping
	// to 0.19 (fair share 0.25, band down to 0.1625): the static split.
	if got := split(cfg, w(400_000, 190_000, 420_000, 380_000)); got[0] != 250_000 || got[1] != 250_000 || got[2] != 250_000 || got[3] != 250_000 {
		t.Fatalf("even demand with a dip: %v, want the static split", got)
	}
	// A region clearly below (0.1 < 0.1625) gets what it wants.
	if got := split(cfg, w(400_000, 100_000, 420_000, 380_000)); got[1] != 100_000 {
		t.Fatalf("low demand: %v, want 100000 for region 1", got)
	}
	// Without a Quantum (a large limit) the dip is followed.
	big := cfg
	big.Quantum = 0
	if got := split(big, w(400_000, 190_000, 420_000, 380_000)); got[1] != 190_000 {
		t.Fatalf("no quantum: %v, want 190000 for region 1", got)
	}
	// A fast limit (1000/s, 10 tokens) follows its estimates as they are.
	if got := cfg.Allocate(pool, func() []Want { ws := w(400_000, 190_000, 420_000, 380_000); cfg.evenBand(pool, ws, 1000); return ws }()); got[1] != 190_000 {
		t.Fatalf("fast limit: %v, want 190000 for region 1", got)
	}
	// Disabled.
	off := cfg
	off.EvenBand = 0
	if got := split(off, w(400_000, 190_000, 420_000, 380_000)); got[1] != 190_000 {
		t.Fatalf("EvenBand 0: %v, want 190000 for region 1", got)
	}
}

// TestDemandBand: demand noise within DemandBand of the reported value
// leaves the reported demand (what every region allocates with) and the
// key's dirty flag alone (here without the refresh, DemandRefresh 0:
// TestDemandRefresh); a move past the band is reported at the next Tick.
func TestDemandBand(t *testing.T) {
	l := demandLedger(t, false)
	l.cfg.DemandBand, l.cfg.DemandRefresh = 0.25, 0
	const rate = 1000 // fast: DemandTokens does not slow the estimate
	now := time.Duration(0)
	tick := func(used int64) {
		now += l.cfg.Interval
		l.Usage(now, "k", rate, used, 0)
		l.Tick(now)
	}
	for range 40 { // 10 s of a steady 400/s (the default interval, 250 ms)
		tick(100)
	}
	p := l.Position("k")
	if p.Demand < l.cfg.Units*39/100 || l.cfg.demandMoved(p.Reported, p.Demand, l.cfg.DemandBand) {
		t.Fatalf("steady demand: reported %d, estimate %d", p.Reported, p.Demand)
	}
	steady := p.Reported
	mean := int64(float64(steady*rate) * l.cfg.Interval.Seconds() / float64(l.cfg.Units)) // the reported demand's usage per tick
	moved := 0
	for j := range 200 { // +-15% noise around it for 50 s
		l.keys["k"].dirty = false
		tick(mean + mean*15/100*int64(2*(j%2)-1))
		p = l.Position("k")
		if p.Demand != steady {
			moved++
		}
		if p.Reported != steady || l.keys["k"].dirty {
			t.Fatalf("tick %d: noise of 15%% reported: %d, was %d (estimate %d, dirty %v)", j, p.Reported, steady, p.Demand, l.keys["k"].dirty)
		}
	}
	if moved == 0 {
		t.Fatal("the estimate never moved: the noise tests nothing")
	}
	for range 10 { // 2.5 s at twice the demand
		tick(2 * mean)
	}
	if p = l.Position("k"); p.Reported < steady*5/4 || !l.cfg.demandMoved(steady, p.Reported, l.cfg.DemandBand) {
		t.Fatalf("demand doubled: reported %d, was %d (estimate %d)", p.Reported, steady, p.Demand)
	}
}

// TestDemandRefresh: a demand that moves within DemandBand and stays there
// is reported within DemandRefresh (plus a Tick), not at once and not
// never; noise within the band is reported at most once per DemandRefresh.
func TestDemandRefresh(t *testing.T) {
	l := demandLedger(t, false)
	l.cfg.DemandBand, l.cfg.DemandRefresh = 0.25, 3*time.Second
	const rate = 1000
	now := time.Duration(0)
	tick := func(used int64) {
		now += l.cfg.Interval
		l.Usage(now, "k", rate, used, 0)
		l.Tick(now)
	}
	for range 40 { // a steady 400/s
		tick(100)
	}
	steady := l.Position("k").Reported
	// 15% more, within the band, from now on.
	start, reportedAt := now, time.Duration(-1)
	for range 60 { // 15 s
		tick(115)
		if p := l.Position("k"); reportedAt < 0 && p.Reported != steady {
			reportedAt = now - start
			if !l.cfg.demandMoved(steady, p.Reported, 1e-9) || p.Reported < steady*110/100 {
				t.Fatalf("refresh reported %d, was %d (estimate %d)", p.Reported, steady, p.Demand)
			}
		}
	}
	switch {
	case reportedAt < 0:
		t.Fatalf("a move of 15%% within the band was never reported (reported %d)", l.Position("k").Reported)
	case reportedAt <= l.cfg.Interval:
		t.Fatalf("a move within the band was reported at once (%v)", reportedAt)
	case reportedAt > l.cfg.DemandRefresh+l.cfg.Interval:
		t.Fatalf("a move within the band reported %v after it, refresh %v", reportedAt, l.cfg.DemandRefresh)
	}
	// Noise of +-15%: the reported demand changes at most once per refresh.
	changes, last := 0, l.Position("k").Reported
	for j := range 120 { // 30 s
		tick(115 + 17*int64(2*(j%2)-1))
		if p := l.Position("k"); p.Reported != last {
			changes, last = changes+1, p.Reported
		}
	}
	if max := int(30*time.Second/l.cfg.DemandRefresh) + 1; changes > max {
		t.Fatalf("noise reported %d times in 30 s, at most %d with a refresh of %v", changes, max, l.cfg.DemandRefresh)
	}
	t.Logf("a move within the band reported after %v; noise reported %d times in 30 s", reportedAt, changes)
}
