#!/usr/bin/env python3
"""Usage reports against 100,000 identities: what one report costs in time and in Redis.

Starts a redis-server and the real sluice binary (report: true on a sliding-log limit of
1000 an hour per x-api-key), seeds N identities directly in the shapes sluice writes — each
identity's sliding log (a sorted set of admission times in microseconds on Redis's clock,
under `bench:api:per-key:{h:x-api-key=cI}`) and the limit's usage index for the current hour
(`bench:api:per-key:usage:BUCKET`, score = the identity's admissions) — then times
`GET /admin/v1/limits/api/per-key/usage?top=T` and reads Redis's `INFO commandstats` before
and after to report calls and Redis microseconds per report. Checks that each report's top T
are the seeded truth. Prints a Markdown table.

    python3 bench/usage.py [--identities 100000] [--reports 20] [--sluice target/release/sluice]

Everything lives in one temporary directory and is stopped at exit.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def redis_cli(port, *args):
    return subprocess.run(
        ["redis-cli", "-p", str(port), *map(str, args)],
        check=True, capture_output=True, text=True,
    ).stdout


def commandstats(port):
    """{command: (calls, usec)} from INFO commandstats."""
    stats = {}
    for line in redis_cli(port, "INFO", "commandstats").splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, fields = line[len("cmdstat_"):].split(":", 1)
        kv = dict(f.split("=") for f in fields.split(","))
        stats[name] = (int(kv["calls"]), int(kv["usec"]))
    return stats


def admissions(i):
    """How many admissions identity i has: most 1-3, one in a hundred 50 or more, each heavy
    user a different number (so the top is one order, without ties)."""
    return 50 + i // 100 if i % 100 == 0 else 1 + i % 3


def wait_for(url, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.1)
    raise SystemExit(f"no answer from {url}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--identities", type=int, default=100_000)
    parser.add_argument("--reports", type=int, default=20)
    parser.add_argument("--sluice", default="target/release/sluice")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="sluice-usage-bench-")
    procs = []

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(1)))
    try:
        run(args, tmp, procs)
    finally:
        stop()


def run(args, tmp, procs):
    rport, port, aport, uport = free_port(), free_port(), free_port(), free_port()
    procs.append(subprocess.Popen(
        ["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
    ))
    for _ in range(100):
        try:
            redis_cli(rport, "PING")
            break
        except subprocess.CalledProcessError:
            time.sleep(0.05)
    config = os.path.join(tmp, "sluice.yaml")
    with open(config, "w") as f:
        f.write(f"""listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{aport}
store:
  redis: {{ url: "redis://127.0.0.1:{rport}/0" }}
  key_prefix: bench
upstreams:
  api: {{ url: "http://127.0.0.1:{uport}" }}
routes:
  - name: api
    match: {{ path_prefix: / }}
    upstream: api
    limits:
      - {{ name: per-key, key: [header:x-api-key], requests: 1000, window: 1h, report: true }}
""")
    procs.append(subprocess.Popen(
        [args.sluice, "run", "--config", config],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "sluice.log"), "w"),
    ))
    admin = f"http://127.0.0.1:{aport}"
    wait_for(admin + "/healthz")

    # Seed: Redis's clock, the current hour's bucket, one sorted set per identity, the index.
    now_s, now_us = map(int, redis_cli(rport, "TIME").split())
    now = now_s * 1_000_000 + now_us
    bucket = now_s // 3600
    index = f"bench:api:per-key:usage:{bucket}"
    started = time.time()
    seed = bytearray()
    for i in range(args.identities):
        key = f"bench:api:per-key:{{h:x-api-key=c{i}}}"
        n = admissions(i)
        members = []
        for j in range(n):
            members += [now - 1_000_000 * (j + 1), f"seed-{i}:{j}"]
        seed += resp("ZADD", key, *members)
        seed += resp("PEXPIRE", key, 3_600_000)
        seed += resp("ZADD", index, n, f"h:x-api-key=c{i}")
    seed += resp("PEXPIRE", index, (3 * 3600 + 60) * 1000)
    subprocess.run(["redis-cli", "-p", str(rport), "--pipe"], input=bytes(seed),
                   check=True, capture_output=True)
    seeded_s = time.time() - started
    used_memory = redis_cli(rport, "MEMORY", "USAGE", index).strip()
    truth = sorted(((admissions(i), f"h:x-api-key=c{i}") for i in range(args.identities)),
                   key=lambda t: (-t[0], t[1]))

    rows = []
    for top in (10, 100, 1000):
        url = f"{admin}/admin/v1/limits/api/per-key/usage?top={top}"
        urllib.request.urlopen(url).read()  # warm: connections, the peek script loaded
        before = commandstats(rport)
        times = []
        for _ in range(args.reports):
            t0 = time.perf_counter()
            body = json.loads(urllib.request.urlopen(url).read())
            times.append(time.perf_counter() - t0)
            got = [(e["used"], e["identity"]) for e in body["identities"]]
            # Below the heavy users the counts tie (1-3): there the counts must match.
            heavy = sum(1 for t in truth[:top] if t[0] >= 50)
            if got[:heavy] != truth[:heavy] or [g[0] for g in got] != [t[0] for t in truth[:top]]:
                raise SystemExit(f"top={top}: the report is not the seeded truth: {got[:5]} ...")
        after = commandstats(rport)
        # The event channel's subscriber pings on its own: not the report's.
        calls = {c: after[c][0] - before.get(c, (0, 0))[0] for c in after
                 if c not in ("info", "ping") and after[c][0] != before.get(c, (0, 0))[0]}
        usec = sum(after[c][1] - before.get(c, (0, 0))[1] for c in calls)
        times.sort()
        rows.append({
            "top": top,
            "p50_ms": times[len(times) // 2] * 1000,
            "max_ms": times[-1] * 1000,
            "calls": {c: n / args.reports for c, n in sorted(calls.items())},
            "redis_us": usec / args.reports,
            "keys_or_scan": calls.get("keys", 0) + calls.get("scan", 0),
        })

    print(f"## Usage reports over {args.identities:,} identities "
          f"({sum(t[0] for t in truth):,} admissions seeded in {seeded_s:.1f} s; "
          f"index {used_memory} bytes)\n")
    print(f"sluice: {args.sluice}; {args.reports} reports each; Redis {redis_cli(rport, 'INFO', 'server').split('redis_version:')[1].split()[0]}\n")
    print("| top N | p50 | max | calls sent per report | commands run inside them | Redis µs per report | KEYS/SCAN |")
    print("|---|---|---|---|---|---|---|")
    client = ("evalsha", "zrevrange", "keys", "scan")
    for r in rows:
        sent = ", ".join(f"{c} {n:g}" for c, n in r["calls"].items() if c in client)
        inside = ", ".join(f"{c} {n:g}" for c, n in r["calls"].items() if c not in client)
        print(f"| {r['top']} | {r['p50_ms']:.1f} ms | {r['max_ms']:.1f} ms | {sent} | {inside} | "
              f"{r['redis_us']:.0f} | {r['keys_or_scan']} |")


if __name__ == "__main__":
    main()
