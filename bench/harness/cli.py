"""The command line (what `bench/run.sh` passes on) and the run itself, step by step."""

from __future__ import annotations

import argparse
import datetime
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .ab import ab, ab_text, binary_label
from .config import (
    BENCH, CONCURRENCY_TARGET, LATENCY_SHARE, PINNED_SCENARIOS, SCENARIOS, SLUICE_BIN
)
from .context import Context, Options, progress
from .errors import HarnessError
from .layout import Pinned, pinned_layout, shared_layout
from .load import closed_loop, latency_rates, open_loop, run_wrk
from .peers import knows_workers, preflight, start_targets, start_upstream
from .procfs import process_tree
from .redis_server import Redis
from .report import built_commit, write_results
from .servers import Servers
from .steps.features import features, features_text
from .steps.leases import leases, leases_text
from .steps.log_cost import log_cost, log_cost_text
from .steps.memory import memory, memory_text
from .steps.rtt import rtt, rtt_text
from .steps.scaling import scaling, scaling_text
from .steps.tokens import token_streams, token_streams_text
from .summary import checks, summarise
from .tables import (
    algorithms_table, concurrency_commands_targets, concurrency_table, cpu_table, generator_lag,
    redis_commands_table, table, targets_table
)

if TYPE_CHECKING:
    from .layout import Layout
    from .peers import Target


DESCRIPTION = "sluice's benchmark harness: every target, every scenario, one run, one table."

# The steps after the main scenarios, in the order they run and print: (name, run it, its
# Markdown). Each has its `--NAME-only` and `--no-NAME` options.
STEPS = (
    ("memory", memory, memory_text),
    ("features", features, features_text),
    ("log_cost", log_cost, log_cost_text),
    ("tokens", token_streams, token_streams_text),
    ("scaling", scaling, scaling_text),
    ("leases", leases, leases_text),
    ("rtt", rtt, rtt_text),
)


def one_step(a: argparse.Namespace) -> bool:
    """Whether the command line asks for one step alone (a `--NAME-only`, or the A/B)."""
    return bool(a.ab) or any(getattr(a, f"{name}_only") for name, _, _ in STEPS)


def parse_args(argv: list[str]) -> tuple[Options, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="bench/run.sh", description=DESCRIPTION)
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
                   help="where a non-smoke A/B writes its table (default bench/AB.md, which "
                   "RESULTS.md links to)")
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
    if one_step(a):
        # No target; the steps and the A/B start their own.
        scenarios, only = [], re.compile("(?!)")
    opts = Options(
        smoke=a.smoke, duration=1 if a.smoke else a.duration, rounds=1 if a.smoke else a.rounds,
        warmup=0 if a.smoke else a.warmup, wrk_threads=a.threads, connections=a.connections,
        loadgen_connections=32, only=only,
        scenarios=scenarios, rate=a.rate,
        scaling_parts=tuple(part for part in a.scaling_parts.split(",") if part),
    )
    return opts, a


@dataclass
class Outcome:
    """What a run measured: the main scenarios per layout, each step's figures (by its name
    in STEPS; absent when it did not run) and the A/Bs."""
    targets: list[Target] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    pinned_targets: list[Target] = field(default_factory=list)
    pinned_results: dict = field(default_factory=dict)
    rates: dict = field(default_factory=dict)
    servers_seen: list[tuple[str, list[str]]] = field(default_factory=list)
    steps: dict = field(default_factory=dict)
    ab_result: dict | None = None
    self_ab: dict | None = None


def main_scenarios(ctx: Context, shared: Layout, out: Outcome) -> None:
    """The shared layout: every selected target started and checked, warmed up, then the
    closed-loop scenarios and the open loop."""
    opts, redis = ctx.opts, ctx.redis
    out.targets = start_targets(ctx, opts.only, shared)
    for t in out.targets:
        progress(f"  {t.name:<26} 127.0.0.1:{t.port}  preflight: {preflight(t)}")
    if opts.warmup:
        progress(f"warm-up: {opts.warmup} s of admit per target")
        for t in out.targets:
            run_wrk(opts, t, redis, "admit", opts.warmup)
    progress("closed loop (wrk)")
    out.results.update(closed_loop(opts, out.targets, redis))
    if "latency" in opts.scenarios:
        out.rates = latency_rates(opts, out.targets, out.results)
        progress("open loop (bench/loadgen)")
        out.results.update(open_loop(opts, out.targets, redis, out.rates))


def pinned_scenarios(ctx: Context, pinned: Layout, scenarios: list[str], out: Outcome) -> None:
    """The pinned layout: the shared layout's targets stopped, the pinned ones started on the
    proxy's core with the load side on the other, warmed up, then `scenarios`."""
    opts, servers, redis = ctx.opts, ctx.servers, ctx.redis
    for t in out.targets:
        if t.name != "upstream":
            servers.stop(t.server)  # idle, but out of the pinned proxy's way
    cpus = lambda c: ",".join(str(x) for x in sorted(c))  # noqa: E731
    progress(f"pinned layout: wrk, the upstream and Redis on CPU {cpus(pinned.load_cpus)}, "
             f"the proxy on CPU {cpus(pinned.proxy_cpus)}, one worker each")
    load_side = process_tree(ctx.upstream.popen.pid) + [redis.server.popen.pid]
    with Pinned(pinned, load_side):
        out.pinned_targets = start_targets(ctx, opts.only, pinned)
        out.servers_seen += [(s.name, s.argv) for s in servers.running
                             if s.name.endswith("-pinned")]
        for t in out.pinned_targets:
            progress(f"  {t.name:<26} 127.0.0.1:{t.port}  preflight: {preflight(t)}")
        if opts.warmup:
            for t in out.pinned_targets:
                run_wrk(opts, t, redis, "admit", opts.warmup)
        out.pinned_results = closed_loop(opts, out.pinned_targets, redis, scenarios)
    for t in out.pinned_targets:
        servers.stop(t.server)


def run(ctx: Context, a: argparse.Namespace, layouts: list[Layout], out: Outcome) -> None:
    """Everything the command line asks for, in order; the figures into `out`."""
    opts = ctx.opts
    progress(f"{binary_label(SLUICE_BIN)}: workers set with "
             + ("`server.workers` and TOKIO_WORKER_THREADS" if knows_workers(ctx, SLUICE_BIN)
                else "TOKIO_WORKER_THREADS (no `server.workers` in this binary)"))
    if a.ab:
        out.ab_result = ab(ctx, a.ab, a.ab_after, layouts,
                           None if a.only is None else re.compile(a.only))
    shared = next((lay for lay in layouts if lay.name == "shared"), None)
    pinned = next((lay for lay in layouts if lay.name == "pinned"), None)
    if opts.scenarios and shared:
        main_scenarios(ctx, shared, out)
    out.servers_seen = [(s.name, s.argv) for s in ctx.servers.running]
    scenarios = [s for s in PINNED_SCENARIOS if s in opts.scenarios]
    if pinned and scenarios:
        pinned_scenarios(ctx, pinned, scenarios, out)
    alone = one_step(a)
    for name, step, _ in STEPS:
        if getattr(a, f"{name}_only") or (not getattr(a, f"no_{name}") and not alone
                                          and opts.only is None):
            out.steps[name] = step(ctx)
    if opts.smoke and not alone and opts.only is None:
        # The A/B mode's own code, checked with this binary against itself.
        out.self_ab = ab(ctx, SLUICE_BIN, SLUICE_BIN, layouts[:1], re.compile("plain|local|gcra"))


def print_report(opts: Options, out: Outcome, rows: list, pinned_rows: list, lines: list[str],
                 date: str) -> None:
    """The run's tables, PASS/FAIL lines and steps, on standard output."""
    print()
    if rows:
        print(table(rows))
        print()
        if generator_lag(out.results):
            print(generator_lag(out.results))
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
    for name, _, text in STEPS:
        if out.steps.get(name):
            print()
            print(text(out.steps[name]))
    for result in (out.ab_result, out.self_ab):
        if result:
            print()
            print(ab_text(result, date))


def main(argv: list[str]) -> int:
    opts, a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    state = a.state
    servers = Servers(state)
    ctx = Context(opts, servers, state)
    clock0 = time.monotonic()
    started = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
               "commit": built_commit()}
    shared = shared_layout(opts.wrk_threads)
    pinned = pinned_layout() if "pinned" in a.layouts else None
    if "pinned" in a.layouts and pinned is None:
        progress("only one CPU is allowed here: no pinned layout")
    layouts = ([shared] if "shared" in a.layouts else []) + ([pinned] if pinned else [])
    out = Outcome()
    try:
        progress(f"starting servers (state in {state})")
        ctx.redis = Redis(servers, state)
        ctx.up_port, ctx.upstream = start_upstream(ctx)
        run(ctx, a, layouts, out)
    except HarnessError as err:
        print(f"\nbench: HARNESS FAILURE: {err}", file=sys.stderr)
        return 1
    finally:
        servers.stop_all()

    rows = summarise(out.targets, out.results)
    pinned_rows = summarise(out.pinned_targets, out.pinned_results)
    lines = (checks(rows) if rows else []) + (checks(pinned_rows, "pinned") if pinned_rows
                                              else [])
    print_report(opts, out, rows, pinned_rows, lines, started["date"])
    finished = {"load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                "seconds": time.monotonic() - clock0}
    progress(f"\nbench: {finished['seconds']:.0f} s after the build")
    if out.ab_result and not opts.smoke:
        a.ab_results.write_text(ab_text(out.ab_result, started["date"]) + "\n")
        progress(f"bench: wrote {a.ab_results}")
    full = (not opts.smoke and opts.only is None and tuple(opts.scenarios) == SCENARIOS
            and out.steps.get("memory") and not a.ab)
    if full:
        write_results(ctx, a.results, started, finished, out.servers_seen, rows, out.results,
                      lines, a.note, out.rates, out.steps, pinned_rows, pinned)
        progress(f"bench: wrote {a.results}")
    return 0
