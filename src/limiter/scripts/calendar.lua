-- Calendar quota: one counter per identity and calendar period. Part of decide.lua and
-- peek.lua (concatenated at compile time, after prelude.lua, whose floor, ceil and format it
-- uses).
--
-- KEYS       the period's counter (a string holding an integer); its name ends with the
--            period's label, found by sluice from its wall clock (zone rules cannot run here),
--            so a new period is a new key. Absent = nothing used in this period.
-- limit      requests, window = time left until the period ends (us), burst (unused), cost
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the count;
--            record: remaining, reset_us
--
-- The count only grows within the period (and shrinks only by a give-back), so a quota
-- without room admits again exactly when its period ends: the wait is the time left. The key
-- outlives the period by a minute, so an instance whose clock lags behind still counts into
-- the same counter instead of starting a fresh one under the old label.

local calendar_slack_ms = 60000

local function calendar_check(key, now, requests, window, burst, cost)
  local count = 0
  local stored = redis.call('GET', key)
  if stored then
    count = tonumber(stored)
  end
  local remaining = requests - count
  if remaining < 0 then
    remaining = 0
  end
  if count + cost > requests then
    return false, window, remaining, window, count
  end
  return true, 0, remaining, window, count
end

-- `cost_arg`: the cost as sent (ARGV), which is how INCRBY would print it anyway.
local function calendar_record(key, now, requests, window, burst, cost, count, _, member, at,
                               delays, cost_arg)
  count = redis.call('INCRBY', key, cost_arg)
  redis.call('PEXPIRE', key,
             format('%d', ceil(window / 1000) + calendar_slack_ms))
  local remaining = requests - count
  if remaining < 0 then
    remaining = 0
  end
  return remaining, window
end

-- Gives back `back` (release.lua) as any counter does (prelude.lua's `counter_give_back`).
-- Exact here: the key names the request's period, so a give-back after that period ended
-- lands on a key that no longer counts.
local function calendar_release(key, now, requests, window, back)
  return counter_give_back(key, back)
end

-- Charges `extra` more: INCRBY, if the period's key exists.
local function calendar_charge(key, requests, extra)
  if redis.call('EXISTS', key) == 0 then
    return false
  end
  redis.call('INCRBY', key, extra)
  return true
end
