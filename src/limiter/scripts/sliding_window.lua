-- Weighted counter (approximation): the current window's count plus the previous window's,
-- weighted by how much of the previous window a window ending now still covers.
-- Part of decide.lua (concatenated at compile time, after prelude.lua, whose floor, ceil and
-- format it uses).
--
-- KEYS       the limit's hash: w = index of the current window (now / window),
--            c = its count, p = the previous window's count. Absent = both empty.
-- limit      requests, window (us), burst (unused), cost
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the current
--            and previous windows' counts; record: remaining, reset_us

-- Time until the weighted count falls to `target` or below, with no new admissions.
local function sliding_window_wait(cur, prev, elapsed, window, target)
  if target < 0 then
    target = 0
  end
  local count = cur + prev * (1 - elapsed / window)
  if count <= target then
    return 0
  end
  if cur <= target then
    return ceil(window * (1 - (target - cur) / prev) - elapsed)
  end
  return ceil((window - elapsed) + window * (1 - target / cur))
end

-- remaining, reset_us for counts `cur` and `prev`, `elapsed` us into the current window.
local function sliding_window_state(cur, prev, elapsed, requests, window)
  local count = cur + prev * (1 - elapsed / window)
  local remaining = floor(requests - count)
  if remaining < 0 then
    remaining = 0
  end
  return remaining, sliding_window_wait(cur, prev, elapsed, window, requests - remaining - 1)
end

local function sliding_window_check(key, now, requests, window, burst, cost)
  local index = floor(now / window)
  local stored = redis.call('HMGET', key, 'w', 'c', 'p')
  local w = tonumber(stored[1])
  local cur, prev = 0, 0
  if w == index then
    cur, prev = tonumber(stored[2] or '0'), tonumber(stored[3] or '0')
  elseif w == index - 1 then
    prev = tonumber(stored[2] or '0')
  end
  local elapsed = now - index * window
  local remaining, reset = sliding_window_state(cur, prev, elapsed, requests, window)
  if cur + prev * (1 - elapsed / window) + cost > requests then
    return false, sliding_window_wait(cur, prev, elapsed, window, requests - cost), remaining,
      reset, cur, prev
  end
  return true, 0, remaining, reset, cur, prev
end

local function sliding_window_record(key, now, requests, window, burst, cost, cur, prev)
  -- The same index and elapsed time as the check's: the same `now`.
  local index = floor(now / window)
  local elapsed = now - index * window
  cur = cur + cost
  redis.call('HSET', key, 'w', format('%d', index),
             'c', format('%d', cur), 'p', format('%d', prev))
  redis.call('PEXPIRE', key, format('%d', ceil(2 * window / 1000)))
  return sliding_window_state(cur, prev, elapsed, requests, window)
end

-- Gives back `back` (release.lua): the count of the window holding `decided` (current
-- or previous counter) drops by back, never below 0; an older window weighs nothing.
local function sliding_window_release(key, now, requests, window, back, keep, member, at,
                                      decided)
  local stored = redis.call('HMGET', key, 'w', 'c', 'p')
  local w = tonumber(stored[1])
  if not w then
    return false
  end
  local index = floor(now / window)
  local counted = floor(decided / window)
  local c, p = tonumber(stored[2] or '0'), tonumber(stored[3] or '0')
  -- The stored window may be behind the clock: bring it to now first.
  if w == index - 1 then
    w, c, p = index, 0, c
  elseif w < index - 1 then
    w, c, p = index, 0, 0
  end
  if counted == w and c > 0 then
    redis.call('HSET', key, 'w', w, 'c', math.max(c - back, 0), 'p', p)
    return true
  elseif counted == w - 1 and p > 0 then
    redis.call('HSET', key, 'w', w, 'c', c, 'p', math.max(p - back, 0))
    return true
  end
  return false
end
