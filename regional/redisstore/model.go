package redisstore

import (
	"sort"
	"time"
)

// Model is the pure Go reference implementation of the store: the same
// algorithms as the Lua scripts, step for step, in int64 arithmetic, over an
// in-memory map with key expiry in virtual time. It is the specification
// the differential test holds the scripts to, and a regional store the
// simulator can run on a virtual clock. It does no I/O and never reads the
// wall clock. A Model is not safe for concurrent use.
type Model struct {
	slackMs int64
	keys    map[string]*modelKey
}

// modelKey mirrors one Redis key: a hash (token, leaky, fixed and sliding
// window buckets) or a sorted set's scores (sliding log).
type modelKey struct {
	h        map[string]int64
	log      []int64 // ascending scores, one per token
	expireAt int64   // virtual ms; 0: no TTL
}

// NewModel returns an empty model whose TTLs use the given slack (the
// store's WithTTLSlack; DefaultTTLSlack if zero).
func NewModel(ttlSlack time.Duration) *Model {
	if ttlSlack == 0 {
		ttlSlack = DefaultTTLSlack
	}
	return &Model{slackMs: ttlSlack.Milliseconds(), keys: map[string]*modelKey{}}
}

const micro = 1_000_000 // millionths of a token per token

// floorDiv and ceilDiv divide integers rounding down and up (b > 0).
func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && (a < 0) {
		q--
	}
	return q
}

func ceilDiv(a, b int64) int64 { return -floorDiv(-a, b) }

func (m *Model) ttl(x int64) int64 {
	x += m.slackMs
	if x < 1000 {
		x = 1000
	}
	return x
}

// get returns the live key or nil, dropping it if it expired at nowMs.
func (m *Model) get(nowMs int64, key string) *modelKey {
	k := m.keys[key]
	if k != nil && k.expireAt != 0 && nowMs >= k.expireAt {
		delete(m.keys, key)
		return nil
	}
	return k
}

func (m *Model) field(k *modelKey, f string) (int64, bool) {
	if k == nil || k.h == nil {
		return 0, false
	}
	v, ok := k.h[f]
	return v, ok
}

func (m *Model) hset(nowMs int64, key string, kv ...any) *modelKey {
	k := m.get(nowMs, key)
	if k == nil {
		k = &modelKey{}
		m.keys[key] = k
	}
	if k.h == nil {
		k.h = map[string]int64{}
	}
	for i := 0; i < len(kv); i += 2 {
		k.h[kv[i].(string)] = kv[i+1].(int64)
	}
	return k
}

// PTTL answers like Redis PTTL at nowMs: -2 for a missing key, -1 for a key
// without TTL, else the ms left.
func (m *Model) PTTL(nowMs int64, key string) int64 {
	k := m.get(nowMs, key)
	switch {
	case k == nil:
		return -2
	case k.expireAt == 0:
		return -1
	}
	return k.expireAt - nowMs
}

type plan struct {
	b      Bucket
	alg    int64
	ok     bool
	limit  int64
	retry  int64
	share  bool
	back   bool // token/leaky: the clock is behind the stored time
	ttl    int64
	t0, t1 int64 // token/leaky: millionths
	capU   int64
	rate   int64
	w      int64 // windows: window index
	n0, n1 int64 // fixed: count; sliding window: current count; log: count
	pc     int64 // sliding window: previous count
	L, W   int64
	off    int64
	reset  int64 // fixed window reset; log: reset when not taken
	eff    int64 // log: effective now
}

// Check evaluates the buckets at nowMs exactly as the store's script does.
func (m *Model) Check(nowMs, cost int64, buckets []Bucket) (bool, []Result, error) {
	if err := validate(cost, buckets); err != nil {
		return false, nil, err
	}
	plans := make([]plan, len(buckets))
	all := true
	for i, b := range buckets {
		p := plan{b: b, alg: algCode(b.Algorithm)}
		k := m.get(nowMs, b.Key)
		switch p.alg {
		case algTokenBucket:
			capacity, rate := b.Capacity, b.Rate
			c, okc := m.field(k, "c")
			r, okr := m.field(k, "r")
			if okc && okr {
				capacity, rate, p.share = c, r, true
			}
			capU := capacity * 1000
			t, okt := m.field(k, "t")
			l, okl := m.field(k, "l")
			if !okt || !okl {
				t, l = capU, nowMs
			}
			t = min(t, capU)
			p.back = nowMs < l
			el := max(nowMs-l, 0)
			if rate > 0 && t < capU {
				if el >= ceilDiv(capU-t, rate) {
					t = capU
				} else {
					t += el * rate
				}
			}
			costU := cost * micro
			p.ok = costU <= t
			p.limit = floorDiv(capacity, 1000)
			p.t0, p.t1 = t, t
			switch {
			case p.ok:
				p.t1 = t - costU
			case costU > capU || rate == 0:
				p.retry = Never
			default:
				p.retry = ceilDiv(costU-t, rate)
			}
			p.capU, p.rate = capU, rate
			if rate > 0 {
				p.ttl = m.ttl(ceilDiv(capU, rate))
			}
		case algLeakyBucket:
			capU, rate := b.Capacity*1000, b.Rate
			lv, okt := m.field(k, "t")
			l, okl := m.field(k, "l")
			if !okt || !okl {
				lv, l = 0, nowMs
			}
			p.back = nowMs < l
			el := max(nowMs-l, 0)
			if lv > 0 {
				if el >= ceilDiv(lv, rate) {
					lv = 0
				} else {
					lv -= el * rate
				}
			}
			costU := cost * micro
			p.ok = lv+costU <= capU
			p.limit = floorDiv(b.Capacity, 1000)
			p.t0, p.t1 = lv, lv
			switch {
			case p.ok:
				p.t1 = lv + costU
				p.retry = ceilDiv(lv, rate)
			case costU > capU:
				p.retry = Never
			default:
				p.retry = ceilDiv(lv+costU-capU, rate)
			}
			p.capU, p.rate = capU, rate
			p.ttl = m.ttl(ceilDiv(capU, rate))
		case algFixedWindow:
			L, W := b.Limit, b.Window.Milliseconds()
			wi := floorDiv(nowMs, W)
			w, okw := m.field(k, "w")
			n, okn := m.field(k, "n")
			if !okw || !okn {
				w, n = wi, 0
			}
			if wi > w {
				w, n = wi, 0
			}
			var off int64
			if wi == w {
				off = nowMs - w*W
			}
			p.ok = n+cost <= L
			p.limit = L
			p.w, p.n0, p.n1 = w, n, n
			switch {
			case p.ok:
				p.n1 = n + cost
			case cost > L:
				p.retry = Never
			default:
				p.retry = W - off
			}
			p.L, p.reset = L, W-off
			p.ttl = m.ttl(W - off)
		case algSlidingWindow:
			L, W := b.Limit, b.Window.Milliseconds()
			wi := floorDiv(nowMs, W)
			w, okw := m.field(k, "w")
			c, okc := m.field(k, "c")
			pc, okp := m.field(k, "p")
			if !okw || !okc || !okp {
				w, c, pc = wi, 0, 0
			}
			if wi == w+1 {
				pc, c, w = c, 0, wi
			} else if wi > w+1 {
				pc, c, w = 0, 0, wi
			}
			var off int64
			if wi == w {
				off = nowMs - w*W
			}
			p.ok = cost <= L && c*W+pc*(W-off)+cost*W <= L*W
			p.limit = L
			p.w, p.n0, p.n1, p.pc = w, c, c, pc
			switch {
			case p.ok:
				p.n1 = c + cost
			case cost > L:
				p.retry = Never
			case c+cost <= L:
				p.retry = W - floorDiv((L-c-cost)*W, pc) - off
			default:
				p.retry = (W - off) + W - floorDiv((L-cost)*W, c)
			}
			p.L, p.W, p.off = L, W, off
			p.ttl = m.ttl(2*W - off)
		case algSlidingLog:
			L, W := b.Limit, b.Window.Milliseconds()
			var log []int64
			if k != nil {
				log = k.log
			}
			eff := nowMs
			var last int64
			if len(log) > 0 {
				last = log[len(log)-1]
				eff = max(eff, last)
			}
			first := sort.Search(len(log), func(j int) bool { return log[j] > eff-W })
			cnt := int64(len(log) - first)
			p.ok = cnt+cost <= L
			p.limit = L
			p.eff, p.W, p.L = eff, W, L
			p.n0, p.n1 = cnt, cnt
			switch {
			case p.ok:
				p.n1 = cnt + cost
			case cost > L:
				p.retry = Never
			default:
				p.retry = log[first+int(cnt+cost-L-1)] + W - eff
			}
			if cnt > 0 {
				p.reset = last + W - eff
			}
			p.ttl = m.ttl(W)
		}
		if !p.ok && !b.Shadow {
			all = false
		}
		plans[i] = p
	}

	results := make([]Result, len(plans))
	for i, p := range plans {
		take := all && p.ok
		var rem, reset int64
		key := p.b.Key
		switch p.alg {
		case algTokenBucket, algLeakyBucket:
			t := p.t0
			if take {
				t = p.t1
			}
			if all || p.back {
				k := m.hset(nowMs, key, "t", t, "l", nowMs)
				if p.share {
					if p.ttl > 0 && m.PTTL(nowMs, key) < p.ttl {
						k.expireAt = nowMs + p.ttl
					}
				} else {
					k.expireAt = nowMs + p.ttl
				}
			}
			if p.alg == algTokenBucket {
				rem = floorDiv(t, micro)
				switch {
				case t >= p.capU:
				case p.rate == 0:
					reset = Never
				default:
					reset = ceilDiv(p.capU-t, p.rate)
				}
			} else {
				rem = floorDiv(p.capU-t, micro)
				reset = ceilDiv(t, p.rate)
			}
		case algFixedWindow:
			n := p.n0
			if take {
				n = p.n1
			}
			if all {
				m.hset(nowMs, key, "w", p.w, "n", n).expireAt = nowMs + p.ttl
			}
			rem, reset = p.L-n, p.reset
		case algSlidingWindow:
			c := p.n0
			if take {
				c = p.n1
			}
			if all {
				m.hset(nowMs, key, "w", p.w, "c", c, "p", p.pc).expireAt = nowMs + p.ttl
			}
			rem = floorDiv(p.L*p.W-c*p.W-p.pc*(p.W-p.off), p.W)
			switch {
			case c > 0:
				reset = (p.W - p.off) + p.W
			case p.pc > 0:
				reset = p.W - p.off
			}
		case algSlidingLog:
			cnt, reset0 := p.n0, p.reset
			reset = reset0
			if take {
				cnt, reset = p.n1, p.W
				k := m.get(nowMs, key)
				if k == nil {
					k = &modelKey{}
					m.keys[key] = k
				}
				first := sort.Search(len(k.log), func(j int) bool { return k.log[j] > p.eff-p.W })
				log := append([]int64(nil), k.log[first:]...)
				for j := int64(0); j < cost; j++ {
					log = append(log, p.eff)
				}
				k.log = log
				k.expireAt = nowMs + p.ttl
			}
			rem = p.L - cnt
		}
		results[i] = Result{Allowed: p.ok, Limit: p.limit, Remaining: max(rem, 0), RetryAfterMs: p.retry, ResetAfterMs: reset}
	}
	return all, results, nil
}

// SetShare applies a share at nowMs exactly as Store.SetShare does and
// reports whether it was applied (false: an older version, ignored).
func (m *Model) SetShare(nowMs int64, key string, capacity, rate, version int64, ttl time.Duration) (bool, error) {
	if err := validateShare(key, capacity, rate, version, ttl); err != nil {
		return false, err
	}
	k := m.get(nowMs, key)
	if ov, ok := m.field(k, "v"); ok && version < ov {
		return false, nil
	}
	capU := capacity * 1000
	t, okt := m.field(k, "t")
	l, okl := m.field(k, "l")
	if !okt || !okl {
		t = capU
	} else {
		oc, okc := m.field(k, "c")
		orate, okr := m.field(k, "r")
		if okc && okr {
			ocU := oc * 1000
			t = min(t, ocU)
			el := max(nowMs-l, 0)
			if orate > 0 && t < ocU {
				if el >= ceilDiv(ocU-t, orate) {
					t = ocU
				} else {
					t += el * orate
				}
			}
		}
	}
	t = min(t, capU)
	k = m.hset(nowMs, key, "t", t, "l", nowMs, "c", capacity, "r", rate, "v", version)
	want := ttl.Milliseconds()
	if rate > 0 {
		want = max(want, ceilDiv(capU, rate)+m.slackMs)
	}
	want = max(want, 1000)
	if m.PTTL(nowMs, key) < want {
		k.expireAt = nowMs + want
	}
	return true, nil
}
