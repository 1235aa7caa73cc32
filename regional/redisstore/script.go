package redisstore

// The Lua scripts. Every value is an integer held in a Lua double; the
// limits in bucket.go keep every intermediate below 2^53, so the arithmetic
// is exact. State is packed with struct.pack('<I6...') (see doc.go); numbers
// that go into commands as text use string.format('%.0f'), because Lua's
// tostring would print large integers in exponent form.
//
// The Go reference model (model.go) implements the same steps in the same
// order; keep the two in step (the differential test compares them).

// checkSrc evaluates all buckets of one request.
//
// KEYS[i]: the bucket keys (distinct).
// ARGV[1]: cost (whole tokens); ARGV[2]: now in ms, or "" to read TIME;
// ARGV[3]: TTL slack in ms; then 4 values per bucket: algorithm code, a, b,
// shadow (0/1). Token/leaky bucket: a = capacity, b = rate (thousandths,
// thousandths per second). Window algorithms: a = limit, b = window in ms.
//
// Reply: {allowed, then per bucket: allowed, limit, remaining, retry_after_ms, reset_after_ms}.
const checkSrc = `
local U = 1000000
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) return -idiv(-a, b) end
local function fmt(x) return string.format('%.0f', x) end
-- state: a binary string of 6-byte little-endian unsigned integers
-- (load returns nil for a missing key, else exactly the stored values)
local function load(key, n1, n2)
  local s = redis.call('GET', key)
  if not s then return nil end
  local n = #s / 6
  if n ~= n1 and n ~= n2 then return error('redisstore: bad state in ' .. key) end
  local v = {struct.unpack('<' .. string.rep('I6', n), s)}
  v[n + 1] = nil
  return v
end
local function save(key, vals, ttl)
  local s = struct.pack('<' .. string.rep('I6', #vals), unpack(vals))
  if ttl > 0 then redis.call('SET', key, s, 'PX', ttl) else redis.call('SET', key, s, 'KEEPTTL') end
end

local cost = tonumber(ARGV[1])
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local tm = redis.call('TIME')
  now = tonumber(tm[1]) * 1000 + idiv(tonumber(tm[2]), 1000)
end
local slack = tonumber(ARGV[3])
local function ttlms(x)
  x = x + slack
  if x < 1000 then x = 1000 end
  return x
end

local plans = {}
local all = true
for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 3 + (i - 1) * 4
  local alg = tonumber(ARGV[base + 1])
  local a = tonumber(ARGV[base + 2])
  local b = tonumber(ARGV[base + 3])
  local p = {key = key, alg = alg, shadow = ARGV[base + 4] == '1'}
  if alg == 1 then
    -- token bucket; t in millionths of a token, l in ms
    local h = load(key, 2, 5) or {}
    local cap, rate = a, b
    if h[3] then cap = h[3]; rate = h[4]; p.share = {h[3], h[4], h[5]} end
    local capU = cap * 1000
    local t, l = h[1], h[2]
    if t == nil then t = capU; l = now end
    if t > capU then t = capU end
    p.back = now < l
    local el = now - l
    if el < 0 then el = 0 end
    if rate > 0 and t < capU then
      if el >= cdiv(capU - t, rate) then t = capU else t = t + el * rate end
    end
    local costU = cost * U
    p.ok = costU <= t
    p.limit = idiv(cap, 1000)
    p.t0 = t
    if p.ok then p.t1 = t - costU; p.retry = 0
    elseif costU > capU or rate == 0 then p.t1 = t; p.retry = -1
    else p.t1 = t; p.retry = cdiv(costU - t, rate) end
    p.cap = capU; p.rate = rate
    if rate > 0 then p.ttl = ttlms(cdiv(capU, rate)) else p.ttl = 0 end
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
  elseif alg == 3 then
    -- fixed window: w = window index, n = count
    local L, W = a, b
    local h = load(key, 2, 2) or {}
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
  elseif alg == 2 then
    -- sliding window counter: w = current window index, c = its count, p = previous window's count
    local L, W = a, b
    local h = load(key, 3, 3) or {}
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
end

local out = {all and 1 or 0}
for i = 1, #plans do
  local p = plans[i]
  local take = all and p.ok
  local rem, reset
  if p.alg == 1 or p.alg == 5 then
    local t = p.t0
    if take then t = p.t1 end
    if all or p.back then
      -- also after a clock step back: the bucket's time follows the clock
      -- (settled level, nothing consumed), so refill resumes at once
      if p.share then
        local ttl = p.ttl
        if ttl > 0 and redis.call('PTTL', p.key) >= ttl then ttl = 0 end
        save(p.key, {t, now, p.share[1], p.share[2], p.share[3]}, ttl)
      else
        save(p.key, {t, now}, p.ttl)
      end
    end
    if p.alg == 1 then
      rem = idiv(t, U)
      if t >= p.cap then reset = 0 elseif p.rate == 0 then reset = -1 else reset = cdiv(p.cap - t, p.rate) end
    else
      rem = idiv(p.cap - t, U)
      reset = cdiv(t, p.rate)
    end
  elseif p.alg == 3 then
    local n = p.n0
    if take then n = p.n1 end
    if all then
      save(p.key, {p.w, n}, p.ttl)
    end
    rem = p.L - n
    reset = p.reset
  elseif p.alg == 2 then
    local c = p.c0
    if take then c = p.c1 end
    if all then
      save(p.key, {p.w, c, p.pc}, p.ttl)
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

// shareSrc sets a region's share of a global token bucket.
//
// KEYS[1]: the token-bucket key. ARGV: capacity (thousandths), rate
// (thousandths per second), version, ttl ms, now ms or "" for TIME, slack ms.
// Reply: 1 if applied, 0 if the version was older than the stored one (ignored).
const shareSrc = `
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) return -idiv(-a, b) end

local key = KEYS[1]
local s = redis.call('GET', key)
local h = {}
if s then
  if #s ~= 12 and #s ~= 30 then return error('redisstore: bad state in ' .. key) end
  h = {struct.unpack('<' .. string.rep('I6', #s / 6), s)}
  h[#s / 6 + 1] = nil
end
local cap, rate, ver, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now
if ARGV[5] ~= '' then
  now = tonumber(ARGV[5])
else
  local tm = redis.call('TIME')
  now = tonumber(tm[1]) * 1000 + idiv(tonumber(tm[2]), 1000)
end
local slack = tonumber(ARGV[6])

local ov = h[5]
if ov and ver < ov then return 0 end
local capU = cap * 1000
local t, l = h[1], h[2]
if t == nil then
  t = capU
else
  local oc, orate = h[3], h[4]
  if oc then
    local ocU = oc * 1000
    if t > ocU then t = ocU end
    local el = now - l
    if el < 0 then el = 0 end
    if orate > 0 and t < ocU then
      if el >= cdiv(ocU - t, orate) then t = ocU else t = t + el * orate end
    end
  end
end
if t > capU then t = capU end
local want = ttl
if rate > 0 and cdiv(capU, rate) + slack > want then want = cdiv(capU, rate) + slack end
if want < 1000 then want = 1000 end
local cur = redis.call('PTTL', key)
if cur > want then want = cur end
redis.call('SET', key, struct.pack('<I6I6I6I6I6', t, now, cap, rate, ver), 'PX', want)
return 1
`
