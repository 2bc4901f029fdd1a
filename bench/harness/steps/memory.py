"""The memory step: Redis's bytes per sliding-log key, and sluice's resident memory per key
its in-process store tracks."""

from __future__ import annotations

import http.client
import subprocess
import time
from typing import TYPE_CHECKING

from ..config import LIMIT_REQUESTS
from ..context import progress
from ..errors import HarnessError
from ..load import wrk_command
from ..peers import local_store, redis_store, sluice_limit, start_sluice
from ..procfs import rss_bytes
from ..servers import http_get

if TYPE_CHECKING:
    from ..context import Context, Options


def metric(admin_port: int, name: str) -> float:
    _, body = http_get(admin_port, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise HarnessError(f"no metric {name}")


def send(port: int, key: str, count: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        for _ in range(count):
            conn.request("GET", "/", headers={"x-api-key": key})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise HarnessError(f"memory step: key {key} answered {response.status}")
    finally:
        conn.close()


def fill_keys(opts: Options, port: int, admin: int, keys: int, bound_s: int) -> tuple[int, float]:
    """Sends requests with distinct keys (m-1-1 ..) until the in-process store tracks `keys`
    keys or `bound_s` seconds pass. Returns (keys tracked, seconds)."""
    argv = wrk_command(opts, port, bound_s, ["keys.lua", "distinct", "m", str(keys)])
    argv[2] = "1"  # one wrk thread: key names count up without gaps
    start = time.monotonic()
    wrk = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while wrk.poll() is None and metric(admin, "sluice_local_store_keys") < keys:
            time.sleep(0.2)
    finally:
        if wrk.poll() is None:
            wrk.terminate()
        wrk.wait(timeout=10)
    return int(metric(admin, "sluice_local_store_keys")), time.monotonic() - start


def memory(ctx: Context) -> dict:
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    progress("memory: Redis bytes per sliding-log key")
    mem = {"redis": [], "local": []}
    server, port, _ = start_sluice(ctx, "memory-redis", up_port, redis_store(redis),
                                   sluice_limit(requests=1_000_000, window="1h"))
    redis.reset()
    for entries in (10, 100, 1000):
        key = f"mem{entries}"
        send(port, key, entries)
        found = [k for k in redis.cli("--scan", "--pattern", f"*={key}}}*").splitlines() if k]
        if len(found) != 1:
            raise HarnessError(f"memory step: expected one Redis key for {key}, found {found}")
        mem["redis"].append({
            "entries": int(redis.cli("ZCARD", found[0])),
            "bytes": int(redis.cli("MEMORY", "USAGE", found[0], "SAMPLES", "0")),
            "encoding": redis.cli("OBJECT", "ENCODING", found[0]),
            "key": found[0],
        })
    servers.stop(server)

    progress("memory: sluice resident memory per tracked in-process key")
    server, port, admin = start_sluice(ctx, "memory-local", up_port,
                                       local_store(max_keys=2_000_000),
                                       sluice_limit(window="1h"))
    send(port, "warm", 10)  # connection pools and buffers exist before the baseline
    time.sleep(0.5)
    mem["local"].append({"keys": int(metric(admin, "sluice_local_store_keys")),
                         "rss": rss_bytes(server.popen.pid), "seconds": 0.0})
    for keys, bound in ((10_000, 30), (1_000_000, 240)):
        if opts.smoke and keys > 10_000:
            break
        tracked, seconds = fill_keys(opts, port, admin, keys, bound)
        time.sleep(1.0)
        mem["local"].append({"keys": tracked, "rss": rss_bytes(server.popen.pid),
                             "seconds": seconds})
        progress(f"  {tracked:,} keys: VmRSS {mem['local'][-1]['rss'] / 2**20:.1f} MiB "
                 f"({seconds:.0f} s to fill)")
    servers.stop(server)
    return mem


def memory_text(mem: dict) -> str:
    lines = [
        "Redis, one sliding-log key (a sorted set) holding N admissions, made by sending N",
        "requests with one API key through sluice (limit 1 000 000 per hour);",
        "`MEMORY USAGE key SAMPLES 0`:",
        "",
        "| entries | encoding | bytes | bytes per entry |",
        "|---:|---|---:|---:|",
    ]
    for m in mem["redis"]:
        lines.append(f"| {m['entries']:,} | {m['encoding']} | {m['bytes']:,} | "
                     f"{m['bytes'] / m['entries']:.1f} |")
    if mem["redis"]:
        lines += ["", f"Key name as written: `{mem['redis'][0]['key']}`."]
    lines += [
        "",
        "sluice's resident memory (VmRSS) with the in-process store tracking K keys of one",
        f"admission each (`store.local.max_keys: 2000000`, limit {LIMIT_REQUESTS} per hour, so no",
        "key expires; keys sent by wrk, each new):",
        "",
        "| tracked keys | VmRSS | above the empty store | bytes per key |",
        "|---:|---:|---:|---:|",
    ]
    base = mem["local"][0]
    for m in mem["local"]:
        extra = m["rss"] - base["rss"]
        per_key = f"{extra / (m['keys'] - base['keys']):.0f}" if m["keys"] > base["keys"] else "-"
        lines.append(f"| {m['keys']:,} | {m['rss'] / 2**20:.1f} MiB | {extra / 2**20:.1f} MiB "
                     f"| {per_key} |")
    return "\n".join(lines)
