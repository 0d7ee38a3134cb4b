-- wrk script: the same POST as the harness's post.lua (../shared/bench/wrk/post.lua) but WITHOUT an
-- Idempotency-Key header, so the gateway passes the request through (no store work, no fingerprint).
-- usage: wrk -t1 -c32 -d10s -s nokey.lua http://127.0.0.1:PORT/orders
-- done() prints the same WRK_JSON line as post.lua, so the harness's tools read it unchanged.
function init(args)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.body = '{"item":"widget","qty":1,"price_cents":1999}'
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,"err_write":%d,' ..
    '"err_status":%d,"err_timeout":%d,"lat_p50_us":%d,"lat_p90_us":%d,"lat_p99_us":%d,"lat_mean_us":%.1f,"lat_max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
