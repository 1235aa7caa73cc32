package ledger

import (
	"fmt"
	"iter"
	"math"
	"slices"
	"sort"
	"strings"
	"time"
	"unsafe"

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
	// Live is, per other region that has one, its latest registered
	// incarnation whose reclaim is not complete: it exists, so every
	// earlier incarnation of that region is superseded (Ledger.superseded).
	Live []Incarnation
	// RunID identifies the current contents of the local store (Redis run id).
	RunID string
	// Sent is when, on the agent's clock, the request that obtained this
	// life was sent (0: when New is called). The life's own lease, before
	// any acknowledgement, counts from it: a peer that learns of the life
	// from the registry, or from the Live list of its own start, learns
	// of it after it was allocated, so after Sent, and its wait for
	// silence then outlasts that lease (the package doc, invariant 3).
	Sent time.Duration
}

// Share is the ledger's view of one key.
type Share struct {
	Units   int64 // position: the units this region may enforce
	Floor   int64
	Initial int64 // units this region holds when nothing has moved (its base)
	Demand  int64 // demand estimate, units
	// Reported is the demand as last reported (within DemandBand of
	// Demand): what every region, this one included, allocates with.
	Reported int64
	Active   bool // coordinated (false: back at its initial part, static share)
}

// Stats counts rejected inputs and forgotten keys.
type Stats struct {
	Rejected  int
	Forgotten int // keys whose state was dropped (retire.go)
	Settled   int // gifts that paid what this region owed a peer on a key (settle.go)
	// Lowered counts the share writes that lowered a key's units below
	// those last written (below the base for a key without a record):
	// gifts, for the agent's metric.
	Lowered uint64
	// Paced counts the reports that left due keys to later reports
	// because a peer had not acknowledged enough of the earlier ones
	// (Config.PaceKeys).
	Paced uint64
	// MarkerLost counts the renewals of a confirmed marker the store
	// answered with no marker under its same run id (its data flushed,
	// the marker deleted or evicted), each followed by a store reset.
	MarkerLost uint64
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

// snap is one unconfirmed write's snapshot, a view of snapWidth values
// of its key's pend array: the write's version (Inc, Seq), then per
// region i the give to i and i's incarnation at the write. One flat array
// per key holds its snapshots (one allocation for them all, where a
// struct with a slice of gives and a slice of incarnations took three per
// write: 136 B per unconfirmed write at three regions, 88 B now).
type snap []int64

func (s snap) ver() Version           { return Version{uint64(s[0]), uint64(s[1])} }
func (s snap) give(i int) int64       { return s[2+2*i] }
func (s snap) setGive(i int, v int64) { s[2+2*i] = v }
func (s snap) inc(i int) uint64       { return uint64(s[3+2*i]) }

// snapWidth is the values of one snap with n regions.
func snapWidth(n int) int { return 2 + 2*n }

type key struct {
	name    string
	rate    float32 // the rule's rate per second; float32 with sentDem in the 8 bytes of a float64
	sentDem float32 // the demand as reported (DemandBand), which give uses too: key.reported
	used    int64
	demand  float64       // estimate (units): ewma / weight
	ewma    float64       // EWMA of the interval samples, from 0
	weight  float64       // total EWMA weight of the samples so far (-> 1)
	busyAt  time.Duration // the last tick whose interval had usage
	lastUse time.Duration
	rare    *keyRare // nil unless a store reset, a hold, a settlement, a retirement or reclaim terms concern the key
	pairs   *pair    // the first of its pairs, one per peer region (Ledger.pairsOf, Ledger.pair)
	pend    *[]int64 // writes not yet confirmed (Ledger.snaps); nil when none: 16 bytes a key less than a slice

	// The flags and seen together, for the struct's size (a key per key
	// in use).
	active   bool
	dirty    bool
	written  bool
	wRelease bool
	force    bool  // rewrite even if unchanged (store reset)
	gifted   bool  // give grew since the last write: a new version must cover it
	seen     uint8 // cost seen since the average started, up to SilenceTokens
	waited   uint8 // Ticks in a row give held the key's gifts back: whole tokens on views that disagree (consistent), or an excess within GiftBand (Config.GiftBand)

	wUnits int64
	// Versions of this incarnation (Version{inc, seq}: the ledger writes
	// and confirms no other) by their Seq alone; 0 is none (Version{}).
	wSeq    uint64 // the last write's
	wAt     time.Duration
	confSeq uint64 // the highest the store confirmed holding
	idleAt  time.Duration
}

// reported is k's demand as last reported (DemandBand), in units: a
// float32 (exact up to 2^24 units, 16.8 times the default Units, and
// within 6e-8 of it above) so that the key keeps its size class. observe
// sets it to at most maxDemand (DemandCap), so it converts back in range.
func (k *key) reported() int64 { return toUnits(float64(k.sentDem), maxDemandUnits) }

// snaps calls fn with each of k's writes not yet confirmed, oldest first.
func (l *Ledger) snaps(k *key, fn func(s snap)) {
	if k.pend == nil {
		return
	}
	p, w := *k.pend, snapWidth(len(l.names))
	for off := 0; off+w <= len(p); off += w {
		fn(snap(p[off : off+w : off+w]))
	}
}

// version is the version of this incarnation with sequence seq
// (key.wSeq, key.confSeq); Version{} for 0.
func (l *Ledger) version(seq uint64) Version {
	if seq == 0 {
		return Version{}
	}
	return Version{l.inc, seq}
}

// keyRare is what few keys need, apart so that the others do not carry it:
// 144 bytes a key instead of 240 (the allocator's size classes).
type keyRare struct {
	extra     int64   // paid by reclaims, beyond the base part (Payment.Keys)
	frozen    int64   // terms of ended pairs: -Q of every frozen pair, and retired counters (retire.go)
	reassert  Version // after a store reset: the marker waits for this version
	hold      int64   // the store cannot lower the key below this until holdUntil (Hold)
	holdUntil time.Duration
	settled   int64         // S - ceil(g/2) + 1 after this region paid g to settle at a sum S of the pairs' |net|; 0: none since the key was last idle (settle.go)
	round     int64         // the sum of the pairs' |net| when this region last began settling the key from rest; 0: none since demand (settle.go)
	retryAt   time.Duration // a beginning that did not halve round may be retried from then on (settleStart)
	tries     uint8         // beginnings since the key's last demand that did not halve round (settleStart's backoff); 0 whenever round is
	ret       *retireState  // non-nil while this region retires the key
}

// extra is what reclaims paid k beyond the base part (keyRare.extra).
func (k *key) extra() int64 {
	if k.rare == nil {
		return 0
	}
	return k.rare.extra
}

// frozen is k's terms of ended pairs (keyRare.frozen).
func (k *key) frozen() int64 {
	if k.rare == nil {
		return 0
	}
	return k.rare.frozen
}

// addFrozen adds d to k's frozen terms.
func (k *key) addFrozen(d int64) {
	if d != 0 {
		k.rareState().frozen += d
		k.dropRare()
	}
}

func (k *key) rareState() *keyRare {
	if k.rare == nil {
		k.rare = &keyRare{}
	}
	return k.rare
}

// dropRare releases k.rare once it holds nothing.
func (k *key) dropRare() {
	if r := k.rare; r != nil && r.reassert == (Version{}) && r.hold == 0 && r.holdUntil == 0 && r.settled == 0 && r.round == 0 && r.ret == nil &&
		r.extra == 0 && r.frozen == 0 {
		k.rare = nil
	}
}

// scratchSpace holds give's per-key slices between calls, so that a Tick
// over n keys does not allocate them n times (and closures' per-region
// flags, once a report).
type scratchSpace struct {
	idx     []int
	wants   []Want
	proj    []int64
	def     []int64
	closeTo []bool
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
	known     uint64        // the highest incarnation the registry showed to exist
	base      int64
	pending   map[uint64]Contribution // contributions not yet seen in the registry
	wanted    map[uint64]bool         // incarnations the registry needs our contribution for
	heardOf   []heard                 // per region index: its newest report this peer acknowledged (Ledger.consistent)
	// Pacing (pace.go): the key reports we had sent up to our newest
	// report the peer acknowledged, its window of key reports in flight
	// (0: none) and when it was last halved.
	ackedKeys int64
	window    int64
	halved    time.Duration
	// The peer's witness key (witness.go): its revision (0: none seen)
	// and when we first saw it at that revision.
	wRev  int64
	wAt   time.Duration
	asked int64 // the revision of the last take asked for (Output.Take)
	// took is the revision of a take that succeeded (WitnessTaken) while
	// we paired with tookInc: that incarnation's witness lease is over.
	took    int64
	tookInc uint64
}

// heard is a report (incarnation, sequence) a peer acknowledged.
type heard struct{ inc, seq uint64 }

// Ledger is the share ledger of one region. It is a pure state machine: all
// methods take the agent's local monotonic time and return what to do. A Ledger
// is not safe for concurrent use; one goroutine of the agent owns it.
type Ledger struct {
	cfg Config
	// The witness (witness.go): the lease its renewals give, and whether
	// this region's key was taken.
	wUntil  time.Duration
	wLost   bool
	self    int
	inc     uint64
	names   []string
	weights []float64
	floor   []int64
	initial []int64
	base    int64
	peers   []peer
	keys    map[string]*key
	// The keys in name order, so that Tick and a report go through them
	// in one pass instead of sorting every key every tick: sorted is in
	// name order as of the last mergeKeys, added holds the keys created
	// since (unsorted). A forgotten key stays in them, with no pairs
	// (forget), until the next mergeKeys or Tick drops it.
	sorted []*key
	added  []*key

	started time.Duration
	// lastTick is when the demand estimates last observed an interval's
	// usage (Tick, unless UsageLate held it back); usageLate is set by
	// UsageLate for the next Tick.
	lastTick  time.Duration
	usageLate bool
	ticks     int
	fenced    bool
	told      bool // a peer froze this incarnation

	wseq     uint64
	runID    string
	markerOK bool // a marker of this run is confirmed (and no reset since)
	everOK   bool // reports start after the first confirmed marker
	creating Version
	createAt time.Duration
	reset    bool // reasserting after StoreReset
	wasReset bool // StoreReset came at least once (no Create of this incarnation is a boot)

	rseq uint64
	sent map[uint64]sentReport
	// Pacing (pace.go): the key reports sent so far, and the key the
	// next report starts from after one was cut ("": the first).
	keysSent int64
	paceFrom string
	cut      bool          // the last report left due keys out
	ackOwed  int           // the most keys of a peer's report heard since our last report (pace.go)
	lastSent time.Duration // when the last report went out (HeartbeatEvery)
	// refreshAt is when the demands last counted as changed at any move
	// past Hysteresis, band or not (DemandBand's refresh, once per
	// heartbeat); band is the band of the Tick running (0 at a refresh).
	refreshAt time.Duration
	band      float64
	treports  int // reports of Tick so far (FullEvery)
	// fullAt holds when the last idleFullReports full reports went out,
	// oldest first (math.MinInt64: none yet): an idle key stays in full
	// reports until that many have carried it (Ledger.idleDone).
	fullAt [idleFullReports]time.Duration
	resync bool // a peer likely missed our reports (a silence, Receive): the next Tick sends a full report
	// Deferred reports (DeferReports): deferReports is set; repOwed, a Tick's report
	// is due and not built yet; owedFull, it is a full one (owedResync:
	// for a resync).
	deferReports, repOwed, owedFull, owedResync bool
	stats                                       Stats

	retires uint64              // retirements started (retire.go)
	closing map[closeID]closing // closures of peers' retirements, until acknowledged
	marks   []mark              // per peer: ignore the keys of its reports below this

	scratch scratchSpace // give's per-key slices, reused from key to key
	order   []int        // the peers' indices (self excluded) by name: a report's order

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
		lastTick: now, runID: st.RunID, sent: map[uint64]sentReport{}}
	for i := range l.fullAt {
		l.fullAt[i] = math.MinInt64
	}
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
		l.peers[i] = peer{name: l.names[i], inc: 1, heard: now, mayFreeze: true, window: int64(cfg.PaceKeys),
			pending: map[uint64]Contribution{}, wanted: map[uint64]bool{}, heardOf: make([]heard, len(regions))}
	}
	for i := range l.names {
		if i != l.self {
			l.order = append(l.order, i)
		}
	}
	sort.Slice(l.order, func(a, b int) bool { return l.names[l.order[a]] < l.names[l.order[b]] })
	for _, k := range st.Known {
		i := l.index(k.Region)
		if i < 0 || i == l.self || k.Inc == 0 {
			return nil, fmt.Errorf("%w: known incarnation %v", ErrUnknownRegion, k)
		}
		l.peers[i].inc = k.Inc
		l.peers[i].frozenInc = k.Inc - 1
	}
	for _, k := range st.Live {
		i := l.index(k.Region)
		if i < 0 || i == l.self || k.Inc == 0 {
			return nil, fmt.Errorf("%w: live incarnation %v", ErrUnknownRegion, k)
		}
		l.peers[i].known = max(l.peers[i].known, k.Inc)
	}
	// A peer's incarnation is frozen by silence only if it existed when
	// this life was allocated (Live), so that the silence counted from now
	// outlasts its own lease, which counts from before its allocation
	// (Start.Sent). One allocated later is frozen once heard (the silence
	// counts from its reports), or once the registry needs our
	// contribution to its reclaim (another region froze it first); one
	// never allocated is not frozen at all: if it starts, its lease counts
	// from its start, maybe after our silence began, and if it never
	// does, it holds its floor (no marker) and its first life's share
	// waits for it. (Until 5 December 2026 every peer's first life was
	// frozen after ReclaimAfter of this life's start: a first life
	// allocated after that start and never heard was reclaimed while its
	// store still enforced its initial part, TestLateFirstLife.)
	for i := range l.peers {
		if i != l.self {
			l.peers[i].mayFreeze = l.peers[i].known >= l.peers[i].inc
		}
	}
	if st.Sent > 0 && st.Sent < now {
		l.started = st.Sent
	}
	if l.base > l.floor[l.self] && now >= l.leaseDeadline() {
		return nil, fmt.Errorf("%w: sent %v, now %v, lease %v", ErrLapsed, st.Sent, now, cfg.Lease)
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
	return allocation.SplitByWeight(f, w), allocation.SplitByWeight(cfg.Units-f, w) // as allocation.Floors
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

// Quantum returns the ledger's Config.Quantum (SetQuantum changes it).
func (l *Ledger) Quantum() int64 { return l.cfg.Quantum }

// SetQuantum changes Config.Quantum of a running ledger to q (in [0,
// Units]): the limit's capacity changed, and q is QuantumOf the new one.
// A rule's capacity may change at any time; with the Quantum fixed at New,
// a capacity cut from a few tokens to 2 left three regions holding 1/2,
// 1/4 and 1/4 of the limit for good (whole tokens of the old capacity):
// two of them below one token, admitting nothing, while all wanted more.
//
// Safe at any call boundary. The Quantum shapes the targets only (give's
// rounding to whole tokens and their hold, EvenBand, GiftWait's
// exemption of whole-token keys) and the Registry's payouts, which are
// separate: no counter, position, pending write, report or plausibility
// check depends on it, and a gift still never exceeds what give may give
// (giveable). Invariants 1 to 3 therefore hold across a change as proven,
// whatever the regions' quanta are meanwhile. The next Tick is where the
// ledger re-rounds: give computes every active key's targets afresh from
// the reported state, rounded to the new token, and the regions holding a
// fraction of one give it or receive the rest (keys at rest keep their
// bases, as they would under a ledger started with q). Until every region
// has applied the change (each agent reads the rule from etcd on its own)
// their targets may differ by the rounding, so a token may move once more
// than needed; once all agree, invariant 4's whole-token argument (step 4)
// applies as to a ledger started with q. The count of Ticks a key's
// gifts were held (the hold of whole tokens with a Quantum, GiftWait
// without) restarts when the ledger switches between the two, so that
// one is not taken for the other.
func (l *Ledger) SetQuantum(q int64) error {
	if q < 0 || q > l.cfg.Units {
		return fmt.Errorf("%w: Quantum %d must be in [0, Units %d]", ErrConfig, q, l.cfg.Units)
	}
	if q == l.cfg.Quantum {
		return nil
	}
	if (q > 1) != (l.cfg.Quantum > 1) {
		for _, k := range l.keys {
			k.waited = 0
		}
	}
	l.cfg.Quantum = q
	return nil
}

// RegionNames returns the names of the ledger's regions, in the order New
// was given them (a copy).
func (l *Ledger) RegionNames() []string { return slices.Clone(l.names) }

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
		s.Units, s.Demand, s.Reported, s.Active = l.position(k), toUnits(k.demand, maxDemandUnits), k.reported(), k.active
	}
	if l.fenced {
		s.Units = s.Floor
	}
	return s
}

// Each calls fn with every key the ledger holds state for and its view
// (Position's), in no particular order; fn must not call the ledger. It
// allocates nothing: a reader that wants a few keys of many (the hottest,
// the largest) need not copy them all.
func (l *Ledger) Each(fn func(name string, s Share)) {
	s := Share{Floor: l.floor[l.self], Initial: l.base}
	l.held(func(k *key) bool {
		s.Units, s.Demand, s.Reported, s.Active = l.position(k), toUnits(k.demand, maxDemandUnits), k.reported(), k.active
		if l.fenced {
			s.Units = s.Floor
		}
		fn(k.name, s)
		return true
	})
}

// held calls fn with every key held, in no particular order, until fn
// returns false. It walks Ledger.sorted and Ledger.added, which hold every
// key (a forgotten one may still be in them, and is skipped), not the map
// Ledger.keys: at 1,000,000 keys the map's walk took 209 ms, the lists'
// 27 ms (BenchmarkEach). fn must not add or forget keys.
func (l *Ledger) held(fn func(k *key) bool) {
	for _, ks := range [2][]*key{l.sorted, l.added} {
		for _, k := range ks {
			if !gone(k) && !fn(k) {
				return
			}
		}
	}
}

// inNameOrder is every key held, in name order: Ledger.sorted once the
// keys created since are merged into it (mergeKeys), without sorting every
// name (a freeze and a store reset sorted them all: 0.4-0.5 s at 1,000,000
// keys, BenchmarkFreezeAndReset). The loop must not add or forget keys, and
// must not run inside a walk of Ledger.sorted (the merge rewrites it).
func (l *Ledger) inNameOrder() iter.Seq[*key] {
	l.mergeKeys()
	return func(yield func(*key) bool) {
		for _, k := range l.sorted {
			if !gone(k) && !yield(k) {
				return
			}
		}
	}
}

// Keys returns the names of the keys the ledger holds state for, sorted.
func (l *Ledger) Keys() []string {
	out := make([]string, 0, len(l.keys))
	for k := range l.inNameOrder() {
		out = append(out, k.name)
	}
	return out
}

// pairsOf is k's pairs, one per peer region, in region order: a key holds
// no pair for this region itself, 56 bytes a key less. The key keeps only
// a pointer to the first (the array stays alive through it): their count
// is the ledger's, len(l.names)-1, so a slice's length and capacity in
// every key would be 16 bytes a key for nothing.
func (l *Ledger) pairsOf(k *key) []pair {
	return unsafe.Slice(k.pairs, len(l.names)-1)
}

// newPairs allocates a key's pairs (pairsOf).
func (l *Ledger) newPairs() *pair {
	return unsafe.SliceData(make([]pair, len(l.names)-1))
}

// pair is k's pair with peer region i (i != l.self).
func (l *Ledger) pair(k *key, i int) *pair {
	switch {
	case i > l.self:
		i--
	case i == l.self:
		panic("ledger: no pair of a region with itself")
	}
	return &l.pairsOf(k)[i]
}

// gone reports whether k was forgotten (forget): it is still in
// Ledger.sorted or Ledger.added until they drop it.
func gone(k *key) bool { return k.pairs == nil }

// mergeKeys sorts the keys created since the last call into l.sorted, and
// drops the forgotten keys when it moves them anyway: O(n + m log m) for m
// new keys, nothing when there are none.
func (l *Ledger) mergeKeys() {
	a := l.added
	if len(a) == 0 {
		return
	}
	slices.SortFunc(a, func(x, y *key) int { return strings.Compare(x.name, y.name) })
	s := l.sorted
	n := len(s)
	s = slices.Grow(s, len(a))[:n+len(a)]
	// From the back: each slot written is free (moved, or past the old end).
	i, j, w := n-1, len(a)-1, n+len(a)-1
	for j >= 0 {
		if i >= 0 && s[i].name > a[j].name {
			s[w] = s[i]
			i--
		} else {
			s[w] = a[j]
			j--
		}
		w--
	}
	live := s[:0]
	for _, k := range s {
		if !gone(k) {
			live = append(live, k)
		}
	}
	clear(s[len(live):])
	l.sorted = live
	clear(a)
	if cap(a) > 1024 {
		a = nil // a burst of new keys: its array would stay for good
	}
	l.added = a[:0]
}

func (l *Ledger) position(k *key) int64 {
	u := l.base + k.extra() + k.frozen()
	for _, pr := range l.pairsOf(k) {
		u += pr.recv - pr.give
	}
	return u
}

func (l *Ledger) key(name string) *key {
	k := l.keys[name]
	if k == nil {
		// A copy: a name decoded from a report must not pin the message.
		name = strings.Clone(name)
		k = &key{name: name, pairs: l.newPairs()}
		l.keys[name] = k
		l.added = append(l.added, k)
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
	k.rate = float32(rate)
	k.used = addCost(k.used, addCost(admitted, rejected)) // saturating: any counts are valid usage (demand.go)
	k.lastUse = now
	if !k.active && !k.retiring() { // a retiring key becomes active when its retirement ends
		k.active, k.dirty = true, true
	}
}
