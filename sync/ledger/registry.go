package ledger

import (
	"fmt"
	"sort"

	"github.com/apportion/apportion/allocation"
)

// Registry is the reclaim registry: the state the agents keep in etcd (one
// document, every change a compare-and-swap on its revision) so that all
// survivors agree on who is reclaimed and for how much. It allocates
// incarnations, records which are over, collects contributions and pays the
// freed units out. It is pure and deterministic; the wire encoding for etcd
// is left to the agent.
//
// An incarnation is open from its start until the next start of its region or
// the completion of its reclaim, whichever comes first. It is closed once its
// successor has confirmed its store marker (Close): from then on its store
// enforces the floor for good and, having ended, it acknowledges nothing.
//
// Reclaims complete in cohorts (see the package doc, Reclaim): the reclaim of
// X completes together with every closed incarnation that overlapped a member
// of the cohort and did not contribute to it, once every other overlapping
// incarnation that is not reclaimed has contributed. Payments are cumulative
// per recipient (Record.Paid), so a recipient that misses a record or applies
// it late loses nothing, and a recipient's own reclaim counts what it was paid
// whether it applied it or not. Contributions from an incarnation whose own
// reclaim is complete are refused, so what it keeps is final.
//
// The state stays bounded: a reclaimed incarnation is forgotten (down to one
// watermark per region) once every earlier incarnation of its region is
// reclaimed too and it is not among its region's two newest.
type Registry struct {
	names   []string
	weights []float64
	initial []int64
	clock   uint64
	lives   []life
	recs    map[Incarnation]*recState
	paid    map[Incarnation]*account // cumulative payments to an unreclaimed incarnation
	kept    map[Incarnation]map[string]int64
	done    map[string]uint64 // every incarnation <= done[region] is reclaimed and forgotten
	quantum int64             // Config.Quantum: payouts in whole tokens (split)
}

type life struct {
	id         Incarnation
	start, end uint64 // end 0: open
	closed     bool   // its successor confirmed its marker: at the floor for good
	closer     bool   // it has recorded that its predecessors are closed
}

type recState struct {
	contribs map[Incarnation]Contribution
	order    []Incarnation
	complete bool
	rec      Record
}

type account struct {
	seq  uint64
	base int64
	keys map[string]int64
}

// NewRegistry returns an empty registry for the regions.
func NewRegistry(cfg Config, regions []RegionSpec) (*Registry, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := &Registry{recs: map[Incarnation]*recState{}, paid: map[Incarnation]*account{},
		kept: map[Incarnation]map[string]int64{}, done: map[string]uint64{}}
	for _, x := range regions {
		r.names = append(r.names, x.Name)
		r.weights = append(r.weights, x.Weight)
	}
	_, r.initial = Split(cfg, regions)
	r.quantum = cfg.Quantum
	return r, nil
}

// split divides units among recipients of weights w. With whole tokens
// (Quantum > 1) it divides whole quanta by weight and gives the rest, less
// than a quantum, to the recipient given the most (the heaviest of a tie):
// a reclaimed token is then a whole token in one region, which can admit
// with it, not a fraction in each, which admit nothing (two regions at
// 1/s, burst 1: half a token in each for 0.6 s after an agent restart,
// simulations TestFaultsServeAgain). Any split pays out exactly units.
func (r *Registry) split(units int64, w []float64) []int64 {
	if r.quantum <= 1 || units <= 0 || len(w) == 0 {
		return allocation.SplitByWeight(max(0, units), w)
	}
	out := allocation.SplitByWeight(units/r.quantum, w)
	best := 0
	for j := range out {
		out[j] *= r.quantum
		if out[j] > out[best] || out[j] == out[best] && w[j] > w[best] {
			best = j
		}
	}
	out[best] += units % r.quantum
	return out
}

// SetQuantum makes later payouts whole tokens of q units (Config.Quantum;
// 0: by weight alone): the limit's capacity changed. Payouts only divide
// what a reclaim freed, and any split sums to it, so q changes no total.
func (r *Registry) SetQuantum(q int64) { r.quantum = max(0, q) }

func (r *Registry) index(name string) int {
	for i, n := range r.names {
		if n == name {
			return i
		}
	}
	return -1
}

func (r *Registry) current(region string) *life {
	for j := len(r.lives) - 1; j >= 0; j-- {
		if r.lives[j].id.Region == region {
			return &r.lives[j]
		}
	}
	return nil
}

func (r *Registry) lifeOf(id Incarnation) *life {
	for j := range r.lives {
		if r.lives[j].id == id {
			return &r.lives[j]
		}
	}
	return nil
}

// Start allocates the next incarnation of region and returns what New needs
// (without the store's run id).
func (r *Registry) Start(region string) (Start, error) {
	if r.index(region) < 0 {
		return Start{}, fmt.Errorf("%w: %q", ErrUnknownRegion, region)
	}
	r.clock++
	inc := r.done[region] + 1
	if c := r.current(region); c != nil {
		inc = c.id.Inc + 1
		if c.end == 0 {
			c.end = r.clock
		}
	}
	r.lives = append(r.lives, life{id: Incarnation{region, inc}, start: r.clock})
	r.settle() // a cohort that had nobody to pay pays the new incarnation
	st := Start{Inc: inc}
	for _, n := range r.names {
		if n == region {
			continue
		}
		k := Incarnation{n, r.done[n] + 1}
		if c := r.current(n); c != nil {
			k.Inc = c.id.Inc
			if r.complete(c.id) {
				k.Inc++
			} else {
				st.Live = append(st.Live, c.id)
			}
		}
		st.Known = append(st.Known, k)
	}
	r.prune()
	return st, nil
}

// Close records that by's store marker is confirmed, so every earlier
// incarnation of its region enforces its floor for good. It may complete
// reclaims; it is idempotent.
func (r *Registry) Close(by Incarnation) error {
	l := r.lifeOf(by)
	if r.index(by.Region) < 0 || l == nil {
		return fmt.Errorf("%w: close by %v", ErrUnknownRegion, by)
	}
	l.closer = true
	for j := range r.lives {
		if x := &r.lives[j]; x.id.Region == by.Region && x.id.Inc < by.Inc {
			x.closed = true
		}
	}
	r.settle()
	return nil
}

func overlap(a, b *life) bool {
	return (a.end == 0 || b.start < a.end) && (b.end == 0 || b.end > a.start)
}

// required lists the unreclaimed incarnations of other regions that
// overlapped of: each must contribute, or be closed and join of's cohort.
func (r *Registry) required(of *life) []Incarnation {
	var out []Incarnation
	for j := range r.lives {
		x := &r.lives[j]
		if x.id.Region == of.id.Region || r.complete(x.id) {
			continue
		}
		if overlap(of, x) {
			out = append(out, x.id)
		}
	}
	return out
}

func (r *Registry) complete(id Incarnation) bool {
	if id.Inc <= r.done[id.Region] {
		return true
	}
	s := r.recs[id]
	return s != nil && s.complete
}

func (r *Registry) contributed(from, to Incarnation) bool {
	s := r.recs[to]
	if s == nil {
		return false
	}
	_, ok := s.contribs[from]
	return ok
}

// Contribute records c (the first contribution of each contributor stands)
// and returns the record of c.Of, complete once its cohort completed.
func (r *Registry) Contribute(c Contribution) (Record, error) {
	if r.index(c.Of.Region) < 0 || r.index(c.From.Region) < 0 || c.Of.Region == c.From.Region || c.Of.Inc == 0 || c.From.Inc == 0 {
		return Record{}, fmt.Errorf("%w: contribution %v from %v", ErrUnknownRegion, c.Of, c.From)
	}
	if c.Of.Inc > r.newestInc(c.Of.Region) || c.From.Inc > r.newestInc(c.From.Region) {
		return Record{}, fmt.Errorf("%w: contribution %v from %v: no such incarnation", ErrUnknownRegion, c.Of, c.From)
	}
	if r.complete(c.From) {
		return Record{}, fmt.Errorf("%w: %v is reclaimed", ErrFrozenIncarnation, c.From)
	}
	if !r.complete(c.Of) {
		s := r.recs[c.Of]
		if s == nil {
			s = &recState{contribs: map[Incarnation]Contribution{}}
			r.recs[c.Of] = s
		}
		if _, ok := s.contribs[c.From]; !ok {
			s.contribs[c.From] = cloneContribution(c)
			s.order = append(s.order, c.From)
		}
		r.settle()
	}
	return r.Record(c.Of), nil
}

// settle completes every cohort that can complete, then prunes.
func (r *Registry) settle() {
	for again := true; again; {
		again = false
		for j := range r.lives {
			if id := r.lives[j].id; !r.complete(id) {
				if s := r.cohort(id); s != nil {
					r.completeCohort(s)
					again = true
					break
				}
			}
		}
	}
	r.prune()
}

// cohort returns the incarnations whose reclaim can complete together with
// x's, or nil. Every unreclaimed incarnation of another region that
// overlapped a member has contributed to that member, or is closed and a
// member itself (their pair is then counted by nobody: both are at their
// floors for good, and a pair's units sum to zero). A member that is not
// closed needs at least one contribution and, from every other region, a
// contribution from the last of that region's incarnations that overlapped
// it (unless that one is reclaimed): that one froze it after silence, later
// than any earlier one of its region could have renewed its lease.
func (r *Registry) cohort(x Incarnation) []Incarnation {
	s := []Incarnation{x}
	in := map[Incarnation]bool{x: true}
	for q := 0; q < len(s); q++ {
		m := r.lifeOf(s[q])
		if m == nil {
			return nil
		}
		for _, id := range r.required(m) {
			if in[id] || r.contributed(id, m.id) {
				continue
			}
			if !r.lifeOf(id).closed {
				return nil
			}
			in[id] = true
			s = append(s, id)
		}
	}
	for _, id := range s {
		m := r.lifeOf(id)
		if m.closed {
			continue
		}
		if rs := r.recs[id]; rs == nil || len(rs.order) == 0 {
			return nil // nobody found it silent: it may be alive
		}
		last := map[string]Incarnation{}
		for j := range r.lives {
			x := &r.lives[j]
			if x.id.Region != m.id.Region && overlap(m, x) && x.id.Inc > last[x.id.Region].Inc {
				last[x.id.Region] = x.id
			}
		}
		for _, q := range last {
			if !r.complete(q) && !r.contributed(q, m.id) {
				return nil
			}
		}
	}
	// Someone must be paid: with every region's newest incarnation in the
	// cohort or reclaimed, what it frees would be held by nobody. It
	// completes once a region has started a new one (Start settles).
	paid := false
	for _, n := range r.names {
		if c := r.current(n); c != nil && !in[c.id] && !r.complete(c.id) {
			paid = true
			break
		}
	}
	if !paid {
		return nil
	}
	sort.Slice(s, func(a, b int) bool { return incLess(s[a], s[b]) })
	return s
}

func incLess(a, b Incarnation) bool {
	return a.Region < b.Region || a.Region == b.Region && a.Inc < b.Inc
}

// completeCohort frees what the members held and pays it out by weight
// (split: in whole tokens with a Quantum) to the newest unreclaimed
// incarnation of every region.
func (r *Registry) completeCohort(s []Incarnation) {
	in := map[Incarnation]bool{}
	for _, id := range s {
		in[id] = true
	}
	r.clock++
	var base int64
	keys := map[string]int64{}
	for _, id := range s {
		l := r.lifeOf(id)
		if l.end == 0 {
			l.end = r.clock
		}
		if id.Inc == 1 {
			base += r.initial[r.index(id.Region)]
		}
		if a := r.paid[id]; a != nil {
			base += a.base
			for k, v := range a.keys {
				keys[k] += v
			}
		}
		for k, v := range r.kept[id] {
			keys[k] += v
		}
		if rs := r.recs[id]; rs != nil {
			for _, from := range rs.order {
				if in[from] || r.complete(from) {
					continue // counted by nobody, or by from's own reclaim
				}
				kp := r.kept[from]
				if kp == nil {
					kp = map[string]int64{}
					r.kept[from] = kp
				}
				for _, q := range rs.contribs[from].Q {
					keys[q.Key] += q.Units
					kp[q.Key] -= q.Units
				}
			}
		}
	}
	var rcp []Incarnation
	var w []float64
	for i, n := range r.names {
		if c := r.current(n); c != nil && !in[c.id] && !r.complete(c.id) {
			rcp = append(rcp, c.id)
			w = append(w, r.weights[i])
		}
	}
	lead := Record{Of: s[0], Complete: true, Base: base, Recipients: rcp, Cohort: s}
	for k, v := range keys {
		if v != 0 {
			lead.Keys = append(lead.Keys, KeyUnits{k, v})
		}
	}
	sort.Slice(lead.Keys, func(a, b int) bool { return lead.Keys[a].Key < lead.Keys[b].Key })
	if len(rcp) > 0 {
		sh0 := r.split(base, w)
		for j, id := range rcp {
			a := r.paid[id]
			if a == nil {
				a = &account{keys: map[string]int64{}}
				r.paid[id] = a
			}
			a.base += sh0[j]
			a.seq++
		}
		for _, ku := range lead.Keys {
			sh := r.split(base+ku.Units, w)
			for j, id := range rcp {
				if d := sh[j] - sh0[j]; d != 0 {
					r.paid[id].keys[ku.Key] += d
				}
			}
		}
	}
	for j, id := range s {
		rec := Record{Of: id, Complete: true, Recipients: rcp, Cohort: s}
		if j == 0 {
			rec = lead
		}
		rs := r.recs[id]
		if rs == nil {
			rs = &recState{}
			r.recs[id] = rs
		}
		rs.complete, rs.rec, rs.contribs, rs.order = true, rec, nil, nil
		delete(r.paid, id)
		delete(r.kept, id)
	}
}

// prune forgets reclaimed incarnations below each region's first
// unreclaimed one, keeping every region's two newest.
func (r *Registry) prune() {
	for _, n := range r.names {
		for {
			var first *life
			newest := r.current(n)
			for j := range r.lives {
				if r.lives[j].id.Region == n {
					first = &r.lives[j]
					break
				}
			}
			// The record of the newest reclaim stays visible a little
			// longer: its region's last two incarnations are kept.
			if first == nil || first.id.Inc+1 >= newest.id.Inc || !r.complete(first.id) {
				break
			}
			id := first.id
			r.done[n] = id.Inc
			delete(r.recs, id)
			out := r.lives[:0]
			for _, l := range r.lives {
				if l.id != id {
					out = append(out, l)
				}
			}
			r.lives = out
		}
	}
	for id := range r.recs {
		if id.Inc <= r.done[id.Region] {
			delete(r.recs, id)
		}
	}
}

func (r *Registry) newestInc(region string) uint64 {
	if c := r.current(region); c != nil {
		return c.id.Inc
	}
	return r.done[region]
}

// Record returns the current record of of.
func (r *Registry) Record(of Incarnation) Record {
	if of.Inc <= r.done[of.Region] && of.Inc > 0 {
		return Record{Of: of, Complete: true}
	}
	var rec Record
	if s := r.recs[of]; s != nil && s.complete {
		rec = cloneRecord(s.rec)
	} else {
		rec = Record{Of: of}
		if s != nil {
			// A reclaim is under way: Required tells the others whose
			// contribution it waits for (and makes them watch its silence).
			if l := r.lifeOf(of); l != nil {
				rec.Required = r.required(l)
			}
			ids := append([]Incarnation(nil), s.order...)
			sort.Slice(ids, func(a, b int) bool { return incLess(ids[a], ids[b]) })
			for _, id := range ids {
				rec.Contributions = append(rec.Contributions, cloneContribution(s.contribs[id]))
			}
		}
	}
	if l := r.lifeOf(of); l != nil {
		rec.Closer = l.closer
	}
	if a := r.paid[of]; a != nil {
		p := &Payment{Seq: a.seq, Base: a.base}
		for k, v := range a.keys {
			if v != 0 {
				p.Keys = append(p.Keys, KeyUnits{k, v})
			}
		}
		sort.Slice(p.Keys, func(x, y int) bool { return p.Keys[x].Key < p.Keys[y].Key })
		rec.Paid = p
	}
	return rec
}
