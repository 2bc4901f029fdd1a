"""Layouts: how the machine's cores are shared out between the proxy under test and the load
side (wrk, the upstream, Redis)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config import workers
from .procfs import pin


@dataclass
class Layout:
    """How the machine is shared out. *shared*: nothing pinned, every proxy with one worker per
    core, wrk with one thread per core. *pinned*: wrk (one thread), the upstream and Redis on one
    core, the proxy under test alone on another with one worker, so a ratio compares the
    proxies themselves, not how each competes with the load generator for the cores."""
    name: str
    workers: int
    wrk_threads: int
    proxy_cpus: set[int] | None = None
    load_cpus: set[int] | None = None

    @staticmethod
    def _taskset(cpus: set[int] | None, argv: list[str]) -> list[str]:
        if not cpus:
            return argv
        return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus)), *argv]

    def proxy_argv(self, argv: list[str]) -> list[str]:
        return self._taskset(self.proxy_cpus, argv)

    def load_argv(self, argv: list[str]) -> list[str]:
        return self._taskset(self.load_cpus, argv)


def shared_layout(wrk_threads: int) -> Layout:
    return Layout("shared", workers=workers(), wrk_threads=wrk_threads)


def pinned_layout() -> Layout | None:
    """The first allowed CPU for the load side, the second for the proxy; None with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return Layout("pinned", workers=1, wrk_threads=1, proxy_cpus={cpus[1]}, load_cpus={cpus[0]})


class Pinned:
    """Within the block, the upstream's and Redis's processes run on the layout's load CPUs;
    after it, on every allowed CPU again."""

    def __init__(self, layout: Layout, pids: list[int]):
        self.layout, self.pids = layout, pids

    def __enter__(self):
        if self.layout.load_cpus:
            pin(self.pids, self.layout.load_cpus)
        return self

    def __exit__(self, *exc):
        if self.layout.load_cpus:
            pin(self.pids, set(os.sched_getaffinity(0)))
        return False


# ---------------------------------------------------------------------------------------------
# Targets
