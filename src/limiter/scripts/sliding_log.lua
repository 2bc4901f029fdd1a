-- Sliding-window log: one sorted set per limit. Part of decide.lua (concatenated at compile
-- time, after prelude.lua, whose floor, ceil and format it uses); defines the functions the
-- driver calls, touches only the key it is given.
--
-- KEYS       the limit's sorted set: members are admitted requests (one per unit of cost),
--            scores their admission time in microseconds on the Redis server's clock.
-- limit      requests, window (us), burst (unused), cost
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the number
--            of entries and the pivot (below); record: remaining, reset_us
--
-- Entries are in the future: an admission is recorded at the time it is forwarded (later for
-- a delayed request) plus the lateness bound (decide.lua's ARGV[2]), the longest sluice may
-- take to forward it after Redis decided; the check counts them, since it only removes
-- entries that have left the window.
--
-- Scores and indexes are written with format('%d') (prelude.lua), an exact integer
-- conversion: Lua would print a 16-digit number with 14 significant digits.

-- The score of the entry at `index` (0 = the oldest).
local function sliding_log_score(key, index)
  local i = format('%d', index)
  return tonumber(redis.call('ZRANGE', key, i, i, 'WITHSCORES')[2])
end

local function sliding_log_check(key, now, requests, window, burst, cost)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now - window))
  local n = redis.call('ZCARD', key)
  local remaining = requests - n
  if remaining < 0 then
    remaining = 0
  end
  -- The pivot: the entry whose departure gives more room, for a full key the
  -- (n - requests)-th oldest, otherwise the oldest.
  local pivot_index = n - requests
  if pivot_index < 0 then
    pivot_index = 0
  end
  local reset, pivot = 0, 0
  if n > 0 then
    pivot = sliding_log_score(key, pivot_index)
    reset = pivot + window - now
  end
  if n + cost > requests then
    -- Room for `cost` more once the (n + cost - requests)-th oldest entry has left: for a
    -- cost of 1, the pivot already read.
    local index = n + cost - requests - 1
    local wait = window
    if index == pivot_index and n > 0 then
      wait = pivot + window - now
    elseif index < n then
      wait = sliding_log_score(key, index) + window - now
    end
    return false, wait, remaining, reset, n, pivot
  end
  return true, 0, remaining, reset, n, pivot
end

-- A log (this file's, and the weighted one's, which shares this) lives until its newest entry leaves
-- the window. An entry lands after the others only on a route with a delay limit (which then
-- applies to every request of the route: `sluice check` refuses `when:` on it), so only there
-- is the newest entry read; otherwise it is `at`, the entry just added. (Every instance adds
-- the same lateness, its store timeout from the same policy; one whose timeout is larger
-- during a rolling change could see its newest entry leave up to the difference early.)
local function log_expire(key, now, window, at, delays)
  local newest = at
  if delays then
    local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
    if last > newest then
      newest = last
    end
  end
  redis.call('PEXPIRE', key, format('%d', ceil((newest - now + window) / 1000)))
end

local function sliding_log_record(key, now, requests, window, burst, cost, n, pivot, member,
                                  at, delays, _, lateness)
  -- Counted until `lateness` after the time it is forwarded at (decide.lua's ARGV[2]).
  at = at + lateness
  local score = format('%d', at)
  if cost == 1 then
    redis.call('ZADD', key, score, member .. ':1')
  else
    -- One entry per unit of cost, added in batches: unpack() is limited by Lua's C stack.
    local args = {}
    for j = 1, cost do
      args[#args + 1] = score
      args[#args + 1] = member .. ':' .. j
      if #args == 1000 or j == cost then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
  end
  log_expire(key, now, window, at, delays)
  local m = n + cost
  local index = m - requests
  if index < 0 then
    index = 0
  end
  local before = n - requests
  if before < 0 then
    before = 0
  end
  -- The pivot moves only when the key was empty, a cost above 1 passes it, or the new
  -- entries land before it (in the future, it can be later than now); otherwise no extra
  -- read is needed.
  if n == 0 then
    pivot = at
  elseif index ~= before or pivot > at then
    pivot = sliding_log_score(key, index)
  end
  local remaining = requests - m
  if remaining < 0 then
    remaining = 0
  end
  return remaining, pivot + window - now
end

-- Gives back `back` of the request's entries (release.lua): member:keep+1 .. member:keep+back.
-- Exact. Whether any was there.
local function sliding_log_release(key, now, requests, window, back, keep, member)
  local members, removed = {}, 0
  for j = keep + 1, keep + back do
    members[#members + 1] = member .. ':' .. j
    if #members == 1000 or j == keep + back then
      removed = removed + redis.call('ZREM', key, unpack(members))
      members = {}
    end
  end
  return removed > 0
end

-- Charges `extra` more to a request recorded with `cost` (release.lua), if member:cost is
-- still there: min(extra, requests) entries member:cost+1 .. at its entries' score (a window
-- full of the request's entries admits nothing more until they leave, so entries past the
-- limit would change no decision). Whether anything was charged.
local function sliding_log_charge(key, requests, extra, cost, member)
  local score = redis.call('ZSCORE', key, member .. ':' .. cost)
  if not score then
    return false
  end
  local last = cost + math.min(extra, requests)
  local args = {}
  for j = cost + 1, last do
    args[#args + 1] = score
    args[#args + 1] = member .. ':' .. j
    if #args == 1000 or j == last then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  return true
end
