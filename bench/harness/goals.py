"""The targets and thresholds the benchmark's results are judged against, as data: one table,
GOALS, of (step, target measured, measure, bound, what it is compared to). The PASS/MISS/FAIL
lines (summary.checks, steps/rtt, steps/log_cost), the targets tables and RESULTS.md all read
it; nothing else holds a threshold.

A goal with `against` is a ratio: the target's measure over the same measure of `against` in
the same run and layout (a CPU goal is a bound from above, a throughput goal from below). A
goal without it is an absolute bound in the measure's own unit. A `target` ending in `*`
stands for every target whose name starts with what precedes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from .config import CLOSED_LOOP


@dataclass(frozen=True)
class Goal:
    step: str  # the scenario or step it is read in: admit, flood, latency, rtt, log-cost
    target: str  # the target measured (`prefix*`: every target so named)
    measure: str  # a key of OPS (and of MEASURES for a ratio of two rows)
    bound: float
    against: str | None = None  # the peer; None: `bound` is absolute
    what: str = ""  # what it is about, as the tables say it

    @property
    def op(self) -> str:
        """How the measured value must compare with the bound."""
        return OPS[self.measure]

    def met(self, value: float) -> bool:
        return {"<": value < self.bound, "≤": value <= self.bound,
                "≥": value >= self.bound}[self.op]

    def matches(self, name: str) -> bool:
        if self.target.endswith("*"):
            return name.startswith(self.target[:-1])
        return name == self.target


GOALS: tuple[Goal, ...] = (
    # Issue 20's and 29's ratios to a peer, in the closed-loop scenarios (the CPU totals are
    # issue 29's: plain ≤ 1.15× nginx and ≤ 1.10× the bare-hyper floor, in-process and the
    # flood's 429 ≤ 1.25× limit_req; the rest issue 20's).
    Goal("admit", "sluice-plain", "user", 1.5, "nginx-proxy", "plain proxy"),
    Goal("admit", "sluice-plain", "total", 1.15, "nginx-proxy", "plain proxy"),
    Goal("admit", "sluice-plain", "total", 1.10, "floor", "plain proxy"),
    Goal("admit", "sluice-plain", "rps", 0.9, "nginx-proxy", "plain proxy"),
    Goal("admit", "sluice-local", "user", 1.5, "nginx-limit", "in-process limit"),
    Goal("admit", "sluice-local", "total", 1.25, "nginx-limit", "in-process limit"),
    Goal("admit", "sluice-local", "rps", 0.9, "nginx-limit", "in-process limit"),
    Goal("flood", "sluice-local", "user", 1.5, "nginx-limit", "flood's 429"),
    Goal("flood", "sluice-local", "total", 1.25, "nginx-limit", "flood's 429"),
    Goal("flood", "sluice-local", "rps", 1.0, "nginx-limit", "flood's 429"),
    # The Redis path's CPU inside sluice against the in-process path's: the store's cost.
    Goal("admit", "sluice-redis-sliding_log", "total", 1.2, "sluice-local",
         "Redis path, sliding_log"),
    Goal("admit", "sluice-redis-sliding_window", "total", 1.2, "sluice-local",
         "Redis path, sliding_window"),
    Goal("admit", "sluice-redis-fixed_window", "total", 1.2, "sluice-local",
         "Redis path, fixed_window"),
    Goal("admit", "sluice-redis-gcra", "total", 1.2, "sluice-local", "Redis path, gcra"),
    Goal("admit", "sluice-redis-weighted_log", "total", 1.2, "sluice-local",
         "Redis path, weighted_log"),
    # The Redis path's throughput (issue 20: ≥ 0.5× limit_req).
    Goal("admit", "sluice-redis-sliding_window", "rps", 0.5, "nginx-limit",
         "Redis path, sliding_window"),
    Goal("admit", "sluice-redis-gcra", "rps", 0.5, "nginx-limit", "Redis path, gcra"),
    # A concurrency limit's request (acquire + release) against the same request under a rate
    # limit: Redis's CPU per request.
    Goal("admit", "sluice-redis-concurrency", "redis", 1.3, "sluice-redis-gcra",
         "concurrency × gcra"),
    Goal("admit", "sluice-redis-concurrency", "redis", 1.3, "sluice-redis-sliding_log",
         "concurrency × sliding_log"),
    # Absolute bounds. The flood's Redis commands per rejected request (the deny cache).
    Goal("flood", "sluice-redis-*", "redis_cmds_per_rejected", 0.05),
    # Issue 29: Redis's own CPU per decision at admit's load, µs.
    Goal("admit", "sluice-redis-gcra", "redis_cpu_us", 8, what="gcra"),
    Goal("admit", "sluice-redis-sliding_window", "redis_cpu_us", 8, what="sliding_window"),
    Goal("admit", "sluice-redis-fixed_window", "redis_cpu_us", 8, what="fixed_window"),
    Goal("admit", "sluice-redis-sliding_log", "redis_cpu_us", 12, what="sliding_log"),
    # The median latency sluice adds in the open loop, ms.
    Goal("latency", "sluice*", "added_p50_ms", 0.3),
    # Issue 39: req/s per core of sluice's CPU with Redis at the longest round trip (the rtt
    # step's last link) against Redis on loopback: the batched calls hide the round trip.
    Goal("rtt", "sluice-rtt-longest", "per_core", 0.8, "sluice-rtt-loopback",
         "Redis across a delayed link"),
    # The flood's throughput at the default log level (info) against RUST_LOG=warn.
    Goal("log-cost", "sluice-log-info", "rps", 0.95, "sluice-log-warn", "log cost"),
)

# Each measure's direction: how a measured value must compare with its goal's bound.
OPS = MappingProxyType({
    "user": "≤", "total": "≤", "redis": "≤", "rps": "≥", "per_core": "≥",
    "redis_cmds_per_rejected": "<", "redis_cpu_us": "≤", "added_p50_ms": "≤",
})

# The ratio measures of a summary row (summary.Row): (label, value).
MEASURES = MappingProxyType({
    "user": ("user CPU µs/req", lambda r: r.cpu_user_us),
    "total": ("CPU µs/req", lambda r: r.cpu_user_us + r.cpu_sys_us),
    "rps": ("req/s", lambda r: r.rps),
    "redis": ("Redis CPU µs/req",
              lambda r: None if r.redis_cpu_per_100k is None else r.redis_cpu_per_100k * 10),
})
# The same, of one round (load.Run).
ROUND_MEASURES = MappingProxyType({
    "user": lambda run: run.cpu_user_s / run.requests,
    "total": lambda run: run.cpu_s / run.requests,
    "rps": lambda run: run.rps,
    "redis": lambda run: run.redis_cpu_s / run.requests,
})


def goals(step: str | None = None, measure: str | None = None,
          target: str | None = None) -> list[Goal]:
    """The goals of GOALS that match every argument given, in the table's order."""
    return [g for g in GOALS if (step is None or g.step == step)
            and (measure is None or g.measure == measure)
            and (target is None or g.target == target)]


def one_goal(step: str, measure: str, target: str | None = None) -> Goal:
    """The one goal of `step` on `measure` (and `target`); a table without it is a bug."""
    found = goals(step, measure, target)
    if len(found) != 1:
        raise LookupError(f"goals: {len(found)} goals for {step}/{measure}/{target}")
    return found[0]


def ratio_goals() -> list[Goal]:
    """The goals that compare two rows of a closed-loop scenario (the targets tables)."""
    return [g for g in GOALS if g.against is not None and g.step in CLOSED_LOOP]


def round_ratios(a, b, measure: str) -> list[float]:
    """The ratio of row `a` to row `b` in each round (the targets take turns within a round,
    so round i of one and round i of the other ran a few seconds apart)."""
    if not a or not b or not a.runs or not b.runs:
        return []
    value = ROUND_MEASURES[measure]
    return [value(x) / value(y) for x, y in zip(a.runs, b.runs) if value(y) > 0]


def spread_text(ratios: list[float]) -> str:
    """` [min–max]` of the rounds' ratios, or nothing for a single round."""
    if len(ratios) < 2:
        return ""
    return f" [{min(ratios):.2f}–{max(ratios):.2f}]"


def target_verdicts(rows: list) -> list[dict]:
    """Each ratio goal measured in these rows: values, ratio, PASS/MISS (n/a when the run did
    not measure the target or its peer)."""
    index = {(r.scenario, r.target.name): r for r in rows}
    out = []
    for g in ratio_goals():
        label, value = MEASURES[g.measure]
        a, b = index.get((g.step, g.target)), index.get((g.step, g.against))
        ratio = (value(a) / value(b) if a and b and value(a) is not None and value(b)
                 else None)
        # Judged on the ratio as printed (two decimals), so a 1.10× never reads MISS at ≤ 1.1×.
        shown = None if ratio is None else round(ratio, 2)
        met = None if shown is None else g.met(shown)
        out.append({
            "scenario": g.step, "what": g.what, "measure": label, "target": g.target,
            "peer": g.against, "value": value(a) if a else None,
            "peer_value": value(b) if b else None,
            "ratio": ratio, "spread": spread_text(round_ratios(a, b, g.measure)),
            "goal": f"{g.op} {g.bound:g}×",
            "verdict": "n/a" if met is None else ("PASS" if met else "MISS"),
        })
    return out
