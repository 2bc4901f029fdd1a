"""The Redis server every Redis-backed target shares, and what the harness reads from it
(commandstats, its own CPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import HarnessError
from .servers import wait_until

if TYPE_CHECKING:
    from .servers import Servers


class Redis:
    def __init__(self, servers: Servers, state: Path):
        self.port = servers.free_port()
        self.dir = state / "redis"
        self.dir.mkdir()
        argv = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--daemonize", "no", "--protected-mode", "yes",
        ]
        self.server = servers.start("redis", argv)
        wait_until("redis-server", self.ping, self.server)

    def ping(self) -> bool:
        out = subprocess.run(["redis-cli", "-p", str(self.port), "PING"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() == "PONG"

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=30,
        )
        if out.returncode != 0:
            raise HarnessError(f"redis-cli {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout.strip()

    def reset(self) -> None:
        # A concurrency limit's epoch survives the flush: a store that forgot it holds the
        # limit back for a quarter lease (src/limiter/redis/epochs.rs), which a bench run
        # must not measure as refusals.
        epochs = [k for k in self.cli("KEYS", "*:concurrency:epoch").splitlines() if k]
        self.cli("FLUSHALL")
        for key in epochs:
            self.cli("SET", key, "0", "PX", "86400000")
        self.cli("CONFIG", "RESETSTAT")

    def command_stats(self) -> dict[str, tuple[int, int]]:
        """Per command since the last reset (`INFO commandstats`): (calls, µs spent in it);
        the commands scripts run count too, and a script's µs include theirs. Without the
        harness's own (INFO, FLUSHALL, CONFIG)."""
        stats = {}
        for line in self.cli("INFO", "commandstats").splitlines():
            m = re.match(r"cmdstat_([^:]+):calls=(\d+),usec=(\d+)", line)
            if not m:
                continue
            name = m.group(1)
            if name in ("info", "flushall") or name.startswith("config"):
                continue  # the harness's own
            stats[name] = (int(m.group(2)), int(m.group(3)))
        return stats

    @staticmethod
    def counts(stats: dict[str, tuple[int, int]]) -> tuple[int, int]:
        """(all commands, script calls) of command_stats()."""
        total = sum(calls for calls, _ in stats.values())
        scripts = sum(calls for name, (calls, _) in stats.items()
                      if name.split("|")[0] in ("eval", "evalsha", "eval_ro", "evalsha_ro",
                                                "fcall"))
        return total, scripts

    def command_counts(self) -> tuple[int, int]:
        """(all commands, script calls) since the last reset; scripts' own calls count too."""
        return self.counts(self.command_stats())

    def cpu_seconds(self) -> float:
        """Redis's own CPU (`INFO cpu`: getrusage, microseconds, where /proc counts 10 ms
        ticks), user + system, every thread."""
        fields = dict(line.split(":", 1) for line in self.cli("INFO", "cpu").splitlines()
                      if ":" in line)
        return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


# ---------------------------------------------------------------------------------------------
# Layouts: where the processes run
