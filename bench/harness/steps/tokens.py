"""The streamed-token step: a paced event stream (like a fast model's tokens) read directly
from the fake LLM API (bench/loadgen serve-sse) and through sluice with a token budget on Redis
that reserves each request and settles it from the stream's usage event."""

from __future__ import annotations

import json
import socket
import subprocess
from typing import TYPE_CHECKING

from ..config import LOADGEN_BIN, SLUICE_BIN
from ..context import progress
from ..errors import HarnessError
from ..peers import redis_store
from ..procfs import cpu_seconds, process_tree
from ..servers import http_get, wait_until

if TYPE_CHECKING:
    from ..context import Context
    from ..redis_server import Redis


TOKEN_EVENTS = 200          # events per answer
TOKEN_EVENT_BYTES = 64      # text bytes per event
TOKEN_INTERVAL_US = 1000    # one event a millisecond
TOKEN_USAGE = 300           # tokens each answer reports
TOKEN_CONCURRENCY = 20


def tokens_yaml(port: int, admin: int, up_port: int, redis: Redis) -> str:
    return f"""listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin}
store: {redis_store(redis)}
upstreams:
  llm: {{ url: "http://127.0.0.1:{up_port}", timeout: 60s }}
routes:
  - name: plain
    match: {{ path_prefix: /plain }}
    upstream: llm
  - name: chat
    match: {{ path_prefix: / }}
    upstream: llm
    limits:
      - name: tokens
        key: [header:x-api-key]
        tokens: 100000000
        window: 1m
        reserve: {{ default_output: 1000, max_output: 1000 }}
"""


def tokens_settled(admin: int) -> float:
    _, body = http_get(admin, "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("sluice_tokens_settled_total{"))


def token_streams(ctx: Context) -> dict:
    """Streamed tokens: per-event delivery directly and through sluice (the difference is
    sluice's overhead per event), sluice's CPU per MB streamed, and tokens settled per second."""
    opts, servers, state, redis = ctx.opts, ctx.servers, ctx.state, ctx.redis
    streams = 20 if opts.smoke else 400
    progress(f"streamed tokens: {streams} answers of {TOKEN_EVENTS} events x "
             f"{TOKEN_EVENT_BYTES} B, one every {TOKEN_INTERVAL_US} us, {TOKEN_CONCURRENCY} at "
             "a time; directly, then through sluice (token budget on Redis)")
    up_port = servers.free_port()
    upstream = servers.start("llm-sse", [
        str(LOADGEN_BIN), "serve-sse", "--port", str(up_port), "--events", str(TOKEN_EVENTS),
        "--event-bytes", str(TOKEN_EVENT_BYTES), "--interval-us", str(TOKEN_INTERVAL_US),
        "--usage", str(TOKEN_USAGE)])
    wait_until("llm-sse", lambda: socket.create_connection(("127.0.0.1", up_port), 1).close()
               is None, upstream)
    port, admin = servers.free_port(), servers.free_port()
    conf = state / "sluice-tokens.yaml"
    conf.write_text(tokens_yaml(port, admin, up_port, redis))
    server = servers.start("sluice-tokens", [str(SLUICE_BIN), "run", "--config", str(conf)],
                           {"RUST_LOG": "warn"})
    wait_until("sluice-tokens", lambda: http_get(admin, "/readyz")[0] == 200, server)

    def stream(to_port: int, prefix: str = "") -> dict:
        argv = [str(LOADGEN_BIN), "stream", "--url",
                f"http://127.0.0.1:{to_port}{prefix}/v1/chat",
                "--streams", str(streams), "--concurrency", str(TOKEN_CONCURRENCY)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if out.returncode != 0 or not out.stdout.strip():
            raise HarnessError(f"streamed tokens: loadgen gave no numbers (exit "
                               f"{out.returncode}): {out.stderr.strip()[-500:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if r["statuses"] != {"200": streams}:
            raise HarnessError(f"streamed tokens: statuses {r['statuses']}")
        return r

    result = {"streams": streams, "direct": stream(up_port)}
    pids = process_tree(server.popen.pid)
    # The same streams on a route without a budget: what the budget itself costs.
    cpu0 = cpu_seconds(pids)
    result["plain"] = stream(port, "/plain")
    result["plain_cpu_s"] = cpu_seconds(pids) - cpu0
    cpu0, settled0 = cpu_seconds(pids), tokens_settled(admin)
    result["sluice"] = stream(port)
    result["cpu_s"] = cpu_seconds(pids) - cpu0
    result["settled"] = tokens_settled(admin) - settled0
    servers.stop(server)
    servers.stop(upstream)
    progress("  " + token_streams_text(result).replace("\n", "\n  "))
    return result


def token_streams_text(r: dict) -> str:
    direct, through, plain = r["direct"], r["sluice"], r["plain"]
    mb = through["bytes"] / 1e6
    plain_mb = plain["bytes"] / 1e6
    overhead = through["delivery_p50_us"] - direct["delivery_p50_us"]
    return (
        f"{r['streams']} streamed answers of {TOKEN_EVENTS} events ({TOKEN_EVENT_BYTES} B of text "
        f"each, one every {TOKEN_INTERVAL_US} us), {TOKEN_CONCURRENCY} at a time, a token budget "
        f"on Redis reserving each and settling it from the usage event.\n"
        f"Per event, write to read: directly p50 {direct['delivery_p50_us']} us / p99 "
        f"{direct['delivery_p99_us']} us; through sluice p50 {through['delivery_p50_us']} us / "
        f"p99 {through['delivery_p99_us']} us: {overhead} us added at the median.\n"
        f"sluice's CPU: {r['cpu_s']:.2f} s for {mb:.1f} MB streamed, "
        f"{r['cpu_s'] / mb * 1000 if mb else 0:.0f} ms per MB (request handling, reservation and "
        f"settlement included); on a route without a budget, {r['plain_cpu_s']:.2f} s, "
        f"{r['plain_cpu_s'] / plain_mb * 1000 if plain_mb else 0:.0f} ms per MB, and per event "
        f"p50 {plain['delivery_p50_us']} us / p99 {plain['delivery_p99_us']} us.\n"
        f"Tokens settled: {r['settled']:,.0f} in {through['elapsed_s']:.1f} s, "
        f"{r['settled'] / through['elapsed_s']:,.0f} per second "
        f"({through['answers'] / through['elapsed_s']:,.0f} answers/s).")


# The lease-renewal step: what keeping concurrency leases alive costs Redis while requests are
# held open and nothing else happens, as the requests held, the keys they are held under and
