"""A run's results summed up: one row per scenario and target over its rounds (medians,
per-request CPU, Redis's work, ratios to the peers), and the PASS/FAIL lines of the goals."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from .config import SCENARIOS
from .row import Row
from .goals import goals, target_verdicts
from .tables import fmt, redis_spread

if TYPE_CHECKING:
    from .peers import Target


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


def checks(rows: list[Row], layout: str = "shared") -> list[str]:
    """The goals (goals.GOALS) as PASS/FAIL (or SKIP when not measured) lines: the absolute
    bounds (Redis commands per rejection, Redis CPU per decision, added latency) and the CPU
    ratios (every ratio is in tables.targets_table() too). Lines of the pinned layout say so."""
    out = []

    def line(ok: bool | None, text: str) -> None:
        if layout != "shared":
            text = f"[{layout}] {text}"
        if ok is None:
            out.append(f"SKIP  {text} (not measured in this run)")
        else:
            out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    for goal in goals("flood", "redis_cmds_per_rejected"):
        for row in rows:
            if row.scenario == goal.step and goal.matches(row.target.name):
                c = row.redis_cmds_per_rejected
                line(None if c is None else goal.met(c),
                     f"flood: {row.target.name} {fmt(c, '.3f')} Redis commands per rejected "
                     f"request (target {goal.op} {goal.bound:g})")
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
    for goal in goals(measure="redis_cpu_us"):
        row = index.get((goal.step, goal.target))
        if row and row.redis_cpu_per_100k is not None:
            us = row.redis_cpu_per_100k * 10
            line(goal.met(us), f"{goal.step}: Redis CPU per decision, {goal.what}: {us:.1f} µs"
                 f"{redis_spread(row)} (target {goal.op} {goal.bound:g} µs)")
    for goal in goals("latency", "added_p50_ms"):
        for row in rows:
            if row.scenario == goal.step and goal.matches(row.target.name):
                line(None if row.added_p50_ms is None else goal.met(row.added_p50_ms),
                     f"latency: {row.target.name} adds {fmt(row.added_p50_ms, '.3f')} ms to "
                     f"the median at {row.rate:,.0f} req/s (target {goal.op} {goal.bound:g} ms)")
    return out


# ---------------------------------------------------------------------------------------------
# Memory (point 7)
