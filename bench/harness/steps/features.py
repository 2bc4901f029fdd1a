"""Shaping and counting by outcome (issue 15): a flood shaped by `on_exceed: delay`, and
limits that count only some outcomes, through Redis."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..config import LIMIT_REQUESTS, LIMIT_WINDOW_S
from ..context import progress
from ..load import check_sane, run_wrk
from ..peers import Target, redis_store, sluice_limit, start_sluice
from ..servers import http_get

if TYPE_CHECKING:
    from ..context import Context


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


def features(ctx: Context) -> dict:
    """A shaped flood (on_exceed: delay) and count-by-outcome limits, through Redis."""
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    out: dict = {"connections": opts.connections}
    progress(f"features: shaped flood ({LIMIT_REQUESTS}/{LIMIT_WINDOW_S} s, on_exceed: delay, "
             f"max_delay: {SHAPED_MAX_DELAY}), Redis")
    limits = sluice_limit(f"on_exceed: delay, max_delay: {SHAPED_MAX_DELAY}")
    server, port, admin = start_sluice(ctx, "sluice-shaped", up_port,
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
        server, port, _ = start_sluice(ctx, f"sluice-count-{name}", up_port,
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
