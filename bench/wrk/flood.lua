-- wrk script of the *flood* scenario: every request carries the same API key, far over its
-- limit. No request() function, so wrk sends one pre-built request without running Lua per
-- request: the load generator stays as cheap as it can be while the targets reject.
--   wrk -t1 -c50 -d5s -s bench/wrk/flood.lua URL
wrk.headers["x-api-key"] = "flood"

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "report.lua")
