-- GCRA (generic cell rate algorithm): a token bucket kept as one number per limit, the
-- theoretical arrival time (TAT). Part of decide.lua (concatenated at compile time).
--
-- KEYS       the limit's TAT in microseconds on the Redis server's clock (a string); absent
--            = the TAT is now (the bucket is full). It expires when it falls behind the clock.
-- limit      {requests, window (us), burst, cost}; emission interval T = ceil(window /
--            requests) us, tolerance tau = T * (burst - 1)
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}

-- {remaining, reset_us} for a TAT `d` us ahead of now.
local function gcra_state(d, t, burst)
  if d <= 0 then
    return burst, 0
  end
  local remaining = math.max(math.floor((burst * t - d) / t), 0)
  return remaining, d - (burst - remaining - 1) * t
end

local function gcra_check(key, now, limit)
  local t = math.ceil(limit.window / limit.requests)
  local tat = math.max(tonumber(redis.call('GET', key) or '0'), now)
  local new = tat + limit.cost * t
  local remaining, reset = gcra_state(tat - now, t, limit.burst)
  local st = {new = new, ok = true, wait = 0, remaining = remaining, reset = reset, t = t}
  if new - now > limit.burst * t then
    st.ok = false
    st.wait = new - limit.burst * t - now
  end
  return st
end

-- `at`: now, or the later time a delayed request is forwarded at; the TAT moves to
-- max(TAT, at) + cost * T (see gcra.rs).
local function gcra_record(key, now, limit, st, member, at)
  local new = math.max(st.new, at + limit.cost * st.t)
  redis.call('SET', key, string.format('%.0f', new), 'PX', math.ceil((new - now) / 1000))
  return gcra_state(new - now, st.t, limit.burst)
end
