"""One row of a run's results: a scenario and target over its rounds (kept apart from the
summing up in `summary` and the tables in `tables`, which both read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .load import Run
    from .peers import Target


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
    cpu_user_us: float  # per request, in the proxy's processes
    cpu_sys_us: float
    redis_cpu_per_100k: float | None
    redis_cmds_per_req: float | None
    redis_scripts_per_req: float | None
    redis_cmds_per_rejected: float | None
    vs_nginx: float | None = None
    vs_node: float | None = None
    added_p50_ms: float | None = None
    runs: list[Run] | None = None  # the rounds, in order
