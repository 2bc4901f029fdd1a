-- The admin API's read of one limit: where KEYS[1] stands for one more request of cost 1,
-- computed by its algorithm's own check function, recording nothing. Concatenated after
-- prelude.lua, sliding_log.lua, weighted_log.lua, sliding_window.lua, fixed_window.lua,
-- gcra.lua and calendar.lua at compile time (see src/limiter/redis/scripts.rs), like
-- decide.lua. The check functions drop what time has expired (the sliding log's old
-- entries), which changes no decision.
--
-- KEYS[1]   the limit's key, of the type its algorithm keeps
-- ARGV[1]   algorithm (sliding_log | weighted_log | sliding_window | fixed_window | gcra |
--           calendar)
-- ARGV[2]   requests
-- ARGV[3]   window in microseconds (calendar: the time left in the period)
-- ARGV[4]   burst
--
-- Returns {count, remaining, reset_us}
--   count      requests counted against the limit now: the log's entries (the weighted
--              log's units), the fixed window's counter, the quota's count in its period;
--              for the sliding-window counter and GCRA, the room used
--              (capacity minus remaining)
--   remaining  requests (of cost 1) the limit would still admit now
--   reset_us   time until it admits one more than now (0 when it holds nothing)

local checks = {
  sliding_log = sliding_log_check,
  weighted_log = weighted_log_check,
  sliding_window = sliding_window_check,
  fixed_window = fixed_window_check,
  gcra = gcra_check,
  calendar = calendar_check,
}
local check = checks[ARGV[1]]
if not check then
  return redis.error_reply('unknown algorithm ' .. tostring(ARGV[1]))
end
local requests, window, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local _, _, remaining, reset, counted = check(KEYS[1], now, requests, window, burst, 1)
local count
if ARGV[1] == 'sliding_log' or ARGV[1] == 'weighted_log' or ARGV[1] == 'fixed_window'
    or ARGV[1] == 'calendar' then
  -- Their first value of state is the count.
  count = counted
elseif ARGV[1] == 'gcra' then
  count = math.max(burst - remaining, 0)
else
  count = math.max(requests - remaining, 0)
end
return {count, remaining, reset}
