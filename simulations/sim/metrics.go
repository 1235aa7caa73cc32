package sim

import (
	"math"
	"slices"
	"time"
)

// win holds one (strategy, key)'s admissions of the last minute, for the
// exact sliding-window maximum: for every admission at t, the admitted cost
// in the closed window [t-W, t]. The supremum over all windows is reached
// with a window ending at an admission, so this is exact.
type win struct {
	ts   []int64
	cost []int64
	head [3]int
	sum  [3]int64
}

func (x *win) add(t, cost int64, bounds *[3]float64, max *[3]float64) {
	x.ts = append(x.ts, t)
	x.cost = append(x.cost, cost)
	for i, W := range Windows {
		x.sum[i] += cost
		for x.ts[x.head[i]] < t-int64(W) {
			x.sum[i] -= x.cost[x.head[i]]
			x.head[i]++
		}
		if r := float64(x.sum[i]) / bounds[i]; r > max[i] {
			max[i] = r
		}
	}
	if h := x.head[len(Windows)-1]; h > 1024 && h > len(x.ts)/2 {
		n := copy(x.ts, x.ts[h:])
		copy(x.cost, x.cost[h:])
		x.ts, x.cost = x.ts[:n], x.cost[:n]
		for i := range x.head {
			x.head[i] -= h
		}
	}
}

type smetric struct {
	offered, admitted  int64 // cost
	requests, admReq   int64
	wrong              int64 // requests rejected here but admitted by the ideal
	wins               map[int]*win
	max                [3]float64
	series             []float64 // admitted cost of key 0 per sample
	shares             [][]float64
	conv               [][]float64
	activeSum          float64 // key-seconds of coordinated keys
	activeMax, activeN int
	quota              map[int]*[2]int64 // a fixed-window rule: key -> window index, admitted in it
	quotaMax           int64             // the most admitted in one window of one key
}

type metrics struct {
	w      *world
	strats []Strategy
	dur    time.Duration
	bins   int
	bounds [3]float64 // burst + rate x W, key 0's rule (the same rule for all keys)
	per    []*smetric
	demand []float64 // offered cost of key 0 per sample
}

func newMetrics(w *world, strats []Strategy, dur time.Duration) *metrics {
	sample := w.sc.Sample.D()
	m := &metrics{w: w, strats: strats, dur: dur, bins: int((dur + sample - 1) / sample)}
	for i, W := range Windows {
		m.bounds[i] = w.sc.Rule.Burst + w.sc.Rule.Rate*W.Seconds()
	}
	m.demand = make([]float64, m.bins)
	for range strats {
		m.per = append(m.per, &smetric{wins: map[int]*win{}, series: make([]float64, m.bins)})
	}
	return m
}

func (m *metrics) bin() int {
	b := int(m.w.eng.now / m.w.sc.Sample.D())
	return min(b, m.bins-1)
}

// request offers one request to every strategy, the ideal first.
func (m *metrics) request(region, key int, cost int64) {
	now := int64(m.w.eng.now)
	b := m.bin()
	if key == 0 {
		m.demand[b] += float64(cost)
	}
	var ideal bool
	for i, s := range m.strats {
		ok := s.Admit(region, key, cost)
		if i == 0 {
			ideal = ok
		}
		x := m.per[i]
		x.requests++
		x.offered += cost
		if !ok {
			if ideal {
				x.wrong++
			}
			continue
		}
		x.admReq++
		x.admitted += cost
		if key == 0 {
			x.series[b] += float64(cost)
		}
		wn := x.wins[key]
		if wn == nil {
			wn = &win{}
			x.wins[key] = wn
		}
		wn.add(now, cost, &m.bounds, &x.max)
		if W := m.w.keys[key].WindowMs; W > 0 {
			x.addQuota(key, now/int64(time.Millisecond)/W, cost)
		}
	}
}

// addQuota counts cost admitted for key in rule window idx (windows of the
// true clock; the stores' clocks are the true one unless a region sets a
// store clock error).
func (x *smetric) addQuota(key int, idx, cost int64) {
	if x.quota == nil {
		x.quota = map[int]*[2]int64{}
	}
	q := x.quota[key]
	if q == nil || q[0] != idx {
		q = &[2]int64{idx, 0}
		x.quota[key] = q
	}
	q[1] += cost
	x.quotaMax = max(x.quotaMax, q[1])
}

// schedule samples shares (per sample period and every 100 ms for
// convergence) and active keys (every second).
func (m *metrics) schedule(shifts bool) {
	nr := len(m.w.sc.Regions)
	var shares func()
	shares = func() {
		for i, s := range m.strats {
			if sh, ok := s.(Sharer); ok {
				row := make([]float64, nr)
				for r := range row {
					row[r] = sh.Share(r, 0)
				}
				m.per[i].shares = append(m.per[i].shares, row)
			}
		}
		if next := m.w.eng.now + m.w.sc.Sample.D(); next < m.dur {
			m.w.eng.at(next, shares)
		}
	}
	m.w.eng.at(0, shares)
	var conv func()
	conv = func() {
		for i, s := range m.strats {
			if sh, ok := s.(Sharer); ok {
				row := make([]float64, nr)
				for r := range row {
					row[r] = sh.Share(r, 0)
				}
				m.per[i].conv = append(m.per[i].conv, row)
			}
		}
		if next := m.w.eng.now + convergeSample; next <= m.dur {
			m.w.eng.at(next, conv)
		}
	}
	if shifts {
		m.w.eng.at(0, conv)
	}
	var active func()
	active = func() {
		for i, s := range m.strats {
			if a, ok := s.(ActiveKeys); ok {
				n := a.ActiveKeys()
				x := m.per[i]
				x.activeSum += float64(n)
				x.activeN++
				x.activeMax = max(x.activeMax, n)
			}
		}
		if next := m.w.eng.now + time.Second; next < m.dur {
			m.w.eng.at(next, active)
		}
	}
	m.w.eng.at(time.Second/2, active)
}

func round(x float64, digits int) float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return x
	}
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

func (m *metrics) result(seed uint64, dur time.Duration, events int) *Result {
	sc := m.w.sc
	res := &Result{Scenario: sc.Name, Seed: seed, DurationS: dur.Seconds(), Rate: sc.Rule.Rate, Burst: sc.Rule.Burst, RuleWindowS: sc.Rule.Window.D().Seconds(),
		SampleS: sc.Sample.D().Seconds(), Events: events, TrackedKey: m.w.keys[0].Name, Keys: len(m.w.keys),
		OutsideClockGuarantee: sc.OutsideClockGuarantee()}
	for _, r := range sc.Regions {
		res.Regions = append(res.Regions, r.Name)
	}
	for _, W := range Windows {
		res.WindowsS = append(res.WindowsS, W.Seconds())
	}
	res.Demand = PerSecond(m.demand, sc.Sample.D(), dur)
	ideal := m.per[0].admitted
	for i, s := range m.strats {
		x := m.per[i]
		sr := StrategyResult{Name: s.Name(), Requests: x.requests, Offered: x.offered, Admitted: x.admitted,
			Rejected: x.offered - x.admitted, WronglyRejected: x.wrong, SyncBytes: m.w.envs[i].bytes}
		for k := range Windows {
			sr.Overshoot = append(sr.Overshoot, round(x.max[k]-1, 6))
		}
		if ideal > 0 {
			sr.Utilization = round(float64(x.admitted)/float64(ideal), 6)
		}
		if x.requests > 0 {
			sr.WronglyRejectedPct = round(100*float64(x.wrong)/float64(x.requests), 4)
		}
		if x.activeN > 0 {
			sr.ActiveKeysMean = round(x.activeSum/float64(x.activeN), 3)
			sr.ActiveKeysMax = x.activeMax
			if x.activeSum > 0 {
				sr.BytesPerKeySecond = round(float64(sr.SyncBytes)/x.activeSum, 3)
			}
		}
		sr.WindowMax = x.quotaMax
		sr.AdmittedRate = PerSecond(x.series, sc.Sample.D(), dur)
		sr.Shares = x.shares
		res.Strategies = append(res.Strategies, sr)
	}
	return res
}

// PerSecond turns the cost per sample into a rate: each sample's cost
// over the time it covers, the whole period but for the last sample of a
// run whose duration dur is not a multiple of it (the time left).
func PerSecond(xs []float64, sample, dur time.Duration) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		span := sample
		if i == len(xs)-1 {
			if left := dur - time.Duration(i)*sample; left > 0 && left < sample {
				span = left
			}
		}
		out[i] = round(x/span.Seconds(), 3)
	}
	return out
}

// convergence fills in the convergence time after each shift: the first
// sample from which every region's share (but a lost one's: Shift.Lost)
// stays within ConvergeTolerance of the limit of its target until the next shift (or the end), sampled every
// 100 ms. -1: the shares were out of tolerance at the end of the period
// (with Poisson arrivals the targets follow noisy demand estimates).
func (m *metrics) convergence(res *Result) {
	for i := range m.strats {
		x := m.per[i]
		if x.conv == nil {
			continue
		}
		sr := &res.Strategies[i]
		sr.HasShares = true
		sr.Reach, sr.Convergence = Converge(x.conv, res.Targets)
	}
}

// within reports whether every region not lost at sh has its share within
// ConvergeTolerance of its target. A lost region is left out: its target
// is its floor, but it has no requests and its sampled share (the
// ledger's 0, a stopped agent's floor live) says nothing of convergence.
func within(shares []float64, sh Shift) bool {
	for r, v := range shares {
		if slices.Contains(sh.Lost, r) {
			continue
		}
		if math.Abs(v-sh.Targets[r]) > ConvergeTolerance {
			return false
		}
	}
	return true
}
