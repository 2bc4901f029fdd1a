"""The targets: the upstream, the peers (nginx, HAProxy, Node, Traefik, Envoy with sluice's
rate limit service, the bare-hyper floor) and sluice per store and algorithm, started from the
templates in bench/peers/ and bench/sluice/, and the preflight that checks each answers as
configured."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import (
    BENCH, CONCURRENCY_LIMIT, CONCURRENCY_TARGET, ENVOY_BIN, FLOOR_BIN, LIMIT_REQUESTS,
    LIMIT_WINDOW_S, PEERS, REDIS_ALGORITHMS, SLUICE_BIN, TRAEFIK_BIN, workers
)
from .errors import HarnessError
from .servers import http_get, render, wait_until

if TYPE_CHECKING:
    from .context import Context
    from .layout import Layout
    from .redis_server import Redis
    from .servers import Server


@dataclass
class Target:
    name: str
    label: str
    port: int
    server: Server
    limited: bool
    redis: bool = False
    nginx_peer: str | None = None  # name of the nginx target it is compared with
    node_peer: str | None = None
    layout: Layout | None = None  # None: shared, as the features and log-cost steps run
    concurrent: int | None = None  # a concurrency limit's N (never refuses in the scenarios)

    @property
    def pid(self) -> int:
        return self.server.popen.pid


def instance_name(name: str, layout: Layout | None) -> str:
    """The server's name (its log, its state directory): the target's name, with the layout
    for any but the shared one, where the same target runs again."""
    return name if layout is None or layout.name == "shared" else f"{name}-{layout.name}"


def start_nginx(ctx: Context, name, template, port, layout: Layout | None = None,
                **values) -> Server:
    servers, state = ctx.servers, ctx.state
    instance = instance_name(name, layout)
    d = state / instance
    d.mkdir()
    conf = render(PEERS / template, d / "nginx.conf", DIR=d, PORT=port, **values)
    argv = ["nginx", "-e", str(d / "error.log"), "-p", str(d), "-c", str(conf)]
    server = servers.start(instance, layout.proxy_argv(argv) if layout else argv)
    wait_until(instance, lambda: http_get(port)[0] in (200, 429), server)
    return server


def traefik_redis(redis: Redis) -> str:
    """The `redis:` option of Traefik's rateLimit (dynamic.yml.in's REDIS), indented under it."""
    return f'        redis:\n          endpoints: ["127.0.0.1:{redis.port}"]'


def start_traefik(ctx: Context, name, port, up_port, layout: Layout, limited: bool,
                  redis: Redis | None = None) -> Server:
    servers, state = ctx.servers, ctx.state
    instance = instance_name(name, layout)
    d = state / instance
    d.mkdir()
    render(PEERS / "traefik" / "dynamic.yml.in", d / "dynamic.yml",
           MIDDLEWARES="[per-key]" if limited else "[]",
           REDIS=traefik_redis(redis) if redis else "",
           REQUESTS=LIMIT_REQUESTS, WINDOW_S=LIMIT_WINDOW_S, UPSTREAM_PORT=up_port)
    conf = render(PEERS / "traefik" / "traefik.yml.in", d / "traefik.yml", DIR=d, PORT=port)
    argv = layout.proxy_argv([str(TRAEFIK_BIN), f"--configFile={conf}"])
    # GOMAXPROCS: the Go runtime's threads running Go code at once, its "workers".
    server = servers.start(instance, argv, {"GOMAXPROCS": str(layout.workers)})
    # The file provider loads the routes just after the listener opens: 404 until then.
    wait_until(instance, lambda: http_get(port, headers={"x-api-key": "ready"})[0] in (200, 429),
               server)
    return server


def nginx_rate() -> str:
    """The limit as nginx's limit_req rate, which is a whole number per second or minute."""
    if LIMIT_REQUESTS % LIMIT_WINDOW_S == 0:
        return f"{LIMIT_REQUESTS // LIMIT_WINDOW_S}r/s"
    if (LIMIT_REQUESTS * 60) % LIMIT_WINDOW_S == 0:
        return f"{LIMIT_REQUESTS * 60 // LIMIT_WINDOW_S}r/m"
    raise HarnessError("nginx's limit_req takes a whole rate per second or per minute only")


def sluice_concurrency_limit(places: int = CONCURRENCY_LIMIT, lease: str = "") -> str:
    """One concurrency limit keyed like sluice_limit()'s, `lease` (e.g. "2s") or the default."""
    fields = f'name: per-key, key: ["header:x-api-key"], concurrent: {places}'
    if lease:
        fields += f", lease: {lease}"
    return f"[{{ {fields} }}]"


def sluice_limit(extra: str = "", requests: int = LIMIT_REQUESTS, window: str = "") -> str:
    window = window or f"{LIMIT_WINDOW_S}s"
    fields = f'name: per-key, key: ["header:x-api-key"], requests: {requests}, window: {window}'
    if extra:
        fields += f", {extra}"
    return f"[{{ {fields} }}]"


def knows_workers(ctx: Context, binary: Path) -> bool:
    """Whether this sluice binary takes `server: { workers: N }` (per-core runtimes, issue 20):
    `sluice check` of the benchmark's config with it. Binaries from before it refuse the
    unknown field; they get TOKIO_WORKER_THREADS only. Asked once per binary and run."""
    known, state, free_port = ctx.knows_workers, ctx.state, ctx.servers.free_port
    if binary not in known:
        def check(server_line: str, tag: str) -> subprocess.CompletedProcess:
            conf = render(
                BENCH / "sluice" / "sluice.yaml.in", state / f"check-{tag}-{len(known)}.yaml",
                PORT=free_port(), ADMIN_PORT=free_port(), UPSTREAM_PORT=free_port(),
                STORE=local_store(), LIMITS=sluice_limit(), SERVER=server_line,
            )
            return subprocess.run([str(binary), "check", "--config", str(conf)],
                                  capture_output=True, text=True, timeout=30)
        plain = check("", "plain")
        if plain.returncode != 0:
            raise HarnessError(f"{binary} check refuses the benchmark's config: "
                               f"{(plain.stdout + plain.stderr).strip()[-500:]}")
        known[binary] = check("server: { workers: 1 }", "workers").returncode == 0
    return known[binary]


def start_sluice(ctx: Context, name, upstream_port, store: str, limits: str,
                 log_level: str = "warn", binary: Path = SLUICE_BIN,
                 layout: Layout | None = None, instance: str | None = None):
    """Starts one sluice from bench/sluice/sluice.yaml.in, logging at `log_level` (RUST_LOG),
    with the layout's number of workers (`server.workers` when the binary knows it, and
    TOKIO_WORKER_THREADS for the multi-threaded runtime either way) on the layout's CPUs;
    returns (server, port, admin port)."""
    servers, state = ctx.servers, ctx.state
    n = layout.workers if layout else workers()
    instance = instance or instance_name(name, layout)
    port, admin = servers.free_port(), servers.free_port()
    server_line = f"server: {{ workers: {n} }}" if knows_workers(ctx, binary) else ""
    conf = render(
        BENCH / "sluice" / "sluice.yaml.in", state / f"{instance}.yaml",
        PORT=port, ADMIN_PORT=admin, UPSTREAM_PORT=upstream_port, STORE=store, LIMITS=limits,
        SERVER=server_line,
    )
    argv = [str(binary), "run", "--config", str(conf)]
    env = {"RUST_LOG": log_level, "TOKIO_WORKER_THREADS": str(n)}
    server = servers.start(instance, layout.proxy_argv(argv) if layout else argv, env)
    wait_until(instance, lambda: http_get(admin, "/readyz")[0] == 200, server)
    return server, port, admin


def start_floor(ctx: Context, name: str, port: int, up_port: int, layout: Layout,
                redis: Redis | None = None) -> Server:
    """bench/floor with the layout's workers on its CPUs; with `redis`, limiting on it as
    envoyproxy/ratelimit does, with the benchmark's limit (a fixed window)."""
    instance = instance_name(name, layout)
    argv = [str(FLOOR_BIN), "--port", str(port), "--upstream", f"127.0.0.1:{up_port}",
            "--workers", str(layout.workers)]
    if redis:
        argv += ["--redis", str(redis.port), "--limit", str(LIMIT_REQUESTS),
                 "--window", str(LIMIT_WINDOW_S), "--key-header", "x-api-key"]
    server = ctx.servers.start(instance, layout.proxy_argv(argv))
    wait_until(instance, lambda: http_get(port, headers={"x-api-key": "ready"})[0] in (200, 429),
               server)
    return server


def start_envoy_rls(ctx: Context, upstream_port: int, redis: Redis) -> tuple[Server, int]:
    """sluice as Envoy's rate limit service on Redis (the limit as an envoyproxy/ratelimit
    file: the same numbers, keyed by x-api-key), and Envoy in front of the upstream asking it.
    Returns (sluice's server, Envoy's port): the target's CPU is sluice's alone, so its CPU
    per request is sluice's CPU per decision; Envoy's own CPU is not counted."""
    units = {1: "second", 60: "minute", 3600: "hour"}
    if LIMIT_WINDOW_S not in units:
        raise HarnessError("the rate limit service's units are a second, a minute or an hour")
    servers, state, free_port = ctx.servers, ctx.state, ctx.servers.free_port
    d = state / "envoy-rls"
    d.mkdir()
    rules = d / "ratelimit.yaml"
    rules.write_text(
        "domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: "
        f"{{unit: {units[LIMIT_WINDOW_S]}, requests_per_unit: {LIMIT_REQUESTS}}}\n")
    port, admin, rls, envoy_admin = free_port(), free_port(), free_port(), free_port()
    conf = d / "sluice.yaml"
    conf.write_text(
        f"listen: 127.0.0.1:{free_port()}\nadmin_listen: 127.0.0.1:{admin}\n"
        f"server: {{ workers: 1 }}\nstore: {redis_store(redis)}\n"
        f"rls: {{ listen: 127.0.0.1:{rls}, config: [{rules}] }}\nroutes: []\n")
    sluice = servers.start("sluice-rls", [str(SLUICE_BIN), "run", "--config", str(conf)],
                           {"RUST_LOG": "warn"})
    wait_until("sluice-rls", lambda: http_get(admin, "/readyz")[0] == 200, sluice)
    envoy_conf = render(PEERS / "envoy" / "envoy.yaml.in", d / "envoy.yaml", PORT=port,
                        ADMIN_PORT=envoy_admin, UPSTREAM_PORT=upstream_port, RLS_PORT=rls)
    envoy = servers.start("envoy", [str(ENVOY_BIN), "-c", str(envoy_conf), "--concurrency",
                                    str(workers()), "--log-level", "warn"])
    wait_until("envoy", lambda: http_get(envoy_admin, "/ready")[0] == 200, envoy)
    return sluice, port


def local_store(max_keys: int = 100_000) -> str:
    return f"{{ local: {{ max_keys: {max_keys} }}, key_prefix: bench }}"


def redis_store(redis: Redis) -> str:
    return (
        f'{{ redis: {{ url: "redis://127.0.0.1:{redis.port}/0", pool_size: 32 }}, '
        f"key_prefix: bench }}"
    )


def start_upstream(ctx: Context) -> tuple[int, Server]:
    """The upstream behind every proxy (nginx return 200, 1 worker), in every layout."""
    port = ctx.servers.free_port()
    return port, start_nginx(ctx, "upstream", "nginx-upstream.conf.in", port)


def start_targets(ctx: Context, only: re.Pattern | None, layout: Layout) -> list[Target]:
    """Starts every selected target of this layout. The shared layout has every peer; the
    pinned one the proxies the targets of issue 20 compare: nginx (proxy, limit_req), Traefik
    and sluice."""
    servers, state, free_port = ctx.servers, ctx.state, ctx.servers.free_port
    redis, up_port, upstream = ctx.redis, ctx.up_port, ctx.upstream
    targets: list[Target] = []
    shared = layout.name == "shared"
    selected = lambda name: only is None or only.search(name)  # noqa: E731

    def add(target: Target) -> None:
        target.layout = layout
        targets.append(target)

    if shared and selected("upstream"):
        add(Target("upstream", "upstream directly (nginx return 200, 1 worker)",
                   up_port, upstream, limited=False))

    common = dict(UPSTREAM_PORT=up_port, WORKERS=layout.workers)
    if selected("nginx-proxy"):
        port = free_port()
        server = start_nginx(ctx, "nginx-proxy", "nginx-proxy.conf.in", port,
                             layout, **common)
        add(Target("nginx-proxy", "nginx proxy", port, server, limited=False))
    if selected("nginx-limit"):
        port = free_port()
        server = start_nginx(ctx, "nginx-limit", "nginx-limit.conf.in", port,
                             layout, REQUESTS=LIMIT_REQUESTS, WINDOW_S=LIMIT_WINDOW_S,
                             RATE=nginx_rate(), **common)
        add(Target("nginx-limit", "nginx + limit_req", port, server, limited=True))
    if shared and selected("haproxy"):
        port = free_port()
        d = state / "haproxy"
        d.mkdir()
        cfg = render(PEERS / "haproxy.cfg.in", d / "haproxy.cfg", DIR=d, PORT=port,
                     REQUESTS=LIMIT_REQUESTS, WINDOW_S=LIMIT_WINDOW_S, **common)
        server = servers.start("haproxy", ["haproxy", "-db", "-f", str(cfg)])
        wait_until("haproxy", lambda: http_get(port)[0] == 200, server)
        add(Target("haproxy", "HAProxy + stick table", port, server, limited=True))
    if shared and selected("node"):
        port = free_port()
        env = {
            "PORT": str(port), "UPSTREAM": f"http://127.0.0.1:{up_port}",
            "REDIS_PORT": str(redis.port), "LIMIT_REQUESTS": str(LIMIT_REQUESTS),
            "LIMIT_WINDOW_S": str(LIMIT_WINDOW_S), "WORKERS": str(workers()),
            "NODE_ENV": "production",
        }
        server = servers.start("node", ["node", str(PEERS / "node" / "server.js")], env)
        # Every worker must be ready; the cluster hands connections out in turn.
        wait_until("node", lambda: all(http_get(port, "/__ready")[0] == 200
                                       for _ in range(2 * workers())), server)
        add(Target("node", "Node: express + rate-limiter-flexible (Redis) + http-proxy",
                   port, server, limited=True, redis=True))
    for name, label, limited, on_redis, peer in (
        ("traefik-proxy", "Traefik proxy", False, False, "nginx-proxy"),
        ("traefik-limit", "Traefik + rateLimit (in-process token bucket)", True, False,
         "nginx-limit"),
        ("traefik-redis", "Traefik + rateLimit with its redis option", True, True,
         "nginx-limit"),
    ):
        if selected(name):
            port = free_port()
            server = start_traefik(ctx, name, port, up_port, layout, limited,
                                   redis if on_redis else None)
            add(Target(name, label, port, server, limited=limited, redis=on_redis,
                       nginx_peer=peer))

    if selected("floor"):
        port = free_port()
        server = start_floor(ctx, "floor", port, up_port, layout)
        add(Target("floor", "bare hyper floor (bench/floor: sluice's runtime layout, nothing "
                   "else)", port, server, limited=False, nginx_peer="nginx-proxy"))
    if selected("floor-envoy"):
        port = free_port()
        server = start_floor(ctx, "floor-envoy", port, up_port, layout, redis)
        add(Target("floor-envoy", "the floor limiting as envoyproxy/ratelimit does: INCRBY + "
                   "EXPIRE per descriptor, pipelined, fixed window, on Redis", port, server,
                   limited=True, redis=True, nginx_peer="nginx-limit"))
    if shared and selected("envoy-rls"):
        server, port = start_envoy_rls(ctx, up_port, redis)
        add(Target("envoy-rls", "Envoy + sluice's rate limit service (Redis; sluice's CPU)",
                   port, server, limited=True, redis=True, nginx_peer="nginx-limit"))
    if selected("sluice-plain"):
        server, port, _ = start_sluice(ctx, "sluice-plain", up_port, local_store(),
                                       "[]", layout=layout)
        add(Target("sluice-plain", "sluice, route without limits", port, server,
                   limited=False, nginx_peer="nginx-proxy"))
    if selected("sluice-local"):
        server, port, _ = start_sluice(ctx, "sluice-local", up_port, local_store(),
                                       sluice_limit(), layout=layout)
        add(Target("sluice-local", "sluice, in-process store", port, server,
                   limited=True, nginx_peer="nginx-limit"))
    for algorithm, extra in REDIS_ALGORITHMS.items():
        name = f"sluice-redis-{algorithm}"
        if selected(name):
            server, port, _ = start_sluice(ctx, name, up_port, redis_store(redis),
                                           sluice_limit(extra), layout=layout)
            add(Target(name, f"sluice, Redis, {algorithm}", port, server,
                       limited=True, redis=True, nginx_peer="nginx-limit",
                       node_peer="node" if shared else None))
    if selected(CONCURRENCY_TARGET):
        # Not `limited`: it admits every request of every scenario (admit and latency only).
        server, port, _ = start_sluice(ctx, CONCURRENCY_TARGET, up_port,
                                       redis_store(redis), sluice_concurrency_limit(),
                                       layout=layout)
        add(Target(CONCURRENCY_TARGET, f"sluice, Redis, a concurrency limit (`concurrent: "
                   f"{CONCURRENCY_LIMIT}` per `x-api-key`, default lease): acquire + release",
                   port, server, limited=False, redis=True, nginx_peer="nginx-limit",
                   concurrent=CONCURRENCY_LIMIT))
    return targets


def preflight(target: Target) -> str:
    """Checks a target answers as configured: 200s, and for a limited target 429s past the
    limit. Returns a one-line summary; raises HarnessError when it does not."""
    key = f"preflight-{target.name}-{os.getpid()}-{time.monotonic_ns()}"
    sent = LIMIT_REQUESTS + 50 if target.limited else 20
    fixed_window = "fixed_window" in target.name or target.name.startswith("floor-envoy")
    if fixed_window:
        # Start just after a window begins (windows are aligned on the epoch), so that the
        # requests fall in one window as far as the machine allows.
        time.sleep(LIMIT_WINDOW_S - time.time() % LIMIT_WINDOW_S + 0.01)
    counts: dict[int, int] = {}
    policies: set[str] = set()
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=5)
    start = time.monotonic()
    try:
        for _ in range(sent):
            conn.request("GET", "/", headers={"x-api-key": key})
            response = conn.getresponse()
            response.read()
            counts[response.status] = counts.get(response.status, 0) + 1
            policies.add(response.getheader("RateLimit-Policy") or "")
    finally:
        conn.close()
    if target.concurrent:
        # Every request is admitted (N is far above one at a time): the limit must be there.
        unit = f'q={target.concurrent};qu="concurrent-requests"'
        if not all(unit in p for p in policies):
            raise HarnessError(f"{target.name}: RateLimit-Policy {sorted(policies)}; expected "
                               f"the concurrency limit ({unit})")
    ok = counts.get(200, 0)
    # A bucket (nginx, Traefik, GCRA) refills while the requests are sent, one at a time: on a
    # busy machine that is a few tenths of a second, and as many more admissions.
    refilled = LIMIT_REQUESTS / LIMIT_WINDOW_S * (time.monotonic() - start)
    if fixed_window:
        # A fixed window that turns over while the requests are sent admits a second limit.
        refilled = max(refilled, LIMIT_REQUESTS)
    if target.limited:
        good = (0.9 * LIMIT_REQUESTS <= ok <= 1.3 * LIMIT_REQUESTS + refilled
                and counts.get(429, 0) >= 10 and ok + counts.get(429, 0) == sent)
    else:
        good = ok == sent
    summary = ", ".join(f"{n}× {status}" for status, n in sorted(counts.items()))
    if not good:
        expected = f"about {LIMIT_REQUESTS}× 200, then 429" if target.limited else "only 200"
        raise HarnessError(f"{target.name}: {sent} requests with one key answered {summary}; "
                           f"expected {expected}")
    return summary


# ---------------------------------------------------------------------------------------------
# Measuring
