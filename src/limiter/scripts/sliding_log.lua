-- Sliding-window log: one sorted set per limit. Part of decide.lua (concatenated at compile
-- time); defines the functions the driver calls, touches only the key it is given.
--
-- KEYS       the limit's sorted set: members are admitted requests (one per unit of cost),
--            scores their admission time in microseconds on the Redis server's clock.
-- limit      {requests, window (us), burst (unused), cost}
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}
--
-- Entries can be in the future (a delayed request is recorded at the time it is forwarded):
-- the check counts them, since it only removes entries that have left the window.
--
-- Scores are written with %.0f: Lua would otherwise print a 16-digit number with 14
-- significant digits.

local function sliding_log_check(key, now, limit)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now - limit.window))
  local n = redis.call('ZCARD', key)
  local st = {count = n, remaining = math.max(limit.requests - n, 0), reset = 0, ok = true, wait = 0}
  if n > 0 then
    -- The entry whose departure gives more room: for a full key the (n - requests)-th
    -- oldest, otherwise the oldest.
    local index = math.max(n - limit.requests, 0)
    st.pivot = tonumber(redis.call('ZRANGE', key, index, index, 'WITHSCORES')[2])
    st.reset = st.pivot + limit.window - now
  end
  if n + limit.cost > limit.requests then
    st.ok = false
    -- Room for `cost` more once the (n + cost - requests)-th oldest entry has left.
    local index = n + limit.cost - limit.requests - 1
    if index < n then
      local score = tonumber(redis.call('ZRANGE', key, index, index, 'WITHSCORES')[2])
      st.wait = score + limit.window - now
    else
      st.wait = limit.window
    end
  end
  return st
end

local function sliding_log_record(key, now, limit, st, member, at)
  local score = string.format('%.0f', at)
  -- One entry per unit of cost, added in batches: unpack() is limited by Lua's C stack.
  local args = {}
  for j = 1, limit.cost do
    args[#args + 1] = score
    args[#args + 1] = member .. ':' .. j
    if #args == 1000 or j == limit.cost then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  -- The key lives until its newest entry leaves the window. Entries can be in the future
  -- only on a route with a delay limit (which then applies to every request of the route:
  -- `sluice check` refuses `when:` on it), so only there is the newest entry read.
  local newest = at
  if limit.delays then
    newest = math.max(at, tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]))
  end
  redis.call('PEXPIRE', key, math.ceil((newest - now + limit.window) / 1000))
  local n = st.count + limit.cost
  local index = math.max(n - limit.requests, 0)
  -- The pivot moves only when the key was empty, a cost above 1 passes it, or the new
  -- entries land before it (in the future, it can be later than now); otherwise no extra
  -- read is needed.
  local pivot = st.pivot
  if st.count == 0 then
    pivot = at
  elseif index ~= math.max(st.count - limit.requests, 0) or st.pivot > at then
    pivot = tonumber(redis.call('ZRANGE', key, index, index, 'WITHSCORES')[2])
  end
  return math.max(limit.requests - n, 0), pivot + limit.window - now
end
