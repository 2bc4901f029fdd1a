"""Generating load and measuring it: wrk's closed-loop scenarios (admit, flood, mixed) and
bench/loadgen's open loop (latency), the targets in turns round after round, with the CPU the
target and Redis used over each run."""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import (
    ADMIT_KEYS, CLOSED_LOOP, LATENCY_SHARE, LOADGEN_BIN, MIXED_ABUSERS, MIXED_ABUSE_PERCENT, WRK
)
from .context import progress
from .errors import HarnessError
from .procfs import cpu_seconds, cpu_times, process_tree
from .servers import log_tail

if TYPE_CHECKING:
    from .context import Options
    from .layout import Layout
    from .peers import Target
    from .redis_server import Redis


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
