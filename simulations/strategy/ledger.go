package strategy

import (
	"slices"
	"strconv"
	"time"

	"github.com/apportion/apportion/allocation"
	"github.com/apportion/apportion/regional/redisstore"
	"github.com/apportion/apportion/rules"
	"github.com/apportion/apportion/simulations/scenario"
	"github.com/apportion/apportion/simulations/sim"
	"github.com/apportion/apportion/sync/driver"
	"github.com/apportion/apportion/sync/ledger"
	"github.com/apportion/apportion/sync/wire"
)

// ruleID names the scenario's one global rule (its marker, its registry).
const ruleID = "global"

// natsMaxPayload is the NATS server's default max_payload: the agent splits
// a report message above it (wire.EncodeSplit).
const natsMaxPayload = 1 << 20

// Ledger is this project: in every region a sync agent runs the production
// driver (sync/driver: the agent's loop, with the real share ledger) on its
// own drifting clock, with ports that stand for Redis, NATS and etcd:
//
//   - the store is the store's Go reference model (regional/redisstore.Model,
//     differentially tested against the Lua scripts) on the region's store
//     clock; the enforcers' checks are Model.Check calls of the global token
//     bucket (or, for a rule with a window, the global fixed window: a
//     quota), the agent's writes the records and markers the agent writes
//     (driver.StoreWrites; a window's records through WriteWindowShares,
//     whose refusals of a record below the key's use of its window the
//     driver hands to Ledger.Hold), each write and its answer sync.store_ms
//     away;
//   - reports are the real wire encoding (wire.EncodeSplit), each part sent
//     to every other region over the virtual WAN and decoded there; sync
//     bytes are the encoded length plus the signature (wire.Overhead) and
//     NATS framing;
//   - the reclaim registry is the real ledger.Registry, reached with the
//     registry delay as etcd would be: Start, Contribute and Close round
//     trips and a poll every RegistryPoll, each given up after EtcdTimeout
//     (then Start backs off as the agent does).
//
// Every key with usage reaches the ledger, as in the agent. Targets come
// from allocation.SplitUnits with the rule's allocation.
type Ledger struct {
	// ReceiveWindow and SendWindow, when set, replace driver.ReceiveWindow
	// (the most keys of a peer's report merged at once) and
	// driver.SendWindow (the most keys of a report built and sent at once):
	// tests set them low so that every message leaves and is read in parts.
	ReceiveWindow, SendWindow int

	env     *sim.Env
	cfg     ledger.Config
	specs   []ledger.RegionSpec
	floor   []int64
	reg     *ledger.Registry
	rev     int64 // the registry's revision: bumped by every change
	rs      []*lregion
	buckets []redisstore.Bucket // per key: the global token bucket (Floor set per region)
	poll    time.Duration
	timeout time.Duration
	srule   driver.StoreRule // the rule as the store needs it (Floor set per region)
	// The witness keys in etcd (sync/driver witness.go): per region, its
	// key's revision (0: none), from one revision counter.
	witness []int64
	wrev    int64
}

// lregion is one region: its store and its agent (nil while down).
type lregion struct {
	idx   int
	name  string
	store *redisstore.Model // nil while the region is lost
	runs  int
	ag    *lagent
}

// lagent is one life of a region's agent: the driver and the agent's own
// state around it (as sync/agent's Agent and ruleState hold it).
type lagent struct {
	s    *Ledger
	r    *lregion
	drv  *driver.Driver
	rule *driver.Rule
	used map[int]*[2]int64 // key -> admitted, rejected cost since the last tick

	runID     string
	starting  bool
	again     bool          // a start in flight when the registry came back (the agent's ruleState.again)
	retryAt   time.Duration // real time
	backoff   time.Duration
	polling   bool
	lastPoll  time.Duration
	pollFails int

	wMine     int64         // the revision of the witness key this life wrote last (0: none yet)
	renewing  bool          // a renewal is in flight
	lastRenew time.Duration // real time of the last renewal sent
}

func (s *Ledger) Name() string { return "ledger" }

// LedgerConfig returns the ledger's Config for the scenario, as every
// region's agent in the simulator runs it, and the regions' specs.
func LedgerConfig(sc *scenario.Scenario) (ledger.Config, []ledger.RegionSpec) {
	cfg := ledger.DefaultConfig()
	cfg.MinShare = sc.Rule.MinShare
	cfg.Interval = sc.Sync.Interval.D()
	cfg.Lease = sc.Sync.Lease.D()
	cfg.Rho = *sc.Sync.ClockError
	cfg.Margin = sc.Sync.Margin.D()
	cfg.StoreTimeout = sc.Sync.StoreTimeout.D()
	cfg.HalfLife = sc.Sync.HalfLife.D()
	cfg.HeartbeatEvery = sc.Sync.Heartbeat.D()
	cfg.DemandBand = *sc.Sync.DemandBand
	cfg.GiftBand, cfg.GiftWait = *sc.Sync.GiftBand, sc.Sync.GiftWait.D()
	cfg.WitnessLease = sc.Sync.WitnessLease.D()
	cfg.Quantum = ledger.QuantumOf(cfg.Units, sc.Rule.Burst)
	if w := sc.Rule.Window.D(); w > 0 {
		cfg.Margin += driver.WindowWait(w, cfg.Rho) // as the agent's ledger of a window rule
	}
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
	s.cfg, s.specs = LedgerConfig(env.Scenario())
	s.floor, _ = ledger.Split(s.cfg, s.specs)
	var err error
	if s.reg, err = ledger.NewRegistry(s.cfg, s.specs); err != nil {
		return err
	}
	sc := env.Scenario()
	s.poll, s.timeout = sc.Sync.RegistryPoll.D(), sc.Sync.EtcdTimeout.D()
	s.srule = driver.StoreRule{Capacity: int64(sc.Rule.Burst * 1000), Rate: sc.Rule.Rate, Total: s.cfg.Units}
	if w := sc.Rule.Window.D(); w > 0 {
		s.srule = driver.StoreRule{Algorithm: rules.FixedWindow, Limit: int64(sc.Rule.Burst), Window: w, Total: s.cfg.Units}
	}
	for _, k := range env.Keys() {
		b := redisstore.Bucket{Key: k.Name, Algorithm: rules.TokenBucket,
			Capacity: int64(k.Burst * 1000), Rate: allocation.Thousandths(k.Rate),
			Global: &redisstore.Global{Rule: ruleID, Units: s.cfg.Units}}
		if k.WindowMs > 0 {
			b.Algorithm, b.Capacity, b.Rate = rules.FixedWindow, 0, 0
			b.Limit, b.Window = int64(k.Burst), time.Duration(k.WindowMs)*time.Millisecond
		}
		s.buckets = append(s.buckets, b)
	}
	s.witness = make([]int64, len(s.specs))
	for i, sp := range s.specs {
		r := &lregion{idx: i, name: sp.Name}
		s.newStore(r)
		s.rs = append(s.rs, r)
		s.startAgent(r)
	}
	return nil
}

// newStore gives r an empty store with a new run id.
func (s *Ledger) newStore(r *lregion) {
	r.runs++
	r.store = redisstore.NewModel(0)
	r.store.Restart(r.name + "-run" + strconv.Itoa(r.runs))
}

// startAgent starts a new agent life; it ticks at once and then every
// interval on the region's agent clock, as the agent's loop does.
func (s *Ledger) startAgent(r *lregion) {
	if r.ag != nil || r.store == nil {
		return
	}
	a := &lagent{s: s, r: r, used: map[int]*[2]int64{}, lastPoll: -time.Hour}
	a.drv = driver.New(r.name, a)
	if s.SendWindow > 0 {
		a.drv.SetSendWindow(s.SendWindow)
	}
	a.rule = a.drv.Add(ruleID)
	r.ag = a
	s.env.AgentAfter(r.idx, 0, a.tick)
}

// receiveWindow is ReceiveWindow, or driver.ReceiveWindow if unset.
func (s *Ledger) receiveWindow() int {
	if s.ReceiveWindow > 0 {
		return s.ReceiveWindow
	}
	return driver.ReceiveWindow
}

func (a *lagent) alive() bool { return a.r.ag == a }

// tick is the agent's tick: the store's run id, usage, the driver's tick,
// the registry poll.
func (a *lagent) tick() {
	if !a.alive() {
		return
	}
	s, env := a.s, a.s.env
	if id := a.r.store.RunID(); id != a.runID {
		if a.runID != "" {
			a.drv.StoreReset(id)
		}
		a.runID = id
	}
	keys := env.Keys()
	ks := make([]int, 0, len(a.used))
	for k := range a.used {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	us := make([]driver.Usage, len(ks))
	for i, k := range ks {
		u := a.used[k]
		us[i] = driver.Usage{Rule: ruleID, Key: keys[k].Name, Rate: keys[k].Rate, Admitted: u[0], Rejected: u[1]}
	}
	clear(a.used)
	a.drv.Tick(us)
	a.renewWitness()
	a.pollRegistry()
	if a.alive() {
		env.AgentAfter(a.r.idx, s.cfg.Interval, a.tick)
	}
}

// Now implements driver.Ports: the region's agent clock.
func (a *lagent) Now() time.Duration { return a.s.env.AgentNow(a.r.idx) }

func (s *Ledger) storeDelay() time.Duration {
	return time.Duration(*s.env.Scenario().Sync.StoreMs * 1e6)
}

// Write implements driver.Ports: the writes reach the store after the store
// delay (applied there even if the agent died meanwhile, as a sent Redis
// command is), their answers (confirmations, a window's refusals) the agent
// after as long again.
func (a *lagent) Write(writes map[*driver.Rule][]ledger.Write) map[*driver.Rule]driver.Applied {
	s, st := a.s, a.r.store
	for r, ws := range writes {
		p := s.srule
		p.Floor = s.floor[a.r.idx]
		recs, markers := driver.StoreWrites(ws, p)
		s.env.After(s.storeDelay(), func() {
			if a.r.store != st {
				return // the region was lost meanwhile
			}
			ms := s.env.StoreMs(a.r.idx)
			var vs []redisstore.WindowApplied
			var mvs []redisstore.Version
			switch {
			case len(recs) > 0 && p.IsWindow():
				vs, _ = st.WriteWindowShares(ms, ruleID, recs)
			case len(recs) > 0:
				v, _ := st.WriteShares(ms, ruleID, recs)
				vs = driver.Versions(v)
			}
			for _, m := range markers {
				if v, err := st.WriteMarker(ms, ruleID, m); err == nil {
					mvs = append(mvs, v)
				}
			}
			cs := driver.Confirmations(recs, vs, mvs)
			s.env.After(s.storeDelay(), func() {
				if a.alive() {
					a.drv.Confirmed(r, cs)
				}
			})
		})
	}
	return nil
}

// Publish implements driver.Ports: every part of the message to every
// other region, decoded at the receiver.
func (a *lagent) Publish(m wire.Message) {
	s := a.s
	parts, err := wire.EncodeSplit(m, natsMaxPayload-wire.Overhead)
	if err != nil {
		return
	}
	for _, p := range parts {
		size := natsOverhead + len(p) + wire.Overhead
		for _, to := range s.rs {
			if to == a.r {
				continue
			}
			s.env.Send(a.r.idx, to.idx, size, func() {
				ag := to.ag
				if ag == nil {
					return
				}
				// As the agent reads a message: checked whole, then
				// merged a window of keys at a time (p is not changed:
				// the strings the decoded keys point into stay valid).
				_, windows, err := wire.DecodeWindowsFromOwned(a.r.name, p, ag.drv.Lists(), s.receiveWindow())
				if err != nil {
					return
				}
				for msg := range windows {
					ag.drv.Receive(msg)
				}
			})
		}
	}
}

// registry runs op at the registry and reply at the agent if this life is
// still alive; if no reply came within the etcd timeout, timeout runs
// instead (the agent's context timeout).
func (a *lagent) registry(op func() (reply func()), timeout func()) {
	s := a.s
	done := false
	s.env.Registry(a.r.idx, func() func() {
		reply := op()
		return func() {
			if done || !a.alive() {
				return
			}
			done = true
			if reply != nil {
				reply()
			}
		}
	})
	s.env.After(s.timeout, func() {
		if done || !a.alive() {
			return
		}
		done = true
		timeout()
	})
}

// Start implements driver.Ports as the agent's maybeStart does.
func (a *lagent) Start(r *driver.Rule) {
	s := a.s
	if r.Led != nil || a.starting || a.runID == "" || s.env.Now() < a.retryAt {
		return
	}
	a.starting = true
	runID, sent := a.runID, a.Now()
	var st ledger.Start
	var err error
	a.registry(func() func() {
		st, err = s.reg.Start(a.r.name)
		if err == nil {
			s.rev++
		}
		return func() {
			a.starting = false
			if err != nil {
				a.failStart()
				return
			}
			st.RunID, st.Sent = runID, sent
			led, err := ledger.New(s.cfg, a.r.name, s.specs, st, a.Now())
			if err != nil {
				a.failStart()
				return
			}
			a.drv.Started(r, led)
			a.backoff, a.again = 0, false
		}
	}, func() {
		a.starting = false
		a.failStart()
	})
}

// failStart backs off as the agent's failStart does.
func (a *lagent) failStart() {
	a.backoff = driver.StartBackoff(a.backoff)
	a.retryAt = a.s.env.Now() + a.backoff
	if a.again {
		a.again, a.retryAt = false, 0
	}
}

// Fenced implements driver.Ports: the agent starts a new incarnation at once.
func (a *lagent) Fenced(r *driver.Rule, _ ledger.Incarnation, _ ledger.Version) { a.Start(r) }

// Contribute implements driver.Ports.
func (a *lagent) Contribute(r *driver.Rule, cs []ledger.Contribution) {
	s := a.s
	a.registry(func() func() {
		var recs []ledger.Record
		for _, c := range cs {
			if rec, err := s.reg.Contribute(c); err == nil {
				recs = append(recs, rec)
				s.rev++
			}
		}
		return func() { a.drv.Contributed(r, recs) }
	}, func() { a.drv.Contributed(r, nil) })
}

// Close implements driver.Ports.
func (a *lagent) Close(r *driver.Rule, by ledger.Incarnation) {
	s := a.s
	a.registry(func() func() {
		if s.reg.Close(by) == nil {
			s.rev++
		}
		return func() { a.drv.Closed(r) }
	}, func() { a.drv.Closed(r) })
}

func (a *lagent) Rejected(reason, peer, rule string, err error) {}

func (a *lagent) Reclaimed(r *driver.Rule, rec ledger.Record) {}

// pollRegistry reads the registry every RegistryPoll (driver.PollWait
// after failures) and feeds a changed revision to the driver; the
// first read that succeeds after failures ends a failed start's backoff,
// as the agent's registryBack does.
func (a *lagent) pollRegistry() {
	s := a.s
	if a.polling || s.env.Now()-a.lastPoll < driver.PollWait(s.poll, a.pollFails) {
		return
	}
	a.polling, a.lastPoll = true, s.env.Now()
	a.registry(func() func() {
		recs := map[string]driver.RuleRecords{ruleID: {Revision: s.rev, Records: s.reg.Records()}}
		keys := slices.Clone(s.witness) // the agent's watch of the witness keys
		return func() {
			back := a.pollFails > 0
			a.polling, a.pollFails = false, 0
			if s.cfg.WitnessLease > 0 {
				for j, rev := range keys {
					if j != a.r.idx {
						a.drv.WitnessSeen(s.specs[j].Name, rev)
					}
				}
			}
			a.drv.Records(recs)
			switch { // the agent's registryBack
			case !back || a.rule.Led != nil:
			case a.starting:
				a.again = true
			case s.env.Now() < a.retryAt:
				a.retryAt = 0
				a.Start(a.rule)
			}
		}
	}, func() {
		a.polling = false
		a.pollFails++
	})
}

func (s *Ledger) Admit(region, key int, cost int64) bool {
	r := s.rs[region]
	if r.store == nil {
		return false
	}
	b := s.buckets[key]
	g := *b.Global
	g.Floor = s.floor[region]
	b.Global = &g
	ok, _, err := r.store.Check(s.env.StoreMs(region), cost, []redisstore.Bucket{b})
	if err != nil {
		return false
	}
	if a := r.ag; a != nil {
		u := a.used[key]
		if u == nil {
			u = new([2]int64)
			a.used[key] = u
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
	if r.store == nil {
		return 0
	}
	g := redisstore.Global{Rule: ruleID, Units: s.cfg.Units, Floor: s.floor[region]}
	return float64(r.store.Enforced(s.env.StoreMs(region), s.env.Keys()[key].Name, g)) / float64(s.cfg.Units)
}

// ActiveKeys counts the keys coordinated (active) in at least one region.
func (s *Ledger) ActiveKeys() int {
	seen := map[string]bool{}
	for _, r := range s.rs {
		if r.ag == nil || r.ag.rule.Led == nil {
			continue
		}
		led := r.ag.rule.Led
		for _, k := range led.Keys() {
			if !seen[k] && led.Position(k).Active {
				seen[k] = true
			}
		}
	}
	return len(seen)
}

func (s *Ledger) RegionLost(region int) {
	r := s.rs[region]
	r.ag = nil
	r.store = nil
}

func (s *Ledger) RegionBack(region int) {
	r := s.rs[region]
	s.newStore(r)
	s.startAgent(r)
}

// StoreReset gives the region an empty store with a new run id (a Redis
// restart): writes in flight to the old one are lost; the agent, which
// carries on, sees the new run id at its next tick (driver.StoreReset).
func (s *Ledger) StoreReset(region int) {
	if r := s.rs[region]; r.store != nil {
		s.newStore(r)
	}
}

func (s *Ledger) AgentDown(region int) { s.rs[region].ag = nil }

func (s *Ledger) AgentUp(region int) { s.startAgent(s.rs[region]) }

// renewWitness renews this region's witness key every WitnessLease/4, as
// the agent does: by compare-and-swap on the revision this life wrote
// last; a key found at another revision (taken by the peer) is reported
// lost and written again. The first renewal of a life takes the key over
// from whatever is there (the agent reads it first).
func (a *lagent) renewWitness() {
	s := a.s
	w := s.cfg.WitnessLease
	if w <= 0 || a.renewing || s.env.Now()-a.lastRenew < w/4 && a.wMine != 0 {
		return
	}
	a.renewing, a.lastRenew = true, s.env.Now()
	sent := a.Now()
	a.registry(func() func() {
		lost := a.wMine != 0 && s.witness[a.r.idx] != a.wMine
		s.wrev++
		s.witness[a.r.idx] = s.wrev
		mine := s.wrev
		return func() {
			a.renewing, a.wMine = false, mine
			if lost {
				a.drv.WitnessLost()
			}
			a.drv.WitnessRenewed(sent)
		}
	}, func() { a.renewing = false })
}

// Take implements driver.Ports: the peer's witness key, by compare-and-swap.
func (a *lagent) Take(region string, rev int64) {
	s := a.s
	j := slices.IndexFunc(s.specs, func(sp ledger.RegionSpec) bool { return sp.Name == region })
	a.registry(func() func() {
		ok := j >= 0 && s.witness[j] == rev
		if ok {
			s.wrev++
			s.witness[j] = s.wrev
		}
		return func() { a.drv.Taken(region, rev, ok) }
	}, func() { a.drv.Taken(region, rev, false) })
}
