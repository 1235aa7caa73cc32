package ledger

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
)

// A global rule's key churn through three regions in virtual time: total
// distinct keys, active of them in use at any time, each for life
// intervals; a key's use moves from one region to another halfway through
// its life (so its units come back to the bases along other pairs than
// they went, and settling runs as well as retirement). The network and the
// stores are perfect; the randomized harness covers the faults.
type churnRun struct {
	tb                  testing.TB
	cfg                 Config
	active, total, life int

	l         []*Ledger
	now       time.Duration
	maxHeld   int
	intervals int
	// The wall time of the steps (checks excluded) in the first and the
	// last quarter of the steady churn (active keys in use): equal if a
	// tick's cost follows the keys in use, not the keys seen so far.
	first, last time.Duration
}

func newChurnRun(tb testing.TB, cfg Config, active, total, life int) *churnRun {
	c := &churnRun{tb: tb, cfg: cfg, active: active, total: total, life: life}
	spec := []RegionSpec{{"r0", 1}, {"r1", 1}, {"r2", 1}}
	reg, err := NewRegistry(cfg, spec)
	if err != nil {
		tb.Fatal(err)
	}
	for _, s := range spec {
		st, err := reg.Start(s.Name)
		if err != nil {
			tb.Fatal(err)
		}
		st.RunID = "run"
		l, err := New(cfg, s.Name, spec, st, 0)
		if err != nil {
			tb.Fatal(err)
		}
		c.l = append(c.l, l)
	}
	return c
}

func churnKey(i int) string { return fmt.Sprintf("rl:{user:%07d}:orders", i) }

// bound is how many keys a ledger may hold: the keys in use, plus those
// that stopped within IdleAfter, the idle reports' time and a retirement
// (a few intervals) plus a settlement (a few more).
func (c *churnRun) bound() int {
	window := int((c.cfg.IdleAfter+c.l[0].idleReported())/c.cfg.Interval) + 30
	return c.active + window*c.active/c.life + 1
}

func (c *churnRun) handle(i int, out Output) []*Report {
	if out.Fenced {
		c.tb.Fatalf("interval %d: r%d fenced", c.intervals, i)
	}
	var reps []*Report
	if out.Report != nil {
		reps = append(reps, out.Report)
	}
	if len(out.Writes) > 0 {
		cs := make([]Confirmation, len(out.Writes))
		for j, w := range out.Writes {
			cs[j] = Confirmation{w.Key, w.Version}
		}
		o := c.l[i].SharesApplied(c.now, cs)
		if o.Fenced {
			c.tb.Fatalf("interval %d: r%d fenced", c.intervals, i)
		}
		if o.Report != nil {
			reps = append(reps, o.Report)
		}
	}
	return reps
}

// step runs one interval: usage of the keys in use (key k, started at
// interval k*life/active, is used by region k%3 for the first half of its
// life and by (k+1)%3 for the second), every ledger's tick, every report
// delivered to both peers, every write confirmed at once.
func (c *churnRun) step(use bool) {
	t := c.intervals
	c.intervals++
	c.now += c.cfg.Interval
	type rep struct {
		from int
		r    *Report
	}
	var q []rep
	for i, l := range c.l {
		if use {
			lo := max(0, (t-c.life)*c.active/c.life+1)
			hi := min(c.total-1, t*c.active/c.life)
			for k := lo; k <= hi; k++ {
				start := k * c.life / c.active
				u := k % 3
				if t-start >= c.life/2 {
					u = (k + 1) % 3
				}
				if u == i {
					l.Usage(c.now, churnKey(k), 100, 40, 0)
				}
			}
		}
		for _, r := range c.handle(i, l.Tick(c.now)) {
			q = append(q, rep{i, r})
		}
	}
	for len(q) > 0 {
		r := q[0]
		q = q[1:]
		for to, l := range c.l {
			if to == r.from {
				continue
			}
			out, err := l.Receive(c.now, *r.r)
			if err != nil {
				c.tb.Fatalf("interval %d: r%d rejects r%d's report: %v", t, to, r.from, err)
			}
			for _, m := range c.handle(to, out) {
				q = append(q, rep{to, m})
			}
		}
	}
}

// check asserts the held-keys bound and the sum on every key held.
func (c *churnRun) check() {
	for i, l := range c.l {
		c.maxHeld = max(c.maxHeld, len(l.keys))
		if b := c.bound(); len(l.keys) > b {
			c.tb.Fatalf("interval %d: r%d holds %d keys, bound %d", c.intervals, i, len(l.keys), b)
		}
	}
	for i, l := range c.l {
	keys:
		for n := range l.keys {
			for _, m := range c.l[:i] {
				if m.keys[n] != nil {
					continue keys // checked already
				}
			}
			var s int64
			for _, m := range c.l {
				s += m.Position(n).Units
			}
			if s > c.cfg.Units {
				c.tb.Fatalf("interval %d: %s sums to %d > %d (held by r%d)", c.intervals, n, s, c.cfg.Units, i)
			}
		}
	}
}

// run churns every key, then lets the last ones go idle, and checks that
// nothing is held at the end.
func (c *churnRun) run() {
	boot := func() {
		c.now += c.cfg.Interval
		for _, l := range c.l {
			for _, w := range l.Tick(c.now).Writes {
				if w.Key == MarkerKey {
					l.ShareApplied(c.now, w.Key, w.Version)
				}
			}
		}
	}
	boot()
	end := c.total*c.life/c.active + c.life
	for c.intervals < end {
		t0 := time.Now()
		c.step(true)
		q := c.quarter()
		switch d := time.Since(t0); {
		case c.intervals > c.life && c.intervals <= c.life+q:
			c.first += d
		case c.intervals > end-c.life-q && c.intervals <= end-c.life:
			c.last += d
		}
		c.check()
	}
	drain := int((c.cfg.IdleAfter+c.l[0].idleReported())/c.cfg.Interval) + 100
	for n := 0; n < drain; n++ {
		c.step(false)
		c.check()
	}
	for i, l := range c.l {
		if len(l.keys) != 0 || len(l.closing) != 0 {
			c.tb.Fatalf("r%d still holds %d keys, %d closures after the drain", i, len(l.keys), len(l.closing))
		}
		if l.stats.Forgotten < c.total || l.retires == 0 {
			c.tb.Logf("r%d: forgot %d, retired %d, settled %d", i, l.stats.Forgotten, l.retires, l.stats.Settled)
		}
	}
}

// quarter is a quarter of the steady churn's intervals: after the first
// life (keys still starting) and before the last (keys only stopping).
func (c *churnRun) quarter() int {
	return (c.total*c.life/c.active - c.life) / 4
}

// perKey is d per interval, key in use and region over a quarter.
func (c *churnRun) perKey(d time.Duration) float64 {
	return float64(d.Nanoseconds()) / float64(c.quarter()*3*c.active)
}

func (c *churnRun) summary() string {
	var f, r, s int
	for _, l := range c.l {
		f += l.stats.Forgotten
		r += int(l.retires)
		s += l.stats.Settled
	}
	return fmt.Sprintf("%d keys seen, %d in use at a time, %d intervals (%v virtual), no fence: at most %d held per region (bound %d); %d forgets, %d retirements, %d settling payments over the three regions; an interval took %.2f µs per key in use and region in the first quarter, %.2f µs in the last",
		c.total, c.active, c.intervals, time.Duration(c.intervals)*c.cfg.Interval, c.maxHeld, c.bound(), f, r, s,
		c.perKey(c.first)/1000, c.perKey(c.last)/1000)
}

// TestChurnThreeRegions is the CI scale of BenchmarkChurn: 3,000 keys seen,
// 300 in use at a time, each for 6 s of use.
func TestChurnThreeRegions(t *testing.T) {
	c := newChurnRun(t, simConfig(), 300, 3000, 60)
	c.run()
	t.Log(c.summary())
}

// BenchmarkChurn runs the churn with the production timing
// (DefaultConfig): APPORTION_CHURN_ACTIVE keys in use at a time (default
// 100,000), APPORTION_CHURN_TOTAL seen (default 1,000,000), each used for
// APPORTION_CHURN_LIFE intervals (default 1,440: 6 minutes at 250 ms, so
// that 1,000,000 keys go through in an hour). One iteration is the whole
// run.
//
//	APPORTION_CHURN_ACTIVE=10000 APPORTION_CHURN_TOTAL=100000 APPORTION_CHURN_LIFE=600 \
//	  go test -run '^$' -bench BenchmarkChurn -benchtime 1x -timeout 2h ./sync/ledger
func BenchmarkChurn(b *testing.B) {
	env := func(name string, def int) int {
		if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
			return v
		}
		return def
	}
	active, total, life := env("APPORTION_CHURN_ACTIVE", 100_000), env("APPORTION_CHURN_TOTAL", 1_000_000), env("APPORTION_CHURN_LIFE", 1440)
	for i := 0; i < b.N; i++ {
		c := newChurnRun(b, DefaultConfig(), active, total, life)
		t0 := time.Now()
		c.run()
		b.ReportMetric(float64(c.maxHeld), "max-held-keys")
		b.ReportMetric(c.perKey(c.first), "first-quarter-ns/key-in-use/region/interval")
		b.ReportMetric(c.perKey(c.last), "last-quarter-ns/key-in-use/region/interval")
		b.ReportMetric(time.Since(t0).Seconds(), "s/run")
		b.Log(c.summary())
	}
}
