-- Sliding-window log for every limit of one request, decided atomically.
--
-- KEYS[i]    one sorted set per limit: members are admitted requests, scores their admission
--            time in microseconds on the Redis server's clock.
-- ARGV[1]    a member name unique to this request (instance id and sequence number), so two
--            requests admitted in the same microsecond never collapse into one entry.
-- ARGV[2i]   the limit's `requests` for KEYS[i]
-- ARGV[2i+1] the limit's window for KEYS[i], in microseconds
--
-- Returns {admitted, retry_after_us, remaining_1, reset_us_1, remaining_2, reset_us_2, ...}
--   admitted        1 if the request was admitted and recorded under every key, 0 if it was
--                   rejected and recorded under none
--   retry_after_us  for a rejection, the time until every full limit has room again
--   remaining_i     requests KEYS[i] would still admit now
--   reset_us_i      time until KEYS[i] admits one more than now (0 when it holds nothing)
--
-- The clock is Redis TIME, so gateways with skewed clocks still agree. Scores are written
-- with %.0f: Lua would otherwise print a 16-digit number with 14 significant digits.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local count = {}
-- Per key, the score of the entry whose departure gives it more room: for a full key the
-- (count - requests)-th oldest, otherwise the oldest. An admission never changes which entry
-- that is, except in an empty key, where it is the new entry itself.
local pivot = {}
local admitted = 1
local retry_after = 0

for i = 1, #KEYS do
  local requests = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', string.format('%.0f', now - window))
  local n = redis.call('ZCARD', KEYS[i])
  count[i] = n
  if n > 0 then
    local index = math.max(n - requests, 0)
    pivot[i] = tonumber(redis.call('ZRANGE', KEYS[i], index, index, 'WITHSCORES')[2])
  end
  if n >= requests then
    admitted = 0
    retry_after = math.max(retry_after, pivot[i] + window - now)
  end
end

local result = {admitted, retry_after}
local score = string.format('%.0f', now)
for i = 1, #KEYS do
  local requests = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  local n = count[i]
  if admitted == 1 then
    redis.call('ZADD', KEYS[i], score, ARGV[1])
    redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000))
    n = n + 1
    pivot[i] = pivot[i] or now
  end
  result[#result + 1] = math.max(requests - n, 0)
  result[#result + 1] = pivot[i] and (pivot[i] + window - now) or 0
end
return result
