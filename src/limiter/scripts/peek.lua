-- A read of one limit (the admin API; a token route's room check before its body): where
-- KEYS[1] stands for one more request, computed by its algorithm's own check function,
-- recording nothing. Concatenated after
-- prelude.lua, every algorithm's file and the `check` and `peek_count` dispatchers generated
-- from the algorithm table (src/limiter/algorithm.rs, src/limiter/redis/scripts.rs), like
-- decide.lua. The check functions drop what time has expired (a log's old entries, a
-- dead instance's leases), which changes no decision.
--
-- KEYS[1]   the limit's key, of the type its algorithm keeps
-- ARGV[1]   algorithm (a label of the algorithm table)
-- ARGV[2]   requests
-- ARGV[3]   window in microseconds (calendar: the time left in the period; concurrency: the
--           lease period)
-- ARGV[4]   burst
-- ARGV[5]   cost: what `wait_us` is for (1 when absent)
-- ARGV[6]   2: the identity's override, if any, replaces requests (prelude.lua's
--           `overridden`); absent or 0: not
--
-- Returns {count, remaining, reset_us, wait_us, override}
--   count      requests counted against the limit now, read as the algorithm's row of the
--              table says (`peek_count`): the check's first value of state (a log's
--              entries or units, a counter, the leases held), or the room used (capacity
--              minus remaining) for an algorithm that keeps no count
--   remaining  requests (of cost 1) the limit would still admit now
--   reset_us   time until it admits one more than now (0 when it holds nothing)
--   wait_us    time until a request of `cost` fits (0 when it fits now)
--   override   the identity's override in force (0: none)

local algorithm = ARGV[1]
local requests, window, burst = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local cost = tonumber(ARGV[5] or '1')
local override = 0
if ARGV[6] == '2' then
  requests, burst, override = overridden(KEYS[1], requests, burst)
end
local ok, wait, remaining, reset, counted = check(algorithm, KEYS[1], now, requests, window,
                                                  burst, cost)
if ok == nil then
  return redis.error_reply('unknown algorithm ' .. tostring(algorithm))
end
if ok then
  wait = 0
end
return {peek_count(algorithm, counted, remaining, requests, burst), remaining, reset, wait,
        override}
