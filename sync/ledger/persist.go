package ledger

import (
	"fmt"
	"sort"
)

// RegistryState is the complete state of a Registry in exported, JSON-ready
// form, so the agent can keep the registry in etcd: State then
// RestoreRegistry gives a registry that behaves exactly like the original.
type RegistryState struct {
	Clock   uint64        `json:"clock"`
	Lives   []LifeState   `json:"lives,omitempty"`
	Records []RecordState `json:"records,omitempty"`
	// Paid and Kept are per unreclaimed incarnation: what reclaims paid it,
	// and what it keeps of its pairs with reclaimed incarnations.
	Paid []AccountState `json:"paid,omitempty"`
	Kept []AccountState `json:"kept,omitempty"`
	// Done is, per region, the incarnation up to which all are reclaimed
	// and forgotten.
	Done []Incarnation `json:"done,omitempty"`
}

// LifeState is one incarnation's open interval on the registry's clock
// (End 0: still open), whether it is closed, and whether it closed its
// predecessors.
type LifeState struct {
	Region string `json:"region"`
	Inc    uint64 `json:"inc"`
	Start  uint64 `json:"start"`
	End    uint64 `json:"end,omitempty"`
	Closed bool   `json:"closed,omitempty"`
	Closer bool   `json:"closer,omitempty"`
}

// RecordState is the registry's state of the reclaim of one incarnation:
// the contributions in the order they arrived, or, once complete, the
// record as it was completed.
type RecordState struct {
	Of            Incarnation    `json:"of"`
	Contributions []Contribution `json:"contributions,omitempty"`
	Complete      bool           `json:"complete,omitempty"`
	Record        *Record        `json:"record,omitempty"`
}

// AccountState is a per-incarnation amount: Base on every key plus Keys.
type AccountState struct {
	Of   Incarnation `json:"of"`
	Seq  uint64      `json:"seq,omitempty"`
	Base int64       `json:"base,omitempty"`
	Keys []KeyUnits  `json:"keys,omitempty"`
}

// State returns the registry's state. It shares no memory with r.
func (r *Registry) State() RegistryState {
	st := RegistryState{Clock: r.clock}
	for _, l := range r.lives {
		st.Lives = append(st.Lives, LifeState{Region: l.id.Region, Inc: l.id.Inc, Start: l.start, End: l.end, Closed: l.closed, Closer: l.closer})
	}
	for _, of := range sortedIDs(r.recs) {
		s := r.recs[of]
		rs := RecordState{Of: of, Complete: s.complete}
		for _, id := range s.order {
			rs.Contributions = append(rs.Contributions, cloneContribution(s.contribs[id]))
		}
		if s.complete {
			rec := cloneRecord(s.rec)
			rs.Record = &rec
		}
		st.Records = append(st.Records, rs)
	}
	for _, of := range sortedIDs(r.paid) {
		a := r.paid[of]
		st.Paid = append(st.Paid, AccountState{Of: of, Seq: a.seq, Base: a.base, Keys: sortedUnits(a.keys)})
	}
	for _, of := range sortedIDs(r.kept) {
		st.Kept = append(st.Kept, AccountState{Of: of, Keys: sortedUnits(r.kept[of])})
	}
	for _, n := range r.names {
		if d := r.done[n]; d > 0 {
			st.Done = append(st.Done, Incarnation{n, d})
		}
	}
	return st
}

func sortedIDs[V any](m map[Incarnation]V) []Incarnation {
	ids := make([]Incarnation, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(a, b int) bool { return incLess(ids[a], ids[b]) })
	return ids
}

func sortedUnits(m map[string]int64) []KeyUnits {
	var out []KeyUnits
	for k, v := range m {
		if v != 0 {
			out = append(out, KeyUnits{k, v})
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Key < out[b].Key })
	return out
}

// RestoreRegistry returns the registry of cfg and regions in state st (as
// returned by State of a registry created with the same cfg and regions).
func RestoreRegistry(cfg Config, regions []RegionSpec, st RegistryState) (*Registry, error) {
	r, err := NewRegistry(cfg, regions)
	if err != nil {
		return nil, err
	}
	r.clock = st.Clock
	for _, d := range st.Done {
		if r.index(d.Region) < 0 || r.done[d.Region] != 0 {
			return nil, fmt.Errorf("%w: registry watermark %v", ErrConfig, d)
		}
		r.done[d.Region] = d.Inc
	}
	for _, l := range st.Lives {
		if r.index(l.Region) < 0 || l.Inc <= r.done[l.Region] || l.Start == 0 || l.Start > st.Clock || l.End > st.Clock || l.End != 0 && l.End < l.Start {
			return nil, fmt.Errorf("%w: registry life %s/%d", ErrConfig, l.Region, l.Inc)
		}
		r.lives = append(r.lives, life{id: Incarnation{l.Region, l.Inc}, start: l.Start, end: l.End, closed: l.Closed, closer: l.Closer})
	}
	for _, rs := range st.Records {
		if r.index(rs.Of.Region) < 0 || r.recs[rs.Of] != nil || rs.Complete != (rs.Record != nil) {
			return nil, fmt.Errorf("%w: registry record of %v", ErrConfig, rs.Of)
		}
		s := &recState{contribs: map[Incarnation]Contribution{}, complete: rs.Complete}
		for _, c := range rs.Contributions {
			if c.Of != rs.Of || r.index(c.From.Region) < 0 {
				return nil, fmt.Errorf("%w: registry contribution %v to %v", ErrConfig, c.From, rs.Of)
			}
			if _, dup := s.contribs[c.From]; dup {
				return nil, fmt.Errorf("%w: duplicate registry contribution %v to %v", ErrConfig, c.From, rs.Of)
			}
			s.contribs[c.From] = cloneContribution(c)
			s.order = append(s.order, c.From)
		}
		if rs.Record != nil {
			s.rec = cloneRecord(*rs.Record)
		}
		r.recs[rs.Of] = s
	}
	for _, a := range st.Paid {
		if r.index(a.Of.Region) < 0 || r.paid[a.Of] != nil {
			return nil, fmt.Errorf("%w: registry payment to %v", ErrConfig, a.Of)
		}
		acc := &account{seq: a.Seq, base: a.Base, keys: map[string]int64{}}
		for _, k := range a.Keys {
			acc.keys[k.Key] += k.Units
		}
		r.paid[a.Of] = acc
	}
	for _, a := range st.Kept {
		if r.index(a.Of.Region) < 0 || r.kept[a.Of] != nil {
			return nil, fmt.Errorf("%w: registry kept units of %v", ErrConfig, a.Of)
		}
		m := map[string]int64{}
		for _, k := range a.Keys {
			m[k.Key] += k.Units
		}
		r.kept[a.Of] = m
	}
	return r, nil
}

// Records returns the current record of every incarnation the registry has
// something to say about (a reclaim entry, a payment, or being its region's
// newest), sorted by region and incarnation. An agent feeds them to its
// ledger with ReclaimRecorded.
func (r *Registry) Records() []Record {
	ids := map[Incarnation]bool{}
	for id := range r.recs {
		ids[id] = true
	}
	for id := range r.paid {
		ids[id] = true
	}
	for _, n := range r.names {
		if c := r.current(n); c != nil {
			ids[c.id] = true
		}
	}
	var out []Record
	for _, of := range sortedIDs(ids) {
		out = append(out, r.Record(of))
	}
	return out
}

func cloneContribution(c Contribution) Contribution {
	c.Q = append([]KeyUnits(nil), c.Q...)
	return c
}

func cloneRecord(rec Record) Record {
	rec.Keys = append([]KeyUnits(nil), rec.Keys...)
	rec.Cohort = append([]Incarnation(nil), rec.Cohort...)
	rec.Recipients = append([]Incarnation(nil), rec.Recipients...)
	rec.Required = append([]Incarnation(nil), rec.Required...)
	cs := rec.Contributions
	rec.Contributions = nil
	for _, c := range cs {
		rec.Contributions = append(rec.Contributions, cloneContribution(c))
	}
	if rec.Paid != nil {
		p := *rec.Paid
		p.Keys = append([]KeyUnits(nil), p.Keys...)
		rec.Paid = &p
	}
	return rec
}
