"""Measuring processes from /proc: the process tree, CPU time (user and kernel), resident
memory, and moving threads between CPUs."""

from __future__ import annotations

import os
from pathlib import Path

from .config import CLK_TCK
from .errors import HarnessError


def _stat_fields(pid: int) -> list[str]:
    # Fields after the parenthesised command name, which may itself hold spaces.
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (nginx's and node's workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """(utime, stime) of these processes, all their threads summed (the kernel keeps a
    process's total in /proc/PID/stat, exited threads included), in seconds: user-space CPU
    and the kernel's CPU on the process's behalf (syscalls, the network stack it drives)."""
    user = system = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
            user += int(fields[11])
            system += int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return user / CLK_TCK, system / CLK_TCK


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), in seconds."""
    return sum(cpu_times(pids))


def pin(pids: list[int], cpus: set[int]) -> None:
    """Moves every thread of these processes to `cpus` (taskset -a -p, without forking)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass  # a thread that exited meanwhile


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now (`VmRSS`) or at its peak so far (`VmHWM`), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise HarnessError(f"no {field} for pid {pid}")


# ---------------------------------------------------------------------------------------------
# Redis
