package rules

import (
	"cmp"
	"fmt"
	"hash/maphash"
	"maps"
	"math/bits"
	"slices"
)

// Index finds the rules that match a request. It is immutable once built, so
// an enforcer swaps whole indexes atomically and a check never sees half a change.
//
// Rules are grouped by shape: the sorted set of their match keys, each marked
// exact or "*". For each shape the index hashes the rules' exact values; a
// lookup reads the request's value of every match key once, then does one
// hash lookup per shape. Its cost grows with the number of distinct shapes
// and keys, not with the number of rules. With more than manyKeys distinct
// keys (rules keyed on a tenant's own attribute names, say), a lookup reads
// only the shapes anchored at a key the request has instead: each shape is
// listed under its key that the fewest shapes have, so its cost grows with
// the request's attributes and the shapes they can match, not with every
// shape and key (5,000 rules each with its own attribute name cost 236 µs
// and 257 KB per lookup scanning them all, 0.21 µs and 8 B anchored:
// BenchmarkMatchManyKeys).
type Index struct {
	rules  []Rule // sorted by id; Match returns pointers into it
	byID   map[string]int32
	keys   []string // the distinct match keys of all rules
	shapes []shape
	seed   maphash.Seed
	// With more than manyKeys keys: the index of every key, the shapes
	// under each anchor key, and those with no key at all.
	keyIdx  map[string]int
	anchors map[int][]int
	bare    []int
}

// manyKeys is the number of distinct match keys above which Match reads the
// shapes anchored at the request's keys rather than every shape.
const manyKeys = 32

// shape is a group of rules with the same match keys and wildcards.
type shape struct {
	exact   []int // indexes into Index.keys, ascending
	any     []int // indexes into Index.keys that must be present
	buckets map[uint64][]entry
}

type entry struct {
	rule int32    // index into Index.rules
	vals []string // the exact values, aligned with shape.exact
}

// NewIndex builds an index over rs. It works on normalized copies of the
// rules, so later changes to rs do not affect it, and refuses an invalid rule
// or a duplicate id.
func NewIndex(rs []Rule) (*Index, error) {
	ix := &Index{
		rules: make([]Rule, len(rs)),
		byID:  make(map[string]int32, len(rs)),
		seed:  maphash.MakeSeed(),
	}
	for i := range rs {
		r := rs[i].Clone()
		r.Normalize()
		if err := r.Validate(); err != nil {
			return nil, err
		}
		ix.rules[i] = r
	}
	slices.SortFunc(ix.rules, func(a, b Rule) int { return cmp.Compare(a.ID, b.ID) })
	keyIdx := map[string]int{}
	shapeIdx := map[string]int{}
	for i := range ix.rules {
		r := &ix.rules[i]
		if i > 0 && ix.rules[i-1].ID == r.ID {
			return nil, &FieldError{RuleID: r.ID, Field: "id", Msg: "duplicate id"}
		}
		ix.byID[r.ID] = int32(i)

		var sh shape
		for _, k := range slices.Sorted(maps.Keys(r.Match)) {
			ki, ok := keyIdx[k]
			if !ok {
				ki = len(ix.keys)
				keyIdx[k] = ki
				ix.keys = append(ix.keys, k)
			}
			if r.Match[k] == MatchAny {
				sh.any = append(sh.any, ki)
			} else {
				sh.exact = append(sh.exact, ki)
			}
		}
		sig := fmt.Sprint(sh.exact, sh.any)
		si, ok := shapeIdx[sig]
		if !ok {
			si = len(ix.shapes)
			shapeIdx[sig] = si
			sh.buckets = map[uint64][]entry{}
			ix.shapes = append(ix.shapes, sh)
		}
		s := &ix.shapes[si]
		e := entry{rule: int32(i), vals: make([]string, len(s.exact))}
		for j, ki := range s.exact {
			e.vals[j] = r.Match[ix.keys[ki]]
		}
		h := ix.hash(e.vals)
		s.buckets[h] = append(s.buckets[h], e)
	}
	if len(ix.keys) > manyKeys {
		ix.anchor(keyIdx)
	}
	return ix, nil
}

// anchor lists every shape under the key of its that the fewest shapes
// have (the lowest index on a tie), or in bare if it has none.
func (ix *Index) anchor(keyIdx map[string]int) {
	ix.keyIdx, ix.anchors = keyIdx, map[int][]int{}
	count := make([]int, len(ix.keys))
	for _, s := range ix.shapes {
		for _, ki := range s.exact {
			count[ki]++
		}
		for _, ki := range s.any {
			count[ki]++
		}
	}
	for si, s := range ix.shapes {
		best := -1
		for _, ki := range append(slices.Clip(s.exact), s.any...) {
			if best < 0 || count[ki] < count[best] || count[ki] == count[best] && ki < best {
				best = ki
			}
		}
		if best < 0 {
			ix.bare = append(ix.bare, si)
		} else {
			ix.anchors[best] = append(ix.anchors[best], si)
		}
	}
}

func (ix *Index) hash(vals []string) uint64 {
	h := uint64(len(vals))
	for _, v := range vals {
		h = bits.RotateLeft64((h^maphash.String(ix.seed, v))*0x9e3779b97f4a7c15, 31)
	}
	return h
}

// Match returns the rules matching the request, in id order. A rule matches
// when every entry of its match does: the key "resource" is compared with
// resource, any other key with attrs; "*" needs the value to be present (for
// resource: not empty). The returned rules belong to the index: read them,
// never modify them. Match is safe for concurrent use, and a nil *Index
// matches nothing.
func (ix *Index) Match(resource string, attrs map[string]string) []*Rule {
	if ix == nil || len(ix.shapes) == 0 {
		return nil
	}
	if ix.keyIdx != nil {
		return ix.matchAnchored(resource, attrs)
	}
	var valBuf [16]string
	var presBuf [16]bool
	vals, present := valBuf[:0], presBuf[:0]
	for _, k := range ix.keys {
		var v string
		var ok bool
		if k == PartResource {
			v, ok = resource, resource != ""
		} else {
			v, ok = attrs[k]
		}
		vals = append(vals, v)
		present = append(present, ok)
	}

	var hitBuf [8]int32
	hits := hitBuf[:0]
	var reqBuf [16]string
shapes:
	for si := range ix.shapes {
		s := &ix.shapes[si]
		for _, ki := range s.any {
			if !present[ki] {
				continue shapes
			}
		}
		req := reqBuf[:0]
		for _, ki := range s.exact {
			if !present[ki] {
				continue shapes
			}
			req = append(req, vals[ki])
		}
		hits = ix.bucketHits(hits, s, req)
	}
	return ix.hitRules(hits)
}

// hitRules returns the rules of hits (indexes into rules), in id order.
func (ix *Index) hitRules(hits []int32) []*Rule {
	if len(hits) == 0 {
		return nil
	}
	slices.Sort(hits)
	out := make([]*Rule, len(hits))
	for i, ri := range hits {
		out[i] = &ix.rules[ri]
	}
	return out
}

// bucketHits appends to hits the rules of shape s whose exact values are
// req.
func (ix *Index) bucketHits(hits []int32, s *shape, req []string) []int32 {
entries:
	for _, e := range s.buckets[ix.hash(req)] {
		for j, v := range e.vals {
			if req[j] != v {
				continue entries
			}
		}
		hits = append(hits, e.rule)
	}
	return hits
}

// matchAnchored is Match for an index of many keys: it reads the shapes
// with no key and those anchored at the request's resource and attribute
// names (each shape is under one anchor: read once), and each shape's keys
// from the request directly.
func (ix *Index) matchAnchored(resource string, attrs map[string]string) []*Rule {
	var hitBuf [8]int32
	hits := hitBuf[:0]
	hits = ix.matchShapes(hits, ix.bare, resource, attrs)
	if resource != "" {
		if ki, ok := ix.keyIdx[PartResource]; ok {
			hits = ix.matchShapes(hits, ix.anchors[ki], resource, attrs)
		}
	}
	for k := range attrs {
		if k == PartResource {
			continue // the resource is read from resource, above
		}
		if ki, ok := ix.keyIdx[k]; ok {
			hits = ix.matchShapes(hits, ix.anchors[ki], resource, attrs)
		}
	}
	return ix.hitRules(hits)
}

// matchShapes appends to hits the rules of the shapes sis that the request
// matches.
func (ix *Index) matchShapes(hits []int32, sis []int, resource string, attrs map[string]string) []int32 {
	value := func(ki int) (string, bool) {
		if k := ix.keys[ki]; k != PartResource {
			v, ok := attrs[k]
			return v, ok
		}
		return resource, resource != ""
	}
	var reqBuf [16]string
shapes:
	for _, si := range sis {
		s := &ix.shapes[si]
		for _, ki := range s.any {
			if _, ok := value(ki); !ok {
				continue shapes
			}
		}
		req := reqBuf[:0]
		for _, ki := range s.exact {
			v, ok := value(ki)
			if !ok {
				continue shapes
			}
			req = append(req, v)
		}
		hits = ix.bucketHits(hits, s, req)
	}
	return hits
}

// Get returns the rule with the given id. The rule belongs to the index:
// never modify it.
func (ix *Index) Get(id string) (*Rule, bool) {
	if ix == nil {
		return nil, false
	}
	i, ok := ix.byID[id]
	if !ok {
		return nil, false
	}
	return &ix.rules[i], true
}

// Rules returns deep copies of all rules, in id order.
func (ix *Index) Rules() []Rule {
	if ix == nil {
		return nil
	}
	out := make([]Rule, len(ix.rules))
	for i := range ix.rules {
		out[i] = ix.rules[i].Clone()
	}
	return out
}

// Len is the number of rules.
func (ix *Index) Len() int {
	if ix == nil {
		return 0
	}
	return len(ix.rules)
}
