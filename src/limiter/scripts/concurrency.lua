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
--            `hold` (how long a lease of the limit is held on average, us, for the retry hint:
--            measured by the instances and written by their renewals) and `reclaimed` (leases
--            taken from instances past their deadline, read and cleared by the next renewal,
--            which counts them).
-- limit      requests = how many at once, window = the lease period (us): an instance's
--            deadline is its last renewal plus the period, and both keys expire one period
--            after the last acquire or renewal; cost 1 (`sluice check`); burst = the epoch
--            flag (src/limiter/redis/epochs.rs): 0 none (a Cluster, the admin API's peek),
--            1 hold the limit back while its epoch is missing or ahead, 2 the same but a
--            missing epoch is written as known (a process's first check of the limit)
-- epoch      the limit's keys' common part (all before the identity's `{`) .. 'epoch':
--            since when (us) the store has known the limit; absent after the store forgot
--            (restart, failover), and then written as now plus the time within which every
--            live instance renews, so restores, its leases (a quarter period, its renewal
--            tick twice and slack): until then the limit admits nothing. Expires after a day
--            without admissions.
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

local CONCURRENCY_EPOCH_MS = '86400000'

local function concurrency_epoch(key)
  local brace = string.find(key, '{', 1, true)
  return string.sub(key, 1, (brace or #key + 1) - 1) .. 'epoch'
end

-- How long the limit of `key` is still held back after the store forgot it (us; 0: not).
local function concurrency_held_back(key, now, window, flag)
  local epoch = concurrency_epoch(key)
  local since = redis.call('GET', epoch)
  if since then
    since = tonumber(since)
  else
    since = flag == 2 and 0 or now + ceil(window / 4) + 300000
    redis.call('SET', epoch, format('%d', since), 'PX', CONCURRENCY_EPOCH_MS)
  end
  return since > now and since - now or 0
end

local function concurrency_check(key, now, requests, window, burst, cost)
  local beats = key .. ':i'
  concurrency_reclaim(key, beats, now)
  local n = redis.call('HLEN', key)
  local remaining = requests - n
  if remaining < 0 then
    remaining = 0
  end
  if burst ~= 0 then
    local held_back = concurrency_held_back(key, now, window, burst)
    if held_back > 0 then
      return false, held_back, remaining, 0, n
    end
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
  local instance = string.sub(member, 1, 16)
  redis.call('HSET', key, member, format('%d', now))
  local remaining = requests - n - 1
  if remaining < 0 then
    remaining = 0
  end
  local ttl = format('%d', ceil(window / 1000))
  if n == 0 then
    -- The lease hash was empty, so gone: made anew by the HSET, without an expiry.
    redis.call('PEXPIRE', key, ttl)
  end
  -- This instance's deadline and the other expiries (the lease hash's, when it held leases,
  -- the instances' hash's, the epoch's) are written again only when its deadline is less than
  -- 7/8 of a period away. Otherwise they stand that long: the write that set the deadline (an
  -- acquire, or a renewal, which extends the lease hash if it exists, and it did if it holds
  -- leases now) gave both keys a period then. The instance counts on no more than that for a
  -- key it starts to hold (`Held::register`, src/limiter/leases.rs); most admissions of a busy
  -- instance write its lease and read its deadline.
  local deadline = tonumber(redis.call('HGET', beats, instance) or '0')
  if deadline >= now + window - floor(window / 8) then
    return remaining, 0
  end
  redis.call('HSET', beats, instance, format('%d', now + window))
  if n > 0 then
    redis.call('PEXPIRE', key, ttl)
  end
  redis.call('PEXPIRE', beats, ttl)
  if burst ~= 0 then
    redis.call('PEXPIRE', concurrency_epoch(key), CONCURRENCY_EPOCH_MS)
  end
  return remaining, 0
end

-- Ends the request's lease (release.lua, when a request decided across Cluster slots is given
-- back; a request's own end is a plain HDEL, `RedisStore::end_lease`): HDEL by its own id, so
-- a second release, or one of a lease already reclaimed, frees nothing. Whether the lease was
-- there.
local function concurrency_release(key, now, requests, window, back, keep, member)
  return redis.call('HDEL', key, member) == 1
end
