-- Weighted log: a log of admissions with one entry per request, weighted by its cost, for
-- limits whose unit is not the request (token budgets). Exact like a log of one entry per
-- unit (the same window, the same arithmetic over units), but a request reserving 4,000
-- tokens is one entry, not 4,000. Part of decide.lua and peek.lua (concatenated at compile
-- time, after prelude.lua, whose floor, ceil and format it uses, and after the unweighted
-- log's file, whose log_expire it shares); defines the functions the driver calls, touches only the key
-- it is given.
--
-- KEYS       the limit's sorted set: one member per admitted request, `<member>#<weight>`
--            (the request's member prefix, then the units it holds), scored with its
--            admission time in microseconds on the Redis server's clock. A settled request
--            is re-added with its new weight and the same score (release.lua).
-- limit      requests (the limit in units), window (us), burst (unused), cost
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the units
--            in the window and its entries; record: remaining, reset_us
--
-- A check reads every entry of the window: O(requests in the window), which for a token
-- budget is a few hundred at most where a log of one entry per unit would hold one per token.

-- The entries of the window, oldest first, as a flat list weight_1, score_1, weight_2, ...
-- (ZRANGE's own reply, its members replaced by their weights in place; the scores stay
-- strings until read, since a walk rarely goes past the first few and a window can hold
-- hundreds), and their total weight.
local function weighted_log_entries(key, now, window)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now - window))
  local flat = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local total = 0
  for j = 1, #flat, 2 do
    local weight = tonumber(string.match(flat[j], '#(%d+)$')) or 0
    flat[j] = weight
    total = total + weight
  end
  return flat, total
end

-- The time until `units` of the oldest entries have left the window; the window itself when
-- the entries do not hold that many (more than the limit was asked for). With `extra` (a
-- score), the entries as if one more of weight `extra_weight` were among them, after those
-- of the same score (where ZADD puts a newer member of an equal score).
local function weighted_log_until_freed(flat, units, now, window, extra, extra_weight)
  local freed = 0
  for j = 1, #flat, 2 do
    if extra and tonumber(flat[j + 1]) > extra then
      freed = freed + extra_weight
      if freed >= units then
        return extra + window - now
      end
      extra = nil
    end
    freed = freed + flat[j]
    if freed >= units then
      return tonumber(flat[j + 1]) + window - now
    end
  end
  if extra then
    freed = freed + extra_weight
    if freed >= units then
      return extra + window - now
    end
  end
  return window
end

-- remaining, reset_us for `total` units in the window: the reset is the time until one more
-- unit fits than now (for a full log, until any fits), zero when it holds nothing.
local function weighted_log_state(flat, total, now, requests, window, extra, extra_weight)
  if total == 0 then
    return requests, 0
  end
  local units = total - requests + 1
  if units < 1 then
    units = 1
  end
  local remaining = requests - total
  if remaining < 0 then
    remaining = 0
  end
  return remaining,
    weighted_log_until_freed(flat, units, now, window, extra, extra_weight)
end

local function weighted_log_check(key, now, requests, window, burst, cost)
  local flat, total = weighted_log_entries(key, now, window)
  local remaining, reset = weighted_log_state(flat, total, now, requests, window)
  local needed = total + cost - requests
  if needed > 0 then
    local wait = window
    if cost <= requests then
      wait = weighted_log_until_freed(flat, needed, now, window)
    end
    return false, wait, remaining, reset, total, flat
  end
  return true, 0, remaining, reset, total, flat
end

-- `cost_arg`: the cost as sent (ARGV), the canonical decimal Lua's own conversion of the
-- number gives below 10^14 (a cost is 32 bits).
local function weighted_log_record(key, now, requests, window, burst, cost, total, flat,
                                   member, at, delays, cost_arg, lateness)
  -- Counted until `lateness` after the time it is forwarded at (decide.lua's ARGV[2]).
  at = at + lateness
  redis.call('ZADD', key, format('%d', at), member .. '#' .. cost_arg)
  log_expire(key, now, window, at, delays)
  -- The state with the new entry in its place among the others.
  return weighted_log_state(flat, total + cost, now, requests, window, at, cost)
end

-- Renames the entry of a request recorded with weight `cost` to weight `keep`, at the same
-- score (removes it when keep is 0). The new entry goes in before the old one leaves, so the
-- set never empties and keeps its TTL (Redis deletes an emptied sorted set, TTL and all, and
-- a key re-created by the ZADD would never expire). Whether the entry was there.
local function weighted_log_reweigh(key, member, cost, keep)
  local name = member .. '#' .. cost
  local score = redis.call('ZSCORE', key, name)
  if not score then
    return false
  end
  if keep > 0 then
    redis.call('ZADD', key, score, member .. '#' .. keep)
  end
  redis.call('ZREM', key, name)
  return true
end

-- Gives back `back` units (release.lua): the entry member#(keep+back) becomes member#keep.
local function weighted_log_release(key, now, requests, window, back, keep, member)
  return weighted_log_reweigh(key, member, keep + back, keep)
end

-- Charges `extra` more: the entry member#cost becomes member#(cost+extra).
local function weighted_log_charge(key, requests, extra, cost, member)
  return weighted_log_reweigh(key, member, cost, cost + extra)
end
