"""The report's tables, as Markdown padded to line up in a terminal: the main table, CPU per
request, the goals, the Redis path per algorithm, the concurrency limit against the rate
limits, and Redis's work by command."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from .config import CLOSED_LOOP, CONCURRENCY_LIMIT, CONCURRENCY_TARGET, REDIS_ALGORITHMS
from .goals import goals, round_ratios, spread_text, target_verdicts
from .steps.leases import leases_text

if TYPE_CHECKING:
    from .row import Row


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


def concurrency_commands_targets() -> list[str]:
    """The targets redis_commands_table() sets side by side: the concurrency limit's request
    and the rate-limited ones it is read against."""
    return [CONCURRENCY_TARGET] + [g.against for g in goals(target=CONCURRENCY_TARGET)]


def concurrency_text(rows: list[Row], pinned_rows: list[Row] | None, lease: dict | None) -> str:
    """RESULTS.md's section on concurrency limits: the comparison per layout, where Redis's
    work per request goes, and the lease-renewal step."""
    goal = goals(target=CONCURRENCY_TARGET)[0]
    parts = []
    for layout_rows, title in ((rows, "shared"), (pinned_rows or [], "pinned")):
        if not concurrency_table(layout_rows):
            continue
        parts += [f"The {title} layout, admit (every request admitted, so each costs an acquire "
                  f"in the decide call and a release when its answer ends; goal: Redis CPU per "
                  f"request {goal.op} {goal.bound:g}× the rate-limited request's):", "",
                  concurrency_table(layout_rows), "",
                  "Where Redis's work per request goes (`INFO commandstats` over the runs):", "",
                  redis_commands_table(layout_rows, concurrency_commands_targets()), ""]
    if lease:
        parts.append(leases_text(lease))
    return "\n".join(parts).strip()


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
