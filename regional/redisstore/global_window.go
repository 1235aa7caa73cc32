package redisstore

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/apportion/apportion/rules"
)

// Global windows (see the package doc, "Global windows"): a fixed_window or
// sliding_window Bucket with Global set enforces the share floor(L*u/U) of
// the GLOBAL limit L per window, u chosen exactly as for a global token
// bucket (marker, record, floor). A share record of a window key is
// refused, and the key keeps the version it held, when the key has already
// used more of the current window than the record would allow: a region can
// give away only what it has not used.

// Script codes of the global windows (3 more arguments, as code 6).
const (
	algGlobalFixedWindow   = 7
	algGlobalSlidingWindow = 8
)

// globalCode is the script code of a global bucket of algorithm code alg.
func globalCode(alg int64) int64 {
	switch alg {
	case algFixedWindow:
		return algGlobalFixedWindow
	case algSlidingWindow:
		return algGlobalSlidingWindow
	}
	return algGlobalTokenBucket
}

// GlobalAlgorithm reports whether the store coordinates a global bucket of
// algorithm a (token_bucket, fixed_window, sliding_window).
func GlobalAlgorithm(a rules.Algorithm) bool {
	return a == rules.TokenBucket || a == rules.FixedWindow || a == rules.SlidingWindow
}

// isWindow reports whether r is a record of a global window key.
func (r ShareRecord) isWindow() bool {
	return r.Algorithm == rules.FixedWindow || r.Algorithm == rules.SlidingWindow
}

// validateLimit checks the record's limit: the global capacity and rate of
// a token bucket, or the global limit and window of a window.
func (r ShareRecord) validateLimit(i int) error {
	switch r.Algorithm {
	case "", rules.TokenBucket:
		switch {
		case r.Capacity < 1 || r.Capacity > MaxCapacity:
			return fmt.Errorf("%w: records[%d].Capacity %d must be in [1, %d]", ErrInvalidShare, i, r.Capacity, MaxCapacity)
		case r.Rate < 1 || r.Rate > MaxRate:
			return fmt.Errorf("%w: records[%d].Rate %d must be in [1, %d]", ErrInvalidShare, i, r.Rate, MaxRate)
		}
		return nil
	case rules.FixedWindow, rules.SlidingWindow:
		w := r.Window.Milliseconds()
		switch {
		case w < 1 || time.Duration(w)*time.Millisecond != r.Window:
			return fmt.Errorf("%w: records[%d].Window %v must be a whole number of milliseconds, at least 1ms", ErrInvalidShare, i, r.Window)
		case r.Limit < 1 || r.Limit > MaxLimit || r.Limit > MaxLimitWindow/w:
			return fmt.Errorf("%w: records[%d].Limit %d must be in [1, 2^40] and Limit x Window(ms) at most 2^52", ErrInvalidShare, i, r.Limit)
		}
		return nil
	}
	return fmt.Errorf("%w: records[%d].Algorithm %q has no share records", ErrInvalidShare, i, r.Algorithm)
}

// sameAlgorithm refuses records of different algorithms in one call (a
// rule has one algorithm; the call runs one script).
func sameAlgorithm(recs []ShareRecord) error {
	for i := 1; i < len(recs); i++ {
		if recs[i].isWindow() != recs[0].isWindow() || recs[i].isWindow() && recs[i].Algorithm != recs[0].Algorithm {
			return fmt.Errorf("%w: records[%d].Algorithm %q differs from records[0]'s %q", ErrInvalidShare, i, recs[i].Algorithm, recs[0].Algorithm)
		}
	}
	return nil
}

// WindowApplied is the store's answer to one record of a global window.
type WindowApplied struct {
	Version Version // the version the key holds afterwards
	// A refused record (a lowering below what the key has used of its
	// window): Need is the fewest units the key can take now, Until the time
	// until its window ends (when its use resets, fixed, or starts to slide
	// out, sliding). Both zero when the record applied or was stale.
	Need  int64
	Until time.Duration
}

// WriteWindowShares is WriteShares for the records of a global window rule
// (Algorithm fixed_window or sliding_window), answering per record what the
// store holds and, for a record refused as below the key's use, how far it
// could lower the key now.
func (s *Store) WriteWindowShares(ctx context.Context, rule string, recs []ShareRecord) ([]WindowApplied, error) {
	if err := validateShares(rule, recs); err != nil || len(recs) == 0 {
		return nil, err
	}
	if !recs[0].isWindow() {
		return nil, fmt.Errorf("%w: records[0].Algorithm %q is not a window", ErrInvalidShare, recs[0].Algorithm)
	}
	now, err := s.nowArg()
	if err != nil {
		return nil, err
	}
	return writeRecords(ctx, s, s.winShares, rule, recs, parseWindowApplied, func(r ShareRecord, rel int) []any {
		return []any{r.Inc, r.Seq, r.Units, rel, algCode(r.Algorithm), r.Limit, r.Window.Milliseconds(), r.Total, r.Floor,
			r.TTL.Milliseconds(), now, s.slackMs, r.Hold.Milliseconds()}
	})
}

func parseWindowApplied(v any) (WindowApplied, error) {
	a, ok := v.([]any)
	if !ok || len(a) != 2 && len(a) != 4 {
		return WindowApplied{}, fmt.Errorf("%w: %T", ErrBadReply, v)
	}
	ver, err := parseVersion(a[:2])
	if err != nil || len(a) == 2 {
		return WindowApplied{Version: ver}, err
	}
	need, ok1 := a[2].(int64)
	until, ok2 := a[3].(int64)
	if !ok1 || !ok2 || need < 0 || until < 0 {
		return WindowApplied{}, fmt.Errorf("%w: %v", ErrBadReply, a)
	}
	return WindowApplied{Version: ver, Need: need, Until: time.Duration(until) * time.Millisecond}, nil
}

// versionsOf is the versions of a window rule's answers (WriteShares).
func versionsOf(as []WindowApplied, err error) ([]Version, error) {
	if err != nil {
		return nil, err
	}
	out := make([]Version, len(as))
	for i, a := range as {
		out[i] = a.Version
	}
	return out, nil
}

// windowPrelude holds the window state helpers. A window's state is its
// values (fixed: w, n; sliding: w, c, p), 6 bytes each, then, for a global
// window with a share record, the record's incarnation (3 bytes), sequence
// (5) and units*2+release (4): 12 or 24 bytes (fixed), 18 or 30 (sliding).
// A sliding window with a record whose counts are below 2^40 stores c and
// p in 5 bytes each instead: 28 bytes, which Redis keeps in its 48-byte
// class with the fixed window's 24, not the 64-byte one 30 bytes take.
const windowPrelude = `
local C40 = 1099511627776
local loadwin, savewin -- winHelpers
`

// winHelpers are the window helpers (see prelude).
const winHelpers = `
-- nothing for a missing key, else the n window values (w, n; or w, c, p),
-- for n = 2 a nil, then the share record's inc, seq, units*2+release if
-- the state holds one
loadwin = function(key, n)
  local s = redis.call('GET', key)
  if not s then return nil end
  local b = #s
  if n == 2 then
    if b == 12 then
      local w, c = unpackle('<I6I6', s)
      return w, c
    elseif b == 24 then
      local w, c, i, q, u = unpackle('<I6I6I3I5I4', s)
      return w, c, nil, i, q, u
    end
  elseif b == 18 then
    local w, c, p = unpackle('<I6I6I6', s)
    return w, c, p
  elseif b == 30 then
    return unpackle('<I6I6I6I3I5I4', s)
  elseif b == 28 then
    return unpackle('<I6I5I5I3I5I4', s)
  end
  return error('redisstore: bad state in ' .. key)
end
-- savewin writes w, x (fixed: n; sliding: c), y (sliding: p; fixed: nil)
-- and the record inc, seq, units*2+release if inc; ttl as savetb's
savewin = function(key, ttl, w, x, y, inc, seq, ru)
  local s
  if not y then
    if inc then s = packle('<I6I6I3I5I4', w, x, inc, seq, ru) else s = packle('<I6I6', w, x) end
  elseif not inc then s = packle('<I6I6I6', w, x, y)
  elseif x < C40 and y < C40 then s = packle('<I6I5I5I3I5I4', w, x, y, inc, seq, ru)
  else s = packle('<I6I6I6I3I5I4', w, x, y, inc, seq, ru) end
  if ttl > 0 then redis.call('SET', key, s, 'PX', ttl)
  elseif ttl == 0 then redis.call('SET', key, s, 'KEEPTTL')
  else redis.call('SET', key, s) end
end
`

// winSharesSrc writes one global window key's share record (WriteShares).
//
// KEYS[1]: the window key; KEYS[2]: the rule's marker key. ARGV: inc, seq,
// units, release (0/1), algorithm code (3 fixed, 2 sliding), global limit,
// window ms, total units, floor units, ttl ms (Release records), now ms or
// "" for TIME, slack ms, hold ms (any other record; 0: persistent).
// Reply: {inc, seq}, the record version the key holds afterwards; for a
// refused record also the fewest units the key can take now and the ms
// until its window ends: {inc, seq, need, until}.
//
// The record is refused (the key keeps its version; {0, 0} if it has no
// record) when the key's use of the current window exceeds the allowance of
// the record's units or of the units it would enforce now: fixed, n >
// allowance; sliding, c*W + p*(W-off) > allowance*W.
const winSharesSrc = prelude + windowPrelude + winHelpers + globalLocals + globalHelpers + `
local key = KEYS[1]
local inc, seq, units, rel = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local alg, L, W = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local UN, F = tonumber(ARGV[8]), tonumber(ARGV[9])
local ttl = tonumber(ARGV[10])
local now = ARGV[11]` + clockLua + `
local slack = tonumber(ARGV[12])
local hold = tonumber(ARGV[13])
local n = 2
if alg == 2 then n = 3 end
local hw, hc, hp, hinc, hseq = loadwin(key, n)
local held = {0, 0}
if hinc then
  held = {hinc, hseq}
  if inc < hinc or (inc == hinc and seq < hseq) then return held end
end
local u = enforced(loadmarker(KEYS[2]) or false, now, UN, F, inc, units)
if units < u then u = units end
local A = shareOf(L, u, UN)
local wi = idiv(now, W)
local w, c, pc, used, off = wi, 0, nil, 0, 0
-- a window after the current one (a clock stepped back): its counts go
-- on in the current window, as the check script reads them
if n == 2 then
  if hw and hw >= wi then c = hc end
  off = now - w * W
  used = c * W
else
  pc = 0
  if hw then
    c, pc = hc, hp
    if wi == hw + 1 then pc = c; c = 0 elseif wi > hw + 1 then pc = 0; c = 0 end
  end
  off = now - w * W
  used = c * W + pc * (W - off)
end
if used > A * W then
  -- refused: also the fewest units whose allowance covers the use (the
  -- least whole requests above used/W), and the ms until the window ends
  local nreq = cdiv(used, W)
  local need = math.floor(nreq / L * UN)
  if need > UN then need = UN end
  while need < UN and shareOf(L, need, UN) < nreq do need = need + 1 end
  while need > 0 and shareOf(L, need - 1, UN) >= nreq do need = need - 1 end
  return {held[1], held[2], need, W - off}
end
if rel == 0 then ttl = hold end
if rel == 1 or hold > 0 then
  local want = (n - 1) * W - off + slack
  if ttl > want then want = ttl end
  if want < 1000 then want = 1000 end
  savewin(key, want, w, c, pc, inc, seq, units * 2 + rel)
else
  savewin(key, -1, w, c, pc, inc, seq, units * 2 + rel)
end
return {inc, seq}
`

// winFields names a window's state values in order, by algorithm code.
var winFields = map[int64][]string{
	algFixedWindow:   {"w", "n", "i", "s", "u"},
	algSlidingWindow: {"w", "c", "p", "i", "s", "u"},
}

// windowShare is the global window's allowance for bucket b at nowMs (its
// GLOBAL limit's share) and the key's share record, if any.
func (m *Model) windowShare(k *modelKey, b Bucket, nowMs int64) (int64, []int64) {
	g := b.Global
	mk, okm := m.markers[MarkerKey(g.Rule)]
	if ri, ok := m.field(k, "i"); ok {
		rec := []int64{ri, k.h["s"], k.h["u"]}
		return shareOf(b.Limit, m.enforced(mk, okm, nowMs, g.Units, g.Floor, true, ri, rec[2]/2), g.Units), rec
	}
	return shareOf(b.Limit, m.enforced(mk, okm, nowMs, g.Units, g.Floor, false, 0, 0), g.Units), nil
}

// setWin replaces a window's whole state with vals and rec (nil: none).
// ttl > 0 sets the key to expire ttl ms from nowMs, 0 keeps its TTL, -1
// makes it persistent.
func (m *Model) setWin(nowMs int64, key string, alg int64, vals, rec []int64, ttl int64) {
	k := m.get(nowMs, key)
	if k == nil {
		k = &modelKey{}
		m.keys[key] = k
	}
	k.h = map[string]int64{}
	for i, x := range append(append([]int64(nil), vals...), rec...) {
		k.h[winFields[alg][i]] = x
	}
	switch {
	case ttl > 0:
		k.expireAt = nowMs + ttl
	case ttl < 0:
		k.expireAt = 0
	}
}

// WriteWindowShares applies a global window rule's records at nowMs exactly
// as Store.WriteWindowShares does.
func (m *Model) WriteWindowShares(nowMs int64, rule string, recs []ShareRecord) ([]WindowApplied, error) {
	if err := validateShares(rule, recs); err != nil || len(recs) == 0 {
		return nil, err
	}
	if !recs[0].isWindow() {
		return nil, fmt.Errorf("%w: records[0].Algorithm %q is not a window", ErrInvalidShare, recs[0].Algorithm)
	}
	mk, okm := m.markers[MarkerKey(rule)]
	out := make([]WindowApplied, len(recs))
	for i, r := range recs {
		inc, seq := int64(r.Inc), int64(r.Seq)
		alg := algCode(r.Algorithm)
		k := m.get(nowMs, r.Key)
		var held Version
		if si, ok := m.field(k, "i"); ok {
			ss := k.h["s"]
			held = Version{uint64(si), uint64(ss)}
			if inc < si || inc == si && seq < ss {
				out[i].Version = held
				continue
			}
		}
		u := min(m.enforced(mk, okm, nowMs, r.Total, r.Floor, true, inc, r.Units), r.Units)
		allow := shareOf(r.Limit, u, r.Total)
		W := r.Window.Milliseconds()
		wi := floorDiv(nowMs, W)
		var vals []int64
		var used, off int64
		_, exists := m.field(k, "w")
		// a window after the current one (a clock stepped back): its
		// counts go on in the current window, as Check reads them
		off = nowMs - wi*W
		if alg == algFixedWindow {
			c := int64(0)
			if exists && k.h["w"] >= wi {
				c = k.h["n"]
			}
			vals, used = []int64{wi, c}, c*W
		} else {
			c, pc := int64(0), int64(0)
			if exists {
				w := k.h["w"]
				c, pc = k.h["c"], k.h["p"]
				if wi == w+1 {
					pc, c = c, 0
				} else if wi > w+1 {
					pc, c = 0, 0
				}
			}
			vals, used = []int64{wi, c, pc}, c*W+pc*(W-off)
		}
		if used > allow*W {
			out[i] = WindowApplied{Version: held, Need: needUnits(r.Limit, r.Total, ceilDiv(used, W)), Until: time.Duration(W-off) * time.Millisecond}
			continue
		}
		var rel, ttl int64 = 0, -1
		if r.Release || r.Hold > 0 {
			n := int64(len(vals)) - 1
			ttl = max(n*W-off+m.slackMs, r.keyTTL().Milliseconds(), 1000)
		}
		if r.Release {
			rel = 1
		}
		m.setWin(nowMs, r.Key, alg, vals, []int64{inc, seq, r.Units*2 + rel}, ttl)
		out[i].Version = r.versionOf()
	}
	return out, nil
}

// needUnits is the fewest units u in [0, total] with shareOf(limit, u,
// total) >= n, found as the script does (an estimate, then exact steps).
func needUnits(limit, total, n int64) int64 {
	u := min(int64(math.Floor(float64(n)/float64(limit)*float64(total))), total)
	for u < total && shareOf(limit, u, total) < n {
		u++
	}
	for u > 0 && shareOf(limit, u-1, total) >= n {
		u--
	}
	return u
}
