-- The first part of decide.lua and peek.lua (concatenated at compile time, see
-- src/limiter/redis/scripts.rs): the library functions every algorithm file uses, as locals
-- its functions capture. One set rather than one per file: each local captured is work on
-- every call, since a script's functions are closures made anew each time it runs.
--
-- format('%d', x) is how the algorithms turn an integer into a string for redis.call: an
-- integer conversion, exact below 2^63. Lua's own conversion ('%.14g') would cut a 16-digit
-- microsecond timestamp, and a number handed to redis.call is printed by Redis 7.0 with
-- '%.17g': float formatting, measured at 0.5 us more per SET than a '%d' string.

local floor, ceil, format = math.floor, math.ceil, string.format
