package redisstore

// The Lua scripts. Every value is an integer held in a Lua double; the
// limits in bucket.go keep every intermediate below 2^53, so the arithmetic
// is exact. State is packed as struct.pack('<I6...') would (see doc.go):
// with struct where the server has it (Redis), else in plain Lua (embedded
// servers such as miniredis have no struct library); numbers
// that go into commands as text use string.format('%.0f'), because Lua's
// tostring would print large integers in exponent form.
//
// The Go reference model (model.go) implements the same steps in the same
// order; keep the two in step (the differential test compares them).

// prelude holds the helpers every script shares.
const prelude = `
local U = 1000000
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) return -idiv(-a, b) end
local function fmt(x) return string.format('%.0f', x) end
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local tm = redis.call('TIME')
  return tonumber(tm[1]) * 1000 + idiv(tonumber(tm[2]), 1000)
end
-- state: a binary string of little-endian unsigned integers (every value
-- an integer in [0, 2^48)). getle reads n of them from s, putle writes vals;
-- f is the layout's struct format, widths its byte widths (nil: read from
-- f, once per call, only without struct). Redis has the
-- struct library and uses it (plain Lua costs it more than 10% of a check);
-- where it is missing (an embedded server such as miniredis), the same
-- bytes are read and written in plain Lua: string.byte, string.char and
-- exact arithmetic on doubles.
local struct = rawget(_G, 'struct')
local function getle(s, f, widths, n)
  if struct then
    local v = {struct.unpack(f, s)}
    v[n + 1] = nil -- struct.unpack's next position
    return v
  end
  if not widths then
    widths = {}
    for w in string.gmatch(f, 'I(%d)') do widths[#widths + 1] = tonumber(w) end
  end
  local v, i = {}, 0
  for k = 1, n do
    local w = widths[k]
    local x = 0
    for j = i + w, i + 1, -1 do x = x * 256 + string.byte(s, j) end
    v[k] = x
    i = i + w
  end
  return v
end
local function putle(vals, f, widths)
  if struct then return struct.pack(f, unpack(vals)) end
  if not widths then
    widths = {}
    for w in string.gmatch(f, 'I(%d)') do widths[#widths + 1] = tonumber(w) end
  end
  local b, n = {}, 0
  for k = 1, #vals do
    local x = vals[k]
    for _ = 1, widths[k] do
      local q = math.floor(x / 256)
      n = n + 1
      b[n] = x - q * 256 -- the low byte (of x's two's complement if x < 0, as struct.pack)
      x = q
    end
  end
  return string.char(unpack(b, 1, n))
end
-- leaky buckets and markers: n 6-byte integers (windows: windowPrelude)
local f6 = {'<I6', '<I6I6', '<I6I6I6', '<I6I6I6I6', '<I6I6I6I6I6'}
local w6 = {6, 6, 6, 6, 6}
-- load returns nil for a missing key, else exactly the stored values
local function load(key, n1, n2)
  local s = redis.call('GET', key)
  if not s then return nil end
  local n = #s / 6
  if n ~= n1 and n ~= n2 then return error('redisstore: bad state in ' .. key) end
  return getle(s, f6[n], w6, n)
end
-- token bucket state, by length: 12 bytes t, l (regional); 16 t, l, e
-- (global: e the units it last enforced); 28 t, l, e, then its share
-- record's inc, seq, units*2+release. Also read, never written: 24 t, l,
-- c, r and 36 t, l, c, r, inc, seq, units*2+release (the earlier global
-- layouts: c, r the capacity and rate it last enforced). And 19 digits:
-- a regional token bucket small enough is one decimal (Redis keeps it as
-- an integer: no string allocation): 10^18 + t*10^9 + l mod 10^9; l is
-- the one within half of 10^9 ms of now (see doc.go)
local tbl = {[12] = '<I6I6', [16] = '<I6I6I4', [28] = '<I6I6I4I3I5I4', [24] = '<I6I6I6I6', [36] = '<I6I6I6I6I3I5I4'}
local tbv = {'', '<I6I6', '<I6I6I4', '', '', '<I6I6I4I3I5I4'}
local CP, CMAX = 1000000000, 8000000000
-- loadtb returns nil for a missing key, else {t = , l = } and for a global
-- state e (or c and r) and rec = {inc, seq, units*2+release} if it has one
local function loadtb(key, now)
  local s = redis.call('GET', key)
  if not s then return nil end
  if #s == 19 then
    local t, m = tonumber(string.sub(s, 1, 10)), tonumber(string.sub(s, 11))
    if not t or not m then return error('redisstore: bad state in ' .. key) end
    local d = (now % CP - m) % CP
    if d >= CP / 2 then d = d - CP end
    return {t = t - CP, l = now - d}
  end
  local f = tbl[#s]
  if not f then return error('redisstore: bad state in ' .. key) end
  local v = getle(s, f, nil, (#f - 1) / 2)
  local h = {t = v[1], l = v[2]}
  if #s == 16 or #s == 28 then
    h.e = v[3]
    if #s == 28 then h.rec = {v[4], v[5], v[6]} end
  elseif #s == 24 or #s == 36 then
    h.c, h.r = v[3], v[4]
    if #s == 36 then h.rec = {v[5], v[6], v[7]} end
  end
  return h
end
-- v: {t, l}, {t, l, e} or {t, l, e, inc, seq, units*2+release}; ttl > 0:
-- PX ttl; 0: KEEPTTL; -1: no TTL (persistent); capU, for a regional
-- bucket: its capacity (millionths), for the decimal layout
local function savetb(key, v, ttl, capU)
  local s
  if capU and capU <= CMAX and ttl > 0 and ttl < CP / 2 then
    s = fmt(CP + v[1]) .. string.format('%09d', v[2] % CP)
  else
    s = putle(v, tbv[#v])
  end
  if ttl > 0 then redis.call('SET', key, s, 'PX', ttl)
  elseif ttl == 0 then redis.call('SET', key, s, 'KEEPTTL')
  else redis.call('SET', key, s) end
end
-- refill t (millionths) for el ms at rate (thousandths/s) up to capU,
-- after clamping to capU; el < 0 counts as 0
local function refill(t, el, capU, rate)
  if t > capU then t = capU end
  if el < 0 then el = 0 end
  if rate > 0 and t < capU then
    if el >= cdiv(capU - t, rate) then t = capU else t = t + el * rate end
  end
  return t
end
-- the share of x for u of UN units: floor(x*u/UN), exact while UN <= 2^26
local function shareOf(x, u, UN)
  local q = idiv(x, UN)
  return q * u + idiv((x - q * UN) * u, UN)
end
-- the capacity and rate a global state h last enforced, for the global
-- capacity C, rate R and total units UN (nil: none stored)
local function lastseen(h, C, R, UN)
  if h.e then return shareOf(C, h.e, UN), shareOf(R, h.e, UN) end
  return h.c, h.r
end
-- marker: inc, seq, units, applied at, lease expiry (ms), then the run id
local function loadmarker(key)
  local s = redis.call('GET', key)
  if not s then return nil end
  if #s < 30 then return error('redisstore: bad marker in ' .. key) end
  local v = getle(s, f6[5], w6, 5)
  return {inc = v[1], seq = v[2], units = v[3], at = v[4], exp = v[5], run = string.sub(s, 31)}
end
-- the server's run id (INFO server); EmbeddedRunID where the server
-- answers that INFO server is not supported (an embedded server)
local runid
local function currentrun()
  if not runid then
    local info = redis.pcall('INFO', 'server')
    if type(info) == 'table' and info.err and string.find(info.err, 'not supported', 1, true) then
      runid = '` + EmbeddedRunID + `'
    else
      -- any other error: fail as redis.call does
      if type(info) == 'table' then info = redis.call('INFO', 'server') end
      runid = string.match(info, 'run_id:(%x+)') or ''
    end
  end
  return runid
end
-- a marker in force: of this server run, applied at or before now, lease not over
local function live(m, now)
  return m and m.at <= now and now < m.exp and m.run == currentrun()
end
-- the units a global key enforces (rinc: its record's incarnation, or nil)
local function enforced(m, now, UN, F, rinc, runits)
  local u = F
  if live(m, now) then
    if rinc == nil then u = m.units elseif rinc == m.inc then u = runits end
  end
  if u > UN then u = UN end
  return u
end
`

// checkSrc evaluates all buckets of one request.
//
// KEYS[i]: the bucket keys (distinct), then the marker keys of the global
// buckets.
// ARGV[1]: cost (whole tokens); ARGV[2]: now in ms, or "" to read TIME;
// ARGV[3]: TTL slack in ms; then 4 values per bucket: algorithm code, a, b,
// shadow (0/1). Token/leaky bucket: a = capacity, b = rate (thousandths,
// thousandths per second). Window algorithms: a = limit, b = window in ms.
// A global token bucket (code 6; a, b the global capacity and rate) has 3
// more: total units, floor units, and the index in KEYS of its marker key.
//
// Reply: {allowed, then per bucket: allowed, limit, remaining, retry_after_ms, reset_after_ms}.
const checkSrc = prelude + windowPrelude + `
local cost = tonumber(ARGV[1])
local now = clock(ARGV[2])
local markers = {}
-- the units a global window key enforces (codes 7, 8; see global_window.go)
local function gunits(base, rec)
  local UN, F, mk = tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local m = markers[mk]
  if m == nil then m = loadmarker(KEYS[mk]) or false; markers[mk] = m end
  if rec then return enforced(m, now, UN, F, rec[1], idiv(rec[3], 2)), UN end
  return enforced(m, now, UN, F, nil, 0), UN
end
local slack = tonumber(ARGV[3])
local function ttlms(x)
  x = x + slack
  if x < 1000 then x = 1000 end
  return x
end

local plans = {}
local all = true
local base, i = 3, 0
while base < #ARGV do
  i = i + 1
  local key = KEYS[i]
  local alg = tonumber(ARGV[base + 1])
  local a = tonumber(ARGV[base + 2])
  local b = tonumber(ARGV[base + 3])
  local p = {key = key, alg = alg, shadow = ARGV[base + 4] == '1'}
  if alg == 1 or alg == 6 then
    -- token bucket; t in millionths of a token, l in ms
    local h = loadtb(key, now)
    local cap, rate = a, b
    local t, l
    if alg == 6 then
      -- global: enforce a share of the global capacity a and rate b
      local UN, F, mk = tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
      local m = markers[mk]
      if m == nil then m = loadmarker(KEYS[mk]) or false; markers[mk] = m end
      if h and h.rec then p.rec = h.rec end
      local u
      if p.rec then u = enforced(m, now, UN, F, p.rec[1], idiv(p.rec[3], 2)) else u = enforced(m, now, UN, F, nil, 0) end
      cap = shareOf(a, u, UN); rate = shareOf(b, u, UN)
      local capU = cap * 1000
      if h == nil then t = capU; l = now
      else
        t, l = h.t, h.l
        -- settle at the rate and capacity the bucket last saw (none: no
        -- credit), then clamp to the new capacity
        local oc, orate = lastseen(h, a, b, UN)
        if oc then t = refill(t, now - l, oc * 1000, orate) end
        if t > capU then t = capU end
        p.changed = oc ~= cap or orate ~= rate
      end
      p.global = true; p.u = u
    else
      if h then t, l = h.t, h.l else t = cap * 1000; l = now end
      t = refill(t, now - l, cap * 1000, rate)
    end
    local capU = cap * 1000
    p.back = now < l
    local costU = cost * U
    p.ok = costU <= t
    p.limit = idiv(cap, 1000)
    p.t0 = t
    if p.ok then p.t1 = t - costU; p.retry = 0
    elseif costU > capU or rate == 0 then p.t1 = t; p.retry = -1
    else p.t1 = t; p.retry = cdiv(costU - t, rate) end
    p.cap = capU; p.rate = rate
    local r1 = rate
    if r1 < 1 then r1 = 1 end
    p.ttl = ttlms(cdiv(capU, r1))
    -- a record that is not a Release record keeps the key's TTL (the
    -- hold its writer renews) or its persistence
    if p.rec and p.rec[3] % 2 == 0 then p.ttl = 0 end
  elseif alg == 5 then
    -- leaky bucket (meter); t = level in millionths of a token
    local h = load(key, 2, 2) or {}
    local capU, rate = a * 1000, b
    local lv, l = h[1], h[2]
    if lv == nil then lv = 0; l = now end
    p.back = now < l
    local el = now - l
    if el < 0 then el = 0 end
    if lv > 0 then
      if el >= cdiv(lv, rate) then lv = 0 else lv = lv - el * rate end
    end
    local costU = cost * U
    p.ok = lv + costU <= capU
    p.limit = idiv(a, 1000)
    p.t0 = lv
    if p.ok then p.t1 = lv + costU; p.retry = cdiv(lv, rate)
    elseif costU > capU then p.t1 = lv; p.retry = -1
    else p.t1 = lv; p.retry = cdiv(lv + costU - capU, rate) end
    p.cap = capU; p.rate = rate
    p.ttl = ttlms(cdiv(capU, rate))
  elseif alg == 3 or alg == 7 then
    -- fixed window: w = window index, n = count
    local L, W = a, b
    local h = loadwin(key, 2)
    if alg == 7 then
      -- global: the share of the global limit a
      if h then p.rec = h.rec end
      local u, UN = gunits(base, p.rec)
      L = shareOf(a, u, UN)
    end
    h = h or {}
    local wi = idiv(now, W)
    local w, n = h[1], h[2]
    if w == nil then w = wi; n = 0 end
    if wi > w then w = wi; n = 0 end
    local off = 0
    if wi == w then off = now - w * W end
    p.ok = n + cost <= L
    p.limit = L
    p.w = w; p.n0 = n
    if p.ok then p.n1 = n + cost; p.retry = 0
    elseif cost > L then p.n1 = n; p.retry = -1
    else p.n1 = n; p.retry = W - off end
    p.L = L; p.reset = W - off
    p.ttl = ttlms(W - off)
    if p.rec and p.rec[3] % 2 == 0 then p.ttl = 0 end
  elseif alg == 2 or alg == 8 then
    -- sliding window counter: w = current window index, c = its count, p = previous window's count
    local L, W = a, b
    local h = loadwin(key, 3)
    if alg == 8 then
      if h then p.rec = h.rec end
      local u, UN = gunits(base, p.rec)
      L = shareOf(a, u, UN)
    end
    h = h or {}
    local wi = idiv(now, W)
    local w, c, pc = h[1], h[2], h[3]
    if w == nil then w = wi; c = 0; pc = 0 end
    if wi == w + 1 then pc = c; c = 0; w = wi elseif wi > w + 1 then pc = 0; c = 0; w = wi end
    local off = 0
    if wi == w then off = now - w * W end
    if cost > L then p.ok = false
    else p.ok = c * W + pc * (W - off) + cost * W <= L * W end
    p.limit = L
    p.w = w; p.c0 = c; p.pc = pc
    if p.ok then p.c1 = c + cost; p.retry = 0
    else
      p.c1 = c
      if cost > L then p.retry = -1
      elseif c + cost <= L then p.retry = W - idiv((L - c - cost) * W, pc) - off
      else p.retry = (W - off) + W - idiv((L - cost) * W, c) end
    end
    p.L = L; p.W = W; p.off = off
    p.ttl = ttlms(2 * W - off)
    if p.rec and p.rec[3] % 2 == 0 then p.ttl = 0 end
  elseif alg == 4 then
    -- sliding log: one sorted-set member per token, scored by its time
    local L, W = a, b
    local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local eff, last = now, nil
    if top[2] then
      last = tonumber(top[2])
      if last > eff then eff = last end
    end
    local lo = '(' .. fmt(eff - W)
    local cnt = redis.call('ZCOUNT', key, lo, '+inf')
    p.ok = cnt + cost <= L
    p.limit = L
    p.eff = eff; p.lo = lo; p.W = W
    if p.ok then p.cnt1 = cnt + cost; p.retry = 0; p.reset1 = W
    else
      p.cnt1 = cnt
      if cost > L then p.retry = -1
      else
        local r = redis.call('ZRANGEBYSCORE', key, lo, '+inf', 'WITHSCORES', 'LIMIT', cnt + cost - L - 1, 1)
        p.retry = tonumber(r[2]) + W - eff
      end
    end
    p.cnt0 = cnt
    if cnt > 0 then p.reset0 = last + W - eff else p.reset0 = 0 end
    p.L = L
    p.ttl = ttlms(W)
  else
    return redis.error_reply('ERR redisstore: unknown algorithm code ' .. tostring(alg))
  end
  if not p.ok and not p.shadow then all = false end
  plans[i] = p
  if alg >= 6 then base = base + 7 else base = base + 4 end
end

local out = {all and 1 or 0}
for i = 1, #plans do
  local p = plans[i]
  local take = all and p.ok
  local rem, reset
  if p.alg == 1 or p.alg == 6 or p.alg == 5 then
    local t = p.t0
    if take then t = p.t1 end
    if all or p.back or p.changed then
      -- also after a clock step back: the bucket's time follows the clock
      -- (settled level, nothing consumed), so refill resumes at once; and
      -- after a share change, so the next check settles at the new rate
      if p.global then
        local v = {t, now, p.u}
        if p.rec then v[4] = p.rec[1]; v[5] = p.rec[2]; v[6] = p.rec[3] end
        savetb(p.key, v, p.ttl)
      else
        local capU
        if p.alg == 1 then capU = p.cap end
        savetb(p.key, {t, now}, p.ttl, capU)
      end
    end
    if p.alg ~= 5 then
      rem = idiv(t, U)
      if t >= p.cap then reset = 0 elseif p.rate == 0 then reset = -1 else reset = cdiv(p.cap - t, p.rate) end
    else
      rem = idiv(p.cap - t, U)
      reset = cdiv(t, p.rate)
    end
  elseif p.alg == 3 or p.alg == 7 then
    local n = p.n0
    if take then n = p.n1 end
    if all then
      savewin(p.key, {p.w, n}, p.rec, p.ttl)
    end
    rem = p.L - n
    reset = p.reset
  elseif p.alg == 2 or p.alg == 8 then
    local c = p.c0
    if take then c = p.c1 end
    if all then
      savewin(p.key, {p.w, c, p.pc}, p.rec, p.ttl)
    end
    rem = idiv(p.L * p.W - c * p.W - p.pc * (p.W - p.off), p.W)
    if c > 0 then reset = (p.W - p.off) + p.W elseif p.pc > 0 then reset = p.W - p.off else reset = 0 end
  else
    local cnt = p.cnt0
    reset = p.reset0
    if take then
      cnt = p.cnt1
      reset = p.reset1
      redis.call('ZREMRANGEBYSCORE', p.key, '-inf', fmt(p.eff - p.W))
      local same = redis.call('ZCOUNT', p.key, fmt(p.eff), fmt(p.eff))
      local args = {}
      local score = fmt(p.eff)
      for j = 1, cost do
        args[#args + 1] = score
        args[#args + 1] = score .. '.' .. fmt(same + j)
        if #args >= 200 or j == cost then
          redis.call('ZADD', p.key, unpack(args))
          args = {}
        end
      end
      redis.call('PEXPIRE', p.key, p.ttl)
    end
    rem = p.L - cnt
  end
  if rem < 0 then rem = 0 end
  out[#out + 1] = p.ok and 1 or 0
  out[#out + 1] = p.limit
  out[#out + 1] = rem
  out[#out + 1] = p.retry
  out[#out + 1] = reset
end
return out
`

// sharesSrc writes one key's share record (WriteShares).
//
// KEYS[1]: the token-bucket key; KEYS[2]: the rule's marker key. ARGV: inc,
// seq, units, release (0/1), global capacity, global rate, total units,
// floor units, ttl ms (Release records), now ms or "" for TIME, slack ms,
// hold ms (any other record; 0: persistent).
// Reply: {inc, seq}, the record version the key holds afterwards.
const sharesSrc = prelude + `
local key = KEYS[1]
local inc, seq, units, rel = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local C, R, UN, F = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])
local now = clock(ARGV[10])
local slack = tonumber(ARGV[11])
local hold = tonumber(ARGV[12])
local h = loadtb(key, now)
if h and h.rec and (inc < h.rec[1] or (inc == h.rec[1] and seq < h.rec[2])) then return {h.rec[1], h.rec[2]} end
local u = enforced(loadmarker(KEYS[2]) or false, now, UN, F, inc, units)
local cap, rate = shareOf(C, u, UN), shareOf(R, u, UN)
local capU = cap * 1000
local t
if h == nil then t = capU
else
  t = h.t
  -- settle at the rate and capacity the bucket last saw (none: no credit)
  local oc, orate = lastseen(h, C, R, UN)
  if oc then t = refill(t, now - h.l, oc * 1000, orate) end
  if t > capU then t = capU end
end
local v = {t, now, u, inc, seq, units * 2 + rel}
if rel == 0 then ttl = hold end
if rel == 1 or hold > 0 then
  local r1 = rate
  if r1 < 1 then r1 = 1 end
  local want = cdiv(capU, r1) + slack
  if ttl > want then want = ttl end
  if want < 1000 then want = 1000 end
  savetb(key, v, want)
else
  savetb(key, v, -1)
end
return {inc, seq}
`

// markerSrc writes a rule's marker (WriteMarker).
//
// KEYS[1]: the marker key. ARGV: inc, seq, units, lease ms, create (0/1),
// run id, now ms or "" for TIME; in a Cluster also (else absent) the
// latest lease end in ms on this master's clock ("" none: the lease ends at
// now + lease) and the run id of the master the copy must be on.
// Reply: {inc, seq}, the version of the marker the store holds afterwards
// ({0, 0}: none, or one of another server run, which counts as none).
const markerSrc = prelude + `
local key = KEYS[1]
local inc, seq, units, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local create, run = ARGV[5] == '1', ARGV[6]
local now = clock(ARGV[7])
local cur = currentrun()
local m = loadmarker(key)
if m and m.run ~= cur then m = nil end
local ok
if ARGV[9] and ARGV[9] ~= '' and ARGV[9] ~= cur then
  -- a Cluster copy on another master than the caller read (see WriteMarker)
  ok = false
elseif create then
  ok = run == cur and (m == nil or inc > m.inc or (inc == m.inc and seq > m.seq))
else
  ok = m ~= nil and inc == m.inc and seq >= m.seq
end
if not ok then
  if m then return {m.inc, m.seq} end
  return {0, 0}
end
local exp = now + lease
if ARGV[8] and ARGV[8] ~= '' then
  local cap = tonumber(ARGV[8])
  if cap < exp then exp = cap end
  if exp < now then exp = now end
end
redis.call('SET', key, putle({inc, seq, units, now, exp}, f6[5], w6) .. cur)
return {inc, seq}
`
