"""How cost grows with the work (issue 29): sluice's CPU per request as routes and limits
per route grow, and Redis's memory per identity per algorithm as identities grow."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..config import REDIS_ALGORITHMS, SLUICE_BIN, workers
from ..context import progress
from ..errors import HarnessError
from ..goals import spread_text
from ..load import in_turns, run_wrk, wrk_command
from ..peers import Target, local_store, redis_store
from ..servers import http_get, wait_until
from ..tables import markdown_table

if TYPE_CHECKING:
    from ..context import Context, Options
    from ..load import Run
    from ..redis_server import Redis


SCALING_ROUTES = (10, 100, 1_000, 10_000)
SCALING_LIMITS = (1, 2, 4, 8)
SCALING_IDENTITIES = (10_000, 100_000, 1_000_000)
# Entries per identity in the logs (sliding_log, weighted_log): a client that sent ten
# requests in the window, where the limit is far above.
SCALING_LOG_ENTRIES = 10
# Route kinds: (routes' prefix for route i, the path requested: the last route's).
ROUTE_KINDS = MappingProxyType({
    "prefix": ("/r{i}", "/r{last}/item"),
    "exact": ("/api/v1/items/r{i}", "/api/v1/items/r{last}"),
})


def scaling_yaml(port: int, admin: int, up_port: int, store: str, prefixes: list[str],
                 limits: list[str]) -> str:
    lines = [f"listen: 127.0.0.1:{port}", f"admin_listen: 127.0.0.1:{admin}",
             f"server: {{ workers: {workers()} }}", f"store: {store}", "upstreams:",
             f'  up: {{ url: "http://127.0.0.1:{up_port}" }}', "routes:"]
    for i, prefix in enumerate(prefixes):
        lines.append(f"  - {{ name: r{i}, match: {{ path_prefix: \"{prefix}\" }}, upstream: up"
                     + (f", limits: [{', '.join(limits)}] }}" if limits else " }"))
    return "\n".join(lines) + "\n"


def start_scaling_sluice(ctx: Context, name: str, yaml: str, port: int,
                         admin: int) -> Target:
    servers, state = ctx.servers, ctx.state
    conf = state / f"{name}.yaml"
    conf.write_text(yaml)
    server = servers.start(name, [str(SLUICE_BIN), "run", "--config", str(conf)],
                           {"RUST_LOG": "warn", "TOKIO_WORKER_THREADS": str(workers())})
    wait_until(name, lambda: http_get(admin, "/readyz")[0] == 200, server, timeout=120)
    return Target(name, name, port, server, limited=False)


def scaling_rounds(opts: Options, redis: Redis, targets: list[tuple[Target, str, str]],
                   rounds: int, duration: int) -> dict[str, list[Run]]:
    """Each (target, scenario, path) for `rounds` rounds, in turns."""
    runs: dict[str, list[Run]] = {}
    for r in range(rounds):
        for target, scenario, path in in_turns(targets, r):
            run = run_wrk(opts, target, redis, scenario, duration, path)
            if run.rejected > 0.01 * run.requests:
                raise HarnessError(f"scaling: {target.name}: {run.rejected} of {run.requests} "
                                   "answered 4xx/5xx")
            runs.setdefault(target.name, []).append(run)
            progress(f"  round {r + 1}/{rounds} {target.name:<22} {run.rps:>8,.0f} req/s  CPU "
                     f"{1e6 * run.cpu_s / run.requests:5.1f} µs/req")
    return runs


def scaling(ctx: Context) -> dict:
    """sluice's CPU per request as routes and limits per route grow, and Redis's memory per
    identity per algorithm as identities grow (the parts `--scaling-parts` asks for)."""
    parts = ctx.opts.scaling_parts
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    smoke = opts.smoke
    rounds, duration = (1, 1) if smoke else (opts.rounds, opts.duration)
    out: dict = {"rounds": rounds, "duration": duration, "routes": {}, "limits": {},
                 "memory": {}}
    route_counts = (10, 1_000) if smoke else SCALING_ROUTES
    for kind, (pattern, path) in ROUTE_KINDS.items() if "routes" in parts else ():
        progress(f"scaling: routes matched by {kind} ({', '.join(map(str, route_counts))})")
        targets = []
        for n in route_counts:
            port, admin = servers.free_port(), servers.free_port()
            prefixes = [pattern.format(i=i) for i in range(n)]
            yaml = scaling_yaml(port, admin, up_port, local_store(), prefixes, [])
            target = start_scaling_sluice(ctx, f"routes-{kind}-{n}", yaml, port, admin)
            targets.append((target, "path", path.format(last=n - 1)))
        runs = scaling_rounds(opts, redis, targets, rounds, duration)
        out["routes"][kind] = {n: runs[t.name] for n, (t, _, _) in zip(route_counts, targets)}
        for t, _, _ in targets:
            servers.stop(t.server)

    limit_counts = (1, 8) if smoke else SCALING_LIMITS
    if "limits" not in parts:
        limit_counts = ()
    progress(f"scaling: limits per route ({', '.join(map(str, limit_counts))}), in-process, admit")
    targets = []
    for k in limit_counts:
        port, admin = servers.free_port(), servers.free_port()
        limits = [f'{{ name: l{j}, key: ["header:x-api-key"], requests: 1000000, window: 1h }}'
                  for j in range(k)]
        yaml = scaling_yaml(port, admin, up_port, local_store(max_keys=1_000_000), ["/"], limits)
        targets.append((start_scaling_sluice(ctx, f"limits-{k}", yaml, port, admin),
                        "admit", "/"))
    runs = scaling_rounds(opts, redis, targets, rounds, duration) if targets else {}
    out["limits"] = {k: runs[t.name] for k, (t, _, _) in zip(limit_counts, targets)}
    for t, _, _ in targets:
        servers.stop(t.server)

    identities = (200, 1_000) if smoke else SCALING_IDENTITIES  # smoke: the copies too
    for algorithm, extra in REDIS_ALGORITHMS.items() if "memory" in parts else ():
        out["memory"][algorithm] = redis_memory(ctx, algorithm,
                                                extra, identities)
    return out


def used_memory(redis: Redis) -> int:
    for line in redis.cli("INFO", "memory").splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    raise HarnessError("no used_memory in INFO memory")


def redis_memory(ctx: Context, algorithm: str, extra: str, identities: tuple[int, ...]) -> list[dict]:
    """Redis's memory per identity: the first count written by sluice itself (wrk sends each
    identity SCALING_LOG_ENTRIES requests, one pass of them all after another), the larger
    counts by copying one identity's keys as sluice wrote them (DUMP, then RESTORE under new
    names with the same TTL, pipelined through `redis-cli --pipe`)."""
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    entries = SCALING_LOG_ENTRIES if algorithm.endswith("_log") else 1
    first = identities[0]
    progress(f"scaling: Redis memory per identity, {algorithm} ({entries} request(s) each; "
             f"{first:,} identities through sluice, then copies up to {identities[-1]:,})")
    port, admin = servers.free_port(), servers.free_port()
    limit = ('{ name: mem, key: ["header:x-api-key"], requests: 100, window: 1h'
             + (f", {extra}" if extra else "") + " }")
    yaml = scaling_yaml(port, admin, up_port, redis_store(redis), ["/"], [limit])
    target = start_scaling_sluice(ctx, f"memory-{algorithm}", yaml, port, admin)
    redis.reset()
    base = used_memory(redis)
    argv = wrk_command(opts, port, 600, ["keys.lua", "distinct", "id", str(first)])
    argv[2] = "1"  # one thread: identities id-1-1 .. id-1-FIRST, in passes
    last = f"id-1-{first}"
    started = time.monotonic()
    wrk = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    keys: list[str] = []
    try:
        while time.monotonic() - started < 300:
            time.sleep(0.5)
            keys = [k for k in redis.cli("--scan", "--pattern", f"*={last}}}*").splitlines() if k]
            if keys and all(scaling_entries(redis, k) >= entries for k in keys):
                break
        else:
            raise HarnessError(f"scaling: {algorithm}: {first:,} identities not written in 300 s")
    finally:
        if wrk.poll() is None:
            wrk.terminate()
        wrk.wait(timeout=10)
    servers.stop(target.server)
    seconds = time.monotonic() - started
    out = [{"identities": first, "bytes": used_memory(redis) - base, "keys": redis_dbsize(redis),
            "seconds": seconds, "written_by": "sluice",
            "sample": {k: scaling_entries(redis, k) for k in keys}}]
    progress(f"  {first:,}: {out[-1]['bytes'] / first:,.0f} B per identity, "
             f"{out[-1]['keys'] / first:.2f} keys each ({seconds:.0f} s)")
    # The copies live 10 minutes whatever the sample's TTL (a GCRA key's is short): an
    # expiry costs the same memory whatever its time, and they must outlive the measurement.
    dumps = [(k, "600000", raw_dump(redis, k)) for k in keys]
    made = first
    for count in identities[1:]:
        started = time.monotonic()
        restore_copies(redis, dumps, last, made, count)
        made = count
        out.append({"identities": count, "bytes": used_memory(redis) - base,
                    "keys": redis_dbsize(redis), "seconds": time.monotonic() - started,
                    "written_by": "copies of one identity's keys"})
        progress(f"  {count:,}: {out[-1]['bytes'] / count:,.0f} B per identity "
                 f"({out[-1]['seconds']:.0f} s to copy)")
    redis.reset()
    return out


def scaling_entries(redis: Redis, key: str) -> int:
    """Entries of a log key (a sorted set); 1 for any other key."""
    kind = redis.cli("TYPE", key)
    return int(redis.cli("ZCARD", key)) if kind == "zset" else 1


def redis_dbsize(redis: Redis) -> int:
    return int(redis.cli("DBSIZE"))


def raw_dump(redis: Redis, key: str) -> bytes:
    """DUMP's payload as bytes (redis-cli --no-raw would escape it): over a socket."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=10) as s:
        s.sendall(resp([b"DUMP", key.encode()]))
        data = b""
        while True:
            data += s.recv(65536)
            if b"\r\n" in data:
                head, rest = data.split(b"\r\n", 1)
                if not head.startswith(b"$"):
                    raise HarnessError(f"DUMP {key}: {head!r}")
                n = int(head[1:])
                if n < 0:
                    raise HarnessError(f"scaling: DUMP {key}: no such key")
                if len(rest) >= n + 2:
                    return rest[:n]


def resp(parts: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += [b"$%d\r\n" % len(part), part, b"\r\n"]
    return b"".join(out)


def restore_copies(redis: Redis, dumps: list[tuple[str, str, bytes]], identity: str, start: int,
                   end: int) -> None:
    """RESTOREs identities start+1 .. end (`id-2-N`, the same length as sluice's `id-1-N`) as
    copies of `identity`'s keys, with their TTL, through `redis-cli --pipe`."""
    pipe = subprocess.Popen(["redis-cli", "-p", str(redis.port), "--pipe"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert pipe.stdin is not None
    for first in range(start + 1, end + 1, 10_000):
        chunk = []
        for n in range(first, min(first + 10_000, end + 1)):
            for key, ttl, payload in dumps:
                name = key.replace(f"={identity}}}", f"=id-2-{n}}}")
                chunk.append(resp([b"RESTORE", name.encode(), ttl.encode(), payload]))
        pipe.stdin.write(b"".join(chunk))
    pipe.stdin.close()
    stdout = pipe.stdout.read().decode(errors="replace") if pipe.stdout else ""
    if pipe.wait(timeout=600) != 0 or "errors: 0" not in stdout:
        raise HarnessError(f"scaling: redis-cli --pipe: {stdout.strip()[-300:]}")


def scaling_text(sc: dict) -> str:
    def cpu(runs: list[Run]) -> float:
        return 1e6 * sum(r.cpu_s for r in runs) / sum(r.requests for r in runs)

    def per_round(runs: list[Run]) -> list[float]:
        return [1e6 * r.cpu_s / r.requests for r in runs]

    def vs(runs: list[Run], base: list[Run]) -> str:
        ratios = [a / b for a, b in zip(per_round(runs), per_round(base))]
        return f"{cpu(runs) / cpu(base):.2f}×{spread_text(ratios)}"

    lines = [f"{sc['rounds']} round(s) of {sc['duration']} s per row, the rows of one table in "
             "turns; sluice with 2 workers, wrk -t2 -c50, nothing pinned. CPU: sluice's user + "
             "kernel µs per request (pooled over the rounds; in brackets each round's min–max).",
             "", "Routes (no limits; every request for the *last* route in the file):", ""]
    rows = []
    for kind, by_n in sc["routes"].items():
        pattern, path = ROUTE_KINDS[kind]
        base = by_n[min(by_n)]
        for n, runs in by_n.items():
            rows.append([kind, f"{n:,}", f"`{pattern}` → `{path.format(last=n - 1)}`",
                         f"{statistics.median(r.rps for r in runs):,.0f}", f"{cpu(runs):.1f}",
                         f"[{min(per_round(runs)):.1f}–{max(per_round(runs)):.1f}]",
                         vs(runs, base)])
    lines.append(markdown_table(["match", "routes", "route i → path requested", "req/s",
                                 "CPU µs/req", "rounds", f"× {min(SCALING_ROUTES)} routes"],
                                rows, left=3))
    lines += ["", "Limits per route (in-process store, admit: 10 000 keys, every limit keyed "
              "by `x-api-key`):", ""]
    rows = []
    base = sc["limits"][min(sc["limits"])] if sc["limits"] else []
    for k, runs in sc["limits"].items():
        rows.append([f"{k}", f"{statistics.median(r.rps for r in runs):,.0f}", f"{cpu(runs):.1f}",
                     f"[{min(per_round(runs)):.1f}–{max(per_round(runs)):.1f}]", vs(runs, base)])
    lines.append(markdown_table(["limits", "req/s", "CPU µs/req", "rounds", "× 1 limit"], rows,
                                left=1))
    lines += ["", "Redis memory per identity (`used_memory` above the empty database, divided by "
              "the identities; limit 100 per hour: the logs and windows keep their keys for the hour, a "
              "GCRA key lives 36 s after one request, longer than the measurement; "
              f"{SCALING_LOG_ENTRIES} entries per identity in the logs):", ""]
    rows = []
    for algorithm, steps in sc["memory"].items():
        for m in steps:
            rows.append([algorithm, f"{m['identities']:,}", m["written_by"],
                         f"{m['keys'] / m['identities']:.2f}", f"{m['bytes'] / 2**20:,.1f} MiB",
                         f"{m['bytes'] / m['identities']:,.0f}"])
    lines.append(markdown_table(["algorithm", "identities", "written by", "keys each", "used_memory",
                                 "bytes per identity"], rows, left=3))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
