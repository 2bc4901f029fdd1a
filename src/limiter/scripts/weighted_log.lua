-- Weighted sliding-window log: the sliding log with one entry per request, weighted by its
-- cost, for limits whose unit is not the request (token budgets). Exact like the sliding
-- log (the same window, the same arithmetic over units), but a request reserving 4,000
-- tokens is one entry, not 4,000. Part of decide.lua and peek.lua (concatenated at compile
-- time); defines the functions the driver calls, touches only the key it is given.
--
-- KEYS       the limit's sorted set: one member per admitted request, `<member>#<weight>`
--            (the request's member prefix, then the units it holds), scored with its
--            admission time in microseconds on the Redis server's clock. A settled request
--            is re-added with its new weight and the same score (release.lua).
-- limit      {requests (the limit in units), window (us), burst (unused), cost}
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}
--
-- A check reads every entry of the window: O(requests in the window), which for a token
-- budget is a few hundred at most where the plain sliding log would hold one entry per token.

-- The entries of the window, oldest first, as {score, weight} pairs, and their total weight.
local function weighted_log_entries(key, now, window)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now - window))
  local flat = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local entries, total = {}, 0
  for j = 1, #flat, 2 do
    local weight = tonumber(string.match(flat[j], '#(%d+)$')) or 0
    entries[#entries + 1] = {tonumber(flat[j + 1]), weight}
    total = total + weight
  end
  return entries, total
end

-- The time until `units` of the oldest entries have left the window; the window itself when
-- the entries do not hold that many (more than the limit was asked for).
local function weighted_log_until_freed(entries, units, now, window)
  local freed = 0
  for _, entry in ipairs(entries) do
    freed = freed + entry[2]
    if freed >= units then
      return entry[1] + window - now
    end
  end
  return window
end

-- {remaining, reset_us} for `total` units in the window: the reset is the time until one
-- more unit fits than now (for a full log, until any fits), zero when it holds nothing.
local function weighted_log_state(entries, total, now, limit)
  if total == 0 then
    return limit.requests, 0
  end
  local units = math.max(total - limit.requests + 1, 1)
  return math.max(limit.requests - total, 0),
    weighted_log_until_freed(entries, units, now, limit.window)
end

local function weighted_log_check(key, now, limit)
  local entries, total = weighted_log_entries(key, now, limit.window)
  local remaining, reset = weighted_log_state(entries, total, now, limit)
  local st = {entries = entries, count = total, remaining = remaining, reset = reset,
    ok = true, wait = 0}
  local needed = total + limit.cost - limit.requests
  if needed > 0 then
    st.ok = false
    if limit.cost > limit.requests then
      st.wait = limit.window
    else
      st.wait = weighted_log_until_freed(entries, needed, now, limit.window)
    end
  end
  return st
end

local function weighted_log_record(key, now, limit, st, member, at)
  redis.call('ZADD', key, string.format('%.0f', at), member .. '#' .. limit.cost)
  local newest = at
  if limit.delays then
    newest = math.max(at, tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]))
  end
  redis.call('PEXPIRE', key, math.ceil((newest - now + limit.window) / 1000))
  -- The new entry in its place among the others, for the state after it.
  local entries, placed = {}, false
  for _, entry in ipairs(st.entries) do
    if not placed and entry[1] > at then
      entries[#entries + 1] = {at, limit.cost}
      placed = true
    end
    entries[#entries + 1] = entry
  end
  if not placed then
    entries[#entries + 1] = {at, limit.cost}
  end
  return weighted_log_state(entries, st.count + limit.cost, now, limit)
end
