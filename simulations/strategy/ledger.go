package strategy

import (
	"slices"
	"strconv"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/internal/bincode"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/sync/ledger"
)

// Ledger is this project: in every region a sync agent runs the real share
// ledger (sync/ledger.Ledger, the production state machine) on its own
// drifting clock, fed with its enforcers' usage every interval; its reports
// cross the virtual WAN; its store writes go to a model of the region's Redis
// that implements the store contract of sync/ledger/doc.go (marker with a
// lease on the store clock, per-key records, floor fallback, versioned
// writes, settle-then-clamp share changes); the reclaim registry is the real
// ledger.Registry, reached with the registry delay as etcd would be. Targets
// come from allocation.SplitUnits with the rule's allocation.
//
// The store model is written here from the contract (regional/redisstore.Model
// implements the same contract for the Lua scripts; it settles a global bucket
// lazily at its next check, while this model settles at the instant of a
// change or lease lapse): each key's bucket is a sim.Bucket whose share is
// floor(R*u/U), floor(C*u/U) for the units u the contract says the store
// enforces. Release records are kept (their units equal the marker's default,
// so their expiry would change nothing here).
//
// For a fixed-window rule (a quota) the buckets are fixed windows of the
// share floor(L*u/U), and the store refuses a record below what the key has
// used of its window, answering the ledger with Ledger.Hold, as the script
// does (regional/redisstore, "Global windows").
type Ledger struct {
	env      *sim.Env
	cfg      ledger.Config
	specs    []ledger.RegionSpec
	floor    []int64
	base     []int64
	reg      *ledger.Registry
	rs       []*lregion
	keyIdx   map[string]int
	activate float64
}

type lregion struct {
	idx   int
	name  string
	led   *ledger.Ledger
	gen   int // bumped at every agent life and death: stale events are dropped
	st    *lstore
	runs  int
	used  map[int]*[2]int64 // key -> admitted, rejected cost since the last tick
	fed   map[int]bool      // keys whose usage reaches the ledger
	fedL  []int
	start bool // a start is in progress
}

type lmarker struct {
	ver        ledger.Version
	units      int64
	leaseUntil int64 // store ms
}

type lrec struct {
	units   int64
	ver     ledger.Version
	release bool
}

type lstore struct {
	runID  string
	marker *lmarker
	recs   map[int]*lrec
	b      buckets
	inited []int
}

func (s *Ledger) Name() string { return "ledger" }

// ledgerConfig returns the ledger's Config for the scenario.
func ledgerConfig(env *sim.Env) (ledger.Config, []ledger.RegionSpec) {
	sc := env.Scenario()
	cfg := ledger.DefaultConfig()
	cfg.MinShare = sc.Rule.MinShare
	cfg.Interval = sc.Sync.Interval.D()
	cfg.Lease = sc.Sync.Lease.D()
	cfg.Rho = *sc.Sync.ClockError
	cfg.Margin = sc.Sync.Margin.D()
	cfg.StoreTimeout = sc.Sync.StoreTimeout.D()
	cfg.Alpha = *sc.Sync.Alpha
	cfg.Quantum = ledger.QuantumOf(cfg.Units, sc.Rule.Burst)
	f, _ := allocation.ByName(sc.Rule.Allocation)
	cfg.Allocate = ledger.AllocatorOf(f)
	var specs []ledger.RegionSpec
	for i, r := range sc.Regions {
		specs = append(specs, ledger.RegionSpec{Name: r.Name, Weight: sc.Weights()[i]})
	}
	return cfg, specs
}

func (s *Ledger) Start(env *sim.Env) error {
	s.env = env
	s.cfg, s.specs = ledgerConfig(env)
	var initial []int64
	s.floor, initial = ledger.Split(s.cfg, s.specs)
	for i := range s.floor {
		s.base = append(s.base, s.floor[i]+initial[i])
	}
	var err error
	if s.reg, err = ledger.NewRegistry(s.cfg, s.specs); err != nil {
		return err
	}
	s.activate = *env.Scenario().Sync.ActivateAbove
	s.keyIdx = make(map[string]int, len(env.Keys()))
	for i, k := range env.Keys() {
		s.keyIdx[k.Name] = i
	}
	for i, sp := range s.specs {
		r := &lregion{idx: i, name: sp.Name}
		r.st = s.newStore(r)
		s.rs = append(s.rs, r)
		s.startAgent(r)
	}
	return nil
}

func (s *Ledger) newStore(r *lregion) *lstore {
	r.runs++
	return &lstore{runID: "run" + strconv.Itoa(r.runs), recs: map[int]*lrec{}, b: newBuckets(s.env.Keys())}
}

// startAgent starts a new incarnation: a registry round trip (retried while
// the registry is out of reach), then the first tick one interval later.
func (s *Ledger) startAgent(r *lregion) {
	if r.led != nil || r.start || r.st == nil {
		return
	}
	if !s.env.RegistryReachable(r.idx) {
		s.env.After(time.Second, func() { s.startAgent(r) })
		return
	}
	r.start = true
	gen := r.gen
	s.env.Registry(r.idx, func() func() {
		st, err := s.reg.Start(r.name)
		if err != nil {
			return nil
		}
		return func() {
			r.start = false
			if r.gen != gen || r.st == nil {
				return
			}
			st.RunID = r.st.runID
			led, err := ledger.New(s.cfg, r.name, s.specs, st, s.env.AgentNow(r.idx))
			if err != nil {
				return
			}
			r.gen++
			r.led, r.used, r.fed, r.fedL = led, map[int]*[2]int64{}, map[int]bool{}, nil
			g := r.gen
			s.env.AgentAfter(r.idx, s.cfg.Interval, func() { s.tick(r, g) })
		}
	})
	// A registry reply lost to a partition must not block restarts forever.
	s.env.After(2*s.env.RegistryDelay()+time.Second, func() {
		if r.gen == gen && r.start {
			r.start = false
			s.startAgent(r)
		}
	})
}

func (s *Ledger) stopAgent(r *lregion) {
	r.led = nil
	r.gen++
}

func (s *Ledger) tick(r *lregion, gen int) {
	if r.gen != gen || r.led == nil {
		return
	}
	now := s.env.AgentNow(r.idx)
	keys := s.env.Keys()
	ks := make([]int, 0, len(r.used))
	for k := range r.used {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	for _, k := range ks {
		u := r.used[k]
		if !r.fed[k] {
			static := keys[k].Rate * float64(s.base[r.idx]) / float64(s.cfg.Units) * s.cfg.Interval.Seconds()
			if float64(u[0]+u[1]) > s.activate*static || r.led.Position(keys[k].Name).Active {
				r.fed[k] = true
				r.fedL = append(r.fedL, k)
			}
		}
		if r.fed[k] {
			r.led.Usage(now, keys[k].Name, keys[k].Rate, u[0], u[1])
		}
	}
	clear(r.used)
	s.handle(r, gen, r.led.Tick(now))
	if r.gen == gen {
		s.env.AgentAfter(r.idx, s.cfg.Interval, func() { s.tick(r, gen) })
	}
}

// handle carries out a ledger Output: store writes, the report to every
// other region, contributions to the registry, and fencing.
func (s *Ledger) handle(r *lregion, gen int, out ledger.Output) {
	if r.gen != gen || r.led == nil {
		return
	}
	for _, w := range out.Writes {
		s.issueWrite(r, gen, w)
	}
	if rep := out.Report; rep != nil {
		size := natsOverhead + ReportSize(rep)
		for q := range s.rs {
			if q == r.idx {
				continue
			}
			to := s.rs[q]
			s.env.Send(r.idx, q, size, func() {
				if to.led == nil {
					return
				}
				g := to.gen
				o, err := to.led.Receive(s.env.AgentNow(to.idx), *rep)
				if err == nil || len(o.Writes) > 0 || o.Fenced {
					s.handle(to, g, o)
				}
			})
		}
	}
	for _, c := range out.Contributions {
		c := c
		s.env.Registry(r.idx, func() func() {
			if _, err := s.reg.Contribute(c); err != nil {
				return nil
			}
			s.pushRecords()
			return nil
		})
	}
	if by := out.Close; by != (ledger.Incarnation{}) {
		s.env.Registry(r.idx, func() func() {
			if s.reg.Close(by) == nil {
				s.pushRecords()
			}
			return nil
		})
	}
	if out.Fenced {
		s.stopAgent(r)
		s.env.After(time.Second, func() { s.startAgent(r) })
	}
}

// pushRecords delivers every record of the registry to every region, as
// the agents' registry poll would: a reclaim's payments are in the
// recipients' own records.
func (s *Ledger) pushRecords() {
	recs := s.reg.Records()
	for _, q := range s.rs {
		q := q
		s.env.After(s.env.RegistryDelay(), func() {
			if q.led == nil || !s.env.RegistryReachable(q.idx) {
				return
			}
			for _, rec := range recs {
				g := q.gen
				s.handle(q, g, q.led.ReclaimRecorded(s.env.AgentNow(q.idx), rec))
			}
		})
	}
}

func (s *Ledger) storeDelay() time.Duration {
	return time.Duration(*s.env.Scenario().Sync.StoreMs * 1e6)
}

func (s *Ledger) issueWrite(r *lregion, gen int, w ledger.Write) {
	s.env.After(s.storeDelay(), func() {
		if r.st == nil {
			return
		}
		if need, until, no := s.refused(r, w); no {
			// A fixed window's lowering below its use: not applied, and
			// the answer goes back to the ledger (Ledger.Hold).
			s.env.After(s.storeDelay(), func() {
				if r.gen == gen && r.led != nil {
					r.led.Hold(s.env.AgentNow(r.idx), w.Key, need, until)
				}
			})
			return
		}
		if !s.applyWrite(r, w) {
			return
		}
		s.env.After(s.storeDelay(), func() {
			if r.gen == gen && r.led != nil {
				s.handle(r, gen, r.led.ShareApplied(s.env.AgentNow(r.idx), w.Key, w.Version))
			}
		})
	})
}

// refused reports whether the store refuses record w of a fixed-window key
// because the key has used more of its window than w would allow (the
// script's rule: the allowance of min(w's units, the units it would
// enforce)), and then the fewest units it could take and the time to the
// window's end.
func (s *Ledger) refused(r *lregion, w ledger.Write) (int64, time.Duration, bool) {
	k, ok := s.keyIdx[w.Key]
	if !ok || s.env.Keys()[k].WindowMs == 0 {
		return 0, 0, false
	}
	key := s.env.Keys()[k]
	st, ms := r.st, s.env.StoreMs(r.idx)
	if x := st.recs[k]; x != nil && !x.ver.Less(w.Version) {
		return 0, 0, false
	}
	u := s.floor[r.idx]
	if m := st.marker; m != nil && ms < m.leaseUntil && m.ver.Inc == w.Version.Inc {
		u = w.Units
	}
	u = min(u, w.Units)
	used := s.bucket(r, k, ms).Used(ms) * 1000
	if used <= key.CapMilli(u, s.cfg.Units) {
		return 0, 0, false
	}
	need := min((used*s.cfg.Units+int64(key.Burst*1000)-1)/int64(key.Burst*1000), s.cfg.Units)
	for need < s.cfg.Units && key.CapMilli(need, s.cfg.Units) < used {
		need++
	}
	for need > 0 && key.CapMilli(need-1, s.cfg.Units) >= used {
		need--
	}
	return need, time.Duration(key.WindowMs-ms%key.WindowMs) * time.Millisecond, true
}

// enforced returns the units the store enforces for key at store time ms
// (the store contract).
func (s *Ledger) enforced(r *lregion, key int, ms int64) int64 {
	st := r.st
	m := st.marker
	if m == nil || ms >= m.leaseUntil {
		return s.floor[r.idx]
	}
	if x := st.recs[key]; x != nil {
		if x.ver.Inc != m.ver.Inc {
			return s.floor[r.idx]
		}
		return x.units
	}
	return m.units
}

func (s *Ledger) params(key int, u int64) (int64, int64) {
	k := s.env.Keys()[key]
	return k.CapMilli(u, s.cfg.Units), k.RateMilli(u, s.cfg.Units)
}

// bucket returns key's bucket settled to ms: if the marker's lease lapsed
// since the last refill, the bucket is settled at the old share up to the
// lapse, then set to the floor and clamped.
func (s *Ledger) bucket(r *lregion, key int, ms int64) *sim.Bucket {
	st := r.st
	b := &st.b[key]
	if !b.Init {
		u := s.enforced(r, key, ms)
		c, rt := s.params(key, u)
		b.Start(ms, c, rt)
		b.Units = u
		st.inited = append(st.inited, key)
		return b
	}
	if m := st.marker; m != nil && b.Last < m.leaseUntil && m.leaseUntil <= ms && b.Units != s.floor[r.idx] {
		c, rt := s.params(key, s.floor[r.idx])
		b.Set(m.leaseUntil, c, rt)
		b.Units = s.floor[r.idx]
	}
	if u := s.enforced(r, key, ms); u != b.Units {
		c, rt := s.params(key, u)
		b.Set(ms, c, rt)
		b.Units = u
	}
	return b
}

func (s *Ledger) settleAll(r *lregion, ms int64) {
	for _, k := range r.st.inited {
		s.bucket(r, k, ms).Refill(ms)
	}
}

// applyWrite is the store script; it reports whether the store now holds a
// version >= w.Version for the key (the confirmation condition).
func (s *Ledger) applyWrite(r *lregion, w ledger.Write) bool {
	st, ms := r.st, s.env.StoreMs(r.idx)
	if w.Key == ledger.MarkerKey {
		m := st.marker
		if w.Create {
			if w.RunID != st.runID {
				return false
			}
			if m != nil && !m.ver.Less(w.Version) {
				return true
			}
			s.settleAll(r, ms)
			st.marker = &lmarker{ver: w.Version, units: w.Units, leaseUntil: ms + w.Lease.Milliseconds()}
			s.settleAll(r, ms)
			return true
		}
		if m == nil || m.ver.Inc != w.Version.Inc || !m.ver.Less(w.Version) {
			return false
		}
		changes := ms >= m.leaseUntil || m.units != w.Units
		if changes {
			s.settleAll(r, ms)
		}
		m.ver, m.units, m.leaseUntil = w.Version, w.Units, ms+w.Lease.Milliseconds()
		if changes {
			s.settleAll(r, ms)
		}
		return true
	}
	k, ok := s.keyIdx[w.Key]
	if !ok {
		return false
	}
	if x := st.recs[k]; x != nil && !x.ver.Less(w.Version) {
		return true
	}
	s.bucket(r, k, ms)
	st.recs[k] = &lrec{units: w.Units, ver: w.Version, release: w.Release}
	s.bucket(r, k, ms)
	return true
}

func (s *Ledger) Admit(region, key int, cost int64) bool {
	r := s.rs[region]
	if r.st == nil {
		return false
	}
	ms := s.env.StoreMs(region)
	ok := s.bucket(r, key, ms).Take(ms, cost)
	if r.led != nil {
		u := r.used[key]
		if u == nil {
			u = new([2]int64)
			r.used[key] = u
		}
		if ok {
			u[0] += cost
		} else {
			u[1] += cost
		}
	}
	return ok
}

// Share returns the fraction of the limit region's store enforces for key.
func (s *Ledger) Share(region, key int) float64 {
	r := s.rs[region]
	if r.st == nil {
		return 0
	}
	return float64(s.enforced(r, key, s.env.StoreMs(region))) / float64(s.cfg.Units)
}

// ActiveKeys counts the keys coordinated (active) in at least one region.
func (s *Ledger) ActiveKeys() int {
	seen := map[int]bool{}
	keys := s.env.Keys()
	for _, r := range s.rs {
		if r.led == nil {
			continue
		}
		for _, k := range r.fedL {
			if !seen[k] && r.led.Position(keys[k].Name).Active {
				seen[k] = true
			}
		}
	}
	return len(seen)
}

func (s *Ledger) RegionLost(region int) {
	r := s.rs[region]
	s.stopAgent(r)
	r.st = nil
}

func (s *Ledger) RegionBack(region int) {
	r := s.rs[region]
	r.st = s.newStore(r)
	s.startAgent(r)
}

func (s *Ledger) AgentDown(region int) { s.stopAgent(s.rs[region]) }

func (s *Ledger) AgentUp(region int) { s.startAgent(s.rs[region]) }

// ReportSize estimates the bytes of a report in a compact binary encoding:
// a version byte; strings as a uvarint length and the bytes; integers as
// (zigzag for signed) uvarints; a region named by its index in the rule's
// region list (one byte); per key its name, demand, position and the Gave and
// Applied counters (region byte, incarnation and units).
func ReportSize(rep *ledger.Report) int {
	n := 1 + str(rep.From) + uv(rep.Inc) + uv(rep.Seq) + sv(rep.Base) + uv(uint64(len(rep.Acks)))
	for _, a := range rep.Acks {
		n += 1 + uv(a.Inc) + uv(a.Seq) + 1
	}
	n += uv(uint64(len(rep.Keys)))
	for _, k := range rep.Keys {
		n += str(k.Key) + sv(k.Demand) + sv(k.Position) + uv(uint64(len(k.Gave))) + uv(uint64(len(k.Applied)))
		for _, c := range k.Gave {
			n += 1 + uv(c.Inc) + sv(c.Units)
		}
		for _, c := range k.Applied {
			n += 1 + uv(c.Inc) + sv(c.Units)
		}
	}
	return n
}

func uv(x uint64) int { return bincode.UvarintLen(x) }

func sv(x int64) int { return uv(uint64(x<<1) ^ uint64(x>>63)) }

func str(s string) int { return bincode.StringLen(s) }
