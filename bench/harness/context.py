"""What every step is handed: the options of the run, its servers and state directory, Redis
and the upstream once started, and what is learnt about the sluice binaries on the way. One
object per run, passed down; the harness keeps no state at module level."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .redis_server import Redis
    from .servers import Server, Servers




@dataclass
class Options:
    """The run's options, from the command line (a smoke run: one round of 1 s, no warm-up)."""
    smoke: bool
    duration: int
    rounds: int
    warmup: int
    wrk_threads: int
    connections: int
    loadgen_connections: int
    only: re.Pattern | None
    scenarios: list[str]
    rate: float | None
    scaling_parts: tuple[str, ...] = ("routes", "limits", "memory")  # the scaling step's parts


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Context:
    """One run's shared state, handed to every step: set up by cli.main, Redis and the
    upstream once they run. `knows_workers` remembers, per sluice binary, whether it takes
    `server: { workers: N }` (peers.knows_workers asks each binary once)."""
    opts: Options
    servers: Servers
    state: Path
    redis: Redis | None = None
    up_port: int = 0
    upstream: Server | None = None
    knows_workers: dict[Path, bool] = field(default_factory=dict)
