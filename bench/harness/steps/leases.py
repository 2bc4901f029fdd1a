"""The lease-renewal step: what keeping concurrency leases alive costs Redis while requests
are held open and nothing else happens, as the requests held, the keys they are held under and
the instances holding them vary. Requests are held by answers that never end by themselves
(bench/loadgen serve-sse, one event a second) until the step closes their connections."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

from ..config import LOADGEN_BIN, SLUICE_BIN
from ..context import progress
from ..errors import HarnessError
from ..peers import redis_store, sluice_concurrency_limit
from ..redis_server import Redis
from ..servers import http_get, wait_until
from ..steps.memory import metric

if TYPE_CHECKING:
    from ..context import Context


LEASE_PERIOD_S = 2  # the step's `lease:`; an instance renews about every quarter of it
LEASE_CASES = (  # (instances, keys, requests held)
    (1, 1, 10), (1, 1, 200), (1, 10, 200), (1, 200, 200), (2, 10, 200))
LEASE_SMOKE_CASES = ((1, 1, 10), (2, 10, 200))
LEASE_PERIODS = 5  # lease periods measured per case (one in --smoke)


def leases_yaml(port: int, admin: int, up_port: int, redis: Redis) -> str:
    return f"""listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin}
store: {redis_store(redis)}
upstreams:
  sse: {{ url: "http://127.0.0.1:{up_port}" }}
routes:
  - name: held
    match: {{ path_prefix: / }}
    upstream: sse
    limits: {sluice_concurrency_limit(lease=f"{LEASE_PERIOD_S}s")}
"""


def in_flight(admin: int) -> float:
    """sluice_concurrency_in_flight of the one limit (0 before its first lease)."""
    try:
        return metric(admin, "sluice_concurrency_in_flight")
    except HarnessError:
        return 0.0


def hold(port: int, keys: list[str]) -> list[socket.socket]:
    """One request per key of `keys` (repeats allowed) to sluice at `port`, each on a
    connection of its own, held open once its answer's head (200) has come; the sockets."""
    socks = []
    try:
        for key in keys:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(sock)
            sock.sendall(f"GET /held HTTP/1.1\r\nHost: bench\r\nx-api-key: {key}\r\n\r\n"
                         .encode())
        for sock in socks:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    raise HarnessError("lease renewal: sluice closed a held request")
                head += chunk
            status = head.split(b" ", 2)[1].decode()
            if status != "200":
                raise HarnessError(f"lease renewal: a held request was answered {status}")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def leases(ctx: Context) -> dict:
    """Redis's work for lease renewals at rest: for each case of LEASE_CASES, the requests
    held open (spread over the keys and the instances in turn), then over LEASE_PERIODS lease
    periods with nothing else happening, the script calls (every one a renewal: no request
    starts or ends), the keys renewed (HEXISTS runs only in leases.lua, once per key), the
    µs inside the scripts (INFO commandstats) and Redis's CPU above an idle baseline
    (INFO cpu, getrusage's microseconds)."""
    opts, servers, state, redis = ctx.opts, ctx.servers, ctx.state, ctx.redis
    cases = LEASE_SMOKE_CASES if opts.smoke else LEASE_CASES
    periods = 1 if opts.smoke else LEASE_PERIODS
    window = periods * LEASE_PERIOD_S
    progress(f"lease renewal: `lease: {LEASE_PERIOD_S}s`, requests held open, "
             f"{window} s measured per case at rest")
    up_port = servers.free_port()
    upstream = servers.start("held-sse", [
        str(LOADGEN_BIN), "serve-sse", "--port", str(up_port), "--events", "100000",
        "--event-bytes", "16", "--interval-us", "1000000"])
    wait_until("held-sse", lambda: socket.create_connection(("127.0.0.1", up_port), 1).close()
               is None, upstream)
    instances = []
    for i in range(max(c[0] for c in cases)):
        port, admin = servers.free_port(), servers.free_port()
        conf = state / f"sluice-leases-{i}.yaml"
        conf.write_text(leases_yaml(port, admin, up_port, redis))
        server = servers.start(f"sluice-leases-{i}", [str(SLUICE_BIN), "run", "--config",
                                                      str(conf)], {"RUST_LOG": "warn"})
        wait_until(f"sluice-leases-{i}", lambda: http_get(admin, "/readyz")[0] == 200, server)
        instances.append((server, port, admin))

    def at_rest(seconds: float) -> dict:
        redis.cli("CONFIG", "RESETSTAT")
        cpu0, t0 = redis.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        stats = redis.command_stats()
        cpu1, t1 = redis.cpu_seconds(), time.monotonic()
        return {"stats": stats, "cpu_s": cpu1 - cpu0, "seconds": t1 - t0}

    # One request through each instance first, so that its connections to Redis are open
    # (opened at the first call) during the idle baseline as during the cases.
    for server, port, admin in instances:
        for sock in hold(port, ["warm"]):
            sock.close()
        wait_until("the warm-up's release", lambda: in_flight(admin) == 0, server)
    redis.reset()
    idle = at_rest(window)
    out: dict = {"period_s": LEASE_PERIOD_S, "periods": periods,
                 "idle_cpu_per_s": idle["cpu_s"] / idle["seconds"],
                 "idle_cmds": Redis.counts(idle["stats"])[0], "cases": []}
    out["idle_before_per_s"] = out["idle_cpu_per_s"]
    for c, (n_instances, n_keys, n_held) in enumerate(cases):
        if n_held % n_instances or n_held // n_instances < n_keys:
            raise HarnessError(f"lease renewal: {n_held} requests do not share out over "
                               f"{n_instances} instance(s) holding each of {n_keys} key(s)")
        # Each instance holds its share of the requests over every key, so that each
        # renews all the keys.
        per_instance = [[f"held-{c}-{j % n_keys}" for j in range(n_held // n_instances)]
                        for _ in range(n_instances)]
        socks = []
        try:
            for (_, port, admin), own in zip(instances, per_instance):
                socks += hold(port, own)
            for (server, _, admin), own in zip(instances, per_instance):
                wait_until("the held requests' leases",
                           lambda: in_flight(admin) == len(own), server, timeout=10)
            # Every key past its first renewal: from here on, renewals only.
            time.sleep(LEASE_PERIOD_S / 2)
            rest = at_rest(window)
            # Requests that sluice cut meanwhile (a lease it could not renew): none expected.
            cut = sum(len(own) - in_flight(admin)
                      for (_, _, admin), own in zip(instances, per_instance))
        finally:
            for sock in socks:
                sock.close()
        for server, _, admin in instances:
            # A closed client is seen at the next event sluice writes to it (one a second).
            wait_until("the held requests' release", lambda: in_flight(admin) == 0, server,
                       timeout=30)
        stats = rest["stats"]
        case = {
            "instances": n_instances, "keys": n_keys, "held": n_held,
            "seconds": rest["seconds"],
            "calls": Redis.counts(stats)[1],
            "keys_renewed": stats.get("hexists", (0, 0))[0],
            "script_us": sum(us for name, (_, us) in stats.items()
                             if name.split("|")[0] in ("evalsha", "eval")),
            "cmds": Redis.counts(stats)[0],
            # decide.lua's HLEN and release.lua's HDEL: none expected at rest.
            "others": stats.get("hlen", (0, 0))[0] + stats.get("hdel", (0, 0))[0],
            "cpu_s": rest["cpu_s"],
            "cut": int(cut),
            "cpu_above_idle_s": rest["cpu_s"] - out["idle_cpu_per_s"] * rest["seconds"],
        }
        out["cases"].append(case)
        per = LEASE_PERIOD_S / case["seconds"]
        progress(f"  {n_instances} instance(s), {n_keys:>3} key(s), {n_held:>3} held: "
                 f"{case['calls'] * per:5.2f} renewal calls and {case['keys_renewed'] * per:6.1f} "
                 f"keys renewed per lease period, {case['script_us'] * per:7.0f} µs in the script, "
                 f"Redis CPU above idle {1e6 * case['cpu_above_idle_s'] * per:7.0f} µs per period"
                 + (f"; {case['cut']} HELD REQUESTS CUT (leases not renewed?)" if case["cut"]
                    else ""))
    # The idle baseline again, the instances still running and holding nothing: the cases'
    # figures above idle are against the mean of the two.
    after = at_rest(window)
    out["idle_after_per_s"] = after["cpu_s"] / after["seconds"]
    out["idle_cmds"] += Redis.counts(after["stats"])[0]
    out["idle_cpu_per_s"] = (out["idle_before_per_s"] + out["idle_after_per_s"]) / 2
    for case in out["cases"]:
        case["cpu_above_idle_s"] = case["cpu_s"] - out["idle_cpu_per_s"] * case["seconds"]
    for server, _, _ in instances:
        servers.stop(server)
    servers.stop(upstream)
    return out


def leases_text(r: dict) -> str:
    period = r["period_s"]
    lines = [
        f"**Lease renewals at rest** (`lease: {period}s`; requests held open by answers that "
        f"stream one event a second; {r['periods']} lease period(s) measured per case with "
        "nothing starting or ending, so every script call is a renewal): per lease period, "
        "the renewal calls (`EVALSHA` of leases.lua), the keys they renewed (its `HEXISTS`, "
        "once per key), the µs Redis spent inside them (`INFO commandstats`) and Redis's CPU "
        f"above idle (`INFO cpu`; idle, nothing held: {1e6 * r['idle_before_per_s'] * period:,.0f} "
        f"µs per period before the cases and {1e6 * r.get('idle_after_per_s', r['idle_before_per_s']) * period:,.0f} "
        f"after, {r['idle_cmds']} commands; the cases are read against the mean, and a few "
        "hundred µs per period is within the idle's own drift).",
        "",
        "| instances | keys (each instance holds leases on every one) | requests held | renewal "
        "calls / period | keys renewed / period | µs in the script / period (per call) | "
        "Redis CPU above idle, µs / period | per held request, µs / period | decide or "
        "release commands | held requests cut |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["cases"]:
        per = period / c["seconds"]
        cpu = 1e6 * c["cpu_above_idle_s"] * per
        lines.append(
            f"| {c['instances']} | {c['keys']} | {c['held']} | {c['calls'] * per:.2f} | "
            f"{c['keys_renewed'] * per:.1f} | {c['script_us'] * per:,.0f} "
            f"({c['script_us'] / c['calls'] if c['calls'] else 0:.0f}) | {cpu:,.0f} | "
            f"{cpu / c['held']:.1f} | {c['others']} | {c.get('cut', 0)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Issue 39: the Redis path across a delayed link
