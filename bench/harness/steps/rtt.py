"""Issue 39's step: the Redis path across a delayed link. sluice on Redis directly on loopback
and through bench/loadgen's delay_relay (a TCP relay adding a fixed delay each way), in turns:
req/s, sluice's CPU per request, Redis's calls, the round trip a PING measures; judged by the
goal of step `rtt` in goals.GOALS (req/s per core at the longest round trip against
loopback's)."""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
from typing import TYPE_CHECKING

from ..config import ADMIT_KEYS, RELAY_BIN
from ..context import progress
from ..errors import HarnessError
from ..goals import one_goal
from ..load import check_sane, in_turns, run_wrk
from ..peers import Target, preflight, sluice_limit, start_sluice
from ..procfs import cpu_seconds
from ..servers import log_tail, wait_until
from ..tables import fmt

if TYPE_CHECKING:
    from ..context import Context
    from ..redis_server import Redis
    from ..servers import Server, Servers


# The one-way delays (µs) the step puts between sluice and Redis with bench/loadgen's
# delay_relay (a round trip takes twice as long more); 0: Redis directly on loopback, no relay.
RTT_DELAYS_US = (0, 100, 500)
RTT_STORE_TIMEOUT = "50ms"  # store.redis.timeout: the default, far above a 1 ms round trip
RTT_PINGS = 200  # PINGs, one at a time on one connection, to measure each link's round trip
RTT_TRIES = 3  # starts of a relay at most, its delay corrected after each (start_relay())
# wrk's connections for a second pass over the links (the first at --connections): enough
# requests in flight to keep sluice busy across a 1 ms round trip (wrk is closed loop).
RTT_DEEP_CONNECTIONS = 150


def rtt_store(port: int) -> str:
    """redis_store()'s store (pool, key prefix) on `port`, with the timeout said explicitly."""
    return (f'{{ redis: {{ url: "redis://127.0.0.1:{port}/0", pool_size: 32, '
            f"timeout: {RTT_STORE_TIMEOUT} }}, key_prefix: bench }}")


def ping_rtt_us(port: int, count: int = RTT_PINGS) -> tuple[float, float]:
    """(median, p99) µs of a Redis PING's round trip on one connection, one at a time: the
    link's round trip plus Redis's and this process's own time (the same for every link)."""
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            t0 = time.perf_counter_ns()
            sock.sendall(b"PING\r\n")
            answer = b""
            while not answer.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    raise HarnessError(f"PING through 127.0.0.1:{port}: connection closed")
                answer += chunk
            times.append((time.perf_counter_ns() - t0) / 1000)
            if answer != b"+PONG\r\n":
                raise HarnessError(f"PING through 127.0.0.1:{port} answered {answer!r}")
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def start_relay(servers: Servers, redis: Redis, delay_us: int,
                direct_us: float) -> tuple[Server, int, int, tuple[float, float]]:
    """delay_relay in front of Redis, given the delay that makes a PING's round trip through it
    `2 × delay_us` longer than `direct_us` (Redis's own), give or take a tenth: the relay's
    own wake-ups add tens of µs to the delay it is given, more on a busy machine, so each of
    at most RTT_TRIES starts is measured (RTT_PINGS PINGs) and the next given that much
    less. Returns (its server, its port, the delay it was given, (median, p99) PING µs)."""
    goal, given = 2 * delay_us, delay_us
    for attempt in range(RTT_TRIES):
        port = servers.free_port()
        relay = servers.start(f"delay-relay-{delay_us}us", [
            str(RELAY_BIN), str(port), str(redis.port), str(given)])
        wait_until(f"delay_relay ({delay_us} µs)", lambda: ping_rtt_us(port, 1) is not None,
                   relay)
        ping = ping_rtt_us(port)
        error = ping[0] - direct_us - goal
        corrected = max(0, round(given - error / 2))
        if abs(error) <= 0.1 * goal or attempt == RTT_TRIES - 1 or corrected == given:
            return relay, port, given, ping
        servers.stop(relay)
        given = corrected
    raise AssertionError("unreachable")


def rtt(ctx: Context) -> dict:
    """sluice on Redis (admit: every request a decision, the rate-limited Redis targets' limit,
    the default algorithm) three ways: Redis directly on loopback, and through delay_relay at
    each delay of RTT_DELAYS_US, one sluice per link, in turns round after round, with wrk at
    the harness's connections and at RTT_DEEP_CONNECTIONS. Per link: req/s and latency (wrk),
    sluice's CPU, Redis's calls and CPU, the relay's own CPU (not sluice's), and the round
    trip a PING measures through the link before the load."""
    opts, servers, redis, up_port = ctx.opts, ctx.servers, ctx.redis, ctx.up_port
    progress(f"Redis across a delayed link: admit through delay_relay at "
             f"{', '.join(f'{d} µs' for d in RTT_DELAYS_US)} each way")
    links = []
    direct = ping_rtt_us(redis.port)
    for delay in RTT_DELAYS_US:
        port, relay, given, ping = redis.port, None, 0, direct
        if delay:
            relay, port, given, ping = start_relay(servers, redis, delay, direct[0])
            progress(f"  delay_relay for {delay} µs each way: given {given} µs, PING "
                     f"{ping[0]:,.0f} µs (direct {direct[0]:,.0f} µs)")
        name = f"sluice-rtt-{delay}us"
        server, sluice_port, _ = start_sluice(ctx, name, up_port, rtt_store(port),
                                              sluice_limit())
        what = f"{delay} µs each way (delay_relay)" if delay else "loopback, no relay"
        target = Target(name, f"sluice, Redis {what}", sluice_port, server, limited=True,
                        redis=True)
        progress(f"  {name:<26} 127.0.0.1:{sluice_port}  preflight: {preflight(target)}")
        links.append({"delay_us": delay, "target": target, "relay": relay, "port": port,
                      "given_us": given, "ping_us": ping[0], "ping_p99_us": ping[1],
                      "runs": {}, "relay_cpu_s": {}})
    if opts.warmup:
        for link in links:
            run_wrk(opts, link["target"], redis, "admit", opts.warmup)
    depths = sorted({opts.connections, RTT_DEEP_CONNECTIONS})
    for connections in depths:
        at = dataclasses.replace(opts, connections=connections)
        for r in range(opts.rounds):
            for link in in_turns(links, r):
                relay_pids = [link["relay"].popen.pid] if link["relay"] else []
                relay0 = cpu_seconds(relay_pids)
                run = run_wrk(at, link["target"], redis, "admit", opts.duration)
                relay_cpu = cpu_seconds(relay_pids) - relay0
                if link["relay"] and link["relay"].popen.poll() is not None:
                    raise HarnessError(f"delay_relay exited:\n{log_tail(link['relay'].log)}")
                check_sane(link["target"], "admit", run)
                link["runs"].setdefault(connections, []).append(run)
                link["relay_cpu_s"].setdefault(connections, []).append(relay_cpu)
                per_call = run.requests / run.redis_scripts if run.redis_scripts else 0
                link_name = (f"{2 * link['delay_us'] / 1000:g} ms RTT" if link["delay_us"]
                             else "loopback")
                progress(f"  -c{connections:<4} round {r + 1}/{opts.rounds} {link_name:<10} "
                         f"{run.rps:>9,.0f} req/s  "
                         f"p50 {run.p50_ms:5.2f}  p99 {run.p99_ms:6.2f} ms  "
                         f"sluice {run.cpu_s / run.seconds:4.2f} cores  "
                         f"{per_call:5.1f} decisions/call  "
                         f"Redis {1e6 * run.redis_cpu_s / run.requests:4.1f} µs/decision  "
                         f"relay {relay_cpu / run.seconds:4.2f} cores")
    for link in links:
        servers.stop(link["target"].server)
        if link["relay"]:
            servers.stop(link["relay"])
    out = {"rounds": opts.rounds, "duration": opts.duration, "threads": opts.wrk_threads,
           "depths": []}
    for connections in depths:
        rows = []
        for link in links:
            runs = link["runs"][connections]
            relay_cpu = sum(link["relay_cpu_s"][connections])
            requests = sum(run.requests for run in runs)
            seconds = sum(run.seconds for run in runs)
            cpu = sum(run.cpu_s for run in runs)
            scripts = sum(run.redis_scripts for run in runs)
            rows.append({
                "delay_us": link["delay_us"], "given_us": link["given_us"],
                "ping_us": link["ping_us"],
                "ping_p99_us": link["ping_p99_us"],
                "rps": statistics.median(run.rps for run in runs),
                "p50_ms": statistics.median(run.p50_ms for run in runs),
                "p99_ms": statistics.median(run.p99_ms for run in runs),
                "cores": cpu / seconds,
                "per_core": requests / cpu if cpu else None,
                "per_core_rounds": [run.requests / run.cpu_s if run.cpu_s else None
                                    for run in runs],
                "per_call": requests / scripts if scripts else None,
                "redis_us": 1e6 * sum(run.redis_cpu_s for run in runs) / requests,
                "relay_cores": relay_cpu / seconds,
                "relay_us": 1e6 * relay_cpu / requests,
                "errors": sum(run.other_errors + run.rejected for run in runs),
            })
        base, far = rows[0], rows[-1]
        ratios = [f / b for f, b in zip(far["per_core_rounds"], base["per_core_rounds"])
                  if f and b]
        out["depths"].append({
            "connections": connections, "links": rows,
            "ratio": (far["per_core"] / base["per_core"]
                      if far["per_core"] and base["per_core"] else None),
            "ratio_rounds": (min(ratios), max(ratios)) if len(ratios) > 1 else None,
            "rps_ratio": far["rps"] / base["rps"],
        })
    return out


def rtt_verdicts(r: dict) -> list[str]:
    """The PASS/MISS lines of issue 39's target, one per wrk connection count."""
    goal = one_goal("rtt", "per_core")
    out = []
    for depth in r["depths"]:
        far = depth["links"][-1]
        ratio = depth["ratio"]
        spread = (f" [{depth['ratio_rounds'][0]:.2f}–{depth['ratio_rounds'][1]:.2f}]"
                  if depth["ratio_rounds"] else "")
        verdict = "n/a " if ratio is None else ("PASS" if goal.met(ratio) else "MISS")
        out.append(f"{verdict}  Redis at {2 * far['delay_us'] / 1000:g} ms RTT, wrk "
                   f"-c{depth['connections']}: req/s per core of sluice CPU "
                   f"{fmt(ratio, '.2f')}×{spread} loopback's (target {goal.op} {goal.bound:g}×; req/s "
                   f"alone {depth['rps_ratio']:.2f}×)")
    return out


def rtt_text(r: dict) -> str:
    lines = [
        f"**Redis across a delayed link** (issue 39): admit (wrk `-t{r['threads']}`, "
        f"{ADMIT_KEYS:,} keys far under the limit: every request one decision on Redis, "
        f"sliding_log), `pool_size: 32, timeout: {RTT_STORE_TIMEOUT}`, {r['rounds']} round(s) "
        f"of {r['duration']} s in turns per connection count; Redis directly on loopback, then "
        "through bench/loadgen's `delay_relay` (a TCP relay holding every chunk a fixed time "
        "each way), its delay set so that a PING's round trip is the loopback's + 0.2 ms or "
        "+ 1 ms within a tenth (its own wake-ups add tens of µs to the delay it is given; at "
        f"most {RTT_TRIES} tries). *PING RTT*: the median round trip of a PING through the "
        f"link, {RTT_PINGS} one at a time, before the load; *per core*: requests per "
        "second of sluice's CPU (user + kernel); *added*: against loopback at the same "
        "connections; *decisions/call*: requests per `EVALSHA`; the relay's CPU is its own, "
        f"not counted in sluice's. wrk is closed loop: at -c{r['depths'][0]['connections']} "
        "a longer round trip lowers the load itself (fewer requests in flight per ms), at "
        f"-c{r['depths'][-1]['connections']} more of it is kept in flight.",
        "",
        "| wrk | link to Redis | PING RTT µs (p99) | req/s | sluice cores | req/s per core | "
        "p50 ms (added) | p99 ms (added) | decisions / call | Redis CPU µs / decision | "
        "relay CPU µs / req (cores) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth in r["depths"]:
        base = depth["links"][0]
        for link in depth["links"]:
            d = link["delay_us"]
            name = (f"{2 * d / 1000:g} ms RTT (relay given {link['given_us']} µs each way)"
                    if d else "loopback")
            added = lambda key: "" if not d else f" ({link[key] - base[key]:+.2f})"  # noqa: E731
            relay = f"{link['relay_us']:.1f} ({link['relay_cores']:.2f})" if d else "-"
            lines.append(
                f"| -c{depth['connections']} | {name} | {link['ping_us']:,.0f} "
                f"({link['ping_p99_us']:,.0f}) | {link['rps']:,.0f} | {link['cores']:.2f} | "
                f"{fmt(link['per_core'], ',.0f')} | {link['p50_ms']:.2f}{added('p50_ms')} | "
                f"{link['p99_ms']:.2f}{added('p99_ms')} | {fmt(link['per_call'], '.1f')} | "
                f"{link['redis_us']:.1f} | {relay} | {link['errors']} |")
    lines += [""] + rtt_verdicts(r)
    return "\n".join(lines)
