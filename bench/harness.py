#!/usr/bin/env python3
"""sluice's benchmark harness: every target, every scenario, one run, one table.

`bench/run.sh` installs the tools, builds sluice and the load generator, makes a temporary
state directory and then runs this file; run it through run.sh, not by hand. Standard library
only.

What it does, in order:
  1. starts Redis, the upstream (nginx `return 200`, 1 worker) and every target on free
     loopback ports, from the templates in bench/peers/ and bench/sluice/, and checks each
     answers as configured (limited targets must answer 429 past the limit);
  2. warms every target up (not in --smoke);
  3. runs the closed-loop scenarios (admit, flood, mixed) with wrk, then the open-loop
     *latency* scenario with bench/loadgen, each as several rounds in which the targets take
     turns, in alternating order, so slow drift on the machine is shared out evenly;
  4. measures Redis's memory per sliding-log key and sluice's resident memory per tracked key;
  5. prints one table and the PASS/FAIL lines, and (full runs only) writes bench/RESULTS.md.

Every server it starts runs in its own process group, recorded in STATE/pgids so run.sh's
trap can stop them even if this process dies, and is stopped here on every exit path.
"""

from __future__ import annotations

import argparse
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
SLUICE_BIN = ROOT / "target" / "release" / "sluice"
LOADGEN_BIN = ROOT / "target" / "bench-loadgen" / "release" / "sluice-loadgen"
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
    "sliding_log": "",  # today's only algorithm, and the default: no field needed
}

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


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise HarnessError(f"no VmRSS for pid {pid}")


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
        self.cli("FLUSHALL")
        self.cli("CONFIG", "RESETSTAT")

    def command_counts(self) -> tuple[int, int]:
        """(all commands, script calls) since the last reset; scripts' own calls count too."""
        total = scripts = 0
        for line in self.cli("INFO", "commandstats").splitlines():
            m = re.match(r"cmdstat_([^:]+):calls=(\d+)", line)
            if not m:
                continue
            name, calls = m.group(1), int(m.group(2))
            if name in ("info", "flushall") or name.startswith("config"):
                continue  # the harness's own
            total += calls
            if name.split("|")[0] in ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall"):
                scripts += calls
        return total, scripts


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

    @property
    def pid(self) -> int:
        return self.server.popen.pid


def start_nginx(servers, state, name, template, port, **values) -> Server:
    d = state / name
    d.mkdir()
    conf = render(PEERS / template, d / "nginx.conf", DIR=d, PORT=port, **values)
    argv = ["nginx", "-e", str(d / "error.log"), "-p", str(d), "-c", str(conf)]
    server = servers.start(name, argv)
    wait_until(name, lambda: http_get(port)[0] in (200, 429), server)
    return server


def nginx_rate() -> str:
    """The limit as nginx's limit_req rate, which is a whole number per second or minute."""
    if LIMIT_REQUESTS % LIMIT_WINDOW_S == 0:
        return f"{LIMIT_REQUESTS // LIMIT_WINDOW_S}r/s"
    if (LIMIT_REQUESTS * 60) % LIMIT_WINDOW_S == 0:
        return f"{LIMIT_REQUESTS * 60 // LIMIT_WINDOW_S}r/m"
    raise HarnessError("nginx's limit_req takes a whole rate per second or per minute only")


def sluice_limit(extra: str = "", requests: int = LIMIT_REQUESTS, window: str = "") -> str:
    window = window or f"{LIMIT_WINDOW_S}s"
    fields = f'name: per-key, key: ["header:x-api-key"], requests: {requests}, window: {window}'
    if extra:
        fields += f", {extra}"
    return f"[{{ {fields} }}]"


def start_sluice(servers, state, name, upstream_port, store: str, limits: str,
                 log_level: str = "warn"):
    """Starts one sluice from bench/sluice/sluice.yaml.in, logging at `log_level` (RUST_LOG);
    returns (server, port, admin port)."""
    port, admin = free_port(), free_port()
    conf = render(
        BENCH / "sluice" / "sluice.yaml.in", state / f"{name}.yaml",
        PORT=port, ADMIN_PORT=admin, UPSTREAM_PORT=upstream_port, STORE=store, LIMITS=limits,
    )
    argv = [str(SLUICE_BIN), "run", "--config", str(conf)]
    env = {"RUST_LOG": log_level, "TOKIO_WORKER_THREADS": str(workers())}
    server = servers.start(name, argv, env)
    wait_until(name, lambda: http_get(admin, "/readyz")[0] == 200, server)
    return server, port, admin


def local_store(max_keys: int = 100_000) -> str:
    return f"{{ local: {{ max_keys: {max_keys} }}, key_prefix: bench }}"


def redis_store(redis: Redis) -> str:
    return (
        f'{{ redis: {{ url: "redis://127.0.0.1:{redis.port}/0", pool_size: 32 }}, '
        f"key_prefix: bench }}"
    )


def workers() -> int:
    return os.cpu_count() or 2


def start_targets(servers: Servers, state: Path, redis: Redis, only: re.Pattern | None):
    """Starts the upstream and every selected target; returns (upstream port, targets)."""
    targets: list[Target] = []
    selected = lambda name: only is None or only.search(name)  # noqa: E731

    up_port = free_port()
    upstream = start_nginx(servers, state, "upstream", "nginx-upstream.conf.in", up_port)
    if selected("upstream"):
        targets.append(Target("upstream", "upstream directly (nginx return 200, 1 worker)",
                              up_port, upstream, limited=False))

    common = dict(UPSTREAM_PORT=up_port, WORKERS=workers())
    if selected("nginx-proxy"):
        port = free_port()
        server = start_nginx(servers, state, "nginx-proxy", "nginx-proxy.conf.in", port, **common)
        targets.append(Target("nginx-proxy", "nginx proxy", port, server, limited=False))
    if selected("nginx-limit"):
        port = free_port()
        server = start_nginx(servers, state, "nginx-limit", "nginx-limit.conf.in", port,
                             REQUESTS=LIMIT_REQUESTS, WINDOW_S=LIMIT_WINDOW_S,
                             RATE=nginx_rate(), **common)
        targets.append(Target("nginx-limit", "nginx + limit_req", port, server, limited=True))
    if selected("haproxy"):
        port = free_port()
        d = state / "haproxy"
        d.mkdir()
        cfg = render(PEERS / "haproxy.cfg.in", d / "haproxy.cfg", DIR=d, PORT=port,
                     REQUESTS=LIMIT_REQUESTS, WINDOW_S=LIMIT_WINDOW_S, **common)
        server = servers.start("haproxy", ["haproxy", "-db", "-f", str(cfg)])
        wait_until("haproxy", lambda: http_get(port)[0] == 200, server)
        targets.append(Target("haproxy", "HAProxy + stick table", port, server, limited=True))
    if selected("node"):
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
        targets.append(Target("node", "Node: express + rate-limiter-flexible (Redis) + http-proxy",
                              port, server, limited=True, redis=True))

    if selected("sluice-plain"):
        server, port, _ = start_sluice(servers, state, "sluice-plain", up_port, local_store(), "[]")
        targets.append(Target("sluice-plain", "sluice, route without limits", port, server,
                              limited=False, nginx_peer="nginx-proxy"))
    if selected("sluice-local"):
        server, port, _ = start_sluice(servers, state, "sluice-local", up_port, local_store(),
                                       sluice_limit())
        targets.append(Target("sluice-local", "sluice, in-process store", port, server,
                              limited=True, nginx_peer="nginx-limit"))
    for algorithm, extra in REDIS_ALGORITHMS.items():
        name = f"sluice-redis-{algorithm}"
        if selected(name):
            server, port, _ = start_sluice(servers, state, name, up_port, redis_store(redis),
                                           sluice_limit(extra))
            targets.append(Target(name, f"sluice, Redis, {algorithm}", port, server,
                                  limited=True, redis=True, nginx_peer="nginx-limit",
                                  node_peer="node"))
    return up_port, targets


def preflight(target: Target) -> str:
    """Checks a target answers as configured: 200s, and for a limited target 429s past the
    limit. Returns a one-line summary; raises HarnessError when it does not."""
    key = f"preflight-{target.name}-{os.getpid()}-{time.monotonic_ns()}"
    sent = LIMIT_REQUESTS + 50 if target.limited else 20
    counts: dict[int, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=5)
    try:
        for _ in range(sent):
            conn.request("GET", "/", headers={"x-api-key": key})
            response = conn.getresponse()
            response.read()
            counts[response.status] = counts.get(response.status, 0) + 1
    finally:
        conn.close()
    ok = counts.get(200, 0)
    if target.limited:
        good = (0.9 * LIMIT_REQUESTS <= ok <= 1.3 * LIMIT_REQUESTS
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
    cpu_s: float
    redis_cpu_s: float = 0.0
    redis_cmds: int = 0
    redis_scripts: int = 0
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


def wrk_command(opts: Options, port: int, duration: int, args: list[str]) -> list[str]:
    script, args = args[0], args[1:]
    return [
        "wrk", "-t", str(opts.wrk_threads), "-c", str(opts.connections), "-d", f"{duration}s",
        "--timeout", "2s", "-s", str(WRK / script), f"http://127.0.0.1:{port}/",
    ] + (["--", *args] if args else [])


def measured(target: Target, redis: Redis, generate) -> Run:
    """Runs `generate()` (a load generator returning a partial Run) and adds the CPU the
    target's processes and Redis used meanwhile, and Redis's command counts."""
    pids = process_tree(target.pid)
    if target.redis:
        redis.reset()
    cpu0, rcpu0 = cpu_seconds(pids), cpu_seconds([redis.server.popen.pid])
    run = generate()
    run.cpu_s = cpu_seconds(pids) - cpu0
    if target.redis:
        run.redis_cpu_s = cpu_seconds([redis.server.popen.pid]) - rcpu0
        run.redis_cmds, run.redis_scripts = redis.command_counts()
    if target.server.popen.poll() is not None:
        raise HarnessError(f"{target.name} exited during the run:\n{log_tail(target.server.log)}")
    return run


def run_wrk(opts: Options, target: Target, redis: Redis, scenario: str, duration: int) -> Run:
    argv = wrk_command(opts, target.port, duration, wrk_args(scenario))

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


def closed_loop(opts: Options, targets: list[Target], redis: Redis) -> dict:
    results: dict[tuple[str, str], list[Run]] = {}
    scenarios = [s for s in CLOSED_LOOP if s in opts.scenarios]
    for r in range(opts.rounds):
        for scenario in scenarios:
            eligible = [t for t in targets if scenario == "admit" or t.limited]
            for target in in_turns(eligible, r):
                run = run_wrk(opts, target, redis, scenario, opts.duration)
                check_sane(target, scenario, run)
                results.setdefault((scenario, target.name), []).append(run)
                progress(f"  round {r + 1}/{opts.rounds} {scenario:<6} {target.name:<26} "
                         f"{run.rps:>9,.0f} req/s  p99 {run.p99_ms:6.2f} ms  "
                         f"rejected {100 * run.rejected / run.requests:5.1f} %")
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
    latency sluice adds is read against the upstream at the same rate. Node, far slower, runs at
    the same share of its own saturation when that is lower."""
    def saturation(name):
        runs = results.get(("admit", name))
        return statistics.median(r.rps for r in runs) if runs else None

    proxies = [saturation(t.name) for t in targets if t.name not in ("upstream", "node")]
    proxies = [s for s in proxies if s]
    common = opts.rate or (LATENCY_SHARE * min(proxies) if proxies else 1000.0)
    rates = {}
    for t in targets:
        rate = common
        own = saturation(t.name)
        if t.name == "node" and own and not opts.rate:
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
    redis_cpu_per_100k: float | None
    redis_cmds_per_req: float | None
    redis_scripts_per_req: float | None
    redis_cmds_per_rejected: float | None
    vs_nginx: float | None = None
    vs_node: float | None = None
    added_p50_ms: float | None = None


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
                redis_cpu_per_100k=1e5 * sum(r.redis_cpu_s for r in runs) / n if redis else None,
                redis_cmds_per_req=sum(r.redis_cmds for r in runs) / n if redis else None,
                redis_scripts_per_req=sum(r.redis_scripts for r in runs) / n if redis else None,
                redis_cmds_per_rejected=(sum(r.redis_cmds for r in runs) / rejected
                                         if redis and rejected else None),
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


def checks(rows: list[Row]) -> list[str]:
    """The performance targets of the issue, as PASS/FAIL (or SKIP when not measured) lines."""
    index = {(r.scenario, r.target.name): r for r in rows}
    out = []

    def line(ok: bool | None, text: str) -> None:
        if ok is None:
            out.append(f"SKIP  {text.replace('-×', '-')} (not measured in this run)")
        else:
            out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    def ratio(scenario, name, peer):
        a, b = index.get((scenario, name)), index.get((scenario, peer))
        return (a.rps / b.rps, a, b) if a and b else (None, a, b)

    r, _, _ = ratio("admit", "sluice-plain", "nginx-proxy")
    line(None if r is None else r >= 1.0,
         f"admit: sluice plain proxy {fmt(r, '.2f')}× nginx proxy (target ≥ 1.0×)")
    r, _, _ = ratio("admit", "sluice-local", "nginx-limit")
    line(None if r is None else r >= 1.0,
         f"admit: sluice in-process {fmt(r, '.2f')}× nginx limit_req (target ≥ 1.0×)")
    for algorithm in REDIS_ALGORITHMS:
        name = f"sluice-redis-{algorithm}"
        r, a, b = ratio("admit", name, "nginx-limit")
        line(None if r is None else r >= 0.75,
             f"admit: sluice Redis {algorithm} {fmt(r, '.2f')}× nginx limit_req "
             "(target ≥ 0.75×)")
        rn, _, _ = ratio("admit", name, "node")
        line(None if rn is None else rn >= 10,
             f"admit: sluice Redis {algorithm} {fmt(rn, '.1f')}× Node (target ≥ 10×)")
        p = a.p99_ms / b.p99_ms if a and b else None
        line(None if p is None else p <= 1.5,
             f"admit: sluice Redis {algorithm} p99 {fmt(a and a.p99_ms, '.2f')} ms = "
             f"{fmt(p, '.2f')}× nginx limit_req's {fmt(b and b.p99_ms, '.2f')} ms "
             "(target ≤ 1.5×)")
        r, a, _ = ratio("flood", name, "nginx-limit")
        c = a.redis_cmds_per_rejected if a else None
        line(None if r is None or c is None else r >= 1.5 and c < 0.05,
             f"flood: sluice Redis {algorithm} {fmt(r, '.2f')}× nginx limit_req "
             "(target ≥ 1.5×), "
             f"{fmt(c, '.3f')} Redis commands per rejected request (target < 0.05)")
    for row in rows:
        if row.scenario == "latency" and row.target.name.startswith("sluice"):
            line(None if row.added_p50_ms is None else row.added_p50_ms <= 0.3,
                 f"latency: {row.target.name} adds {fmt(row.added_p50_ms, '.3f')} ms to the "
                 f"median at {row.rate:,.0f} req/s (target ≤ 0.3 ms)")
    return out


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
                     ["redis-server", "--version"], ["node", "--version"], ["wrk", "--version"])
    ]
    return [
        f"sluice: commit {commit}{' with uncommitted changes' if dirty else ''}, built with "
        "`cargo build --release --locked`",
        *(f"`{' '.join(argv)}`: {out}" for argv, out in printed),
        f"Node peer (`npm ci`, bench/peers/node/package-lock.json): {', '.join(node_pkgs)}",
        "open-loop generator: bench/loadgen (this repository; hyper 1, tokio), "
        "`cargo build --release --locked`",
    ]


def analysis() -> str:
    """The hand-written account of the missed targets (bench/analysis.md): profiles and
    reasoning a run cannot produce, kept beside the figures it explains."""
    path = BENCH / "analysis.md"
    return path.read_text().strip() if path.exists() else ""


def write_results(path: Path, opts: Options, state: Path, started: dict, finished: dict,
                  servers_seen: list[tuple[str, list[str]]], rows: list[Row], results: dict,
                  lines: list[str], mem: dict | None, note: str, rates: dict,
                  feat: dict | None = None, cost: dict | None = None) -> None:
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
  options. sluice: its exact sliding log. Before the run, each got one new key
  {LIMIT_REQUESTS + 50} times and had to answer about {LIMIT_REQUESTS} of them 200 and the rest
  429.
- **Workers: one per core for every proxy.** nginx `worker_processes {n}`, HAProxy
  `nbthread {n}`, Node `cluster` with {n} workers, sluice's Tokio runtime with {n} worker threads
  (its default, one per core; set with `TOKIO_WORKER_THREADS`). The upstream is one more nginx
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
  minus the upstream's median at the same rate) is what the proxy adds; Node, far slower, gets
  {LATENCY_SHARE:.0%} of its own. Rates (req/s): {rate_text}. The {generator_lag(results)}.
- **CPU s/100k**: utime + stime from `/proc/PID/stat` of the proxy's processes (master and
  workers summed) and of Redis, per 100 000 requests. **Redis cmds/req**: calls in
  `INFO commandstats` after `CONFIG RESETSTAT` (and `FLUSHALL`) before each run, per request,
  including the commands scripts run; in brackets, script calls alone (`EVALSHA`), i.e. round
  trips.

## Results

{table(rows)}

{chr(10).join(lines)}

{analysis()}

## Memory

{memory_text(mem) if mem else 'Not measured in this run.'}

## Shaping and counting by outcome

{features_text(feat) if feat else 'Not measured in this run.'}

## What logging costs under a flood

{log_cost_text(cost) if cost else 'Not measured in this run.'}

## Caveats

- Everything shares {m['nproc']} cores over loopback: wrk ({opts.wrk_threads} threads), the
  upstream, the proxy and Redis. No proxy ever has {m['nproc']} cores to itself; each is
  oversubscribed in the same way and none is pinned. Absolute figures say more about this
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
                   help="every target and scenario for 1 s, one round, no warm-up, no RESULTS.md")
    p.add_argument("--duration", type=int, default=5, help="seconds per run (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every scenario (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up seconds per target (default 2)")
    p.add_argument("--only", help="regex: only targets whose name matches (upstream, nginx-proxy, "
                   "nginx-limit, haproxy, node, sluice-plain, sluice-local, "
                   "sluice-redis-ALGORITHM); ratios and checks need the peers too")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--rate", type=float, help="open-loop rate for every target (default: "
                   f"{LATENCY_SHARE:.0%} of the admit saturation)")
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
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md",
                   help="where a full run writes its report (default bench/RESULTS.md)")
    p.add_argument("--note", default="", help="a paragraph to put at the top of RESULTS.md")
    a = p.parse_args(argv)
    scenarios = [s for s in a.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if a.duration < 1 or a.rounds < 1:
        p.error("--duration and --rounds must be at least 1")
    only = re.compile(a.only) if a.only else None
    if a.memory_only or a.features_only or a.log_cost_only:
        # No target; the memory, features and log-cost steps start their own.
        scenarios, only = [], re.compile("(?!)")
    opts = Options(
        smoke=a.smoke, duration=1 if a.smoke else a.duration, rounds=1 if a.smoke else a.rounds,
        warmup=0 if a.smoke else a.warmup, wrk_threads=a.threads, connections=a.connections,
        loadgen_connections=32, only=only,
        scenarios=scenarios, rate=a.rate,
    )
    return opts, a


def main(argv: list[str]) -> int:
    opts, a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    state = a.state
    servers = Servers(state)
    clock0 = time.monotonic()
    started = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    try:
        progress(f"starting servers (state in {state})")
        redis = Redis(servers, state)
        up_port, targets = start_targets(servers, state, redis, opts.only)
        servers_seen = [(s.name, s.argv) for s in servers.running]
        for t in targets:
            progress(f"  {t.name:<26} 127.0.0.1:{t.port}  preflight: {preflight(t)}")

        results: dict = {}
        rates: dict = {}
        if opts.scenarios:
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

        mem = None
        one_step = a.memory_only or a.features_only or a.log_cost_only
        if a.memory_only or (not a.no_memory and not one_step and opts.only is None):
            mem = memory(opts, servers, state, redis, up_port)
        feat = None
        if a.features_only or (not a.no_features and not one_step and opts.only is None):
            feat = features(opts, servers, state, redis, up_port)
        cost = None
        if a.log_cost_only or (not a.no_log_cost and not one_step and opts.only is None):
            cost = log_cost(opts, servers, state, redis, up_port)
    except HarnessError as err:
        print(f"\nbench: HARNESS FAILURE: {err}", file=sys.stderr)
        return 1
    finally:
        servers.stop_all()

    rows = summarise(targets, results)
    lines = checks(rows) if rows else []
    print()
    if rows:
        print(table(rows))
        print()
        if generator_lag(results):
            print(generator_lag(results))
        if opts.smoke:
            print("(smoke run: 1 s per target and scenario; PASS/FAIL below are informational)")
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
    finished = {"load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                "seconds": time.monotonic() - clock0}
    progress(f"\nbench: {finished['seconds']:.0f} s after the build")
    full = not opts.smoke and opts.only is None and opts.scenarios == SCENARIOS and mem
    if full:
        write_results(a.results, opts, state, started, finished, servers_seen, rows, results,
                      lines, mem, a.note, rates, feat, cost)
        progress(f"bench: wrote {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
