-- Renewal of one instance's leases (its heartbeat), concatenated after prelude.lua and
-- concurrency.lua: one call per period for every concurrency key the instance holds leases
-- under (one per Cluster slot), so Redis's work per period grows with the keys in use and the
-- instances, not with the requests in flight. A key whose store forgot the instance (Redis
-- restarted empty, a failover to a replica that had not seen the lease, or the instance was
-- past its deadline and reclaimed) gets its leases back in a second call, which sends them.
--
-- KEYS[i]          a concurrency key (its hash of leases; its instances' hash is KEYS[i]:i)
-- ARGV[1]          the instance id (16 hex digits)
-- ARGV[2]          the lease period (us), the same for every key of the call
-- ARGV[3]          1: restore, the leases follow; 0: renew only
-- ARGV[4..3+n]     per key in order (n keys), how long the instance's leases of its limit
--                  were held on average (us; 0: none ended yet), written as the key's `hold`,
--                  the refusals' retry hint (concurrency.lua)
-- ARGV[4+n..]      with restore: per key in order, its number of leases m, then m lease ids
--
-- Whether the store still holds what this instance had is told by a marker only this script
-- writes, `r:{instance}` in the instances' hash: an admission writes the instance's deadline
-- but not the marker, so a store that forgot everything and then admitted a request of this
-- instance is still found to have forgotten (its older leases are restored).
--
-- Returns, per key, three numbers: {known_i, reclaimed_i, added_i}
--   known_i        1 if the key still had this instance's marker (its leases are where it
--                  left them, renewed); 0 if not (a store that forgot, or a key this instance
--                  has not renewed yet: restore)
--   reclaimed_i    leases the key had taken from other instances past their deadline since
--                  the last renewal (cleared here; the caller counts them)
--   added_i        with restore: leases written back that the key did not hold (HSETNX: a
--                  lease it holds keeps the time it was taken)
--
-- Every key written gets the period as its expiry, so leases of instances that all die go
-- with their keys.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local instance, window, restore = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local marker = 'r:' .. instance
local ttl = format('%d', ceil(window / 1000))
local deadline = format('%d', now + window)
local taken = format('%d', now)
local result, arg = {}, 4 + #KEYS
for i = 1, #KEYS do
  local key = KEYS[i]
  local beats = key .. ':i'
  local known = redis.call('HEXISTS', beats, marker)
  local added = 0
  if restore then
    local m = tonumber(ARGV[arg])
    for j = arg + 1, arg + m do
      added = added + redis.call('HSETNX', key, ARGV[j], taken)
    end
    arg = arg + m + 1
    known = 1
  end
  local reclaimed = 0
  if known == 1 then
    redis.call('HSET', beats, instance, deadline, marker, '1')
    local hold = ARGV[3 + i]
    if hold ~= '0' then
      redis.call('HSET', beats, 'hold', hold)
    end
    reclaimed = tonumber(redis.call('HGET', beats, 'reclaimed') or '0')
    if reclaimed > 0 then
      redis.call('HDEL', beats, 'reclaimed')
    end
    if redis.call('EXISTS', key) == 1 then
      redis.call('PEXPIRE', key, ttl)
    end
    redis.call('PEXPIRE', beats, ttl)
  end
  result[#result + 1] = known
  result[#result + 1] = reclaimed
  result[#result + 1] = added
end
return result
