package usage

import (
	"cmp"
	"hash/maphash"
	"slices"
	"sync"
	"sync/atomic"
)

// Delta is the usage of one bucket since the last flush.
type Delta struct {
	Rule, Key          string
	Admitted, Rejected int64
}

// DefaultMaxKeys is the key bound NewRecorder uses when given maxKeys <= 0.
const DefaultMaxKeys = 100_000

// numShards spreads Add over this many independent mutexes. A power of two.
const numShards = 64

// Recorder aggregates usage deltas in memory between two drains. Add is
// safe for concurrent use on the request path; Drain is meant for the single
// flushing goroutine (it is safe to call concurrently, each addition is then
// returned by exactly one Drain).
type Recorder struct {
	seed    maphash.Seed
	maxKeys int64
	nkeys   atomic.Int64  // distinct keys held across all shards
	dropped atomic.Uint64 // additions refused because of maxKeys
	shards  [numShards]shard
}

type bucket struct{ rule, key string }

type counts struct{ admitted, rejected int64 }

// shard maps a bucket to an index in c. Both keep their capacity across
// drains, so a steady key set costs no allocation in Add.
type shard struct {
	mu   sync.Mutex
	idx  map[bucket]int32 // guarded by mu
	keys []bucket         // guarded by mu; keys[i] is the bucket of c[i]
	c    []counts         // guarded by mu
	// added is set by an Add that the shard holds, cleared by Drain and
	// takeAdded; guarded by mu.
	added bool
	_     [64]byte // keep neighbouring shards' mutexes off one cache line
}

// NewRecorder returns a Recorder that holds at most maxKeys distinct
// (rule, key) pairs between two drains (DefaultMaxKeys if maxKeys <= 0).
func NewRecorder(maxKeys int) *Recorder {
	if maxKeys <= 0 {
		maxKeys = DefaultMaxKeys
	}
	r := &Recorder{seed: maphash.MakeSeed(), maxKeys: int64(maxKeys)}
	for i := range r.shards {
		r.shards[i].idx = make(map[bucket]int32)
	}
	return r
}

// Add records admitted and rejected cost for the bucket key of a global rule.
// It never blocks on I/O. Negative values are treated as 0 (costs are never
// negative); a call with nothing to add is a no-op. If the bucket is new and
// the Recorder already holds maxKeys buckets, the addition is dropped and
// counted in Dropped. Add keeps references to rule and key until the next
// Drain, so they must not be mutated afterwards (ordinary Go strings never
// are).
func (r *Recorder) Add(rule, key string, admitted, rejected int64) {
	admitted, rejected = max(admitted, 0), max(rejected, 0)
	if admitted == 0 && rejected == 0 {
		return
	}
	s := &r.shards[maphash.String(r.seed, key)&(numShards-1)]
	b := bucket{rule, key}
	s.mu.Lock()
	if i, ok := s.idx[b]; ok {
		c := &s.c[i]
		c.admitted += admitted
		c.rejected += rejected
		s.added = true
		s.mu.Unlock()
		return
	}
	if r.nkeys.Add(1) > r.maxKeys {
		r.nkeys.Add(-1)
		s.mu.Unlock()
		r.dropped.Add(1)
		return
	}
	s.idx[b] = int32(len(s.c))
	s.keys = append(s.keys, b)
	s.c = append(s.c, counts{admitted, rejected})
	s.added = true
	s.mu.Unlock()
}

// Drain returns the deltas recorded since the previous Drain, sorted by rule
// then key, and resets the Recorder. It returns nil if nothing was recorded.
func (r *Recorder) Drain() []Delta {
	n := r.nkeys.Load()
	if n == 0 {
		return nil
	}
	out := make([]Delta, 0, n)
	for i := range r.shards {
		s := &r.shards[i]
		s.mu.Lock()
		for j, b := range s.keys {
			out = append(out, Delta{Rule: b.rule, Key: b.key, Admitted: s.c[j].admitted, Rejected: s.c[j].rejected})
		}
		taken := len(s.keys)
		clear(s.idx) // keeps the map's buckets for the next interval
		clear(s.keys)
		s.keys = s.keys[:0]
		s.c = s.c[:0]
		s.added = false
		r.nkeys.Add(-int64(taken))
		s.mu.Unlock()
	}
	if len(out) == 0 {
		return nil
	}
	slices.SortFunc(out, func(a, b Delta) int {
		if c := cmp.Compare(a.Rule, b.Rule); c != 0 {
			return c
		}
		return cmp.Compare(a.Key, b.Key)
	})
	return out
}

// held returns how many distinct keys the Recorder holds until the next Drain.
func (r *Recorder) held() int64 { return r.nkeys.Load() }

// takeAdded reports whether anything was added (and held) since the
// previous Drain or takeAdded: whether a flush now would send deltas that
// no earlier flush would have. Meant for the flushing goroutine.
func (r *Recorder) takeAdded() bool {
	added := false
	for i := range r.shards {
		s := &r.shards[i]
		s.mu.Lock()
		added = added || s.added
		s.added = false
		s.mu.Unlock()
	}
	return added
}

// Dropped returns how many additions were dropped since the Recorder was
// created because their bucket did not fit in maxKeys. A key that does not
// fit is counted once per Add call. The count only grows.
func (r *Recorder) Dropped() uint64 { return r.dropped.Load() }
