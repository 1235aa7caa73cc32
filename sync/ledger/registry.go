package ledger

import (
	"fmt"
	"sort"
)

// Registry is the reclaim registry: the state the agents keep in etcd (one
// document, every change a compare-and-swap on its revision) so that all
// survivors agree on who is reclaimed and for how much. It allocates
// incarnations and collects contributions. It is pure and deterministic;
// the wire encoding for etcd is left to the agent.
//
// An incarnation is open from its start until the next start of its region or
// the completion of its reclaim, whichever comes first. The reclaim of X
// completes when every incarnation of another region whose open interval
// overlaps X's has contributed. Contributions from an incarnation whose own
// reclaim is complete are refused, so a record's Own is final.
type Registry struct {
	names   []string
	weights []float64
	initial []int64
	clock   uint64
	lives   []life
	recs    map[Incarnation]*recState
}

type life struct {
	id         Incarnation
	start, end uint64 // end 0: open
}

type recState struct {
	contribs map[Incarnation]Contribution
	order    []Incarnation
	complete bool
	rec      Record
}

// NewRegistry returns an empty registry for the regions.
func NewRegistry(cfg Config, regions []RegionSpec) (*Registry, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := &Registry{recs: map[Incarnation]*recState{}}
	for _, x := range regions {
		r.names = append(r.names, x.Name)
		r.weights = append(r.weights, x.Weight)
	}
	_, r.initial = Split(cfg, regions)
	return r, nil
}

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
	var inc uint64 = 1
	if c := r.current(region); c != nil {
		inc = c.id.Inc + 1
		if c.end == 0 {
			c.end = r.clock
		}
	}
	r.lives = append(r.lives, life{id: Incarnation{region, inc}, start: r.clock})
	st := Start{Inc: inc}
	for _, n := range r.names {
		if n == region {
			continue
		}
		k := Incarnation{n, 1}
		if c := r.current(n); c != nil {
			k.Inc = c.id.Inc
			if s := r.recs[c.id]; s != nil && s.complete {
				k.Inc++
			}
		}
		st.Known = append(st.Known, k)
	}
	return st, nil
}

func (r *Registry) required(of *life) []Incarnation {
	var out []Incarnation
	for _, x := range r.lives {
		if x.id.Region == of.id.Region || r.complete(x.id) {
			continue
		}
		if (of.end == 0 || x.start < of.end) && (x.end == 0 || x.end > of.start) {
			out = append(out, x.id)
		}
	}
	return out
}

func (r *Registry) complete(id Incarnation) bool {
	s := r.recs[id]
	return s != nil && s.complete
}

// Contribute records c (the first contribution of each contributor stands)
// and returns the record of c.Of, complete once every required contribution is in.
func (r *Registry) Contribute(c Contribution) (Record, error) {
	if r.index(c.Of.Region) < 0 || r.index(c.From.Region) < 0 || c.Of.Region == c.From.Region {
		return Record{}, fmt.Errorf("%w: contribution %v from %v", ErrUnknownRegion, c.Of, c.From)
	}
	if s := r.recs[c.From]; s != nil && s.complete {
		return Record{}, fmt.Errorf("%w: %v is reclaimed", ErrFrozenIncarnation, c.From)
	}
	s := r.recs[c.Of]
	if s == nil {
		s = &recState{contribs: map[Incarnation]Contribution{}}
		r.recs[c.Of] = s
	}
	if _, ok := s.contribs[c.From]; !ok && !s.complete {
		s.contribs[c.From] = c
		s.order = append(s.order, c.From)
	}
	r.tryComplete(c.Of, s)
	return r.Record(c.Of), nil
}

func (r *Registry) tryComplete(of Incarnation, s *recState) {
	if s.complete {
		return
	}
	l := r.lifeOf(of)
	if l == nil {
		return
	}
	req := r.required(l)
	for _, q := range req {
		if _, ok := s.contribs[q]; !ok {
			return
		}
	}
	r.clock++
	if l.end == 0 {
		l.end = r.clock
	}
	s.complete = true
	rec := Record{Of: of, Complete: true, Required: req}
	if of.Inc == 1 {
		rec.Base = r.initial[r.index(of.Region)]
	}
	// Each pair (of, X) is counted once: if X's reclaim is already complete it
	// took the pair's in-flight units and X's holding, and only of's own
	// holding (the negated Q of of's contribution to X) is left; otherwise X's
	// contribution Q is of's holding plus the in-flight units.
	own := map[string]int64{}
	for id, o := range r.recs {
		if !o.complete {
			continue
		}
		if c, ok := o.contribs[of]; ok && id.Region != of.Region {
			for _, q := range c.Q {
				own[q.Key] -= q.Units
			}
		}
	}
	for id := range s.contribs {
		if r.complete(id) {
			delete(s.contribs, id)
		}
	}
	n := 0
	for _, id := range s.order {
		if _, ok := s.contribs[id]; ok {
			s.order[n] = id
			n++
		}
	}
	s.order = s.order[:n]
	for k, v := range own {
		if v != 0 {
			rec.Own = append(rec.Own, KeyUnits{k, v})
		}
	}
	sort.Slice(rec.Own, func(a, b int) bool { return rec.Own[a].Key < rec.Own[b].Key })
	latest := map[string]Incarnation{}
	for _, q := range req {
		if q.Inc >= latest[q.Region].Inc {
			latest[q.Region] = q
		}
	}
	for _, n := range r.names {
		if q, ok := latest[n]; ok {
			rec.Recipients = append(rec.Recipients, q)
		}
	}
	s.rec = rec
}

// Record returns the current record of the reclaim of of.
func (r *Registry) Record(of Incarnation) Record {
	s := r.recs[of]
	if s == nil {
		return Record{Of: of}
	}
	var rec Record
	if s.complete {
		rec = s.rec
	} else {
		rec = Record{Of: of}
		if l := r.lifeOf(of); l != nil {
			rec.Required = r.required(l)
		}
	}
	rec.Contributions = nil
	ids := append([]Incarnation(nil), s.order...)
	sort.Slice(ids, func(a, b int) bool {
		return ids[a].Region < ids[b].Region || ids[a].Region == ids[b].Region && ids[a].Inc < ids[b].Inc
	})
	for _, id := range ids {
		rec.Contributions = append(rec.Contributions, s.contribs[id])
	}
	return rec
}
