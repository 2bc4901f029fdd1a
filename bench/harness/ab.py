"""The A/B of two sluice binaries (`run.sh --ab BEFORE`): every sluice target of the main run
from each binary, in turns, back to back, on admit and flood, in every layout."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from .config import AB_SCENARIOS, REDIS_ALGORITHMS, ROOT, SLUICE_BIN
from .context import progress
from .errors import HarnessError
from .layout import Pinned
from .load import check_sane, in_turns, run_wrk
from .peers import (
    Target, instance_name, knows_workers, local_store, preflight, redis_store, sluice_limit,
    start_sluice
)
from .procfs import process_tree, rss_bytes
from .report import command_output
from .tables import markdown_table

if TYPE_CHECKING:
    from .context import Context
    from .layout import Layout
    from .load import Run
    from .redis_server import Redis


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


def ab(ctx: Context, before: Path, after: Path, layouts: list[Layout],
       only: re.Pattern | None) -> dict:
    """Every sluice target of the main run (plain, in-process, Redis per algorithm), once from
    each binary, on admit and flood, in every layout: in each round the two binaries of a
    target run back to back, in alternating order, so drift on the machine is shared out."""
    opts, servers, redis, upstream = ctx.opts, ctx.servers, ctx.redis, ctx.upstream
    for binary in (before, after):
        if not os.access(binary, os.X_OK):
            raise HarnessError(f"A/B: {binary} is not an executable")
    results: dict[tuple[str, str, str, str], list[Run]] = {}
    peaks: dict[tuple[str, str, str], int] = {}
    kinds = [k for k in ab_kinds(redis) if only is None or only.search(k[0])]
    if not kinds:
        raise HarnessError("A/B: --only selects none of sluice's targets")
    workers_field = {side: knows_workers(ctx, b)
                     for side, b in (("before", before), ("after", after))}
    for layout in layouts:
        progress(f"A/B, {layout.name} layout: {binary_label(before)} against {binary_label(after)}")
        with Pinned(layout, process_tree(upstream.popen.pid) + [redis.server.popen.pid]):
            pairs = []
            for name, store, limits, limited, on_redis in kinds:
                pair = []
                for side, binary in (("before", before), ("after", after)):
                    server, port, _ = start_sluice(
                        ctx, name, ctx.up_port, store, limits, binary=binary,
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
