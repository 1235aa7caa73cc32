package sim

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"time"

	"github.com/apportion/apportion/allocation"
)

// world is the state every strategy shares: the clock, the scenario, the
// keys, the regions' clocks and the network's topology.
type world struct {
	eng       engine
	sc        *Scenario
	keys      []Key
	agentRate []float64
	agentOff  []time.Duration
	storeRate []float64
	lost      []bool
	group     []int     // partition group of each region: 0 is the main one
	lossy     []float64 // per region: the loss of a loss event in force (0: none)
	envs      []*Env
}

// Env is one strategy's view of the world. It is not safe for concurrent
// use: the whole simulation runs on one goroutine.
type Env struct {
	w     *world
	idx   int
	rng   *rand.Rand
	bytes int64
}

// Scenario returns the scenario being run.
func (e *Env) Scenario() *Scenario { return e.w.sc }

// Keys returns the keys (index = key id in Admit).
func (e *Env) Keys() []Key { return e.w.keys }

// Regions returns the number of regions.
func (e *Env) Regions() int { return len(e.w.sc.Regions) }

// Rand returns the strategy's own random stream.
func (e *Env) Rand() *rand.Rand { return e.rng }

// Now returns the virtual real time.
func (e *Env) Now() time.Duration { return e.w.eng.now }

// After runs fn after d of real time.
func (e *Env) After(d time.Duration, fn func()) { e.w.eng.at(e.w.eng.now+d, fn) }

// AgentNow returns region r's agent clock: a monotonic clock with an offset
// and a rate error.
func (e *Env) AgentNow(r int) time.Duration {
	return e.w.agentOff[r] + time.Duration(float64(e.w.eng.now)*e.w.agentRate[r])
}

// AgentAfter runs fn after d has passed on region r's agent clock.
func (e *Env) AgentAfter(r int, d time.Duration, fn func()) {
	e.After(time.Duration(math.Ceil(float64(d)/e.w.agentRate[r])), fn)
}

// StoreMs returns region r's store clock (Redis TIME) in whole ms.
func (e *Env) StoreMs(r int) int64 {
	return int64(float64(e.w.eng.now) * e.w.storeRate[r] / 1e6)
}

// Lost reports whether region r is lost.
func (e *Env) Lost(r int) bool { return e.w.lost[r] }

// Reachable reports whether a message can travel from region a to region b now.
func (e *Env) Reachable(a, b int) bool {
	w := e.w
	return !w.lost[a] && !w.lost[b] && w.group[a] == w.group[b]
}

// RegistryReachable reports whether region r can reach the registry (etcd),
// which lives with the main partition.
func (e *Env) RegistryReachable(r int) bool { return !e.w.lost[r] && e.w.group[r] == 0 }

// Send carries a message of size bytes from region a to b: it is counted,
// then dropped if the regions cannot reach each other (at sending or at
// delivery) or lost with the network's loss probability or that of a loss
// event on either region, else delivered
// after the one-way delay plus jitter.
func (e *Env) Send(a, b, size int, deliver func()) {
	e.bytes += int64(size)
	if !e.Reachable(a, b) {
		return
	}
	n := &e.w.sc.Network
	if n.Loss > 0 && e.rng.Float64() < n.Loss {
		return
	}
	if p := max(e.w.lossy[a], e.w.lossy[b]); p > 0 && e.rng.Float64() < p {
		return
	}
	d := e.w.sc.Delay(a, b)
	if n.JitterMs > 0 {
		d += time.Duration(e.rng.Float64() * n.JitterMs * 1e6)
	}
	e.After(d, func() {
		if e.Reachable(a, b) {
			deliver()
		}
	})
}

// Registry runs op at the registry after the one-way registry delay, if
// region r can reach it then, and delivers its reply to r after the same delay.
func (e *Env) Registry(r int, op func() (reply func())) {
	d := time.Duration(*e.w.sc.Network.RegistryMs * 1e6)
	if !e.RegistryReachable(r) {
		return
	}
	e.After(d, func() {
		if !e.RegistryReachable(r) {
			return
		}
		reply := op()
		if reply == nil {
			return
		}
		e.After(d, func() {
			if e.RegistryReachable(r) {
				reply()
			}
		})
	})
}

// RegistryDelay is the one-way delay to the registry.
func (e *Env) RegistryDelay() time.Duration {
	return time.Duration(*e.w.sc.Network.RegistryMs * 1e6)
}

// stream is one region's share of one demand entry.
type stream struct {
	region int
	d      int // demand index
	frac   float64
	max    float64 // upper bound of the level (for thinning)
	key    int     // fixed key, or the first key of a key set
	zipf   *rand.Zipf
	rng    *rand.Rand
}

// Options adjust a run.
type Options struct {
	// Seed overrides the scenario's seed when non-zero.
	Seed uint64
	// Duration overrides the scenario's duration when non-zero (tests).
	Duration time.Duration
	// Progress, if set, is called with the fraction of virtual time done,
	// about every 1%.
	Progress func(done float64)
}

// Run simulates sc with the strategies; strategies[0] must be the reference
// (the centralized ideal).
func Run(ctx context.Context, sc *Scenario, strategies []Strategy, opt Options) (*Result, error) {
	if len(strategies) == 0 {
		return nil, fmt.Errorf("sim: no strategies")
	}
	seed := sc.Seed
	if opt.Seed != 0 {
		seed = opt.Seed
	}
	dur := sc.Duration.D()
	if opt.Duration > 0 {
		dur = opt.Duration
	}
	if err := sc.CheckSize(dur); err != nil {
		return nil, err
	}
	nr := len(sc.Regions)
	w := &world{sc: sc, lost: make([]bool, nr), group: make([]int, nr), lossy: make([]float64, nr)}
	setup := rand.New(rand.NewPCG(seed, 0x5eed))
	for i, r := range sc.Regions {
		e := *sc.Sync.ClockError
		rate := 1 + e*(2*setup.Float64()-1)
		if r.AgentClock != nil {
			rate = 1 + *r.AgentClock
		}
		w.agentRate = append(w.agentRate, rate)
		w.agentOff = append(w.agentOff, time.Duration(setup.Int64N(int64(time.Hour))))
		w.storeRate = append(w.storeRate, 1+r.StoreClock)
		_ = i
	}
	// Keys and streams.
	keyIdx := map[string]int{}
	addKey := func(name string) int {
		if i, ok := keyIdx[name]; ok {
			return i
		}
		keyIdx[name] = len(w.keys)
		w.keys = append(w.keys, Key{Name: name, Rate: sc.Rule.Rate, Burst: sc.Rule.Burst, WindowMs: sc.Rule.Window.D().Milliseconds()})
		return len(w.keys) - 1
	}
	var streams []*stream
	for di := range sc.Demand {
		d := &sc.Demand[di]
		first := -1
		if d.Keys != nil {
			for k := 0; k < d.Keys.Count; k++ {
				i := addKey(fmt.Sprintf("%s%d", d.Keys.Prefix, k))
				if k == 0 {
					first = i
				}
			}
		} else {
			first = addKey(d.Key)
		}
		for r, f := range sc.Fractions(d) {
			if f <= 0 {
				continue
			}
			st := &stream{region: r, d: di, frac: f, max: d.Peak(), key: first,
				rng: rand.New(rand.NewPCG(seed, uint64(1000+len(streams))))}
			if d.Keys != nil && d.Keys.Count > 1 {
				st.zipf = rand.NewZipf(st.rng, d.Keys.S, 1, uint64(d.Keys.Count-1))
			}
			streams = append(streams, st)
		}
	}
	m := newMetrics(w, strategies, dur)
	for i, s := range strategies {
		env := &Env{w: w, idx: i, rng: rand.New(rand.NewPCG(seed, uint64(1_000_000+i)))}
		w.envs = append(w.envs, env)
		if err := s.Start(env); err != nil {
			return nil, fmt.Errorf("sim: %s: %w", s.Name(), err)
		}
	}
	// Request streams.
	for _, st := range streams {
		startStream(w, m, st)
	}
	// Disruptions: at an event's start (and end), fn for each of its regions.
	for ei, ev := range sc.Events {
		ei, ev := ei, ev
		var regions []int
		for _, n := range ev.Regions {
			regions = append(regions, sc.Index(n))
		}
		each := func(at time.Duration, fn func(r int)) {
			w.eng.at(at, func() {
				for _, r := range regions {
					fn(r)
				}
			})
		}
		disrupt := func(fn func(Disrupted)) {
			for _, s := range strategies {
				if x, ok := s.(Disrupted); ok {
					fn(x)
				}
			}
		}
		at, end := ev.At.D(), ev.At.D()+ev.For.D()
		switch ev.Kind {
		case "partition":
			each(at, func(r int) { w.group[r] = ei + 1 })
			if ev.For > 0 {
				each(end, func(r int) { w.group[r] = 0 })
			}
		case "region_loss":
			each(at, func(r int) { w.lost[r] = true; disrupt(func(x Disrupted) { x.RegionLost(r) }) })
			if ev.For > 0 {
				each(end, func(r int) { w.lost[r] = false; disrupt(func(x Disrupted) { x.RegionBack(r) }) })
			}
		case "loss":
			each(at, func(r int) { w.lossy[r] = ev.Loss })
			if ev.For > 0 {
				each(end, func(r int) { w.lossy[r] = 0 })
			}
		case "store_reset":
			each(at, func(r int) {
				for _, s := range strategies {
					if x, ok := s.(Reset); ok && !w.lost[r] {
						x.StoreReset(r)
					}
				}
			})
		case "agent_restart":
			each(at, func(r int) { disrupt(func(x Disrupted) { x.AgentDown(r) }) })
			each(end, func(r int) { disrupt(func(x Disrupted) { x.AgentUp(r) }) })
		}
	}
	shifts := targets(sc, w, dur)
	m.schedule(len(shifts) > 0)
	// The loop.
	var n int
	step := max(dur/100, 1)
	nextProgress := step
	for {
		ev, ok := w.eng.pop()
		if !ok || ev.at > dur {
			break
		}
		if opt.Progress != nil && ev.at >= nextProgress {
			opt.Progress(float64(ev.at) / float64(dur))
			nextProgress = (ev.at/step + 1) * step
		}
		w.eng.now = ev.at
		ev.fn()
		n++
		if n&0xffff == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
	}
	w.eng.now = dur
	res := m.result(seed, dur, n)
	res.Targets = shifts
	m.convergence(res)
	return res, nil
}

// Shift is a demand change, or the end of a fault (or a region lost), and
// the shares the allocation targets after it.
type Shift struct {
	At      float64   `json:"at_s"`
	Targets []float64 `json:"targets"` // fraction of the limit, per region
	// Fault names the event whose end (a region_loss: start) this is;
	// empty for a demand change.
	Fault string `json:"fault,omitempty"`
	// Lost lists the regions (indices) lost at At: their targets are
	// their floors, but convergence compares only the other regions (a
	// lost region's share is not enforced: it has no requests).
	Lost []int `json:"lost,omitempty"`
}

// faultEnds returns, per event of sc, the time from which the shares must
// return to the targets, and what it is: a partition or loss event that
// ends, an agent back up, a store reset, a region lost (its share is
// reclaimed) or back. A time at which another fault is still in force (a
// node's Redis reset while its agent is down, say) is left out: that
// fault's own end follows. (A region lost for good is not in force in
// that sense: the targets leave it its floor.)
func faultEnds(sc *Scenario) (times []time.Duration, what []string) {
	inForce := func(t time.Duration, skip int) bool {
		for j, e := range sc.Events {
			if j == skip || e.Kind == "store_reset" || e.Kind == "region_loss" && e.For == 0 {
				continue
			}
			if e.At.D() <= t && (e.For == 0 || t < e.At.D()+e.For.D()) {
				return true
			}
		}
		return false
	}
	add := func(i int, t time.Duration, name string) {
		if !inForce(t, i) {
			times, what = append(times, t), append(what, name)
		}
	}
	for i, e := range sc.Events {
		name := e.Kind + " " + strings.Join(e.Regions, ",")
		switch {
		case e.Kind == "store_reset":
			add(i, e.At.D(), name)
		case e.Kind == "region_loss":
			add(i, e.At.D(), name+" lost")
			if e.For > 0 {
				add(i, e.At.D()+e.For.D(), name+" back")
			}
		case e.For > 0: // partition, loss, agent_restart (For set by the defaults)
			add(i, e.At.D()+e.For.D(), name+" over")
		}
	}
	return times, what
}

// lostAt reports, per region, whether a region_loss event has it lost at t.
func lostAt(sc *Scenario, t time.Duration) []bool {
	lost := make([]bool, len(sc.Regions))
	for _, e := range sc.Events {
		if e.Kind != "region_loss" || t < e.At.D() || e.For > 0 && t >= e.At.D()+e.For.D() {
			continue
		}
		for _, n := range e.Regions {
			lost[sc.Index(n)] = true
		}
	}
	return lost
}

// targets returns the demand shifts of the tracked key (key 0) and the ends
// of the faults (faultEnds), and the allocation's targets after each:
// floors min_share x weight, the rest split by the rule's allocation over
// the true demand levels of the regions not lost (a lost region's demand
// is gone: it is left its floor).
func targets(sc *Scenario, w *world, dur time.Duration) []Shift {
	type point struct {
		at    time.Duration
		fault string
	}
	var points []point
	seen := map[time.Duration]bool{}
	for i := range sc.Demand {
		d := &sc.Demand[i]
		if d.Keys != nil || d.Key != w.keys[0].Name {
			continue
		}
		for _, t := range d.Changes() {
			if t < dur && !seen[t] {
				seen[t] = true
				points = append(points, point{at: t})
			}
		}
	}
	ft, fw := faultEnds(sc)
	for i, t := range ft {
		if t < dur && !seen[t] {
			seen[t] = true
			points = append(points, point{t, fw[i]})
		}
	}
	sort.SliceStable(points, func(a, b int) bool { return points[a].at < points[b].at })
	f, _ := allocation.ByName(sc.Rule.Allocation)
	wts := sc.Weights()
	var out []Shift
	for _, p := range points {
		lost := lostAt(sc, p.at)
		lv := make([]float64, len(sc.Regions))
		for i := range sc.Demand {
			d := &sc.Demand[i]
			if d.Keys != nil || d.Key != w.keys[0].Name {
				continue
			}
			for r, fr := range sc.Fractions(d) {
				if !lost[r] {
					lv[r] += fr * d.LevelAt(p.at)
				}
			}
		}
		// A lost region keeps its floor (floors never move); the rest is
		// the live regions' (the survivors reclaim it).
		var regs []allocation.Region
		var live, gone []int
		tg := make([]float64, len(lv))
		for r := range lv {
			tg[r] = sc.Rule.MinShare * wts[r]
			if lost[r] {
				gone = append(gone, r)
			} else {
				live = append(live, r)
				regs = append(regs, allocation.Region{Weight: wts[r], Floor: sc.Rule.MinShare * wts[r], Demand: lv[r]})
			}
		}
		for j, v := range allocation.Targets(f, 1-sc.Rule.MinShare, regs) {
			tg[live[j]] = v
		}
		out = append(out, Shift{At: p.at.Seconds(), Targets: tg, Fault: p.fault, Lost: gone})
	}
	return out
}

// startStream schedules a stream's requests: Poisson arrivals by thinning
// (candidates at the stream's peak rate, each kept with probability
// level/peak), or evenly spaced ones at the current level.
func startStream(w *world, m *metrics, st *stream) {
	sc := w.sc
	d := &sc.Demand[st.d]
	perLevel := st.frac * sc.Rule.Rate / float64(d.Cost) // requests/s per unit of level
	emit := func() {
		if w.lost[st.region] {
			return
		}
		key := st.key
		if st.zipf != nil {
			key += int(st.zipf.Uint64())
		}
		m.request(st.region, key, d.Cost)
	}
	if d.Arrivals == "uniform" {
		var next func()
		next = func() {
			lvl := d.LevelAt(w.eng.now) * perLevel
			if lvl <= 0 {
				w.eng.at(w.eng.now+100*time.Millisecond, next)
				return
			}
			w.eng.at(w.eng.now+time.Duration(1e9/lvl), func() {
				emit()
				next()
			})
		}
		w.eng.at(0, next)
		return
	}
	peak := st.max * perLevel
	if peak <= 0 {
		return
	}
	var cand func()
	cand = func() {
		now := w.eng.now
		w.eng.at(now+time.Duration(st.rng.ExpFloat64()/peak*1e9), cand)
		if st.rng.Float64()*st.max < d.LevelAt(now) {
			emit()
		}
	}
	w.eng.at(time.Duration(st.rng.ExpFloat64()/peak*1e9), cand)
}
