package ledger

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/apportion/apportion/allocation"
)

// Start describes the incarnation a Ledger runs as. The agent obtains it from
// the reclaim registry (Registry.Start) before creating the Ledger.
type Start struct {
	// Inc is this life's incarnation number; 1 is the region's first life,
	// which owns its floor plus its initial part. Later lives own their floor only.
	Inc uint64
	// Known is, per other region, the lowest incarnation this life may pair with.
	Known []Incarnation
	// RunID identifies the current contents of the local store (Redis run id).
	RunID string
}

// Share is the ledger's view of one key.
type Share struct {
	Units   int64 // position: the units this region may enforce
	Floor   int64
	Initial int64 // units this region holds when nothing has moved (its base)
	Demand  int64 // demand estimate, units
	Active  bool  // coordinated (false: back at its initial part, static share)
}

// Stats counts rejected inputs.
type Stats struct {
	Rejected int
}

type pair struct {
	recv        int64 // peer's gifts applied here (max of its confirmed counter)
	give        int64 // units given to the peer: lowered here (pending or confirmed)
	conf        int64 // confirmed (durable in the store): the published counter
	peerApplied int64 // the peer says it applied this many of our gifts
	peerPos     int64
	peerDemand  int64
	peerSeq     uint64 // report seq of peerPos/peerDemand; 0: none
}

type snap struct {
	ver  Version
	give []int64
	inc  []uint64
}

type key struct {
	name    string
	rate    float64
	used    int64
	demand  float64
	lastUse time.Duration
	extra   int64 // paid by reclaims, beyond the base part (Payment.Keys)
	frozen  int64 // -Q of every frozen pair
	pairs   []pair
	pend    []snap
	active  bool
	dirty   bool

	written   bool
	wUnits    int64
	wRelease  bool
	wVer      Version
	wAt       time.Duration
	confirmed Version
	reassert  Version // after a store reset: the marker waits for this version
	force     bool    // rewrite even if unchanged (store reset)
	gifted    bool    // give grew since the last write: a new version must cover it
	idleAt    time.Duration
}

type peer struct {
	name      string
	inc       uint64 // the incarnation we pair with (or expect next)
	seen      bool   // heard from inc
	mayFreeze bool   // inc is known to exist: freeze it when silent
	heard     time.Duration
	lastSeq   uint64
	ackedSend time.Duration // our clock: send time of our newest report it acknowledged
	frozenInc uint64        // every incarnation <= frozenInc is frozen
	base      int64
	pending   map[uint64]Contribution // contributions not yet seen in the registry
	wanted    map[uint64]bool         // incarnations the registry needs our contribution for
}

// Ledger is the share ledger of one region. It is a pure state machine: all
// methods take the agent's local monotonic time and return what to do. A Ledger
// is not safe for concurrent use; one goroutine of the agent owns it.
type Ledger struct {
	cfg     Config
	self    int
	inc     uint64
	names   []string
	weights []float64
	floor   []int64
	initial []int64
	base    int64
	peers   []peer
	keys    map[string]*key

	started  time.Duration
	lastTick time.Duration
	ticks    int
	fenced   bool
	told     bool // a peer froze this incarnation

	wseq     uint64
	runID    string
	markerOK bool // a marker of this run is confirmed (and no reset since)
	everOK   bool // reports start after the first confirmed marker
	creating Version
	createAt time.Duration
	reset    bool // reasserting after StoreReset

	rseq  uint64
	sent  map[uint64]time.Duration
	stats Stats

	paid        Payment // the payment applied so far (cumulative)
	markerUnits int64   // the default units of the last marker write
	owed        Payment // the newest payment the registry shows
	closeSent   bool    // Output.Close emitted at least once
	closeAck    bool    // the registry shows our Close
}

// New returns the ledger of region self among regions, running as st.Inc,
// at local time now. The first Tick asks the store for the marker.
func New(cfg Config, self string, regions []RegionSpec, st Start, now time.Duration) (*Ledger, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(regions) == 0 {
		return nil, fmt.Errorf("%w: no regions", ErrConfig)
	}
	if st.Inc == 0 {
		return nil, fmt.Errorf("%w: incarnation must be positive", ErrConfig)
	}
	l := &Ledger{cfg: cfg, self: -1, inc: st.Inc, keys: map[string]*key{}, started: now,
		lastTick: now, runID: st.RunID, sent: map[uint64]time.Duration{}}
	seen := map[string]bool{}
	for i, r := range regions {
		if r.Name == "" || seen[r.Name] || !(r.Weight > 0) || math.IsInf(r.Weight, 0) {
			return nil, fmt.Errorf("%w: region %d: empty, duplicate or bad weight", ErrConfig, i)
		}
		seen[r.Name] = true
		l.names = append(l.names, r.Name)
		l.weights = append(l.weights, r.Weight)
		if r.Name == self {
			l.self = i
		}
	}
	if l.self < 0 {
		return nil, fmt.Errorf("%w: %q", ErrUnknownRegion, self)
	}
	l.floor, l.initial = Split(cfg, regions)
	l.base = l.floor[l.self]
	if st.Inc == 1 {
		l.base += l.initial[l.self]
	}
	l.markerUnits = l.base
	l.peers = make([]peer, len(regions))
	for i := range l.peers {
		l.peers[i] = peer{name: l.names[i], inc: 1, heard: now, mayFreeze: true,
			pending: map[uint64]Contribution{}, wanted: map[uint64]bool{}}
	}
	for _, k := range st.Known {
		i := l.index(k.Region)
		if i < 0 || i == l.self || k.Inc == 0 {
			return nil, fmt.Errorf("%w: known incarnation %v", ErrUnknownRegion, k)
		}
		l.peers[i].inc = k.Inc
		l.peers[i].frozenInc = k.Inc - 1
	}
	return l, nil
}

// Regions returns a rule's region weights in the order every region and
// every enforcer uses for a ledger: by name. Split's results follow it.
func Regions(weights map[string]float64) []RegionSpec {
	out := make([]RegionSpec, 0, len(weights))
	for n, w := range weights {
		out = append(out, RegionSpec{Name: n, Weight: w})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Split returns the floors and the initial parts of the regions, in units:
// floors split MinShare*Units by weight, initial parts split the rest.
func Split(cfg Config, regions []RegionSpec) (floor, initial []int64) {
	w := make([]float64, len(regions))
	for i, r := range regions {
		w[i] = r.Weight
	}
	f := int64(math.Floor(cfg.MinShare * float64(cfg.Units)))
	return splitByWeight(f, w), splitByWeight(cfg.Units-f, w) // as allocation.Floors
}

func (l *Ledger) index(name string) int {
	for i, n := range l.names {
		if n == name {
			return i
		}
	}
	return -1
}

// Incarnation returns this ledger's incarnation.
func (l *Ledger) Incarnation() Incarnation { return Incarnation{l.names[l.self], l.inc} }

// Fenced reports whether this incarnation has fenced itself.
func (l *Ledger) Fenced() bool { return l.fenced }

// Stats returns the rejected-input counters.
func (l *Ledger) Stats() Stats { return l.stats }

// Base returns the units this region holds for a key it has no state for.
func (l *Ledger) Base() int64 {
	if l.fenced {
		return l.floor[l.self]
	}
	return l.base
}

// Position returns the ledger's view of a key.
func (l *Ledger) Position(name string) Share {
	s := Share{Floor: l.floor[l.self], Initial: l.base, Units: l.base}
	if k := l.keys[name]; k != nil {
		s.Units, s.Demand, s.Active = l.position(k), int64(k.demand), k.active
	}
	if l.fenced {
		s.Units = s.Floor
	}
	return s
}

// Keys returns the names of the keys the ledger holds state for, sorted.
func (l *Ledger) Keys() []string {
	out := make([]string, 0, len(l.keys))
	for n := range l.keys {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (l *Ledger) position(k *key) int64 {
	u := l.base + k.extra + k.frozen
	for i := range k.pairs {
		u += k.pairs[i].recv - k.pairs[i].give
	}
	return u
}

func (l *Ledger) key(name string) *key {
	k := l.keys[name]
	if k == nil {
		k = &key{name: name, pairs: make([]pair, len(l.names))}
		l.keys[name] = k
	}
	return k
}

// Usage folds admitted and rejected cost of a key into its demand; rate is the
// rule's global rate per second (the whole Units).
func (l *Ledger) Usage(now time.Duration, name string, rate float64, admitted, rejected int64) {
	if l.fenced || admitted < 0 || rejected < 0 || !(rate > 0) {
		return
	}
	k := l.key(name)
	k.rate = rate
	k.used += admitted + rejected
	k.lastUse = now
	if !k.active {
		k.active, k.dirty = true, true
	}
}

func (l *Ledger) fence() Output {
	l.fenced = true
	return Output{Fenced: true}
}

func (l *Ledger) leaseDeadline() time.Duration {
	if len(l.names) == 1 {
		return math.MaxInt64
	}
	d := l.started
	for i := range l.peers {
		if i != l.self && l.peers[i].ackedSend > d {
			d = l.peers[i].ackedSend
		}
	}
	return d + l.cfg.Lease
}

// holdsMore reports whether this incarnation holds more than its floor on
// any key (or for keys without state).
func (l *Ledger) holdsMore() bool {
	f := l.floor[l.self]
	if l.base > f {
		return true
	}
	for _, k := range l.keys {
		if l.position(k) > f {
			return true
		}
	}
	return false
}

// joined reports whether a peer has acknowledged one of our reports within
// the lease: only then does the ledger take reclaim payments, since holding
// more than the floor without a lease would make it fence at once.
func (l *Ledger) joined(now time.Duration) bool {
	if len(l.names) == 1 {
		return true
	}
	acked := false
	for i := range l.peers {
		acked = acked || i != l.self && l.peers[i].ackedSend > 0
	}
	return acked && now < l.leaseDeadline()
}

// payOwed applies the part of the registry's payment not applied yet.
func (l *Ledger) payOwed(now time.Duration) {
	if l.owed.Seq <= l.paid.Seq || !l.joined(now) {
		return
	}
	l.base += l.owed.Base - l.paid.Base
	keys := map[string]int64{}
	for _, ku := range l.paid.Keys {
		keys[ku.Key] = 0 // listed before: reset unless listed again
	}
	for _, ku := range l.owed.Keys {
		keys[ku.Key] = ku.Units
	}
	for n, v := range keys {
		k := l.key(n)
		if k.extra != v {
			k.extra = v
			k.active, k.dirty = true, true
			k.lastUse = now
		}
	}
	if l.owed.Base != l.paid.Base {
		for _, k := range l.keys {
			k.dirty = true // every position moved
		}
	}
	l.paid = l.owed
}

func (l *Ledger) live(i int, now time.Duration) bool {
	p := &l.peers[i]
	return i != l.self && p.seen && now-p.heard <= l.cfg.Lease
}

// giftable reports whether gifts may go to peer i: a later incarnation (a
// restarted or fenced region) only once it has acknowledged one of our
// reports. Hearing it is not enough: behind a one-way or flapping link it
// could never apply a gift, and the units would sit in flight until its
// reclaim returned them (measured live: survivors of a cut region lost a
// third of their share that way, one new incarnation after another).
func (l *Ledger) giftable(i int) bool {
	p := &l.peers[i]
	return p.inc <= 1 || p.ackedSend > 0
}

// Tick runs one sync interval.
func (l *Ledger) Tick(now time.Duration) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	if l.told {
		return l.fence()
	}
	if now >= l.leaseDeadline() {
		// The store lease has lapsed: the store enforces the floor. An
		// incarnation that holds more must end (peers may reclaim it); one
		// that holds only its floor has nothing to give up and carries on,
		// so a region alone does not start a new life every lease. Its next
		// marker is a Create, once a peer acknowledges it again.
		if l.holdsMore() {
			return l.fence()
		}
		l.markerOK = false
	}
	var out Output
	l.payOwed(now)
	if l.everOK && l.inc > 1 && !l.closeAck && (!l.closeSent || (l.ticks+1)%(4*l.cfg.FullEvery) == 0) {
		out.Close, l.closeSent = Incarnation{l.names[l.self], l.inc}, true
	}
	// Freeze silent incarnations, if a peer acknowledges us: a region with
	// no live peer could not take a reclaim payment anyway (see joined), and
	// reclaiming the other side of a partition would only make it start a
	// new life. A newer incarnation seen in a report freezes at once (Receive).
	joined := l.joined(now)
	for i := range l.peers {
		p := &l.peers[i]
		if i != l.self && joined && p.mayFreeze && now-p.heard >= l.cfg.ReclaimAfter() {
			out.Contributions = append(out.Contributions, l.freeze(i, p.inc, now)...)
		}
	}
	// Demand.
	dt := (now - l.lastTick).Seconds()
	if l.ticks == 0 || dt <= 0 {
		dt = l.cfg.Interval.Seconds()
	}
	l.lastTick = now
	l.ticks++
	for _, k := range l.keys {
		if k.rate > 0 {
			inst := float64(k.used) / dt * float64(l.cfg.Units) / k.rate
			old := int64(k.demand)
			a := l.cfg.Alpha
			if l.cfg.DemandTokens > 0 {
				a = min(a, dt*k.rate/l.cfg.DemandTokens)
			}
			k.demand = a*inst + (1-a)*k.demand
			if k.demand < 0.5 {
				k.demand = 0
			}
			if int64(k.demand) != old {
				k.dirty = true
			}
		}
		k.used = 0
	}
	names := l.Keys()
	for _, n := range names {
		k := l.keys[n]
		if k.active {
			l.give(k, now)
			l.maybeIdle(k, now)
		}
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	if w, ok := l.marker(now); ok {
		out.Writes = append(out.Writes, w)
	}
	full := l.ticks%l.cfg.FullEvery == 0
	out.Report = l.report(now, full)
	// Resend contributions the registry has not shown us yet.
	if l.ticks%l.cfg.FullEvery == 0 {
		for i := range l.peers {
			for _, c := range l.peers[i].pending {
				out.Contributions = append(out.Contributions, c)
			}
		}
		sort.Slice(out.Contributions, func(a, b int) bool {
			x, y := out.Contributions[a].Of, out.Contributions[b].Of
			return x.Region < y.Region || x.Region == y.Region && x.Inc < y.Inc
		})
	}
	return out
}

// give hands this region's excess over its target to the live regions below
// theirs, in proportion to their deficits.
func (l *Ledger) give(k *key, now time.Duration) {
	var idx []int
	var wants []Want
	var proj []int64
	var pool int64
	for i := range l.names {
		var pos, dem int64
		switch {
		case i == l.self:
			pos, dem = l.position(k), int64(k.demand)
		case l.live(i, now):
			pr := &k.pairs[i]
			pos = l.peers[i].base
			if pr.peerSeq > 0 {
				pos, dem = pr.peerPos, pr.peerDemand
			}
			pos += pr.give - pr.peerApplied
		default:
			continue
		}
		idx = append(idx, i)
		proj = append(proj, pos)
		pool += pos - l.floor[i]
		wants = append(wants, Want{Weight: l.weights[i], Demand: max(0, dem-l.floor[i])})
	}
	if len(idx) < 2 || pool <= 0 {
		return
	}
	tg := l.cfg.Allocate(pool, wants)
	if len(tg) != len(idx) {
		return
	}
	if q := l.cfg.Quantum; q > 1 {
		// Whole tokens, by demand. (A bonus for the region holding a token
		// made the regions' views disagree on the holder and gifts swing
		// back and forth under faults: TestRandomized's small-limit seeds.)
		fl, dem := make([]int64, len(idx)), make([]int64, len(idx))
		for j, i := range idx {
			fl[j], dem[j] = l.floor[i], wants[j].Demand
		}
		tg = allocation.WholeTokens(tg, fl, q, dem)
	}
	var excess, sumD int64
	def := make([]int64, len(idx))
	for j, i := range idx {
		if i == l.self {
			excess = proj[j] - l.floor[i] - tg[j]
		} else if d := tg[j] - (proj[j] - l.floor[i]); d > 0 {
			def[j] = d
			sumD += d
		}
	}
	if excess <= l.cfg.Hysteresis || sumD == 0 {
		return
	}
	// Never below our floor: excess <= position - floor since targets are >= 0.
	for j, i := range idx {
		if def[j] == 0 || !l.giftable(i) {
			continue
		}
		g := min(def[j], int64(float64(excess)*float64(def[j])/float64(sumD)))
		if g > 0 {
			k.pairs[i].give += g
			k.dirty, k.gifted = true, true
		}
	}
}

// maybeIdle releases a key from coordination once every region is back at its
// initial part, nothing is in flight and the key has had no usage for IdleAfter.
func (l *Ledger) maybeIdle(k *key, now time.Duration) {
	if now-k.lastUse < l.cfg.IdleAfter || k.demand > 0 || k.extra != 0 || k.frozen != 0 || l.position(k) != l.base {
		return
	}
	for i := range k.pairs {
		if i == l.self {
			continue
		}
		pr := &k.pairs[i]
		if pr.give != pr.conf || pr.conf != pr.peerApplied || pr.peerDemand > 0 ||
			(pr.peerSeq > 0 && pr.peerPos != l.peers[i].base) {
			return
		}
	}
	k.active, k.dirty, k.idleAt = false, true, now
}

// write returns the store write a key needs, if any.
func (l *Ledger) write(k *key, now time.Duration) (Write, bool) {
	units := l.position(k)
	release := !k.active
	if !k.written && !k.active && !k.force {
		return Write{}, false
	}
	if k.written && !k.force && !k.gifted && units == k.wUnits && release == k.wRelease {
		if k.confirmed.Less(k.wVer) && now-k.wAt >= l.cfg.RetryWrite {
			k.wAt = now
			return Write{Key: k.name, Version: k.wVer, Units: k.wUnits, Release: k.wRelease}, true
		}
		return Write{}, false
	}
	l.wseq++
	v := Version{l.inc, l.wseq}
	s := snap{ver: v, give: make([]int64, len(l.names)), inc: make([]uint64, len(l.names))}
	for i := range k.pairs {
		s.give[i], s.inc[i] = k.pairs[i].give, l.peers[i].inc
	}
	k.pend = append(k.pend, s)
	k.gifted = false
	if k.force {
		k.reassert, k.force = v, false
	}
	k.written, k.wUnits, k.wRelease, k.wVer, k.wAt = true, units, release, v, now
	return Write{Key: k.name, Version: v, Units: units, Release: release}, true
}

// storeLease is how long, on the store's clock, the marker may stay valid if
// written now: (1-rho)((D-now)/(1+rho) - StoreTimeout), D the lease deadline.
func (l *Ledger) storeLease(now time.Duration) time.Duration {
	d := l.leaseDeadline()
	if d == math.MaxInt64 {
		return l.cfg.Lease
	}
	rho := l.cfg.Rho
	v := (1 - rho) * (float64(d-now)/(1+rho) - float64(l.cfg.StoreTimeout))
	if v <= 0 {
		return 0
	}
	return time.Duration(v)
}

// markerDefault is the marker's default units: the base, once every key
// whose position is below the base has a confirmed record of its own
// (a reclaim payment can raise the base by more than it raises some keys);
// until then the default written last. Lower first, for the marker too.
func (l *Ledger) markerDefault() int64 {
	u := l.base
	if u > l.markerUnits {
		for _, k := range l.keys {
			if l.position(k) < u && !(k.written && !k.wRelease && k.confirmed.Inc == l.inc && !k.confirmed.Less(k.wVer)) {
				u = l.markerUnits
				break
			}
		}
	}
	l.markerUnits = u
	return u
}

func (l *Ledger) marker(now time.Duration) (Write, bool) {
	lease := l.storeLease(now)
	if lease <= 0 && (l.everOK || l.holdsMore()) {
		return Write{}, false
	}
	// A first marker past the lease deadline, of an incarnation that holds
	// only its floor, gets a zero lease: it grants nothing, but it floors
	// the records of the region's earlier incarnations, so reports may
	// start and a peer's acknowledgement can give this one a lease.
	lease = max(lease, 0)
	if l.markerOK {
		l.wseq++
		return Write{Key: MarkerKey, Version: Version{l.inc, l.wseq}, Units: l.markerDefault(), Lease: lease}, true
	}
	if l.reset {
		for _, k := range l.keys {
			if k.reassert != (Version{}) && k.confirmed.Less(k.reassert) {
				return Write{}, false
			}
		}
	}
	if l.creating != (Version{}) && now-l.createAt < l.cfg.RetryWrite {
		return Write{}, false
	}
	l.wseq++
	l.creating, l.createAt = Version{l.inc, l.wseq}, now
	return Write{Key: MarkerKey, Version: l.creating, Units: l.markerDefault(), Create: true, RunID: l.runID, Lease: lease}, true
}

func (l *Ledger) report(now time.Duration, full bool) *Report {
	if !l.everOK {
		return nil
	}
	l.rseq++
	l.sent[l.rseq] = now
	for s, t := range l.sent {
		if now-t > l.cfg.Lease {
			delete(l.sent, s)
		}
	}
	r := &Report{From: l.names[l.self], Inc: l.inc, Seq: l.rseq, Base: l.base}
	for i := range l.peers {
		p := &l.peers[i]
		if i == l.self {
			continue
		}
		if p.frozenInc > 0 {
			r.Acks = append(r.Acks, Ack{Region: p.name, Inc: p.frozenInc, Frozen: true})
		}
		if p.seen {
			r.Acks = append(r.Acks, Ack{Region: p.name, Inc: p.inc, Seq: p.lastSeq})
		}
	}
	sort.Slice(r.Acks, func(a, b int) bool {
		x, y := r.Acks[a], r.Acks[b]
		return x.Region < y.Region || x.Region == y.Region && x.Inc < y.Inc
	})
	var names []string
	if full {
		names = l.Keys()
	} else {
		// Only the changed keys: a map scan, not a sort of every key.
		for n, k := range l.keys {
			if k.dirty {
				names = append(names, n)
			}
		}
		sort.Strings(names)
	}
	for _, n := range names {
		k := l.keys[n]
		if !(k.dirty || full && (k.active || now-k.idleAt < 3*time.Duration(l.cfg.FullEvery)*l.cfg.Interval)) {
			continue
		}
		k.dirty = false
		kr := KeyReport{Key: n, Demand: int64(k.demand), Position: l.position(k)}
		for i := range k.pairs {
			if i == l.self {
				continue
			}
			if c := k.pairs[i].conf; c > 0 {
				kr.Gave = append(kr.Gave, Counter{l.names[i], l.peers[i].inc, c})
			}
			if a := k.pairs[i].recv; a > 0 {
				kr.Applied = append(kr.Applied, Counter{l.names[i], l.peers[i].inc, a})
			}
		}
		sort.Slice(kr.Gave, func(a, b int) bool { return kr.Gave[a].Region < kr.Gave[b].Region })
		sort.Slice(kr.Applied, func(a, b int) bool { return kr.Applied[a].Region < kr.Applied[b].Region })
		r.Keys = append(r.Keys, kr)
	}
	return r
}

// freeze stops pairing with incarnations up to inc of peer i: it moves the
// pair terms of inc into the frozen terms and returns the contributions.
func (l *Ledger) freeze(i int, inc uint64, now time.Duration) []Contribution {
	p := &l.peers[i]
	if inc <= p.frozenInc {
		return nil
	}
	var out []Contribution
	for x := max(p.frozenInc+1, p.inc); x <= inc; x++ {
		c := Contribution{Of: Incarnation{p.name, x}, From: Incarnation{l.names[l.self], l.inc}}
		if x == p.inc {
			for _, n := range l.Keys() {
				k := l.keys[n]
				pr := &k.pairs[i]
				// Only confirmed gifts count: an unconfirmed one is cancelled
				// (a raise back), since its lowering may not be in the store yet.
				if q := pr.conf - pr.recv; q != 0 {
					c.Q = append(c.Q, KeyUnits{n, q})
					k.frozen -= q
					k.dirty = true
				}
				*pr = pair{}
			}
		}
		p.pending[x] = c
		out = append(out, c)
	}
	p.frozenInc, p.inc, p.seen, p.mayFreeze, p.heard, p.lastSeq, p.ackedSend = inc, inc+1, false, p.wanted[inc+1], now, 0, 0
	for x := range p.wanted {
		if x <= inc {
			delete(p.wanted, x)
		}
	}
	return out
}

func validCounters(cs []Counter, known func(string) bool) bool {
	for j, c := range cs {
		if !known(c.Region) || c.Inc == 0 || c.Units < 0 || j > 0 && cs[j-1].Region >= c.Region {
			return false
		}
	}
	return true
}

// Receive merges a peer's report. A report that is malformed, names unknown
// regions, comes from a stale or frozen incarnation, or carries a counter that
// went backwards is rejected whole: it returns an error and changes nothing.
// The returned Output carries the raises the report allows (and may fence).
func (l *Ledger) Receive(now time.Duration, r Report) (Output, error) {
	if l.fenced {
		return Output{Fenced: true}, ErrFenced
	}
	if err := l.check(r); err != nil {
		l.stats.Rejected++
		if errors.Is(err, ErrFrozenIncarnation) && l.frozenBy(r) {
			// We ignore the sender, but it tells us it froze us: both
			// incarnations are over for each other; ours ends here.
			return l.fence(), err
		}
		return Output{}, err
	}
	var out Output
	i := l.index(r.From)
	p := &l.peers[i]
	if r.Inc > p.inc {
		out.Contributions = l.freeze(i, r.Inc-1, now)
	}
	newer := r.Seq > p.lastSeq
	p.seen, p.mayFreeze, p.heard = true, true, now
	if newer {
		p.lastSeq, p.base = r.Seq, r.Base
	}
	me := l.names[l.self]
	for _, a := range r.Acks {
		if a.Region != me || a.Inc != l.inc {
			continue
		}
		if a.Frozen {
			l.told = true
		} else if t, ok := l.sent[a.Seq]; ok && t > p.ackedSend {
			p.ackedSend = t
		}
	}
	if l.told {
		return l.fence(), nil
	}
	for _, kr := range r.Keys {
		k := l.key(kr.Key)
		pr := &k.pairs[i]
		if r.Seq > pr.peerSeq {
			pr.peerSeq, pr.peerPos, pr.peerDemand = r.Seq, kr.Position, kr.Demand
		}
		for _, c := range kr.Gave {
			if c.Region == me && c.Inc == l.inc && c.Units > pr.recv {
				pr.recv = c.Units
				k.active, k.dirty = true, true
			}
		}
		for _, c := range kr.Applied {
			if c.Region == me && c.Inc == l.inc && c.Units > pr.peerApplied {
				pr.peerApplied = c.Units
			}
		}
		if !k.active && (kr.Demand > 0 || kr.Position != r.Base) {
			k.active, k.dirty = true, true
			k.lastUse = now
		}
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	return out, nil
}

func (l *Ledger) frozenBy(r Report) bool {
	for _, a := range r.Acks {
		if a.Region == l.names[l.self] && a.Inc == l.inc && a.Frozen {
			return true
		}
	}
	return false
}

func (l *Ledger) check(r Report) error {
	i := l.index(r.From)
	if i < 0 || i == l.self {
		return fmt.Errorf("%w: from %q", ErrUnknownRegion, r.From)
	}
	if r.Inc == 0 || r.Seq == 0 || r.Base < 0 {
		return fmt.Errorf("%w: zero incarnation or sequence, or negative base", ErrMalformed)
	}
	p := &l.peers[i]
	if r.Inc <= p.frozenInc {
		return fmt.Errorf("%w: %s/%d", ErrFrozenIncarnation, r.From, r.Inc)
	}
	if r.Inc < p.inc {
		return fmt.Errorf("%w: %s/%d < %d", ErrStaleIncarnation, r.From, r.Inc, p.inc)
	}
	known := func(n string) bool { return l.index(n) >= 0 }
	for j, a := range r.Acks {
		if !known(a.Region) {
			return fmt.Errorf("%w: ack for %q", ErrUnknownRegion, a.Region)
		}
		if j > 0 && (r.Acks[j-1].Region > a.Region || r.Acks[j-1].Region == a.Region && r.Acks[j-1].Inc >= a.Inc) {
			return fmt.Errorf("%w: acks not sorted", ErrMalformed)
		}
	}
	same := r.Inc == p.inc && p.seen
	me := l.names[l.self]
	for j, kr := range r.Keys {
		if j > 0 && r.Keys[j-1].Key >= kr.Key {
			return fmt.Errorf("%w: keys not sorted", ErrMalformed)
		}
		if kr.Demand < 0 || kr.Position < 0 {
			return fmt.Errorf("%w: negative demand or position", ErrMalformed)
		}
		if !validCounters(kr.Gave, known) || !validCounters(kr.Applied, known) {
			return fmt.Errorf("%w: counters", ErrMalformed)
		}
		k := l.keys[kr.Key]
		if !same || k == nil || r.Seq <= p.lastSeq {
			continue
		}
		pr := &k.pairs[i]
		for _, c := range kr.Gave {
			if c.Region == me && c.Inc == l.inc && c.Units < pr.recv {
				return fmt.Errorf("%w: gave %d < %d", ErrBackwards, c.Units, pr.recv)
			}
		}
		for _, c := range kr.Applied {
			if c.Region == me && c.Inc == l.inc && c.Units < pr.peerApplied {
				return fmt.Errorf("%w: applied %d < %d", ErrBackwards, c.Units, pr.peerApplied)
			}
		}
	}
	return l.plausible(r) // plausible.go
}

// ShareApplied tells the ledger that the store now holds a version >= v for
// the key (or the marker, MarkerKey). Gifts lowered by writes up to v become
// durable: their counters are published in the returned report.
func (l *Ledger) ShareApplied(now time.Duration, name string, v Version) Output {
	if l.fenced || v.Inc != l.inc {
		return Output{Fenced: l.fenced}
	}
	if !l.confirm(name, v) {
		return Output{}
	}
	return Output{Report: l.report(now, false)}
}

// Confirmation is one store write the store confirmed: it holds Version
// (or a later one) for Key.
type Confirmation struct {
	Key     string
	Version Version
}

// SharesApplied is ShareApplied for many confirmations at once: it applies
// them all and returns at most one report, so an agent that confirms the
// writes of a whole interval publishes one report, not one per key.
func (l *Ledger) SharesApplied(now time.Duration, cs []Confirmation) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	changed := false
	for _, c := range cs {
		if c.Version.Inc != l.inc {
			continue
		}
		if l.confirm(c.Key, c.Version) {
			changed = true
		}
	}
	if !changed {
		return Output{}
	}
	return Output{Report: l.report(now, false)}
}

// confirm applies one confirmation; it reports whether a gift became
// durable (and so a report is due).
func (l *Ledger) confirm(name string, v Version) bool {
	if name == MarkerKey {
		if l.creating != (Version{}) && !v.Less(l.creating) {
			l.markerOK, l.everOK, l.reset, l.creating = true, true, false, Version{}
			for _, k := range l.keys {
				k.reassert = Version{}
			}
		}
		return false
	}
	k := l.keys[name]
	if k == nil {
		return false
	}
	if k.confirmed.Less(v) {
		k.confirmed = v
	}
	changed := false
	n := 0
	for _, s := range k.pend {
		if v.Less(s.ver) {
			k.pend[n] = s
			n++
			continue
		}
		for i := range k.pairs {
			if s.inc[i] == l.peers[i].inc && s.give[i] > k.pairs[i].conf {
				k.pairs[i].conf = s.give[i]
				changed = true
			}
		}
	}
	k.pend = k.pend[:n]
	if changed {
		k.dirty = true
	}
	return changed
}

// StoreReset tells the ledger that the local store lost its data and now runs
// as runID. Until the ledger has re-asserted every key and re-created the
// marker, the store enforces floors (no marker).
func (l *Ledger) StoreReset(now time.Duration, runID string) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	l.runID, l.markerOK, l.reset, l.creating = runID, false, true, Version{}
	var out Output
	for _, n := range l.Keys() {
		k := l.keys[n]
		if !k.written {
			continue
		}
		k.force = true
		if w, ok := l.write(k, now); ok {
			out.Writes = append(out.Writes, w)
		}
	}
	return out
}

// ReclaimRecorded feeds the registry's record of an incarnation. An
// incomplete record that needs this incarnation's contribution makes the
// incarnation freezable; a complete one freezes it (and fences it, if it is
// this one). A record of this incarnation carries what reclaims paid it,
// applied (now or later) while a peer acknowledges us.
func (l *Ledger) ReclaimRecorded(now time.Duration, rec Record) Output {
	if l.fenced {
		return Output{Fenced: true}
	}
	me := Incarnation{l.names[l.self], l.inc}
	if rec.Of.Region == me.Region {
		if rec.Of != me {
			return Output{}
		}
		if rec.Complete {
			return l.fence()
		}
		if rec.Closer {
			l.closeAck = true
		}
		if p := rec.Paid; p != nil && p.Seq > l.owed.Seq {
			l.owed = Payment{Seq: p.Seq, Base: p.Base, Keys: append([]KeyUnits(nil), p.Keys...)}
			l.payOwed(now)
		}
		return Output{}
	}
	i := l.index(rec.Of.Region)
	if i < 0 {
		l.stats.Rejected++
		return Output{}
	}
	p := &l.peers[i]
	for _, c := range rec.Contributions {
		if c.From == me {
			delete(p.pending, rec.Of.Inc)
		}
	}
	if !rec.Complete {
		for _, q := range rec.Required {
			if q == me && rec.Of.Inc >= p.inc {
				// The incarnation exists and others find it silent: freeze it
				// once it is silent for ReclaimAfter here too. A newer one than
				// ours proves ours existed; each is frozen only on its own silence.
				p.mayFreeze = true
				p.wanted[rec.Of.Inc] = true
			}
		}
		return Output{}
	}
	var out Output
	if rec.Of.Inc > p.frozenInc {
		out.Contributions = l.freeze(i, rec.Of.Inc, now)
	}
	delete(p.pending, rec.Of.Inc)
	return out
}
