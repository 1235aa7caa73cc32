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
}

// LifeState is one incarnation's open interval on the registry's clock
// (End 0: still open).
type LifeState struct {
	Region string `json:"region"`
	Inc    uint64 `json:"inc"`
	Start  uint64 `json:"start"`
	End    uint64 `json:"end,omitempty"`
}

// RecordState is the registry's state of the reclaim of one incarnation:
// the contributions in the order they arrived, and, once complete, the
// record as it was completed.
type RecordState struct {
	Of            Incarnation    `json:"of"`
	Contributions []Contribution `json:"contributions,omitempty"`
	Complete      bool           `json:"complete,omitempty"`
	Record        *Record        `json:"record,omitempty"`
}

// State returns the registry's state. It shares no memory with r.
func (r *Registry) State() RegistryState {
	st := RegistryState{Clock: r.clock}
	for _, l := range r.lives {
		st.Lives = append(st.Lives, LifeState{Region: l.id.Region, Inc: l.id.Inc, Start: l.start, End: l.end})
	}
	for _, of := range r.recordIDs() {
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
	return st
}

// RestoreRegistry returns the registry of cfg and regions in state st (as
// returned by State of a registry created with the same cfg and regions).
func RestoreRegistry(cfg Config, regions []RegionSpec, st RegistryState) (*Registry, error) {
	r, err := NewRegistry(cfg, regions)
	if err != nil {
		return nil, err
	}
	r.clock = st.Clock
	for _, l := range st.Lives {
		if r.index(l.Region) < 0 || l.Inc == 0 || l.Start == 0 || l.Start > st.Clock || l.End > st.Clock || l.End != 0 && l.End < l.Start {
			return nil, fmt.Errorf("%w: registry life %s/%d", ErrConfig, l.Region, l.Inc)
		}
		r.lives = append(r.lives, life{id: Incarnation{l.Region, l.Inc}, start: l.Start, end: l.End})
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
	return r, nil
}

// Records returns the current record of every incarnation the registry has
// a reclaim entry for (complete or not), sorted by region and incarnation.
// An agent feeds them to its ledger with ReclaimRecorded.
func (r *Registry) Records() []Record {
	var out []Record
	for _, of := range r.recordIDs() {
		out = append(out, r.Record(of))
	}
	return out
}

func (r *Registry) recordIDs() []Incarnation {
	ids := make([]Incarnation, 0, len(r.recs))
	for id := range r.recs {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(a, b int) bool {
		return ids[a].Region < ids[b].Region || ids[a].Region == ids[b].Region && ids[a].Inc < ids[b].Inc
	})
	return ids
}

func cloneContribution(c Contribution) Contribution {
	c.Q = append([]KeyUnits(nil), c.Q...)
	return c
}

func cloneRecord(rec Record) Record {
	rec.Own = append([]KeyUnits(nil), rec.Own...)
	rec.Recipients = append([]Incarnation(nil), rec.Recipients...)
	rec.Required = append([]Incarnation(nil), rec.Required...)
	cs := rec.Contributions
	rec.Contributions = nil
	for _, c := range cs {
		rec.Contributions = append(rec.Contributions, cloneContribution(c))
	}
	return rec
}
