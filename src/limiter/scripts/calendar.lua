-- Calendar quota: one counter per identity and calendar period. Part of decide.lua and
-- peek.lua (concatenated at compile time).
--
-- KEYS       the period's counter (a string holding an integer); its name ends with the
--            period's label, found by sluice from its wall clock (zone rules cannot run here),
--            so a new period is a new key. Absent = nothing used in this period.
-- limit      {requests, window = time left until the period ends (us), burst (unused), cost}
-- Returns    check: {ok, wait_us, remaining, reset_us}; record: {remaining, reset_us}
--
-- The count only grows within the period (and shrinks only by a give-back), so a quota
-- without room admits again exactly when its period ends: the wait is the time left. The key
-- outlives the period by a minute, so an instance whose clock lags behind still counts into
-- the same counter instead of starting a fresh one under the old label.

local calendar_slack_ms = 60000

local function calendar_check(key, now, limit)
  local count = tonumber(redis.call('GET', key) or '0')
  local st = {count = count, ok = true, wait = 0, reset = limit.window,
              remaining = math.max(limit.requests - count, 0)}
  if count + limit.cost > limit.requests then
    st.ok = false
    st.wait = limit.window
  end
  return st
end

local function calendar_record(key, now, limit, st)
  local count = redis.call('INCRBY', key, limit.cost)
  redis.call('PEXPIRE', key, math.ceil(limit.window / 1000) + calendar_slack_ms)
  return math.max(limit.requests - count, 0), limit.window
end
