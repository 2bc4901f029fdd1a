-- The driver: one or more requests, each with every limit of its own (of any mix of
-- algorithms), decided in order in one atomic call. The Redis store batches the decisions
-- waiting on one connection into one call (see redis/batch.rs); a single decision is a batch
-- of one. Concatenated after prelude.lua, every algorithm's file and the `check` and `record`
-- dispatchers generated from the algorithm table (src/limiter/algorithm.rs and
-- src/limiter/redis/scripts.rs): check(algorithm, key, now, requests, window, burst, cost)
-- and record(algorithm, key, now, requests, window, burst, cost, a, b, member, at, delays,
-- cost_arg, lateness) call `{algorithm}_check` and `{algorithm}_record`.
--
-- KEYS         every key of every request, request after request: request r's k_r keys, one
--              per limit, of the type its algorithm keeps
-- ARGV[1]      n, the number of requests
-- ARGV[2]      the lateness bound in microseconds: how long after this call sluice may still
--              forward a request it admits (the store timeout, which bounds the whole
--              decision: a later answer is a store error). The exact logs (their
--              record functions take it) record an admission that much later, so that what the upstream
--              receives, not only what Redis decided, stays within the limit in any window
-- then, per request r in order:
--   member     a name unique to the request (instance id and sequence number), so two
--              requests admitted in the same microsecond never collapse into one entry
--   k_r        its number of keys (limits)
--   7 per key  the limit of its i-th key: algorithm (a label of the algorithm table),
--              requests, window in microseconds (for a calendar quota: the time left in
--              its period), burst, cost,
--              flags (a sum: 1 shadow: the limit is counted but never rejects; 2 the
--              identity's override, if any, replaces requests (prelude.lua's `overridden`);
--              4 `notify`: 8 times the thresholds, packed (see `crossed` below), follow),
--              max delay in microseconds (`on_exceed: delay`; 0: a limit without room
--              rejects)
-- then         e, the number of lease ends (the ends of requests' concurrency leases queued
--              on the same connection, `RedisStore::end_lease`), and per end: its lease id
--              (the request's member) and its number of keys, which follow the requests'
--              in KEYS
--
-- Returns, flat, request after request, 4 + 3 k_r numbers each:
--          {admitted, retry_after_us, now_us, at_us, remaining_1, reset_us_1, rejecting_1,
--           remaining_2, ...}
--   admitted        1 if the request was admitted and recorded under every key, 0 if it was
--                   rejected and recorded under none
--   retry_after_us  for a rejection, the time until every rejecting limit admits it
--   now_us          the Redis TIME the decision was made at (one TIME for the whole call)
--   at_us           for an admission, when it is forwarded: now_us, or later for a request
--                   delayed by a limit with a max delay (the longest wait among those limits;
--                   every other limit must admit it now); the logs record it at at_us plus
--                   the lateness bound, the token bucket at at_us
--   remaining_i     requests (of cost 1) key i would still admit now
--   reset_us_i      time until key i admits one more than now (0 when it holds nothing)
--   rejecting_i     1 if key i had no room for the request (for a shadow limit: would have
--                   rejected it), else 0; plus twice the thresholds this admission newly
--                   crossed (bit t for the limit's t-th threshold, 5 bits); plus 64 times the
--                   identity's override when one was in force (0 without)
--
--          then per end, per key: 1 if the lease was there (HDEL), else 0
--
-- Each request is all-or-nothing, as if it had been sent alone: every key is checked before
-- any is recorded, a rejection records nothing anywhere, and a later request of the batch
-- sees what the earlier ones recorded. A shadow limit without room neither rejects the
-- request nor records it in itself. A delayed request is recorded at at_us by the algorithms
-- that delay in the store (the table's `delays_in_store`; their Rust modules say why they
-- stay exact), at now in the counters. Every
-- key written gets an expiry from its algorithm's record function. The clock is Redis TIME,
-- so gateways with skewed clocks still agree.

-- Each algorithm's check returns ok, wait_us, remaining, reset_us and two values of state its
-- record takes back (no table per limit); the state of a request's limits waits in `pending`,
-- one table reused by every request of the call; numbers from ARGV are converted once per
-- call. The driver runs in the script's body rather than in functions of its own: every
-- function is a closure made anew on each call, and capturing upvalues is what costs.

local argv, keys = ARGV, KEYS

-- ARGV's numbers by their text: a batch repeats the same few limits, and strtod is not free.
local numbers = {}
local function number(text)
  local value = tonumber(text)
  numbers[text] = value
  return value
end

-- Per limit of a request with several, 12 slots: requests, window, burst, cost, ok,
-- remaining, reset_us, the two values of state, whether it is a shadow limit, its override
-- and its flags.
local pending = {}

-- Threshold notifications (`notify`, src/limiter/thresholds.rs packs them): `packed` holds up
-- to 5 thresholds in permille of `requests` (the number in force), 10 bits each, lowest
-- first. A threshold is crossed by the admission that takes the use (requests - remaining)
-- from below it to at or past it; the first such admission of the window or period marks it
-- with SET NX beside the key (same hash tag, same Cluster slot), expiring after `window`
-- (microseconds: the window's length, a calendar quota's time left in its period), and only
-- it reports the crossing. Returns the thresholds this call marked, as bits.
local function crossed(key, packed, requests, window, before, after)
  local bits, bit, px = 0, 1, nil
  local used_before, used_after = requests - before, requests - after
  while packed > 0 do
    local permille = packed % 1024
    packed = (packed - permille) / 1024
    local need = permille * requests
    if used_after * 1000 >= need and used_before * 1000 < need then
      px = px or format('%d', math.max(1, ceil(window / 1000)))
      if redis.call('SET', key .. ':n' .. format('%d', permille), '1', 'NX', 'PX', px) then
        bits = bits + bit
      end
    end
    bit = bit * 2
  end
  return bits
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local result, n = {}, 0
-- Request r's keys are KEYS[first + 1 .. first + count]; its limits start at ARGV[base].
local lateness = tonumber(argv[2])
local first, base = 0, 3
for _ = 1, tonumber(argv[1]) do
  local member, count = argv[base], tonumber(argv[base + 1])
  base = base + 2
  if count == 1 then
    -- One limit (the most common): its state stays in locals.
    local algorithm, key = argv[base], keys[first + 1]
    local requests, window, burst, cost = argv[base + 1], argv[base + 2], argv[base + 3],
      argv[base + 4]
    requests, window = numbers[requests] or number(requests), numbers[window] or number(window)
    burst, cost = numbers[burst] or number(burst), numbers[cost] or number(cost)
    local flags, override = argv[base + 5], 0
    flags = numbers[flags] or number(flags)
    if flags % 4 >= 2 then
      requests, burst, override = overridden(key, requests, burst)
    end
    local ok, wait, remaining, reset, a, b = check(algorithm, key, now, requests, window, burst,
                                                   cost)
    if ok == nil then
      return redis.error_reply('unknown algorithm ' .. tostring(algorithm))
    end
    local shadow = flags % 2 == 1
    local admitted, retry_after, delay = 1, 0, 0
    if not ok and not shadow then
      if wait <= tonumber(argv[base + 6]) then
        if wait > 0 then
          delay = wait
        end
      else
        admitted = 0
        if wait > 0 then
          retry_after = wait
        end
      end
    end
    local at = now + delay
    result[n + 1], result[n + 2], result[n + 3], result[n + 4] = admitted, retry_after, now, at
    -- Recorded: a limit with room, or one that delays the request. (Sluice sends integers:
    -- a max delay of '0' is none.)
    local crossing = 0
    if admitted == 1 and (ok or not shadow) then
      local before = remaining
      remaining, reset = record(algorithm, key, now, requests, window, burst, cost, a, b,
                                member, at, argv[base + 6] ~= '0', argv[base + 4], lateness)
      if flags >= 4 then
        crossing = crossed(key, floor(flags / 8), requests, window, before, remaining)
      end
    end
    result[n + 5], result[n + 6], result[n + 7] = remaining, reset,
      (ok and 0 or 1) + 2 * crossing + 64 * override
    n = n + 7
  else
    -- Whether some limit of the request may delay it: a log's keys may then hold future
    -- entries, which their expiry must cover.
    local delays = false
    for i = 1, count do
      if argv[base + 7 * i - 1] ~= '0' then
        delays = true
      end
    end
    local admitted, retry_after, delay = 1, 0, 0
    for i = 1, count do
      local at = base + 7 * (i - 1)
      local requests, window, burst, cost = argv[at + 1], argv[at + 2], argv[at + 3],
        argv[at + 4]
      requests, window = numbers[requests] or number(requests), numbers[window] or number(window)
      burst, cost = numbers[burst] or number(burst), numbers[cost] or number(cost)
      local flags, override = argv[at + 5], 0
      flags = numbers[flags] or number(flags)
      if flags % 4 >= 2 then
        requests, burst, override = overridden(keys[first + i], requests, burst)
      end
      local ok, wait, remaining, reset, a, b = check(argv[at], keys[first + i], now, requests,
                                                     window, burst, cost)
      if ok == nil then
        return redis.error_reply('unknown algorithm ' .. tostring(argv[at]))
      end
      local shadow = flags % 2 == 1
      if not ok and not shadow then
        if wait <= tonumber(argv[at + 6]) then
          if wait > delay then
            delay = wait
          end
        else
          admitted = 0
        end
        if wait > retry_after then
          retry_after = wait
        end
      end
      local s = 12 * (i - 1)
      pending[s + 1], pending[s + 2], pending[s + 3], pending[s + 4] = requests, window, burst,
        cost
      pending[s + 5], pending[s + 6], pending[s + 7] = ok, remaining, reset
      pending[s + 8], pending[s + 9], pending[s + 10], pending[s + 11] = a, b, shadow, override
      pending[s + 12] = flags
    end
    if admitted == 1 then
      retry_after = 0
    end
    local at = now + delay
    result[n + 1], result[n + 2], result[n + 3], result[n + 4] = admitted, retry_after, now, at
    n = n + 4
    for i = 1, count do
      local s = 12 * (i - 1)
      local arg = base + 7 * (i - 1)
      local ok, remaining, reset = pending[s + 5], pending[s + 6], pending[s + 7]
      local crossing = 0
      -- Recorded: every limit with room, and every limit that delays the request.
      if admitted == 1 and (ok or not pending[s + 10]) then
        local before = remaining
        remaining, reset = record(argv[arg], keys[first + i], now, pending[s + 1],
                                  pending[s + 2], pending[s + 3], pending[s + 4],
                                  pending[s + 8], pending[s + 9], member, at, delays,
                                  argv[arg + 4], lateness)
        if pending[s + 12] >= 4 then
          crossing = crossed(keys[first + i], floor(pending[s + 12] / 8), pending[s + 1],
                             pending[s + 2], before, remaining)
        end
      end
      result[n + 1], result[n + 2], result[n + 3] = remaining, reset,
        (ok and 0 or 1) + 2 * crossing + 64 * pending[s + 11]
      n = n + 3
    end
  end
  first = first + count
  base = base + 7 * count
end
-- The lease ends, after every decision: HDEL of the lease's own id (concurrency.lua).
for _ = 1, tonumber(argv[base]) do
  local member, count = argv[base + 1], tonumber(argv[base + 2])
  base = base + 2
  for i = 1, count do
    n = n + 1
    result[n] = redis.call('HDEL', keys[first + i], member)
  end
  first = first + count
end
return result
