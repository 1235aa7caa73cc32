package ledger

import (
	"fmt"
	"math"
	"testing"
)

// hugeCluster is newCluster's three regions with cfg tweaked first.
func hugeCluster(t *testing.T, tweak func(*Config)) *cluster {
	t.Helper()
	c := &cluster{t: t, cfg: simConfig()}
	c.cfg.HalfLife = 0
	c.cfg.HeartbeatEvery, c.cfg.DemandBand = 0, 0
	tweak(&c.cfg)
	for i := range 3 {
		c.spec = append(c.spec, RegionSpec{Name: "r" + string(rune('0'+i)), Weight: 1})
	}
	var err error
	if c.reg, err = NewRegistry(c.cfg, c.spec); err != nil {
		t.Fatal(err)
	}
	c.use, c.down = make([]int64, 3), make([]bool, 3)
	for i := range 3 {
		c.start(i)
	}
	return c
}

// hugeRound is cluster.exchange with, before r0's Tick, the usage of
// attack fed to r0 (nil: none); it fails the test if any report is
// refused, any ledger fences, or a report carries a demand out of range.
func hugeRound(c *cluster, attack func(l *Ledger)) {
	t := c.t
	t.Helper()
	c.now += c.cfg.Interval
	var reps []*Report
	for i, l := range c.l {
		if c.use[i] > 0 {
			l.Usage(c.now, "k", 100, c.use[i], 0)
		}
		if i == 0 && attack != nil {
			attack(l)
		}
		out := l.Tick(c.now)
		if out.Fenced {
			t.Fatalf("at %v r%d fenced", c.now, i)
		}
		reps = append(reps, out.Report)
		if r := c.confirm(i, out).Report; r != nil {
			reps = append(reps, r)
		}
	}
	hi := c.cfg.maxDemand()
	for _, r := range reps {
		if r == nil {
			continue
		}
		for _, kr := range r.Keys {
			if kr.Demand < 0 || kr.Demand > hi {
				t.Fatalf("at %v %s reports key %q with demand %d outside [0, %d]", c.now, r.From, kr.Key, kr.Demand, hi)
			}
		}
		for to := range c.l {
			if c.l[to].names[c.l[to].self] != r.From {
				c.confirm(to, c.deliver(to, r)) // deliver fails the test on a refusal
			}
		}
	}
	for i, l := range c.l {
		if n := l.Stats().Rejected; n > 0 {
			t.Fatalf("at %v r%d rejected %d reports", c.now, i, n)
		}
	}
}

// TestHugeUsage: usage of any size on keys of a rule (one delta of 1e15
// requests, two of 2^62 whose sum passes 2^63, math.MaxInt64, at rates
// that float32 rounds to 0 or to +Inf), as anyone who can publish on a
// region's usage subject can send it, on a new key at every interval and
// on one key at every interval, changes only those keys' demand, bounded
// by DemandCap: the region's reports stay well formed, every peer accepts
// every report (acknowledgements included), nobody fences, and the other
// key's positions are, at every interval, those of the same run without
// the usage. Before, an estimate above 2^63 units became math.MinInt64,
// the region published a negative demand, its peers refused its whole
// reports and its lease lapsed: every key of the rule at its floor.
func TestHugeUsage(t *testing.T) {
	type use struct{ adm, rej int64 }
	cases := []struct {
		name string
		uses []use
		rate float64
	}{
		{"1e15", []use{{1e15, 0}}, 100},
		{"2^62+2^62", []use{{1 << 62, 1 << 62}}, 100},
		{"2^62 twice", []use{{1 << 62, 0}, {0, 1 << 62}}, 100},
		{"MaxInt64", []use{{math.MaxInt64, math.MaxInt64}, {math.MaxInt64, 0}}, 100},
		{"1e15 at 1/s", []use{{1e15, 0}}, 1},
		{"MaxInt64 at a rate float32 rounds to 0", []use{{math.MaxInt64, 0}}, 1e-300},
		{"MaxInt64 at a rate float32 rounds to +Inf", []use{{math.MaxInt64, 0}}, 1e300},
		{"MaxInt64 at the smallest rate", []use{{math.MaxInt64, 0}}, math.SmallestNonzeroFloat64},
	}
	configs := []struct {
		name  string
		tweak func(*Config)
	}{
		{"instant", func(*Config) {}},
		{"defaults", func(c *Config) {
			// The EWMA, DemandTokens' slow path, the band and the heartbeat.
			d := DefaultConfig()
			c.HalfLife, c.DemandTokens, c.DemandBand, c.Hysteresis = d.HalfLife, d.DemandTokens, d.DemandBand, d.Hysteresis
		}},
		{"units 2^45", func(c *Config) { c.Units = 1 << 45 }}, // maxDemand at its bound, 2^62
		{"units 2^61", func(c *Config) { c.Units = 1 << 61 }},
	}
	for _, cf := range configs {
		for _, tc := range cases {
			t.Run(cf.name+"/"+tc.name, func(t *testing.T) {
				attacked, control := hugeCluster(t, cf.tweak), hugeCluster(t, cf.tweak)
				for _, c := range []*cluster{attacked, control} {
					c.use[0], c.use[1] = 6, 2
				}
				hi := attacked.cfg.maxDemand()
				for round := range 60 {
					hugeRound(attacked, func(l *Ledger) {
						for _, u := range tc.uses {
							l.Usage(attacked.now, fmt.Sprintf("evil-%d", round), tc.rate, u.adm, u.rej)
							l.Usage(attacked.now, "evil", tc.rate, u.adm, u.rej)
						}
					})
					hugeRound(control, nil)
					for i := range attacked.l {
						if got, want := attacked.l[i].Position("k"), control.l[i].Position("k"); got != want {
							t.Fatalf("round %d: r%d's other key is at %+v, without the usage %+v", round, i, got, want)
						}
						for _, k := range []string{"evil", fmt.Sprintf("evil-%d", round)} {
							s := attacked.l[i].Position(k)
							if s.Demand < 0 || s.Demand > hi || s.Reported < 0 || s.Reported > hi {
								t.Fatalf("round %d: r%d's key %s has demand %d, reported %d, outside [0, %d]", round, i, k, s.Demand, s.Reported, hi)
							}
						}
					}
					for _, k := range []string{"k", "evil"} {
						if s := attacked.sum(k); s > attacked.cfg.Units {
							t.Fatalf("round %d: positions of %s sum to %d > %d", round, k, s, attacked.cfg.Units)
						}
					}
				}
				if d := attacked.l[0].Position("evil").Reported; tc.rate <= 1e30 && tc.rate > 1e-30 && d == 0 {
					t.Errorf("the key's usage left no demand")
				}
				if p := control.l[0].Position("k"); p.Units <= control.l[2].Position("k").Units {
					t.Errorf("no share moved to the demand: r0 %+v, r2 %+v", p, control.l[2].Position("k"))
				}
			})
		}
	}
}

// TestToUnits: every conversion of a demand to int64 saturates.
func TestToUnits(t *testing.T) {
	for _, tc := range []struct {
		f    float64
		hi   int64
		want int64
	}{
		{math.NaN(), 10, 0}, {math.Inf(-1), 10, 0}, {-5, 10, 0}, {0.7, 10, 0}, {7.9, 10, 7},
		{10, 10, 10}, {1e300, 10, 10}, {math.Inf(1), 10, 10},
		{math.Inf(1), math.MaxInt64, math.MaxInt64}, {0x1p63, math.MaxInt64, math.MaxInt64},
		{math.Nextafter(0x1p63, 0), math.MaxInt64, 1<<63 - 1024},
		{float64(maxDemandUnits) * 1.0000001, maxDemandUnits, maxDemandUnits},
	} {
		if got := toUnits(tc.f, tc.hi); got != tc.want {
			t.Errorf("toUnits(%v, %d) = %d, want %d", tc.f, tc.hi, got, tc.want)
		}
	}
	for _, tc := range [][3]int64{{1, 2, 3}, {1 << 62, 1 << 62, math.MaxInt64}, {math.MaxInt64, math.MaxInt64, math.MaxInt64}, {math.MaxInt64, 0, math.MaxInt64}} {
		if got := addCost(tc[0], tc[1]); got != tc[2] {
			t.Errorf("addCost(%d, %d) = %d, want %d", tc[0], tc[1], got, tc[2])
		}
	}
	c := DefaultConfig()
	for _, tc := range [][2]int64{{-1, DemandCap * c.Units}, {math.MinInt64, DemandCap * c.Units}, {0, 0}, {5, 5}, {math.MaxInt64, DemandCap * c.Units}} {
		if got := c.readDemand(tc[0]); got != tc[1] {
			t.Errorf("readDemand(%d) = %d, want %d", tc[0], got, tc[1])
		}
	}
	c.Units = math.MaxInt64
	if got := c.maxDemand(); got != maxDemandUnits {
		t.Errorf("maxDemand at Units MaxInt64 = %d", got)
	}
}

// TestDemandOutOfRangeBounded: a key report whose demand is out of range
// (negative, as a sender before DemandCap published an estimate above
// 2^63 units, or above DemandCap limits) is merged with its demand
// bounded; the report is not refused, and its acknowledgements apply. Before, the whole report was refused as
// malformed, its acknowledgements too: the sender's lease lapsed.
func TestDemandOutOfRangeBounded(t *testing.T) {
	c := newCluster(t, 3)
	c.use[0] = 6
	for range 10 {
		c.exchange()
	}
	hi := c.cfg.maxDemand()
	for _, d := range []int64{math.MinInt64, -1, math.MaxInt64, hi + 1} {
		c.now += c.cfg.Interval
		c.l[0].Usage(c.now, "k", 100, 6, 0)
		out := c.l[0].Tick(c.now)
		c.confirm(0, out)
		if out.Report == nil {
			t.Fatal("r0 sent no report")
		}
		r := *out.Report
		r.Keys = append([]KeyReport{{Key: "evil", Demand: d, Position: r.Base}}, r.Keys...)
		if _, err := c.l[1].Receive(c.now, r); err != nil {
			t.Fatalf("demand %d: r1 refused the report: %v", d, err)
		}
		if got := c.l[1].pair(c.l[1].keys["evil"], 0).peerDemand; got != hi {
			t.Errorf("demand %d read as %d, want %d", d, got, hi)
		}
		if got := c.l[1].peers[0].lastSeq; got != r.Seq {
			t.Errorf("demand %d: the report was not merged (r0's last sequence %d, the report's %d)", d, got, r.Seq)
		}
		c.confirm(1, c.l[1].Tick(c.now))
	}
	for range 20 {
		c.exchange()
	}
	for i, l := range c.l {
		if l.Fenced() || l.Stats().Rejected > 0 {
			t.Errorf("r%d fenced %v, rejected %d", i, l.Fenced(), l.Stats().Rejected)
		}
	}
}
