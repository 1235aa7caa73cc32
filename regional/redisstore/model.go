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
	markers map[string]modelMarker // by marker key; they never expire
	runID   string
}

// modelMarker mirrors a marker key.
type modelMarker struct {
	inc, seq, units int64
	at, exp         int64 // applied at, lease end (virtual ms)
	run             string
	// boot: a first incarnation's marker, in force with the same default
	// units without a break since its Create (see the package doc, "The
	// boot fill").
	boot bool
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
	return &Model{slackMs: ttlSlack.Milliseconds(), keys: map[string]*modelKey{}, markers: map[string]modelMarker{}, runID: "model-run-1"}
}

// RunID is the model's run id, like Store.RunID ("model-run-1" until Restart).
func (m *Model) RunID() string { return m.runID }

// Restart simulates a restart of Redis without persistence: every key and
// marker is gone and the run id becomes runID.
func (m *Model) Restart(runID string) {
	clear(m.keys)
	clear(m.markers)
	m.runID = runID
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
	b       Bucket
	alg     int64
	ok      bool
	limit   int64
	retry   int64
	global  bool
	rec     []int64 // global bucket or window: the stored record (inc, seq, units*2+release)
	changed bool    // global token bucket: the enforced share differs from the stored one
	units   int64   // global token bucket: the units enforced
	back    bool    // the clock is behind the stored time (or window)
	shift   int64   // sliding log: the clock is this far behind its newest entry
	ttl     int64
	t0, t1  int64 // token/leaky: millionths
	capU    int64
	rate    int64
	w       int64 // windows: window index
	n0, n1  int64 // fixed: count; sliding window: current count; log: count
	pc      int64 // sliding window: previous count
	L, W    int64
	off     int64
	reset   int64 // fixed window reset; log: reset when not taken
	eff     int64 // log: effective now
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
			t, okt := m.field(k, "t")
			l := tbLast(k, nowMs)
			if g := b.Global; g != nil {
				p.global = true
				mk, okm := m.markers[MarkerKey(g.Rule)]
				var u int64
				if ri, ok := m.field(k, "i"); ok {
					p.rec = []int64{ri, k.h["s"], k.h["u"]}
					u = m.enforced(mk, okm, nowMs, g.Units, g.Floor, true, ri, k.h["u"]/2)
				} else {
					u = m.enforced(mk, okm, nowMs, g.Units, g.Floor, false, 0, 0)
				}
				capacity, rate = shareOf(b.Capacity, u, g.Units), shareOf(b.Rate, u, g.Units)
				capU := capacity * 1000
				if !okt {
					t, l = capU, nowMs
				} else {
					oc, or, okc := lastSeen(k, b.Capacity, b.Rate, g.Units)
					if okc {
						t = refill(t, nowMs-l, oc*1000, or)
						t = m.bootFill(mk, okm, nowMs, t, k.h["e"], g.Floor, u, b.Capacity, g.Units)
					}
					t = min(t, capU)
					p.changed = !okc || oc != capacity || or != rate
				}
				p.units = u
			} else {
				if !okt {
					t, l = capacity*1000, nowMs
				}
				t = refill(t, nowMs-l, capacity*1000, rate)
			}
			capU := capacity * 1000
			p.back = nowMs < l
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
			p.ttl = m.ttl(ceilDiv(capU, max(rate, 1)))
			if p.rec != nil && p.rec[2]%2 == 0 {
				p.ttl = 0 // a record that is not a Release record: its key keeps its TTL (Hold) or persistence
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
			if b.Global != nil {
				L, p.rec = m.windowShare(k, b, nowMs)
			}
			wi := floorDiv(nowMs, W)
			w, okw := m.field(k, "w")
			n, okn := m.field(k, "n")
			if !okw || !okn {
				w, n = wi, 0
			}
			// a clock stepped back past the window: the count goes on in
			// the current one, written answered or not
			p.back = wi < w
			if wi > w {
				n = 0
			}
			w = wi
			off := nowMs - w*W
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
			if p.rec != nil && p.rec[2]%2 == 0 {
				p.ttl = 0 // a record that is not a Release record: its key keeps its TTL (Hold) or persistence
			}
		case algSlidingWindow:
			L, W := b.Limit, b.Window.Milliseconds()
			if b.Global != nil {
				L, p.rec = m.windowShare(k, b, nowMs)
			}
			wi := floorDiv(nowMs, W)
			w, okw := m.field(k, "w")
			c, okc := m.field(k, "c")
			pc, okp := m.field(k, "p")
			if !okw || !okc || !okp {
				w, c, pc = wi, 0, 0
			}
			p.back = wi < w
			if wi == w+1 {
				pc, c = c, 0
			} else if wi > w+1 {
				pc, c = 0, 0
			}
			w = wi
			off := nowMs - w*W
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
			if p.rec != nil && p.rec[2]%2 == 0 {
				p.ttl = 0
			}
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
				if last > nowMs {
					// a clock stepped back past the newest entry: every
					// entry is read d earlier, the newest at now, and
					// written so whether the call is allowed or not
					p.shift = last - nowMs
					log = append([]int64(nil), log...)
					for j := range log {
						log[j] -= p.shift
					}
					last = nowMs
				}
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
			switch {
			case p.alg == algLeakyBucket && (all || p.back):
				m.hset(nowMs, key, "t", t, "l", nowMs).expireAt = nowMs + p.ttl
			case p.alg == algTokenBucket && (all || p.back || p.changed):
				// the whole state is replaced (a regional write drops a share)
				v := []int64{t, nowMs}
				if p.global {
					v = append(v, p.units)
					v = append(v, p.rec...)
				}
				m.setTB(nowMs, key, v, p.ttl)
				if !p.global && compactTB(p.capU, p.ttl) {
					m.keys[key].h = map[string]int64{"t": t, "m": nowMs % compactPeriod}
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
			if all || p.back {
				m.setWin(nowMs, key, p.alg, []int64{p.w, n}, p.rec, p.ttl)
			}
			rem, reset = p.L-n, p.reset
		case algSlidingWindow:
			c := p.n0
			if take {
				c = p.n1
			}
			if all || p.back {
				m.setWin(nowMs, key, p.alg, []int64{p.w, c, p.pc}, p.rec, p.ttl)
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
			if p.shift > 0 {
				k := m.get(nowMs, key)
				log := append([]int64(nil), k.log...)
				for j := range log {
					log[j] -= p.shift
				}
				k.log, k.expireAt = log, nowMs+p.ttl
			}
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

// refill adds el ms (< 0 counts as 0) at rate to t (millionths), after
// clamping t to capU; never above capU.
func refill(t, el, capU, rate int64) int64 {
	t = min(t, capU)
	el = max(el, 0)
	if rate > 0 && t < capU {
		if el >= ceilDiv(capU-t, rate) {
			t = capU
		} else {
			t += el * rate
		}
	}
	return t
}

// ShareOf is what the store enforces of a global limit x for a region
// holding u of total units: floor(x*u/total), computed as the scripts do
// (without overflow). rlctl's limits show uses it, so that the figures it
// prints are the enforced ones.
func ShareOf(x, u, total int64) int64 { return shareOf(x, u, total) }

// shareOf is floor(x*u/total), computed as the script does.
func shareOf(x, u, total int64) int64 {
	q := floorDiv(x, total)
	return q*u + floorDiv((x-q*total)*u, total)
}

// The decimal layout of a regional token bucket (see doc.go): its
// capacity at most compactMaxU millionths and its TTL below half of
// compactPeriod ms, it stores l modulo compactPeriod (field "m").
const (
	compactPeriod = 1_000_000_000
	compactMaxU   = 8_000_000_000
)

func compactTB(capU, ttl int64) bool { return capU <= compactMaxU && ttl > 0 && ttl < compactPeriod/2 }

// tbLast is a token bucket's last refill time: l, or for the decimal
// layout the time within half of compactPeriod of nowMs that is m modulo it.
func tbLast(k *modelKey, nowMs int64) int64 {
	if k == nil {
		return 0
	}
	m, ok := k.h["m"]
	if !ok {
		return k.h["l"]
	}
	d := ((nowMs%compactPeriod-m)%compactPeriod + compactPeriod) % compactPeriod
	if d >= compactPeriod/2 {
		d -= compactPeriod
	}
	return nowMs - d
}

// tbFields names the token-bucket state values in order (see doc.go): e is
// the units a global bucket last enforced; i, s, u its share record.
var tbFields = []string{"t", "l", "e", "i", "s", "u"}

// lastSeen is the capacity and rate a global state last enforced, for the
// global capacity c, rate r and total units (ok false: none stored, a
// regional state).
func lastSeen(k *modelKey, c, r, total int64) (int64, int64, bool) {
	e, ok := k.h["e"]
	if !ok {
		return 0, 0, false
	}
	return shareOf(c, e, total), shareOf(r, e, total), true
}

// setTB replaces a token bucket's whole state with v (2, 3 or 6 values).
// ttl > 0 sets the key to expire ttl ms from nowMs, 0 keeps its TTL, -1
// makes it persistent.
func (m *Model) setTB(nowMs int64, key string, v []int64, ttl int64) {
	k := m.get(nowMs, key)
	if k == nil {
		k = &modelKey{}
		m.keys[key] = k
	}
	k.h = map[string]int64{}
	for i, x := range v {
		k.h[tbFields[i]] = x
	}
	switch {
	case ttl > 0:
		k.expireAt = nowMs + ttl
	case ttl < 0:
		k.expireAt = 0
	}
}

// live reports whether a marker is in force at nowMs: of the current run,
// applied at or before nowMs, its lease not over.
func (m *Model) live(mk modelMarker, ok bool, nowMs int64) bool {
	return ok && mk.at <= nowMs && nowMs < mk.exp && mk.run == m.runID
}

// bootFill is the boot fill (see the package doc, "The boot fill"): t, a
// global key's tokens settled up to nowMs at the capacity of the units e it
// last enforced, plus the capacity of min(u, the marker's default units)
// above the floor's, if the marker is a boot marker in force, e is the
// floor and u, the units the key has enforced since the marker's Create
// (its held record's or the default), is above it; else t.
func (m *Model) bootFill(mk modelMarker, ok bool, nowMs, t, e, floor, u, c, total int64) int64 {
	if !mk.boot || e != floor || u <= floor || !m.live(mk, ok, nowMs) {
		return t
	}
	return t + (shareOf(c, min(u, mk.units), total)-shareOf(c, floor, total))*1000
}

// enforced is the units a global key enforces (see the package doc).
func (m *Model) enforced(mk modelMarker, ok bool, nowMs, total, floor int64, hasRec bool, recInc, recUnits int64) int64 {
	u := floor
	if m.live(mk, ok, nowMs) {
		switch {
		case !hasRec:
			u = mk.units
		case recInc == mk.inc:
			u = recUnits
		}
	}
	return min(u, total)
}

// WriteMarker applies mk for rule at nowMs exactly as Store.WriteMarker does.
func (m *Model) WriteMarker(nowMs int64, rule string, mk Marker) (Version, error) {
	if err := validateMarker(rule, mk); err != nil {
		return Version{}, err
	}
	key := MarkerKey(rule)
	old, ok := m.markers[key]
	if ok && old.run != m.runID {
		ok = false
	}
	inc, seq := int64(mk.Inc), int64(mk.Seq)
	var apply bool
	if mk.Create {
		apply = mk.RunID == m.runID && (!ok || inc > old.inc || inc == old.inc && seq > old.seq)
	} else {
		apply = ok && inc == old.inc && seq >= old.seq
	}
	if !apply {
		if ok {
			return Version{uint64(old.inc), uint64(old.seq)}, nil
		}
		return Version{}, nil
	}
	nm := modelMarker{inc: inc, seq: seq, units: mk.Units, at: nowMs, exp: nowMs + mk.Lease.Milliseconds(), run: m.runID}
	switch {
	case ok && old.boot && inc == old.inc && mk.Units == old.units && m.live(old, true, nowMs):
		nm.boot = true
	case !ok && mk.Create && mk.Boot && inc == 1:
		nm.boot = true
	}
	m.markers[key] = nm
	return Version{mk.Inc, mk.Seq}, nil
}

// WriteShares applies recs for rule at nowMs exactly as Store.WriteShares does.
func (m *Model) WriteShares(nowMs int64, rule string, recs []ShareRecord) ([]Version, error) {
	if err := validateShares(rule, recs); err != nil || len(recs) == 0 {
		return nil, err
	}
	if recs[0].isWindow() {
		return versionsOf(m.WriteWindowShares(nowMs, rule, recs))
	}
	mk, okm := m.markers[MarkerKey(rule)]
	out := make([]Version, len(recs))
	for i, r := range recs {
		inc, seq := int64(r.Inc), int64(r.Seq)
		k := m.get(nowMs, r.Key)
		if si, ok := m.field(k, "i"); ok {
			ss := k.h["s"]
			if inc < si || inc == si && seq < ss {
				out[i] = Version{uint64(si), uint64(ss)}
				continue
			}
		}
		u := m.enforced(mk, okm, nowMs, r.Total, r.Floor, true, inc, r.Units)
		capacity, rate := shareOf(r.Capacity, u, r.Total), shareOf(r.Rate, u, r.Total)
		capU := capacity * 1000
		t, okt := m.field(k, "t")
		if !okt {
			t = capU
		} else {
			if oc, or, ok := lastSeen(k, r.Capacity, r.Rate, r.Total); ok {
				t = refill(t, nowMs-tbLast(k, nowMs), oc*1000, or)
				// the boot fill at the units the key enforced until now (its held record's or the marker's default)
				hi, hasRec := m.field(k, "i")
				uo := m.enforced(mk, okm, nowMs, r.Total, r.Floor, hasRec, hi, k.h["u"]/2)
				t = m.bootFill(mk, okm, nowMs, t, k.h["e"], r.Floor, uo, r.Capacity, r.Total)
			}
			t = min(t, capU)
		}
		var rel, ttl int64 = 0, -1
		if r.Release || r.Hold > 0 {
			ttl = max(ceilDiv(capU, max(rate, 1))+m.slackMs, r.keyTTL().Milliseconds(), 1000)
		}
		if r.Release {
			rel = 1
		}
		m.setTB(nowMs, r.Key, []int64{t, nowMs, u, inc, seq, r.Units*2 + rel}, ttl)
		out[i] = r.versionOf()
	}
	return out, nil
}
