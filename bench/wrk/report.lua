-- Shared by the wrk scripts of sluice's benchmark: done() prints one line of JSON for
-- bench/harness/load.py: request count, errors (wrk counts every response with a status of 400 or
-- more as a "status error": here, the rejections) and latency percentiles in microseconds.
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"status_errors":%d,"connect_errors":%d,' ..
    '"read_errors":%d,"write_errors":%d,"timeouts":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
