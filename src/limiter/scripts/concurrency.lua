-- Concurrency: how many requests of one key are in flight at once, as leases with an
-- identity. Part of decide.lua, peek.lua, release.lua and leases.lua (concatenated after
-- prelude.lua, see src/limiter/redis/scripts.rs).
--
-- KEYS       the limit's hash of leases: field = a request's member (`{instance:016x}-{seq}`,
--            its lease id), value = when it was taken (us, Redis clock). Beside it, in the
--            same Cluster slot (the name only adds a suffix after the hash tag), `key .. ':i'`:
--            a hash of the instances holding leases there, field = instance id (16 hex
--            digits), value = the deadline (us) by which it must renew them (leases.lua), its
--            marker `r:{instance}` (written by its renewals only, see leases.lua), plus
--            `hold` (a moving average of how long a lease is held, us, for the retry hint) and
--            `reclaimed` (leases taken from instances past their deadline, read and cleared
--            by the next renewal, which counts them).
-- limit      requests = how many at once, window = the lease period (us): an instance's
--            deadline is its last renewal plus the period, and both keys expire one period
--            after the last acquire or renewal; burst unused; cost 1 (`sluice check`)
-- Returns    check: ok, wait_us, remaining, reset_us (0: a slot frees at no known time),
--            then its state for record: the leases held; record: remaining, reset_us
--
-- Exact across instances: a lease is counted until it is released by its own id (HDEL:
-- idempotent, never another's) or its instance misses its deadline. A full key's wait is a
-- hint, not a promise: the average hold divided by the leases held, the expected time until
-- the first of them ends when holds are alike.

-- Removes the leases of every instance past its deadline; counts them under `reclaimed`.
local function concurrency_reclaim(key, beats, now)
  local seen = redis.call('HGETALL', beats)
  local reclaimed, dead = 0, nil
  for i = 1, #seen, 2 do
    local field = seen[i]
    if #field == 16 and tonumber(seen[i + 1]) <= now then
      dead = dead or {}
      dead[field .. '-'] = field
    end
  end
  if not dead then
    return
  end
  local leases = redis.call('HKEYS', key)
  for _, lease in ipairs(leases) do
    if dead[string.sub(lease, 1, 17)] then
      redis.call('HDEL', key, lease)
      reclaimed = reclaimed + 1
    end
  end
  -- Counted before the instances go, so the hash is never emptied (and never loses its TTL).
  redis.call('HINCRBY', beats, 'reclaimed', reclaimed)
  for _, instance in pairs(dead) do
    redis.call('HDEL', beats, instance, 'r:' .. instance)
  end
end

local function concurrency_check(key, now, requests, window, burst, cost)
  local beats = key .. ':i'
  concurrency_reclaim(key, beats, now)
  local n = redis.call('HLEN', key)
  local remaining = requests - n
  if remaining < 0 then
    remaining = 0
  end
  if n + cost > requests then
    local hold = tonumber(redis.call('HGET', beats, 'hold') or '1000000')
    local wait = ceil(hold / (n > 0 and n or 1))
    if wait < 1000 then
      wait = 1000
    end
    return false, wait, remaining, 0, n
  end
  return true, 0, remaining, 0, n
end

local function concurrency_record(key, now, requests, window, burst, cost, n, _, member)
  local beats = key .. ':i'
  local ttl = format('%d', ceil(window / 1000))
  redis.call('HSET', key, member, format('%d', now))
  redis.call('HSET', beats, string.sub(member, 1, 16), format('%d', now + window))
  redis.call('PEXPIRE', key, ttl)
  redis.call('PEXPIRE', beats, ttl)
  local remaining = requests - n - 1
  if remaining < 0 then
    remaining = 0
  end
  return remaining, 0
end

-- Ends the request's lease (release.lua): HDEL by its own id, so a second release, or one of
-- a lease already reclaimed, frees nothing. Folds its hold time into the average. Whether the
-- lease was there.
local function concurrency_release(key, now, requests, window, back, keep, member)
  local taken = redis.call('HGET', key, member)
  if not taken then
    return false
  end
  redis.call('HDEL', key, member)
  local beats = key .. ':i'
  -- Only into a hash that exists: HSET would create one without an expiry.
  if redis.call('EXISTS', beats) == 1 then
    local held = now - tonumber(taken)
    local hold = tonumber(redis.call('HGET', beats, 'hold') or tostring(held))
    redis.call('HSET', beats, 'hold', format('%d', floor(hold + (held - hold) / 8)))
  end
  return true
end
