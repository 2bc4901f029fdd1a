-- Fixed window: one counter per limit, whose expiry is set by the first hit of its window.
-- Part of decide.lua (concatenated at compile time).
--
-- KEYS       the limit's counter (a string holding an integer); absent = an empty window.
-- limit      {requests, window (us), burst (unused), cost}
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}
--
-- The window starts at the first hit, so up to twice `requests` can pass within one window's
-- length across a boundary (a full window ending, a new one starting at once).

local function fixed_window_check(key, now, limit)
  local count = tonumber(redis.call('GET', key) or '0')
  local ttl = 0
  if count > 0 then
    ttl = math.max(redis.call('PTTL', key), 0) * 1000
  end
  local st = {count = count, ttl = ttl, ok = true, wait = 0, reset = ttl,
              remaining = math.max(limit.requests - count, 0)}
  if count + limit.cost > limit.requests then
    st.ok = false
    st.wait = ttl
  end
  return st
end

local function fixed_window_record(key, now, limit, st)
  local count = st.count + limit.cost
  local ttl = st.ttl
  if st.count == 0 then
    ttl = math.ceil(limit.window / 1000) * 1000
    redis.call('SET', key, count, 'PX', ttl / 1000)
  else
    redis.call('INCRBY', key, limit.cost)
  end
  return math.max(limit.requests - count, 0), ttl
end
