-- Sliding window counter (approximation): the current fixed window's count plus the previous
-- window's, weighted by how much of the previous window the sliding window still covers.
-- Part of decide.lua (concatenated at compile time).
--
-- KEYS       the limit's hash: w = index of the current fixed window (now / window),
--            c = its count, p = the previous window's count. Absent = both empty.
-- limit      {requests, window (us), burst (unused), cost}
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}

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
    return math.ceil(window * (1 - (target - cur) / prev) - elapsed)
  end
  return math.ceil((window - elapsed) + window * (1 - target / cur))
end

local function sliding_window_check(key, now, limit)
  local index = math.floor(now / limit.window)
  local stored = redis.call('HMGET', key, 'w', 'c', 'p')
  local w, c, p = tonumber(stored[1]), tonumber(stored[2] or '0'), tonumber(stored[3] or '0')
  local cur, prev = 0, 0
  if w == index then
    cur, prev = c, p
  elseif w == index - 1 then
    prev = c
  end
  local elapsed = now - index * limit.window
  local count = cur + prev * (1 - elapsed / limit.window)
  local remaining = math.max(math.floor(limit.requests - count), 0)
  local st = {index = index, cur = cur, prev = prev, elapsed = elapsed, ok = true, wait = 0,
              remaining = remaining,
              reset = sliding_window_wait(cur, prev, elapsed, limit.window,
                                          limit.requests - remaining - 1)}
  if count + limit.cost > limit.requests then
    st.ok = false
    st.wait = sliding_window_wait(cur, prev, elapsed, limit.window, limit.requests - limit.cost)
  end
  return st
end

local function sliding_window_record(key, now, limit, st)
  local cur = st.cur + limit.cost
  redis.call('HSET', key, 'w', st.index, 'c', cur, 'p', st.prev)
  redis.call('PEXPIRE', key, math.ceil(2 * limit.window / 1000))
  local count = cur + st.prev * (1 - st.elapsed / limit.window)
  local remaining = math.max(math.floor(limit.requests - count), 0)
  return remaining, sliding_window_wait(cur, st.prev, st.elapsed, limit.window,
                                        limit.requests - remaining - 1)
end
