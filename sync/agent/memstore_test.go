package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/apportion/apportion/regional/redisstore"
)

// world is the lock every memStore of a test shares, so that a sample of
// all regions' enforced units is one instant.
type world struct {
	mu sync.Mutex
}

// memStore implements Store with the store contract of the ledger package
// doc (marker with lease on the store's clock, versioned per-key records,
// floor without a valid marker or for another incarnation's record).
type memStore struct {
	w       *world
	runID   string
	runs    int
	markers map[string]*memMarker
	recs    map[string]map[string]memRec
	down    bool
}

type memMarker struct {
	v       redisstore.Version
	units   int64
	expires time.Time
}

type memRec struct {
	v       redisstore.Version
	units   int64
	release bool
}

func newMemStore(w *world, name string) *memStore {
	s := &memStore{w: w}
	s.resetLocked(name)
	return s
}

func (s *memStore) resetLocked(name string) {
	s.runs++
	s.runID = fmt.Sprintf("%s-run-%d", name, s.runs)
	s.markers = map[string]*memMarker{}
	s.recs = map[string]map[string]memRec{}
}

func (s *memStore) WriteMarker(ctx context.Context, rule string, m redisstore.Marker) (redisstore.Version, error) {
	s.w.mu.Lock()
	defer s.w.mu.Unlock()
	if s.down {
		return redisstore.Version{}, fmt.Errorf("memstore: down")
	}
	mv := redisstore.Version{Inc: m.Inc, Seq: m.Seq}
	cur := s.markers[rule]
	switch {
	case m.Create && m.RunID == s.runID && (cur == nil || cur.v.Less(mv)):
		s.markers[rule] = &memMarker{v: mv, units: m.Units, expires: time.Now().Add(m.Lease)}
	case !m.Create && cur != nil && cur.v.Inc == m.Inc && cur.v.Less(mv):
		cur.v, cur.units, cur.expires = mv, m.Units, time.Now().Add(m.Lease)
	}
	if cur := s.markers[rule]; cur != nil {
		return cur.v, nil
	}
	return redisstore.Version{}, nil
}

func (s *memStore) WriteShares(ctx context.Context, rule string, recs []redisstore.ShareRecord) ([]redisstore.Version, error) {
	s.w.mu.Lock()
	defer s.w.mu.Unlock()
	if s.down {
		return nil, fmt.Errorf("memstore: down")
	}
	m := s.recs[rule]
	if m == nil {
		m = map[string]memRec{}
		s.recs[rule] = m
	}
	out := make([]redisstore.Version, len(recs))
	for i, r := range recs {
		rv := redisstore.Version{Inc: r.Inc, Seq: r.Seq}
		if cur, ok := m[r.Key]; !ok || cur.v.Less(rv) {
			m[r.Key] = memRec{v: rv, units: r.Units, release: r.Release}
		}
		out[i] = m[r.Key].v
	}
	return out, nil
}

func (s *memStore) RunID(ctx context.Context) (string, error) {
	s.w.mu.Lock()
	defer s.w.mu.Unlock()
	if s.down {
		return "", fmt.Errorf("memstore: down")
	}
	return s.runID, nil
}

// enforcedLocked is the units the store enforces for key now.
func (s *memStore) enforcedLocked(rule, key string, floor int64) int64 {
	mk := s.markers[rule]
	if mk == nil || !time.Now().Before(mk.expires) {
		return floor
	}
	if r, ok := s.recs[rule][key]; ok && r.v.Inc == mk.v.Inc {
		return r.units
	}
	if r, ok := s.recs[rule][key]; ok && r.v.Inc != mk.v.Inc {
		return floor
	}
	return mk.units
}
