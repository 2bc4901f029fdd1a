-- wrk script of the admit and mixed scenarios (and the memory step); bench/harness/ runs it as
--   wrk -t1 -c50 -d5s -s bench/wrk/keys.lua URL -- MODE ARGS...
--
-- MODE and its arguments:
--   admit KEYS                  each request carries one of KEYS API keys (k1 .. kKEYS), drawn
--                               at random: every key stays far under its limit
--   mixed KEYS ABUSERS PERCENT  PERCENT % of requests carry one of ABUSERS keys (abuser1 ..),
--                               drawn at random, far over their limit; the rest are as in admit
--   distinct PREFIX MAX         every request carries a key never sent before (PREFIX-t-n,
--                               n = 1, 2, ...), until MAX keys per thread were sent; then
--                               the same keys again: the memory step fills the in-process
--                               store with it
--
-- Requests are formatted once in init() wherever the set of keys is fixed, so the per-request
-- Lua cost is one table lookup and stays the same for every target.
-- (The flood scenario has its own script, flood.lua.) done() is in report.lua.

local mode
local pool = {}
local abusers = {}
local abuse_percent = 0
local prefix
local counter = 0
local max_keys = 0

-- thread_id is a global set by setup() in each thread's own Lua state.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local function request_with_key(key)
  return wrk.format(nil, nil, { ["x-api-key"] = key })
end

function init(args)
  mode = args[1] or "admit"
  math.randomseed(os.time() * 1000 + (thread_id or 0))
  if mode == "admit" or mode == "mixed" then
    local keys = tonumber(args[2] or "10000")
    for i = 1, keys do
      pool[i] = request_with_key("k" .. i)
    end
    if mode == "mixed" then
      for i = 1, tonumber(args[3] or "5") do
        abusers[i] = request_with_key("abuser" .. i)
      end
      abuse_percent = tonumber(args[4] or "10")
    end
  elseif mode == "distinct" then
    prefix = (args[2] or "d") .. "-" .. (thread_id or 0) .. "-"
    max_keys = tonumber(args[3] or "1000000")
  else
    error("unknown mode " .. mode)
  end
end

function request()
  if mode == "distinct" then
    counter = counter + 1
    if counter > max_keys then
      counter = 1
    end
    return request_with_key(prefix .. counter)
  elseif mode == "mixed" and math.random(100) <= abuse_percent then
    return abusers[math.random(#abusers)]
  end
  return pool[math.random(#pool)]
end

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
