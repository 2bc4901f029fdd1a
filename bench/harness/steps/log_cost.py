"""What logging costs under a flood: sluice at the default log level against RUST_LOG=warn, in
turns; judged by the goal of step `log-cost` in goals.GOALS."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..context import progress
from ..goals import one_goal
from ..load import check_sane, in_turns, run_wrk
from ..peers import Target, local_store, sluice_limit, start_sluice

if TYPE_CHECKING:
    from ..context import Context
    from ..load import Run


def log_cost(ctx: Context) -> dict:
    """The flood against two in-process sluices, one at the default log level (info: a
    rejection's first line, then a summary every 10 s) and one at RUST_LOG=warn (no rejection
    lines), in turns; the throughput ratio and the bytes of log the info instance wrote."""
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    progress("log cost: flood, in-process store, RUST_LOG=info (the default) against warn")
    targets = []
    for level in ("info", "warn"):
        name = f"sluice-log-{level}"
        server, port, _ = start_sluice(ctx, name, up_port, local_store(),
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
    goal = one_goal("log-cost", "rps")
    met = "met" if goal.met(cost["ratio"]) else "missed"
    return "\n".join([
        f"**Log cost**: wrk's flood (one API key, closed loop, `-c{cost['connections']}`), "
        f"in-process store, median of {cost['rounds']} run(s) of {cost['duration']} s in turns:",
        f"default log level (info) {cost['info_rps']:,.0f} answers/s, `RUST_LOG=warn` "
        f"{cost['warn_rps']:,.0f} answers/s: ratio {cost['ratio']:.3f} "
        f"(target >= {goal.bound:g}: {met}); sluice's CPU per answer {cost['info_cpu_us']:.1f} "
        f"µs at info, {cost['warn_cpu_us']:.1f} µs at warn. "
        f"The info instance wrote {cost['log_bytes']:,} "
        f"bytes of log in all, start and shutdown included, for {cost['rejected']:,} rejections.",
    ])
