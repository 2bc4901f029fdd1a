-- The driver: one or more requests, each with every limit of its own (of any mix of
-- algorithms), decided in order in one atomic call. The Redis store batches the decisions
-- waiting on one connection into one call (see redis/batch.rs); a single decision is a batch
-- of one. Concatenated after sliding_log.lua, weighted_log.lua, sliding_window.lua,
-- fixed_window.lua, gcra.lua and calendar.lua at compile time (see src/limiter/redis/scripts.rs), whose
-- check and record functions it calls.
--
-- KEYS         every key of every request, request after request: request r's k_r keys, one
--              per limit, of the type its algorithm keeps
-- ARGV[1]      n, the number of requests
-- then, per request r in order:
--   member     a name unique to the request (instance id and sequence number), so two
--              requests admitted in the same microsecond never collapse into one entry
--   k_r        its number of keys (limits)
--   7 per key  the limit of its i-th key: algorithm (sliding_log | weighted_log |
--              sliding_window | fixed_window | gcra | calendar), requests, window in
--              microseconds (for a calendar quota: the time left in its period), burst, cost,
--              shadow (1: the limit is counted but never rejects), max delay in microseconds
--              (`on_exceed: delay`; 0: a limit without room rejects)
--
-- Returns, flat, request after request, 4 + 3 k_r numbers each:
--          {admitted, retry_after_us, now_us, at_us, remaining_1, reset_us_1, rejecting_1,
--           remaining_2, ...}
--   admitted        1 if the request was admitted and recorded under every key, 0 if it was
--                   rejected and recorded under none
--   retry_after_us  for a rejection, the time until every rejecting limit admits it
--   now_us          the Redis TIME the decision was made at (one TIME for the whole call)
--   at_us           for an admission, when it is recorded in the exact algorithms: now_us,
--                   or later for a request delayed by a limit with a max delay (the longest
--                   wait among those limits; every other limit must admit it now)
--   remaining_i     requests (of cost 1) key i would still admit now
--   reset_us_i      time until key i admits one more than now (0 when it holds nothing)
--   rejecting_i     1 if key i had no room for the request (for a shadow limit: would have
--                   rejected it), else 0
--
-- Each request is all-or-nothing, as if it had been sent alone: every key is checked before
-- any is recorded, a rejection records nothing anywhere, and a later request of the batch
-- sees what the earlier ones recorded. A shadow limit without room neither rejects the
-- request nor records it in itself. A delayed request is recorded at at_us in sliding_log
-- and gcra (see sliding_log.rs for why the log stays exact), at now in the counters. Every
-- key written gets an expiry from its algorithm's record function. The clock is Redis TIME,
-- so gateways with skewed clocks still agree.

local algorithms = {
  sliding_log = {check = sliding_log_check, record = sliding_log_record},
  weighted_log = {check = weighted_log_check, record = weighted_log_record},
  sliding_window = {check = sliding_window_check, record = sliding_window_record},
  fixed_window = {check = fixed_window_check, record = fixed_window_record},
  gcra = {check = gcra_check, record = gcra_record},
  calendar = {check = calendar_check, record = calendar_record},
}

-- Decides one request whose keys are KEYS[first + 1 .. first + count] and whose limits start
-- at ARGV[base]; appends its answer to `result`. Nil, or an error reply to return.
local function decide(first, count, base, member, now, result)
  -- Whether some limit of the request may delay it: sliding_log keys may then hold future
  -- entries, which their expiry must cover.
  local delays = false
  for i = 1, count do
    if tonumber(ARGV[base + 7 * i - 1]) > 0 then
      delays = true
    end
  end

  local limits, states = {}, {}
  local admitted = 1
  local retry_after = 0
  local delay = 0
  for i = 1, count do
    local at = base + 7 * (i - 1)
    local limit = {
      algorithm = algorithms[ARGV[at]],
      requests = tonumber(ARGV[at + 1]),
      window = tonumber(ARGV[at + 2]),
      burst = tonumber(ARGV[at + 3]),
      cost = tonumber(ARGV[at + 4]),
      shadow = ARGV[at + 5] == '1',
      max_delay = tonumber(ARGV[at + 6]),
      delays = delays,
    }
    if not limit.algorithm then
      return redis.error_reply('unknown algorithm ' .. tostring(ARGV[at]))
    end
    limits[i] = limit
    states[i] = limit.algorithm.check(KEYS[first + i], now, limit)
    if not states[i].ok and not limit.shadow then
      if states[i].wait <= limit.max_delay then
        delay = math.max(delay, states[i].wait)
      else
        admitted = 0
      end
      retry_after = math.max(retry_after, states[i].wait)
    end
  end

  if admitted == 1 then
    retry_after = 0
  end
  local at = now + delay
  local n = #result
  result[n + 1], result[n + 2], result[n + 3], result[n + 4] = admitted, retry_after, now, at
  n = n + 4
  for i = 1, count do
    local remaining, reset = states[i].remaining, states[i].reset
    -- Recorded: every limit with room, and every limit that delays the request.
    if admitted == 1 and (states[i].ok or not limits[i].shadow) then
      remaining, reset = limits[i].algorithm.record(KEYS[first + i], now, limits[i], states[i],
                                                    member, at)
    end
    result[n + 1], result[n + 2], result[n + 3] = remaining, reset, states[i].ok and 0 or 1
    n = n + 3
  end
  return nil
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local result = {}
local first, base = 0, 2
for _ = 1, tonumber(ARGV[1]) do
  local member, count = ARGV[base], tonumber(ARGV[base + 1])
  local failed = decide(first, count, base + 2, member, now, result)
  if failed then
    return failed
  end
  first = first + count
  base = base + 2 + 7 * count
end
return result
