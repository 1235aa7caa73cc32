package ledger

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"testing"
	"time"
)

// This file fuzzes the ledgers of three regions with a network the fuzzer
// controls: it picks the order of every tick, store confirmation, reclaim
// record, crash, store reset and report delivery, replays any report ever
// sent to any region at any time (the sender included), and injects reports
// that decode but are hostile: from regions outside the rule, claiming to
// come from the receiver, or malformed copies of real reports. The safety
// invariant (per key, the units the stores enforce sum to at most Units)
// must hold after every step, and every hostile report must be rejected
// whole, changing nothing. Forged reports from a rule's own region (an
// insider, which only report signatures keep out) are not part of this
// adversary: see TestInsiderForgery.
//
// A copy of a real report whose only change is a key's demand (negative,
// or far above the limit) is not hostile: demand is bounded on receipt,
// not refused (Config.readDemand), and such a copy is delivered as a
// genuine report. A genuine report is never refused as malformed or
// implausible, and no ledger reports a demand outside [0, maxDemand],
// even after usage of any size (1e15, 2^62 + 2^62, math.MaxInt64).

// hostileStore is a region's store as the package doc's contract says,
// writes applied at once (well within StoreTimeout).
type hostileStore struct {
	runID  int
	marker *struct {
		ver        Version
		units      int64
		leaseUntil time.Duration
	}
	recs map[string]struct {
		units int64
		ver   Version
	}
}

// apply applies w at now and reports whether the store then holds a
// version >= w's (the confirmation condition).
func (s *hostileStore) apply(w Write, now time.Duration) bool {
	if w.Key == MarkerKey {
		m := s.marker
		if w.Create() {
			if w.Marker.RunID != strconv.Itoa(s.runID) {
				return false
			}
			if m != nil && !m.ver.Less(w.Version) {
				return true
			}
		} else if m == nil || m.ver.Inc != w.Version.Inc || !m.ver.Less(w.Version) {
			return false
		}
		s.marker = &struct {
			ver        Version
			units      int64
			leaseUntil time.Duration
		}{w.Version, w.Units, now + w.Marker.Lease}
		return true
	}
	if x, ok := s.recs[w.Key]; ok && !x.ver.Less(w.Version) {
		return true
	}
	s.recs[w.Key] = struct {
		units int64
		ver   Version
	}{w.Units, w.Version}
	return true
}

// enforced is what the store enforces for key at now.
func (s *hostileStore) enforced(key string, now time.Duration, floor int64) int64 {
	m := s.marker
	if m == nil || now >= m.leaseUntil {
		return floor
	}
	if x, ok := s.recs[key]; ok {
		if x.ver.Inc != m.ver.Inc {
			return floor
		}
		return x.units
	}
	return m.units
}

type hostileRegion struct {
	name    string
	led     *Ledger // nil: the agent is down
	store   *hostileStore
	pending []Confirmation // applied writes not yet confirmed to the ledger
	records []Record       // reclaim records not yet delivered
	demand  []float64      // per key, tokens per second
}

type hostileWorld struct {
	t        *testing.T
	cfg      Config
	specs    []RegionSpec
	floor    []int64
	reg      *Registry
	regions  []*hostileRegion
	keys     []string
	rates    []float64
	now      time.Duration
	sent     []Report // every report any ledger produced
	network  []int    // pending deliveries: index into sent * len(regions) + destination
	insider  bool     // also forge reports of the rule's own regions (TestInsiderForgery)
	violated string
	log      []string
}

func newHostileWorld(t *testing.T, insider bool) *hostileWorld {
	cfg := simConfig()
	cfg.Units = 1000
	cfg.Hysteresis = 1
	cfg.Lease = 3 * time.Second // the fuzzer's network is slow: about 10 steps per tick
	w := &hostileWorld{t: t, cfg: cfg, specs: []RegionSpec{{"a", 1}, {"b", 2}, {"c", 1}},
		keys: []string{"k0", "k1"}, rates: []float64{100, 1000}, insider: insider}
	w.floor, _ = Split(cfg, w.specs)
	var err error
	if w.reg, err = NewRegistry(cfg, w.specs); err != nil {
		t.Fatal(err)
	}
	for _, sp := range w.specs {
		r := &hostileRegion{name: sp.Name, demand: []float64{60, 500},
			store: &hostileStore{runID: 1, recs: map[string]struct {
				units int64
				ver   Version
			}{}}}
		w.regions = append(w.regions, r)
		w.start(r)
	}
	return w
}

func (w *hostileWorld) logf(format string, args ...any) {
	w.log = append(w.log, fmt.Sprintf("%8v ", w.now)+fmt.Sprintf(format, args...))
}

func (w *hostileWorld) start(r *hostileRegion) {
	st, err := w.reg.Start(r.name)
	if err != nil {
		w.t.Fatal(err)
	}
	st.RunID = strconv.Itoa(r.store.runID)
	if r.led, err = New(w.cfg, r.name, w.specs, st, w.now); err != nil {
		w.t.Fatal(err)
	}
	r.pending = nil
	w.logf("%s starts incarnation %d", r.name, st.Inc)
}

// handle carries out a ledger's output.
func (w *hostileWorld) handle(r *hostileRegion, out Output) {
	for _, wr := range out.Writes {
		if r.store.apply(wr, w.now) {
			r.pending = append(r.pending, Confirmation{wr.Key, wr.Version})
		}
	}
	if out.Report != nil {
		for _, kr := range out.Report.Keys {
			if kr.Demand < 0 || kr.Demand > w.cfg.maxDemand() {
				w.violated = fmt.Sprintf("at %v %s reports key %q with demand %d outside [0, %d]", w.now, r.name, kr.Key, kr.Demand, w.cfg.maxDemand())
			}
		}
		w.sent = append(w.sent, *out.Report)
		for j := range w.regions {
			if w.regions[j] != r {
				w.network = append(w.network, (len(w.sent)-1)*len(w.regions)+j)
			}
		}
	}
	for _, c := range out.Contributions {
		rec, err := w.reg.Contribute(c)
		if err != nil {
			continue
		}
		for _, x := range w.regions {
			x.records = append(x.records, rec)
		}
	}
	if out.Fenced {
		w.logf("%s fenced", r.name)
		r.led = nil
	}
}

// check asserts the invariant at this instant.
func (w *hostileWorld) check() {
	for _, k := range w.keys {
		var sum int64
		var parts []string
		for i, r := range w.regions {
			u := r.store.enforced(k, w.now, w.floor[i])
			sum += u
			parts = append(parts, fmt.Sprintf("%s=%d", r.name, u))
		}
		if sum > w.cfg.Units && w.violated == "" {
			w.violated = fmt.Sprintf("at %v key %s: stores enforce %d units > %d (%v)", w.now, k, sum, w.cfg.Units, parts)
		}
	}
}

// script reads the fuzz input.
type script struct{ b []byte }

func (s *script) next() int {
	if len(s.b) == 0 {
		return 0
	}
	c := s.b[0]
	s.b = s.b[1:]
	return int(c)
}

// mutate makes a hostile copy of rep, or returns false when the mutation
// does not apply. outsider: from a region outside the rule or the receiver
// itself; malformed: a copy the ledger's checks must refuse; insider: a
// well-formed forgery from the region it names. genuine: the copy differs
// only in a key's demand, which the receiver bounds (not hostile).
func (w *hostileWorld) mutate(rep Report, to string, kind, arg int) (r Report, ok, genuine bool) {
	r, ok = w.mutateKind(rep, to, kind, arg)
	return r, ok, kind == 3 && arg%3 == 1
}

// hugeValues are usage counts and demands of any size.
var hugeValues = [...]int64{0, 1e15, 1 << 62, math.MaxInt64}

func (w *hostileWorld) mutateKind(rep Report, to string, kind, arg int) (Report, bool) {
	r := rep
	r.Acks = append([]Ack(nil), rep.Acks...)
	r.Keys = append([]KeyReport(nil), rep.Keys...)
	for i := range r.Keys {
		r.Keys[i].Gave = append([]Counter(nil), r.Keys[i].Gave...)
		r.Keys[i].Applied = append([]Counter(nil), r.Keys[i].Applied...)
	}
	big := int64(arg) * w.cfg.Units / 16
	switch kind {
	case 0: // outsider: a region the rule does not have
		r.From = "intruder"
	case 1: // outsider: claims to be the receiver
		r.From = to
	case 2: // malformed: zero incarnation or sequence
		if arg%2 == 0 {
			r.Inc = 0
		} else {
			r.Seq = 0
		}
	case 3: // malformed: negative base, demand or position
		switch {
		case arg%3 == 0:
			r.Base = -1 - big
		case len(r.Keys) > 0 && arg%3 == 1: // genuine: a demand out of range is bounded
			r.Keys[0].Demand = -1 - big
			if arg%2 == 1 {
				r.Keys[0].Demand = []int64{math.MinInt64, math.MaxInt64, 1e15, 1 << 62}[arg/2%4]
			}
		case len(r.Keys) > 0:
			r.Keys[0].Position = -1 - big
		default:
			return r, false
		}
	case 4: // malformed: keys out of order
		if len(r.Keys) < 2 {
			return r, false
		}
		r.Keys[0], r.Keys[1] = r.Keys[1], r.Keys[0]
	case 5: // malformed: a counter or an ack for an unknown region, or a negative counter
		switch {
		case arg%3 == 0:
			r.Acks = append(r.Acks, Ack{Region: "zz-unknown", Inc: 1, Seq: 1})
		case len(r.Keys) > 0 && arg%3 == 1:
			r.Keys[0].Gave = append(r.Keys[0].Gave, Counter{Region: "zz-unknown", Inc: 1, Units: big})
		case len(r.Keys) > 0 && len(r.Keys[0].Gave) > 0:
			r.Keys[0].Gave[0].Units = -1 - big
		default:
			return r, false
		}
	case 6: // malformed: counters out of order
		if len(r.Keys) == 0 || len(r.Keys[0].Gave) < 2 {
			return r, false
		}
		g := r.Keys[0].Gave
		g[0], g[1] = g[1], g[0]
	default:
		if !w.insider {
			return r, false
		}
		// insider: a larger gift to the receiver, an acknowledgement, a
		// later incarnation: well formed, and only signatures can tell.
		switch arg % 3 {
		case 0:
			if len(r.Keys) == 0 {
				r.Keys = []KeyReport{{Key: w.keys[arg%len(w.keys)]}}
			}
			inc := uint64(1)
			for _, x := range w.regions {
				if x.name == to && x.led != nil {
					inc = x.led.inc
				}
			}
			// small enough to pass plausibility checks on positions
			r.Keys[0].Gave = []Counter{{Region: to, Inc: inc, Units: int64(arg%8+1) * w.cfg.Units / 32}}
		case 1:
			r.Seq += uint64(arg)
		default:
			r.Inc++
		}
	}
	return r, true
}

// shares is every key's position in every live ledger, to tell that a
// report changed nothing.
func (w *hostileWorld) shares() string {
	s := ""
	for _, r := range w.regions {
		if r.led == nil {
			continue
		}
		for _, k := range w.keys {
			s += fmt.Sprintf("%s/%s:%+v ", r.name, k, r.led.Position(k))
		}
	}
	return s
}

// step runs one action of the script.
func (w *hostileWorld) step(s *script) {
	op := s.next()
	r := w.regions[s.next()%len(w.regions)]
	switch op % 32 {
	case 0, 1, 2, 3, 4, 5, 6, 7: // time passes; every agent reports usage and ticks
		d := w.cfg.Interval / 4 * time.Duration(1+s.next()%4)
		w.now += d
		for _, x := range w.regions {
			if x.led == nil {
				continue
			}
			for i, k := range w.keys {
				cost := int64(x.demand[i] * d.Seconds())
				ix := w.index(x.name)
				allowed := int64(float64(x.store.enforced(k, w.now, w.floor[ix])) * w.rates[i] / float64(w.cfg.Units) * d.Seconds())
				x.led.Usage(w.now, k, w.rates[i], min(cost, allowed), cost-min(cost, allowed))
			}
			w.handle(x, x.led.Tick(w.now))
		}
	case 8, 9, 10, 11, 12, 13, 14, 15: // the network delivers a few of the latest reports, in any order
		for n := 1 + s.next()%4; n > 0 && len(w.network) > 0; n-- {
			i := len(w.network) - 1 - s.next()%min(len(w.network), 6)
			d := w.network[i]
			w.network = append(w.network[:i], w.network[i+1:]...)
			w.deliver(w.regions[d%len(w.regions)], w.sent[d/len(w.regions)], false)
		}
	case 16, 17: // a replay of any report ever sent, to any region
		if len(w.sent) == 0 {
			return
		}
		w.deliver(r, w.sent[(s.next()<<8|s.next())%len(w.sent)], false)
	case 18, 19, 20: // a hostile copy of a report
		if len(w.sent) == 0 {
			return
		}
		base := w.sent[(s.next()<<8|s.next())%len(w.sent)]
		kind := s.next() % 8
		hostile, ok, genuine := w.mutate(base, r.name, kind, s.next())
		if ok {
			w.deliver(r, hostile, kind < 7 && !genuine)
		}
	case 21, 22, 23, 24, 25, 26: // the store confirms applied writes
		if r.led != nil && len(r.pending) > 0 {
			n := 1 + s.next()%len(r.pending)
			cs := r.pending[:n]
			r.pending = append([]Confirmation(nil), r.pending[n:]...)
			w.handle(r, r.led.SharesApplied(w.now, cs))
		}
	case 27, 28: // reclaim records reach the agent
		if r.led != nil {
			for _, rec := range r.records {
				if r.led == nil {
					break
				}
				w.handle(r, r.led.ReclaimRecorded(w.now, rec))
			}
		}
		r.records = nil
	case 29: // the agent crashes (or was fenced) and starts a new incarnation
		if r.led != nil && s.next()%8 != 0 {
			return // crashes are rarer than restarts after a fence
		}
		w.start(r)
	case 30: // the store restarts empty
		if s.next()%8 != 0 {
			return
		}
		r.store = &hostileStore{runID: r.store.runID + 1, recs: map[string]struct {
			units int64
			ver   Version
		}{}}
		r.pending = nil
		w.logf("%s store reset", r.name)
		if r.led != nil {
			w.handle(r, r.led.StoreReset(w.now, strconv.Itoa(r.store.runID)))
		}
	case 31: // demand changes, or usage of any size comes at once
		i, v := s.next()%len(w.keys), s.next()
		if v < 240 {
			r.demand[i] = w.rates[0] * float64(v%16) / 4
		} else if r.led != nil {
			v -= 240
			r.led.Usage(w.now, w.keys[i], w.rates[i], hugeValues[v%4], hugeValues[v/4])
		}
	}
	w.check()
}

func (w *hostileWorld) index(name string) int {
	for i, sp := range w.specs {
		if sp.Name == name {
			return i
		}
	}
	return -1
}

// deliver gives rep to r; a hostile one must be rejected and change nothing.
func (w *hostileWorld) deliver(r *hostileRegion, rep Report, hostile bool) {
	if r.led == nil {
		return
	}
	before := ""
	if hostile {
		before = w.shares()
	}
	out, err := r.led.Receive(w.now, rep)
	if !hostile && (errors.Is(err, ErrMalformed) || errors.Is(err, ErrImplausible)) && w.violated == "" {
		w.violated = fmt.Sprintf("at %v %s refused a genuine report of %s: %v", w.now, r.name, rep.From, err)
	}
	if out.Fenced {
		w.logf("%s fenced by a report from %s/%d (hostile %v, err %v)", r.name, rep.From, rep.Inc, hostile, err)
	}
	if hostile {
		if err == nil {
			w.violated = fmt.Sprintf("at %v %s accepted a hostile report %+v", w.now, r.name, rep)
		} else if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknownRegion) && !errors.Is(err, ErrStaleIncarnation) && !errors.Is(err, ErrFrozenIncarnation) && !errors.Is(err, ErrBackwards) {
			w.violated = fmt.Sprintf("%s refused a hostile report with an unexpected error: %v", r.name, err)
		} else if len(out.Writes) > 0 || out.Report != nil || len(out.Contributions) > 0 || w.shares() != before {
			w.violated = fmt.Sprintf("at %v %s refused a hostile report (%v) but it changed something: %+v", w.now, r.name, err, out)
		}
	}
	w.handle(r, out)
}

// runHostile runs a script and returns the first violation ("" if none).
func runHostile(t *testing.T, data []byte, insider bool) (string, []string) {
	w := newHostileWorld(t, insider)
	s := &script{b: data}
	for steps := 0; len(s.b) > 0 && steps < 2000 && w.violated == ""; steps++ {
		w.step(s)
	}
	return w.violated, w.log
}

// FuzzHostileReports: see the top of the file.
func FuzzHostileReports(f *testing.F) {
	// Ticks and deliveries in order, then a replay, hostile copies, a crash
	// and a store reset.
	f.Add([]byte{0, 0, 4, 5, 0, 5, 1, 5, 2, 2, 0, 2, 0, 0, 1, 3, 5, 1, 5, 2, 0, 0, 2, 1, 0, 0, 0, 2, 2, 1, 0, 3, 0, 0, 7,
		4, 1, 0, 0, 3, 9, 4, 2, 0, 1, 5, 1, 9, 0, 9, 0, 1, 7, 2, 7, 0, 0, 8, 1, 0, 0, 6, 1, 0, 4, 6, 0})
	// Ticks, confirmations and deliveries around usage of any size on
	// a's k0 (2^62 admitted; then math.MaxInt64 admitted and
	// rejected at once), then a copy of a report with a key's demand at
	// math.MinInt64 delivered to each region (not hostile).
	round := []byte{0, 0, 3, 21, 0, 255, 21, 1, 255, 21, 2, 255, 8, 0, 3, 0, 0, 0, 0}
	var huge []byte
	for _, v := range []byte{242, 255} {
		for range 4 {
			huge = append(huge, round...)
		}
		f.Add(append(slices.Clone(huge), 31, 0, 0, v, 0, 0, 3, 8, 0, 3, 0, 0, 0, 0))
	}
	for to := range 3 {
		huge = append(huge, 18, byte(to), 0, byte(10+to), 3, 1)
	}
	f.Add(huge)
	f.Fuzz(func(t *testing.T, data []byte) {
		if v, log := runHostile(t, data, false); v != "" {
			t.Fatalf("%s\n%s", v, tail(log, 30))
		}
	})
}

func tail(log []string, n int) string {
	if len(log) > n {
		log = log[len(log)-n:]
	}
	s := ""
	for _, l := range log {
		s += l + "\n"
	}
	return s
}

// TestInsiderForgery shows why reports must be authenticated: a forged
// report that names one of the rule's own regions (a larger gift to the
// receiver) is well formed, and the ledger, which trusts its peers'
// counters, raises its share above the limit. Report signatures keep such
// reports out; the ledger cannot.
func TestInsiderForgery(t *testing.T) {
	found := false
	for seed := 0; seed < 200 && !found; seed++ {
		data := make([]byte, 400)
		x := uint64(seed)*0x9e3779b97f4a7c15 + 1
		for i := range data {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			data[i] = byte(x)
		}
		v, _ := runHostile(t, data, true)
		found = v != ""
		if found {
			t.Logf("seed %d: %s", seed, v)
		}
	}
	if !found {
		t.Fatal("no forged insider report broke the invariant: if the ledger now refuses them, make them part of FuzzHostileReports")
	}
}
