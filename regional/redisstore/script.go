package redisstore

import "strings"

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

// prelude holds the helpers every script shares. A script's top level runs
// on every call, so every closure and table it builds is built (and
// collected) per call: on Redis 7, each costs about 1,000 instructions
// (callgrind) of the 80,000 to 90,000 a simple check takes
// (TestScriptCost). So the helpers are few, return several values rather
// than tables and use struct with literal formats, and the check script
// builds the helpers of a kind (tbHelpers, winHelpers, globalHelpers,
// assignments to locals declared here) only at its first bucket of that
// kind.
const prelude = `
local U = 1000000
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) return -idiv(-a, b) end
-- state: a binary string of little-endian unsigned integers (every value
-- an integer in [0, 2^48)). unpackle(f, s) returns the values of layout f
-- (a struct format such as '<I6I6') read from s, then a position, as
-- struct.unpack; packle(f, ...) packs the values. Redis has the struct
-- library and uses it (plain Lua costs it more than 10% of a check);
-- where it is missing (an embedded server such as miniredis), the same
-- bytes are read and written in plain Lua: string.byte, string.char and
-- exact arithmetic on doubles.
local struct = rawget(_G, 'struct')
local unpackle, packle
if struct then unpackle, packle = struct.unpack, struct.pack
else
  unpackle = function(f, s)
    local v, n, i = {}, 0, 0
    for ws in string.gmatch(f, 'I(%d)') do
      local w, x = tonumber(ws), 0
      for j = i + w, i + 1, -1 do x = x * 256 + string.byte(s, j) end
      n = n + 1
      v[n] = x
      i = i + w
    end
    v[n + 1] = i + 1
    return unpack(v, 1, n + 1)
  end
  packle = function(f, ...)
    local vals, b, n, k = {...}, {}, 0, 0
    for w in string.gmatch(f, 'I(%d)') do
      k = k + 1
      local x = vals[k]
      for _ = 1, tonumber(w) do
        local q = floor(x / 256)
        n = n + 1
        b[n] = x - q * 256 -- the low byte (of x's two's complement if x < 0, as struct.pack)
        x = q
      end
    end
    return string.char(unpack(b, 1, n))
  end
end
local CP, CMAX = 1000000000, 8000000000
local loadtb, savetb, refill -- tbHelpers
`

// tbHelpers are the token and leaky bucket helpers (as globalHelpers,
// built by the check script only when it has such a bucket).
const tbHelpers = `
-- token bucket state, by length: 12 bytes t, l (regional); 16 t, l, e
-- (global: e the units it last enforced); 28 t, l, e, then its share
-- record's inc, seq, units*2+release. Also read, never written: 24 t, l,
-- c, r and 36 t, l, c, r, inc, seq, units*2+release (the earlier global
-- layouts: c, r the capacity and rate it last enforced). And 19 digits:
-- a regional token bucket small enough is one decimal (Redis keeps it as
-- an integer: no string allocation): 10^18 + t*10^9 + l mod 10^9; l is
-- the one within half of 10^9 ms of now (see doc.go)
-- loadtb returns nothing for a missing key, else t, l, e, c, r, inc,
-- seq, units*2+release (nil where the layout has none)
loadtb = function(key, now)
  local s = redis.call('GET', key)
  if not s then return nil end
  local n = #s
  if n == 19 then
    local t, m = tonumber(string.sub(s, 1, 10)), tonumber(string.sub(s, 11))
    if not t or not m then return error('redisstore: bad state in ' .. key) end
    local d = (now % CP - m) % CP
    if d >= CP / 2 then d = d - CP end
    return t - CP, now - d
  elseif n == 12 then
    local t, l = unpackle('<I6I6', s)
    return t, l
  elseif n == 16 then
    local t, l, e = unpackle('<I6I6I4', s)
    return t, l, e
  elseif n == 28 then
    local t, l, e, i, q, r = unpackle('<I6I6I4I3I5I4', s)
    return t, l, e, nil, nil, i, q, r
  elseif n == 24 then
    local t, l, c, r = unpackle('<I6I6I6I6', s)
    return t, l, nil, c, r
  elseif n == 36 then
    local t, l, c, r, i, q, u = unpackle('<I6I6I6I6I3I5I4', s)
    return t, l, nil, c, r, i, q, u
  end
  return error('redisstore: bad state in ' .. key)
end
-- savetb writes t, l and for a global state e, and inc, seq,
-- units*2+release if it has a record; ttl > 0: PX ttl; 0: KEEPTTL;
-- -1: no TTL (persistent); capU, for a regional
-- bucket: its capacity (millionths), for the decimal layout
savetb = function(key, ttl, capU, t, l, e, inc, seq, ru)
  local s
  if capU and capU <= CMAX and ttl > 0 and ttl < CP / 2 then
    s = string.format('%.0f%09d', CP + t, l % CP)
  elseif not e then s = packle('<I6I6', t, l)
  elseif not inc then s = packle('<I6I6I4', t, l, e)
  else s = packle('<I6I6I4I3I5I4', t, l, e, inc, seq, ru) end
  -- ttl > 0: PX ttl; 0: KEEPTTL; -1: no TTL (persistent)
  if ttl > 0 then redis.call('SET', key, s, 'PX', ttl)
  elseif ttl == 0 then redis.call('SET', key, s, 'KEEPTTL')
  else redis.call('SET', key, s) end
end
-- refill t (millionths) for el ms at rate (thousandths/s) up to capU,
-- after clamping to capU; el < 0 counts as 0
refill = function(t, el, capU, rate)
  if t > capU then t = capU end
  if el < 0 then el = 0 end
  if rate > 0 and t < capU then
    if el >= cdiv(capU - t, rate) then t = capU else t = t + el * rate end
  end
  return t
end
`

// tbDecide decides a token bucket of t millionths of a token, capacity
// capU and rate: sets ok (cost fits), t1 (the tokens if taken), retry and
// ttl (the key's TTL once written), all declared before it.
const tbDecide = `
    t1, retry = t, 0
    ok = costU <= t
    if ok then t1 = t - costU
    elseif costU > capU or rate == 0 then retry = -1
    else retry = cdiv(costU - t, rate) end
    local r1 = rate
    if r1 < 1 then r1 = 1 end
    ttl = math.max(cdiv(capU, r1) + slack, 1000)
`

// clockLua follows "local now = <argument>": now becomes its number of
// ms, or Redis TIME if it is "" (inline, not a helper: one closure fewer
// per call).
const clockLua = `
if now == '' then
  local tm = redis.call('TIME')
  now = tonumber(tm[1]) * 1000 + idiv(tonumber(tm[2]), 1000)
else now = tonumber(now) end
`

// globalLocals and globalHelpers are the helpers of global buckets, as
// assignments to locals, so that the check script builds them only once
// it meets a global bucket.
const globalLocals = `
local shareOf, loadmarker, runid, currentrun, live, enforced, bootfill
`

const globalHelpers = `
-- the share of x for u of UN units: floor(x*u/UN), exact while UN <= 2^26
shareOf = function(x, u, UN)
  local q = idiv(x, UN)
  return q * u + idiv((x - q * UN) * u, UN)
end
-- marker: inc, seq (+ 2^47 for a boot marker), units, applied at, lease
-- expiry (ms), then the run id
loadmarker = function(key)
  local s = redis.call('GET', key)
  if not s then return nil end
  if #s < 30 then return error('redisstore: bad marker in ' .. key) end
  local i, q, u, at, exp = unpackle('<I6I6I6I6I6', s)
  local boot = q >= 140737488355328
  if boot then q = q - 140737488355328 end
  return {inc = i, seq = q, units = u, at = at, exp = exp, run = string.sub(s, 31), boot = boot}
end
-- the server's run id (INFO server); EmbeddedRunID where the server
-- answers that INFO server is not supported (an embedded server)
currentrun = function()
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
live = function(m, now)
  return m and m.at <= now and now < m.exp and m.run == currentrun()
end
-- the units a global key enforces (rinc: its record's incarnation, or nil)
enforced = function(m, now, UN, F, rinc, runits)
  local u = F
  if live(m, now) then
    if rinc == nil then u = m.units elseif rinc == m.inc then u = runits end
  end
  if u > UN then u = UN end
  return u
end
-- the boot fill (package doc): tokens t settled at the e units last
-- enforced, plus the capacity of min(u, default) above the floor's, if m
-- is a boot marker in force, e the floor and u (the units enforced since
-- the marker's Create) above it
bootfill = function(m, now, t, e, F, u, C, UN)
  if e == F and u > F and m and m.boot and live(m, now) then
    if u > m.units then u = m.units end
    t = t + (shareOf(C, u, UN) - shareOf(C, F, UN)) * 1000
  end
  return t
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
const checkSrc = prelude + windowPrelude + globalLocals + `
local cost = tonumber(ARGV[1])
local now = ARGV[2]` + clockLua + `
local slack = tonumber(ARGV[3])
local costU = cost * U
` + checkFast + tbHelpers + checkBody

// checkFast, tbHelpers, checkBody: the check script's evaluation of one
// call (KEYS, ARGV, cost, costU, now and slack set), which ends with its
// reply; multiSrc runs it once per call.
const checkFast = `
if #ARGV == 7 and ARGV[4] == '1' then
  -- one regional token bucket, the most common call: no plans (the same
  -- steps as the general path below, for one bucket)
`

const checkBody = `
  local key, cap, rate = KEYS[1], tonumber(ARGV[5]), tonumber(ARGV[6])
  local t, l = loadtb(key, now)
  local capU = cap * 1000
  if t == nil then t = capU; l = now end
  t = refill(t, now - l, capU, rate)
  local ok, t1, retry, ttl
` + tbDecide + `
  local all = ok or ARGV[7] == '1'
  if ok then t = t1 end
  if all or now < l then savetb(key, ttl, capU, t, now) end
  local rem, reset = idiv(t, U), -1
  if rem < 0 then rem = 0 end
  if t >= capU then reset = 0 elseif rate ~= 0 then reset = cdiv(capU - t, rate) end
  return {all and 1 or 0, ok and 1 or 0, idiv(cap, 1000), rem, retry, reset}
end

local markers, gunits -- built at the first global bucket
local logadd -- built at the first sliding log

-- the plans: 17 values per bucket (one table, sized for one bucket):
-- key, alg, ok, limit, retry, ttl, then by algorithm (x: unused)
--   token, leaky bucket: t0, t1, capU, rate, back, changed, u, rinc, rseq, ru
--   fixed window: n0, n1, w, reset, L, x, x, rinc, rseq, ru, back
--   sliding window: c0, c1, w, pc, L, W, off, rinc, rseq, ru, back
--   sliding log: cnt0, cnt1, eff, W, reset0, L, d
-- (t0, n0, c0, cnt0: the state if the request is not taken; t1, n1, c1,
-- cnt1: if it is; rinc, rseq, ru: the share record kept, if any; back: the
-- clock is before the stored window, which the state moves to; d: the
-- clock is d ms before the log's newest entry, and the log moves back by
-- d: both written whether the call is allowed or not, and only in the
-- second pass, so that a call that fails in the first writes nothing)
local P = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
local all = true
local base, i = 3, 0
while base < #ARGV do
  local k = 17 * i
  i = i + 1
  local key = KEYS[i]
  local alg = tonumber(ARGV[base + 1])
  local a = tonumber(ARGV[base + 2])
  local b = tonumber(ARGV[base + 3])
  local ok
  -- build the helpers of this kind of bucket, once
  if alg == 1 or alg == 5 or alg == 6 then
    if not savetb then
` + tbHelpers + `
    end
  elseif alg ~= 4 and not savewin then
` + winHelpers + `
  elseif alg == 4 and not logadd then
    -- logadd adds the n members pair(1..n) gives (score, member) to the
    -- sorted set key, 100 to a ZADD, then sets its TTL
    logadd = function(key, n, pair, ttl)
      local args = {}
      for j = 1, n do
        local sc, mb = pair(j)
        args[#args + 1] = sc
        args[#args + 1] = mb
        if #args >= 200 or j == n then
          redis.call('ZADD', key, unpack(args))
          args = {}
        end
      end
      redis.call('PEXPIRE', key, ttl)
    end
  end
  if alg >= 6 and not markers then
    markers = {}
` + globalHelpers + `
    -- the units a global key enforces and the total (rinc, ru: its
    -- record's incarnation and units*2+release, nil if none)
    gunits = function(base, rinc, ru)
      local UN, F, mk = tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
      local m = markers[mk]
      if m == nil then m = loadmarker(KEYS[mk]) or false; markers[mk] = m end
      if rinc then return enforced(m, now, UN, F, rinc, idiv(ru, 2)), UN, m, F end
      return enforced(m, now, UN, F, nil, 0), UN, m, F
    end
  end
  if alg == 1 or alg == 6 then
    -- token bucket; t in millionths of a token, l in ms
    local t, l, e, oc, orate, rinc, rseq, ru = loadtb(key, now)
    local cap, rate, changed, u = a, b, false, nil
    if alg == 6 then
      -- global: enforce a share of the global capacity a and rate b
      local UN, gm, F
      u, UN, gm, F = gunits(base, rinc, ru)
      cap = shareOf(a, u, UN); rate = shareOf(b, u, UN)
      local capU = cap * 1000
      if t == nil then t = capU; l = now
      else
        -- settle at the rate and capacity the bucket last saw (e, or the
        -- earlier layouts' c and r; none: no credit), then clamp to the
        -- new capacity
        if e then oc = shareOf(a, e, UN); orate = shareOf(b, e, UN) end
        if oc then t = refill(t, now - l, oc * 1000, orate) end
        if e then t = bootfill(gm, now, t, e, F, u, a, UN) end
        if t > capU then t = capU end
        changed = oc ~= cap or orate ~= rate
      end
    else
      -- a regional check keeps only the tokens of a global state
      rinc = nil
      if t == nil then t = cap * 1000; l = now end
      t = refill(t, now - l, cap * 1000, rate)
    end
    local capU = cap * 1000
    local t1, retry, ttl
` + tbDecide + `
    -- a record that is not a Release record keeps the key's TTL (the
    -- hold its writer renews) or its persistence
    if rinc and ru % 2 == 0 then ttl = 0 end
    P[k + 1], P[k + 2], P[k + 3], P[k + 4], P[k + 5], P[k + 6] = key, alg, ok, idiv(cap, 1000), retry, ttl
    P[k + 7], P[k + 8], P[k + 9], P[k + 10], P[k + 11], P[k + 12] = t, t1, capU, rate, now < l, changed
    P[k + 13], P[k + 14], P[k + 15], P[k + 16] = u, rinc, rseq, ru
  elseif alg == 5 then
    -- leaky bucket (meter); t = level in millionths of a token
    local s = redis.call('GET', key)
    local lv, l = 0, now
    if s then
      if #s ~= 12 then return error('redisstore: bad state in ' .. key) end
      lv, l = unpackle('<I6I6', s)
    end
    local capU, rate = a * 1000, b
    local el = now - l
    if el < 0 then el = 0 end
    if lv > 0 then
      if el >= cdiv(lv, rate) then lv = 0 else lv = lv - el * rate end
    end
    local t1, retry = lv, 0
    ok = lv + costU <= capU
    if ok then t1 = lv + costU; retry = cdiv(lv, rate)
    elseif costU > capU then retry = -1
    else retry = cdiv(lv + costU - capU, rate) end
    P[k + 1], P[k + 2], P[k + 3], P[k + 4], P[k + 5], P[k + 6] = key, alg, ok, idiv(a, 1000), retry, math.max(cdiv(capU, rate) + slack, 1000)
    P[k + 7], P[k + 8], P[k + 9], P[k + 10], P[k + 11], P[k + 12] = lv, t1, capU, rate, now < l, false
    P[k + 13], P[k + 14], P[k + 15], P[k + 16] = nil, nil, nil, nil
  elseif alg == 3 or alg == 7 then
    -- fixed window: w = window index, n = count
    local L, W = a, b
    local w, n, _, rinc, rseq, ru = loadwin(key, 2)
    if alg == 7 then
      -- global: the share of the global limit a
      local u, UN = gunits(base, rinc, ru)
      L = shareOf(a, u, UN)
    else
      rinc = nil
    end
    local wi = idiv(now, W)
    if w == nil then w = wi; n = 0 end
    local back = wi < w
    if wi > w then n = 0 end
    w = wi
    local off = now - w * W
    local n1, retry = n, 0
    ok = n + cost <= L
    if ok then n1 = n + cost
    elseif cost > L then retry = -1
    else retry = W - off end
    local ttl = math.max(W - off + slack, 1000)
    if rinc and ru % 2 == 0 then ttl = 0 end
    P[k + 1], P[k + 2], P[k + 3], P[k + 4], P[k + 5], P[k + 6] = key, alg, ok, L, retry, ttl
    P[k + 7], P[k + 8], P[k + 9], P[k + 10], P[k + 11] = n, n1, w, W - off, L
    P[k + 14], P[k + 15], P[k + 16], P[k + 17] = rinc, rseq, ru, back
  elseif alg == 2 or alg == 8 then
    -- sliding window counter: w = current window index, c = its count, pc = previous window's count
    local L, W = a, b
    local w, c, pc, rinc, rseq, ru = loadwin(key, 3)
    if alg == 8 then
      local u, UN = gunits(base, rinc, ru)
      L = shareOf(a, u, UN)
    else
      rinc = nil
    end
    local wi = idiv(now, W)
    if w == nil then w = wi; c = 0; pc = 0 end
    local back = wi < w
    if wi == w + 1 then pc = c; c = 0 elseif wi > w + 1 then pc = 0; c = 0 end
    w = wi
    local off = now - w * W
    ok = false
    if cost <= L then ok = c * W + pc * (W - off) + cost * W <= L * W end
    local c1, retry = c, 0
    if ok then c1 = c + cost
    elseif cost > L then retry = -1
    elseif c + cost <= L then retry = W - idiv((L - c - cost) * W, pc) - off
    else retry = (W - off) + W - idiv((L - cost) * W, c) end
    local ttl = math.max(2 * W - off + slack, 1000)
    if rinc and ru % 2 == 0 then ttl = 0 end
    P[k + 1], P[k + 2], P[k + 3], P[k + 4], P[k + 5], P[k + 6] = key, alg, ok, L, retry, ttl
    P[k + 7], P[k + 8], P[k + 9], P[k + 10], P[k + 11], P[k + 12], P[k + 13] = c, c1, w, pc, L, W, off
    P[k + 14], P[k + 15], P[k + 16], P[k + 17] = rinc, rseq, ru, back
  elseif alg == 4 then
    -- sliding log: one sorted-set member per token, scored by its time
    local L, W = a, b
    local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local eff, last, d = now, nil, 0
    if top[2] then
      last = tonumber(top[2])
      -- a clock stepped back past the newest entry (see doc.go, Clocks):
      -- every entry is read, and written back when the call is answered,
      -- d earlier, the newest at now, so that each leaves the window as
      -- long after the step as it would have without it
      if last > now then d = last - now; last = now end
    end
    local lo = '(' .. string.format('%.0f', eff - W + d)
    local cnt = redis.call('ZCOUNT', key, lo, '+inf')
    local cnt1, retry = cnt, 0
    ok = cnt + cost <= L
    if ok then cnt1 = cnt + cost
    elseif cost > L then retry = -1
    else
      local r = redis.call('ZRANGEBYSCORE', key, lo, '+inf', 'WITHSCORES', 'LIMIT', cnt + cost - L - 1, 1)
      retry = tonumber(r[2]) - d + W - eff
    end
    local reset0 = 0
    if cnt > 0 then reset0 = last + W - eff end
    P[k + 1], P[k + 2], P[k + 3], P[k + 4], P[k + 5], P[k + 6] = key, alg, ok, L, retry, math.max(W + slack, 1000)
    P[k + 7], P[k + 8], P[k + 9], P[k + 10], P[k + 11], P[k + 12], P[k + 13] = cnt, cnt1, eff, W, reset0, L, d
  else
    return redis.error_reply('ERR redisstore: unknown algorithm code ' .. tostring(alg))
  end
  if not ok and ARGV[base + 4] ~= '1' then all = false end
  if alg >= 6 then base = base + 7 else base = base + 4 end
end

local out
if i == 0 then out = {1} end
for j = 0, i - 1 do
  local key, alg, ok, limit, retry, ttl, x0, x1, v9, v10, v11, v12, v13, rinc, rseq, ru, back = unpack(P, 17 * j + 1, 17 * j + 17)
  local take = all and ok
  local rem, reset
  if alg == 1 or alg == 6 or alg == 5 then
    local t, capU, rate = x0, v9, v10
    if take then t = x1 end
    if all or v11 or v12 then
      -- also after a clock step back (v11): the bucket's time follows the
      -- clock (settled level, nothing consumed), so refill resumes at once;
      -- and after a share change (v12), so the next check settles at the
      -- new rate
      if alg == 6 then savetb(key, ttl, nil, t, now, v13, rinc, rseq, ru)
      elseif alg == 1 then savetb(key, ttl, capU, t, now)
      else savetb(key, ttl, nil, t, now) end
    end
    if alg ~= 5 then
      rem = idiv(t, U)
      if t >= capU then reset = 0 elseif rate == 0 then reset = -1 else reset = cdiv(capU - t, rate) end
    else
      rem = idiv(capU - t, U)
      reset = cdiv(t, rate)
    end
  elseif alg == 3 or alg == 7 then
    local n = x0
    if take then n = x1 end
    -- back: the count goes on in the current window (a clock step back),
    -- written whether the call was allowed or not
    if all or back then savewin(key, ttl, v9, n, nil, rinc, rseq, ru) end
    rem = v11 - n
    reset = v10
  elseif alg == 2 or alg == 8 then
    local c, pc, L, W, off = x0, v10, v11, v12, v13
    if take then c = x1 end
    if all or back then savewin(key, ttl, v9, c, pc, rinc, rseq, ru) end
    rem = idiv(L * W - c * W - pc * (W - off), W)
    if c > 0 then reset = (W - off) + W elseif pc > 0 then reset = W - off else reset = 0 end
  else
    local cnt, eff, W = x0, v9, v10
    reset = v11
    if v13 > 0 then
      -- the log moved back by v13 (a clock step back)
      local es = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      redis.call('DEL', key)
      local same = {}
      logadd(key, #es / 2, function(e)
        local sc = string.format('%.0f', tonumber(es[2 * e]) - v13)
        same[sc] = (same[sc] or 0) + 1
        return sc, sc .. '.' .. same[sc]
      end, ttl)
    end
    if take then
      cnt = x1
      reset = W
      redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', eff - W))
      local score = string.format('%.0f', eff)
      local same = redis.call('ZCOUNT', key, score, score)
      logadd(key, cost, function(n) return score, score .. '.' .. string.format('%.0f', same + n) end, ttl)
    end
    rem = v12 - cnt
  end
  if rem < 0 then rem = 0 end
  if j == 0 then out = {all and 1 or 0, ok and 1 or 0, limit, rem, retry, reset}
  else
    local o = 5 * j + 1
    out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = ok and 1 or 0, limit, rem, retry, reset
  end
end
return out
`

// multiSrc evaluates several calls in one script call, each as checkSrc
// does (all-or-nothing within a call, independent between calls), with
// one TIME for all: the EVALSHA and the clock, about a quarter of a
// simple check's instructions, are paid once.
//
// KEYS: each call's keys (as checkSrc's), one call after another. ARGV[1]:
// now in ms, or "" to read TIME; ARGV[2]: TTL slack in ms; then per call:
// its number of keys, its number of bucket values (checkSrc's ARGV from
// 4), its cost, then those values.
//
// Reply: the calls' checkSrc replies, concatenated. A call whose
// evaluation raised an error (a Redis error or a bad state, caught by
// pcall: the other calls still run) is -1, the length of the error's
// message, then its bytes (an integer each).
var multiSrc = prelude + windowPrelude + globalLocals + `
local now = ARGV[1]` + clockLua + `
local slack = tonumber(ARGV[2])
-- one call: its keys are KEYS[ko + 1], ..., its checkSrc ARGV[x] (x >= 4)
-- is ARGV[ao + x] and nargs its checkSrc #ARGV (no tables built per call)
local function one(ko, ao, nargs, cost)
  local costU = cost * U
` + callArgs.Replace(checkFast) + `
  if not savetb then
` + tbHelpers + `
  end
` + callArgs.Replace(checkBody) + `
end
local out, n, ki, ai, na = {}, 0, 0, 3, #ARGV
while ai <= na do
  local nk, nb = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
  local ok, r = pcall(one, ki, ai - 1, 3 + nb, tonumber(ARGV[ai + 2]))
  ki, ai = ki + nk, ai + 3 + nb
  if ok and r.err == nil then
    for j = 1, #r do out[n + j] = r[j] end
    n = n + #r
  else
    local msg
    if type(r) == 'table' and r.err then msg = r.err else msg = 'ERR ' .. tostring(r) end
    out[n + 1], out[n + 2] = -1, #msg
    for j = 1, #msg do out[n + 2 + j] = string.byte(msg, j) end
    n = n + 2 + #msg
  end
end
return out
`

// callArgs rewrites checkSrc's evaluation of one call for multiSrc: the
// call's keys and arguments are at offsets in KEYS and ARGV. It rewrites
// text, so checkFast and checkBody must reach a call's keys and arguments
// only as KEYS[...], ARGV[...] and #ARGV (never #KEYS, unpack(KEYS) or a
// local alias of the tables); TestDifferentialMulti is what catches a slip.
var callArgs = strings.NewReplacer("KEYS[", "KEYS[ko + ", "ARGV[", "ARGV[ao + ", "#ARGV", "nargs")

// sharesSrc writes one key's share record (WriteShares).
//
// KEYS[1]: the token-bucket key; KEYS[2]: the rule's marker key. ARGV: inc,
// seq, units, release (0/1), global capacity, global rate, total units,
// floor units, ttl ms (Release records), now ms or "" for TIME, slack ms,
// hold ms (any other record; 0: persistent).
// Reply: {inc, seq}, the record version the key holds afterwards.
const sharesSrc = prelude + tbHelpers + globalLocals + globalHelpers + `
local key = KEYS[1]
local inc, seq, units, rel = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local C, R, UN, F = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])
local now = ARGV[10]` + clockLua + `
local slack = tonumber(ARGV[11])
local hold = tonumber(ARGV[12])
local t, l, e, oc, orate, hinc, hseq, hru = loadtb(key, now)
if hinc and (inc < hinc or (inc == hinc and seq < hseq)) then return {hinc, hseq} end
local m = loadmarker(KEYS[2]) or false
local u = enforced(m, now, UN, F, inc, units)
local cap, rate = shareOf(C, u, UN), shareOf(R, u, UN)
local capU = cap * 1000
if t == nil then t = capU
else
  -- settle at the rate and capacity the bucket last saw (e, or the
  -- earlier layouts' c and r; none: no credit)
  if e then oc = shareOf(C, e, UN); orate = shareOf(R, e, UN) end
  if oc then t = refill(t, now - l, oc * 1000, orate) end
  -- the boot fill at the units enforced until now (the held record's or
  -- the default)
  if e then
    local uo
    if hinc then uo = enforced(m, now, UN, F, hinc, idiv(hru, 2)) else uo = enforced(m, now, UN, F, nil, 0) end
    t = bootfill(m, now, t, e, F, uo, C, UN)
  end
  if t > capU then t = capU end
end
if rel == 0 then ttl = hold end
if rel == 1 or hold > 0 then
  local r1 = rate
  if r1 < 1 then r1 = 1 end
  local want = cdiv(capU, r1) + slack
  if ttl > want then want = ttl end
  if want < 1000 then want = 1000 end
  savetb(key, want, nil, t, now, u, inc, seq, units * 2 + rel)
else
  savetb(key, -1, nil, t, now, u, inc, seq, units * 2 + rel)
end
return {inc, seq}
`

// markerSrc writes a rule's marker (WriteMarker).
//
// KEYS[1]: the marker key. ARGV: inc, seq, units, lease ms, create (0/1),
// run id, now ms or "" for TIME; then the latest lease end in ms on this
// server's clock (absent or "": the lease ends at now + lease; WriteMarker
// sends its clock read before the write plus the lease) and, in a Cluster,
// the run id of the master the copy must be on.
// Reply: {inc, seq}, the version of the marker the store holds afterwards
// ({0, 0}: none, or one of another server run, which counts as none).
const markerSrc = prelude + globalLocals + globalHelpers + `
local key = KEYS[1]
local inc, seq, units, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local create, boot, run = ARGV[5] == '1' or ARGV[5] == '2', ARGV[5] == '2', ARGV[6]
local now = ARGV[7]` + clockLua + `
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
-- a boot marker: a first incarnation's boot Create (its writer's first
-- Create, no store reset seen: ARGV[5] 2) over no marker of this run,
-- or a write of its incarnation and default units over a boot marker in
-- force (package doc, "The boot fill"); flagged by 2^47 in seq
local q = seq
if (m and m.boot and inc == m.inc and units == m.units and live(m, now)) or (not m and boot and inc == 1) then
  q = seq + 140737488355328
end
redis.call('SET', key, packle('<I6I6I6I6I6', inc, q, units, now, exp) .. cur)
return {inc, seq}
`
