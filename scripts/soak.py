#!/usr/bin/env python3
"""sluice's soak: a long mixed run with faults, and a checker of the whole history.

Run by scripts/soak.sh (which installs Redis and builds sluice). Python 3.11 standard library
only, and the `h2` package for the HTTP/2 clients (soak.sh installs it in a venv).

Topology: a Redis master, a replica and three sentinels (or, with --mode cluster, a Redis
Cluster of three masters with a replica each); sluice A, B and C on that Redis, sluice L on its
in-process store; one upstream HTTP server in this process that
records every request it receives (time, instance, route, identity, what it answered, tokens
it reported). That record is the ground truth of every check.

Load: open-loop clients on every route (each algorithm, a token budget with streamed and JSON
answers, a calendar quota, shaping, counting by outcome, a multi-limit route), per-key and
per-IP identities (trusted X-Forwarded-For, and distinct loopback source addresses), HTTP/1.1
with and without keep-alive, HTTP/2 (h2c) with several streams per connection; and closed-loop
clients on a concurrency limit (`concurrent: 4` per key, `lease: 2s`), a dozen per key, whose
requests the upstream holds 20-600 ms or streams (a few for 3 s, longer than the lease), some
abandoned mid-stream.

Faults, on a schedule drawn from --seed: the Redis master SIGKILLed and restarted empty,
SIGSTOPped then SIGCONTed, cut off by a silent partition (iptables DROP on its port, 1-5 s),
behind 1 % packet loss (iptables' statistic match, 3-6 s), a Sentinel failover, SCRIPT FLUSH, a policy reload that changes a
limit, an invalid policy pushed then fixed, sluice B SIGKILLed and restarted, sluice C SIGTERMed
with requests in flight and restarted, and upstream episodes of 500s, aborted answers (502)
and answers slower than the upstream timeout (504).

Checks (one line each, with the figure that decided it; exit 1 on any violation): per limit
and identity the most the upstream received in any window against the bound the README
promises for the faults in progress; per concurrency key the most requests the upstream served
at any instant (its own record, from a request's arrival to the end or abort of its answer)
against the limit, strictly but for requests that arrived during a Redis fault (reported
apart), and the limit used whole; every 5xx and failed request explained by a fault in
progress; no request left hanging; RSS and open fds flat; every Redis key with a TTL;
sluice's request counters equal to what the clients saw.
"""

import argparse
import asyncio
import collections
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.monotonic()


def now():
    return time.monotonic() - T0


def log(msg):
    print(f"soak: [{now():7.2f}] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# A tiny synchronous RESP client (Redis and Sentinel).


def resp_encode(args):
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(f"${len(b)}\r\n".encode() + b + b"\r\n")
    return b"".join(out)


def resp_read(f):
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        n = int(rest)
        if n < 0:
            return None
        return [resp_read(f) for _ in range(n)]
    raise ConnectionError(f"bad reply {line!r}")


def redis_cmds(port, cmds, timeout=2.0):
    """Sends commands pipelined, returns their replies (errors as RuntimeError values)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"".join(resp_encode(c) for c in cmds))
        f = s.makefile("rb")
        return [resp_read(f) for _ in cmds]


def redis_cmd(port, *args, timeout=2.0):
    return redis_cmds(port, [list(args)], timeout)[0]


def try_redis(port, *args, timeout=1.0):
    try:
        return redis_cmd(port, *args, timeout=timeout)
    except (OSError, ConnectionError):
        return None


# --------------------------------------------------------------------------------------------
# Processes.


class Proc:
    def __init__(self, name, argv, logpath):
        self.name, self.argv, self.logpath = name, argv, logpath
        self.p = None

    def start(self):
        logf = open(self.logpath, "ab")
        self.p = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=logf,
                                  stderr=logf, start_new_session=True)
        logf.close()

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def stop(self):
        if self.p is None:
            return
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass
        self.p.wait()


class RedisGroup:
    """A master, a replica and three sentinels, like tests/it/support/sentinel.rs."""

    def __init__(self, state):
        self.state = state
        self.ports = [free_port(), free_port()]
        self.servers = {}
        self.sentinels = []

    def server_argv(self, port, replicaof=None):
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.state, "--dbfilename", f"dump-{port}.rdb",
                # A demoted master resyncs at once (the default waits 5 s for more replicas).
                "--repl-diskless-sync-delay", "0"]
        if replicaof:
            argv += ["--replicaof", "127.0.0.1", str(replicaof)]
        return argv

    def start_server(self, port, replicaof=None):
        p = Proc(f"redis-{port}", self.server_argv(port, replicaof),
                 os.path.join(self.state, f"redis-{port}.log"))
        p.start()
        self.servers[port] = p
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if try_redis(port, "PING") == "PONG":
                return
            time.sleep(0.05)
        raise SystemExit(f"redis-server on {port} did not answer PING")

    def start(self):
        self.start_server(self.ports[0])
        self.start_server(self.ports[1], replicaof=self.ports[0])
        for i in range(3):
            port = free_port()
            d = os.path.join(self.state, f"sentinel-{i}")
            os.makedirs(d)
            conf = os.path.join(d, "sentinel.conf")
            with open(conf, "w") as f:
                f.write(f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {d}\n"
                        f"logfile {d}/sentinel.log\n"
                        f"sentinel monitor mymaster 127.0.0.1 {self.ports[0]} 2\n"
                        "sentinel down-after-milliseconds mymaster 1000\n"
                        "sentinel failover-timeout mymaster 3000\n"
                        "sentinel parallel-syncs mymaster 1\n")
            p = Proc(f"sentinel-{i}", ["redis-sentinel", conf], os.path.join(d, "stdout.log"))
            p.start()
            p.port = port
            self.sentinels.append(p)
        if not self.wait_healthy(40):
            raise SystemExit("the sentinel group did not become healthy in 40 s")

    def sentinel_nodes(self):
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    # The interface the faults use (shared with ClusterGroup).
    def store_yaml(self):
        nodes = ", ".join(f'"{n}"' for n in self.sentinel_nodes())
        return (f"  redis:\n    sentinel: {{ master_name: mymaster, nodes: [{nodes}] }}\n"
                "    timeout: 200ms\n    pool_size: 2\n")

    def describe(self):
        return (f"Redis master :{self.ports[0]}, replica :{self.ports[1]}, sentinels "
                f"{self.sentinel_nodes()}")

    def named(self):
        return self.master_port()

    def serving(self, named):
        if named is None:
            return False
        role = try_redis(named, "ROLE", timeout=0.5)
        return isinstance(role, list) and bool(role) and role[0] == "master"

    def victim(self, rng):
        return self.master_port()

    def failover(self, rng):
        old = self.master_port()
        s = rng.choice(self.sentinels)
        r = try_redis(s.port, "SENTINEL", "FAILOVER", "mymaster")
        return old, f"SENTINEL FAILOVER: {r}", r == "OK"

    def script_flush(self):
        m = self.master_port()
        return f"on :{m}: {try_redis(m, 'SCRIPT', 'FLUSH')}"

    def master_port(self):
        for s in self.sentinels:
            r = try_redis(s.port, "SENTINEL", "get-master-addr-by-name", "mymaster")
            if isinstance(r, list) and len(r) == 2:
                return int(r[1])
        return None

    def healthy(self):
        """The sentinels name a master that is one, the other server replicates it, and
        every sentinel knows the replica and the two other sentinels."""
        self.why = "no master named"
        m = self.master_port()
        if m is None:
            return False
        role = try_redis(m, "ROLE")
        self.why = f"named master :{m} has role {role}"
        if not (isinstance(role, list) and role and role[0] == "master"):
            return False
        other = [p for p in self.ports if p != m][0]
        info = try_redis(other, "INFO", "replication")
        self.why = f"replica :{other} not linked to :{m}"
        if not (isinstance(info, str) and "master_link_status:up" in info
                and f"master_port:{m}" in info):
            return False
        for s in self.sentinels:
            reps = try_redis(s.port, "SENTINEL", "replicas", "mymaster")
            sents = try_redis(s.port, "SENTINEL", "sentinels", "mymaster")
            self.why = f"sentinel :{s.port} knows sentinels {sents}"
            if not isinstance(reps, list) or not isinstance(sents, list) or len(sents) != 2:
                return False
            ok = False
            for r in reps:
                d = dict(zip(r[::2], r[1::2])) if isinstance(r, list) else {}
                self.why = f"sentinel :{s.port} sees replica {d.get('port')} {d.get('flags')}"
                if d.get("port") == str(other) and "down" not in d.get("flags", "") \
                        and "disconnected" not in d.get("flags", ""):
                    ok = True
            if not ok:
                return False
        self.why = None
        return True

    def wait_healthy(self, seconds):
        start = time.monotonic()
        deadline = start + seconds
        reported = False
        while time.monotonic() < deadline:
            if self.healthy():
                return True
            if not reported and time.monotonic() - start > 8:
                log(f"Redis group not healthy after 8 s: {self.why}")
                reported = True
            time.sleep(0.2)
        return False

    def stop(self):
        for p in self.sentinels + list(self.servers.values()):
            p.stop()


class ClusterGroup:
    """A Redis Cluster of three masters with a replica each, like tests/it/support/cluster.rs
    (`redis-cli --cluster create`, `cluster-node-timeout 2000`)."""

    def __init__(self, state):
        self.state = state
        # The cluster bus listens on port + 10000: ports up to 55535 only.
        self.ports = []
        while len(self.ports) < 6:
            p = free_port()
            if p <= 55535 and p not in self.ports:
                self.ports.append(p)
        self.servers = {}
        self.why = None

    def server_argv(self, port):
        return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.state, "--dbfilename", f"dump-{port}.rdb",
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0"]

    def start_server(self, port, replicaof=None):
        # A restarted node keeps its nodes-PORT.conf: it rejoins the cluster, empty.
        p = Proc(f"redis-{port}", self.server_argv(port),
                 os.path.join(self.state, f"redis-{port}.log"))
        p.start()
        self.servers[port] = p
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if try_redis(port, "PING") == "PONG":
                return
            time.sleep(0.05)
        raise SystemExit(f"redis-server on {port} did not answer PING")

    def start(self):
        for port in self.ports:
            self.start_server(port)
        r = subprocess.run(["redis-cli", "--cluster", "create",
                            *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", "1", "--cluster-yes"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise SystemExit(f"redis-cli --cluster create failed: {r.stdout}{r.stderr}")
        if not self.wait_healthy(40):
            raise SystemExit(f"the cluster did not become healthy in 40 s: {self.why}")

    def store_yaml(self):
        nodes = ", ".join(f'"127.0.0.1:{p}"' for p in self.ports)
        return f"  redis:\n    cluster: {{ nodes: [{nodes}] }}\n    timeout: 1s\n"

    def describe(self):
        return f"Redis Cluster, 3 masters and 3 replicas on {self.ports}"

    def named(self):
        """The slot map as (start, end, master port), from the first node that answers."""
        for port in self.ports:
            r = try_redis(port, "CLUSTER", "SLOTS", timeout=0.5)
            if isinstance(r, list) and r:
                return tuple(sorted((x[0], x[1], int(x[2][1])) for x in r))
        return None

    def masters(self):
        named = self.named()
        return sorted({m for _, _, m in named}) if named else []

    def serving(self, named):
        if not named or sum(b - a + 1 for a, b, _ in named) != 16384:
            return False
        for m in {m for _, _, m in named}:
            role = try_redis(m, "ROLE", timeout=0.5)
            if not (isinstance(role, list) and role and role[0] == "master"):
                return False
        return True

    def healthy(self):
        self.why = "slot map incomplete or a master not answering"
        named = self.named()
        if not self.serving(named):
            return False
        for port in self.ports:
            info = try_redis(port, "CLUSTER", "INFO", timeout=0.5)
            self.why = f"node :{port} not in an ok cluster"
            if not (isinstance(info, str) and "cluster_state:ok" in info):
                return False
        for m in {m for _, _, m in named}:
            role = try_redis(m, "ROLE", timeout=0.5)
            self.why = f"master :{m} without a connected replica"
            if not (isinstance(role, list) and len(role) > 2 and role[2]):
                return False
            for rep in role[2]:
                info = try_redis(int(rep[1]), "INFO", "replication", timeout=0.5)
                self.why = f"replica :{rep[1]} of :{m} not linked"
                if not (isinstance(info, str) and "master_link_status:up" in info):
                    return False
        self.why = None
        return True

    def wait_healthy(self, seconds):
        return RedisGroup.wait_healthy(self, seconds)

    def victim(self, rng):
        masters = self.masters()
        return rng.choice(masters) if masters else self.ports[0]

    def failover(self, rng):
        old = self.named()
        m = rng.choice(self.masters())
        role = try_redis(m, "ROLE")
        reps = role[2] if isinstance(role, list) and len(role) > 2 else []
        if not reps:
            return old, f"no replica of :{m}", False
        rep = int(reps[0][1])
        r = try_redis(rep, "CLUSTER", "FAILOVER")
        return old, f"CLUSTER FAILOVER on :{rep} (replica of :{m}): {r}", r == "OK"

    def script_flush(self):
        return ", ".join(f":{m} {try_redis(m, 'SCRIPT', 'FLUSH')}" for m in self.masters())

    def stop(self):
        for p in self.servers.values():
            p.stop()


# --------------------------------------------------------------------------------------------
# The policy.

# Each route: name -> (path, on_store_error, limits). A limit: name, key kind (key/ip/global),
# algorithm, quantity, window (s) or quota, and extras. `bound_factor` is the README's bound for
# the algorithm without faults: 1 for the exact ones, 2 for sliding_window ("close to twice the
# limit in one window's length") and fixed_window ("up to twice requests across a boundary").
ROUTES = {
    "slog": dict(ose="deny", limits=[dict(name="per-key", key="key", alg="sliding_log",
                                          n="SLOG", window=4)]),
    "swin": dict(ose="local", limits=[dict(name="per-ip", key="ip", alg="sliding_window",
                                           n=20, window=4)]),
    "fwin": dict(ose="local", limits=[dict(name="per-key", key="key", alg="fixed_window",
                                           n=20, window=4)]),
    "gcra": dict(ose="deny", limits=[dict(name="per-key", key="key", alg="gcra", n=4,
                                          window=4, burst=2)]),
    "chat": dict(ose="deny", limits=[dict(name="tokens", key="key", alg="weighted_log",
                                          n=3000, window=5, tokens=True)]),
    "quota": dict(ose="deny", limits=[dict(name="daily", key="key", alg="quota", n=40,
                                           quota="day")]),
    "shaped": dict(ose="deny", limits=[dict(name="shaped", key="key", alg="sliding_log", n=10,
                                            window=2, delay="500ms")]),
    "login": dict(ose="deny", limits=[dict(name="failed-per-ip", key="ip", alg="sliding_log",
                                           n=5, window=5, count=[401])]),
    "multi": dict(ose="local", limits=[
        dict(name="per-key", key="key", alg="sliding_log", n=8, window=4),
        dict(name="global", key="global", alg="fixed_window", n=30, window=4)]),
    # A concurrency limit: at most `n` requests of a key in flight at once (no window). `deny`:
    # a `local` fallback would count per instance. A short lease, so that the places of the
    # SIGKILLed instance come back (reclaimed) within the run.
    "conc": dict(ose="deny", limits=[dict(name="per-key", key="key", alg="concurrent", n=4,
                                          lease=2)]),
}
SEED_BUG = None  # --seed-bug: a policy the checker must fail, to show that it can
SLOG_LIMITS = (20, 12)  # the reload fault alternates /slog's limit between these
UPSTREAM_TIMEOUT = 2.0
# An answer sluice closed before its end (its client left, its upstream timeout, a lease cut)
# is judged to have ended this long before the upstream saw its connection close: sluice frees
# the place as it ends the request, and the FIN follows from hyper's connection task
# (check_concurrency reports the raw record too).
CLOSE_ALLOWANCE = 0.010


def limit_yaml(lim, slog_limit, invalid):
    key = {"key": '["header:x-api-key"]', "ip": "[client_ip]", "global": "[]"}[lim["key"]]
    if lim["alg"] == "concurrent":
        # --seed-bug concurrent-plus-one: sluice is given one place more than the checker
        # holds the upstream's record to.
        n = lim["n"] + (1 if SEED_BUG == "concurrent-plus-one" else 0)
        return (f"      - {{ name: {lim['name']}, key: {key}, concurrent: {n}, "
                f"lease: {lim['lease']}s }}\n")
    n = slog_limit if lim["n"] == "SLOG" else lim["n"]
    if invalid and lim["n"] == "SLOG":
        n = 0  # refused: requests must be at least 1
    parts = [f"name: {lim['name']}", f"key: {key}"]
    if lim.get("tokens"):
        parts.append(f"tokens: {n}")
        parts.append("reserve: { default_output: 256, max_output: 512 }")
    else:
        parts.append(f"requests: {n}")
    if "quota" in lim:
        parts.append(f"quota: {lim['quota']}")
    else:
        parts.append(f"window: {lim['window']}s")
        if lim["alg"] not in ("weighted_log",):
            parts.append(f"algorithm: {lim['alg']}")
    if "burst" in lim:
        parts.append(f"burst: {lim['burst']}")
    if "delay" in lim:
        parts.append(f"on_exceed: delay, max_delay: {lim['delay']}")
    if "count" in lim:
        parts.append(f"count: {{ status: {lim['count']} }}")
    return "      - { " + ", ".join(parts) + " }\n"


def policy(inst, listen, admin, upstream_port, store, slog_limit, invalid=False):
    y = [f"listen: 127.0.0.1:{listen}\n", f"admin_listen: 127.0.0.1:{admin}\n",
         "trusted_proxies: [127.0.0.1/32]\n",
         "server: { workers: 1, shutdown_grace: 10s }\n", "store:\n"]
    if store:
        y.append(store.store_yaml())
    # --seed-bug split-prefix: C counts under keys of its own, so the three instances no
    # longer share their limits (the checker must see the redis group over its limits).
    prefix = "soakc" if SEED_BUG == "split-prefix" and inst == "C" else "soak"
    y.append(f"  key_prefix: {prefix}\n")
    y.append(f'upstreams:\n  up: {{ url: "http://127.0.0.1:{upstream_port}/{inst}", '
             f"timeout: {int(UPSTREAM_TIMEOUT)}s }}\n")
    y.append("routes:\n")
    for name, r in ROUTES.items():
        path = "/v1/chat" if name == "chat" else f"/{name}"
        y.append(f"  - name: {name}\n    match: {{ path_prefix: {path} }}\n    upstream: up\n")
        if store:
            # --seed-bug local-for-deny: the deny routes decide locally when Redis fails,
            # while the checker holds them to deny's bound.
            ose = "local" if SEED_BUG == "local-for-deny" else r["ose"]
            y.append(f"    on_store_error: {ose}\n")
        if name == "shaped":
            y.append("    max_delayed: 200\n")
        y.append("    limits:\n")
        for lim in r["limits"]:
            y.append(limit_yaml(lim, slog_limit, invalid))
    return "".join(y)


class Sluice:
    def __init__(self, name, binary, state, upstream_port, store):
        self.name = name
        self.binary = binary
        self.listen, self.admin = free_port(), free_port()
        self.upstream_port, self.store = upstream_port, store
        self.config = os.path.join(state, f"sluice-{name}.yaml")
        self.proc = Proc(f"sluice-{name}", [binary, "run", "--config", self.config],
                         os.path.join(state, f"sluice-{name}.log"))
        self.pids = []  # every process this instance has been: (pid, start, end)
        self.down = []  # [start, end] while not serving (killed or terminated until ready)
        self.invalid_pushes = 0

    def write_policy(self, slog_limit, invalid=False):
        text = policy(self.name, self.listen, self.admin, self.upstream_port,
                      self.store, slog_limit, invalid)
        tmp = self.config + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.config)  # whole files only (see the README's Hot reload)

    def start(self):
        self.proc.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if http_get(self.admin, "/healthz") == 200:
                self.pids.append([self.proc.p.pid, now(), None])
                return
            if not self.proc.alive():
                break
            time.sleep(0.05)
        raise SystemExit(f"sluice {self.name} did not start; see {self.proc.logpath}")

    def ended(self):
        if self.pids and self.pids[-1][2] is None:
            self.pids[-1][2] = now()


def http_get(port, path, timeout=2.0):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        return int(data.split(b" ", 2)[1])
    except (OSError, ValueError, IndexError):
        return None


def http_get_body(port, path, timeout=5.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.split(b";")[0], 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2:]
        body = out
    return body.decode(errors="replace")


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels] = float(value)
        except ValueError:
            pass
    return out


# --------------------------------------------------------------------------------------------
# The upstream: records every request it receives.


class Upstream:
    def __init__(self, seed):
        self.records = []  # dicts: t, inst, route, ident, rid, status, tokens, fault
        # /conc: each request's arrival (+1) and the end or abort of its answer (-1), in the
        # order this loop saw them: (t, +1 or -1, record). The ground truth of the
        # concurrency check (how many requests of a key the upstream serves at once).
        self.conc = []
        self.fault = None  # None, or (mode, probability) during an upstream episode
        self.rng = random.Random(seed ^ 0x5eed)
        self.port = free_port()

    async def start(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port,
                                                 backlog=1024)

    async def handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t = now()
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await reader.readline()).split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += chunk[:-2]
                keep = await self.answer(t, method, target, headers, body, reader, writer)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, OSError,
                asyncio.CancelledError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def answer(self, t, method, target, headers, body, reader, writer):
        path = target.split("?")[0]
        parts = path.split("/")
        inst = parts[1] if len(parts) > 1 else "?"
        route = parts[2] if len(parts) > 2 else "?"
        if route == "v1":
            route = "chat"
        xff = headers.get("x-forwarded-for", "")
        rec = dict(t=t, inst=inst, route=route, key=headers.get("x-api-key"),
                   ip=xff.split(",")[0].strip(), rid=headers.get("x-request-id"),
                   status=200, tokens=0, fault=None)
        self.records.append(rec)
        fault = None
        if self.fault and self.rng.random() < self.fault[1]:
            fault = self.fault[0]
        rec["fault"] = fault
        if route == "conc":
            return await self.answer_conc(rec, fault, parts, reader, writer)
        if fault == "abort":
            rec["status"] = None
            writer.transport.abort()
            return False
        if fault == "slow":
            # Past sluice's upstream timeout: the client has had its 504 by the time this
            # answer leaves, so the answer is recorded as late, not as a status the client got
            # (a 401 here is no counted failure: sluice gave the place back on its 504).
            await asyncio.sleep(UPSTREAM_TIMEOUT + 1.0)
            rec["status"] = "late"
            self.send(writer, 200, b"late\n")
            return True
        if fault == "error":
            rec["status"] = 500
            self.send(writer, 500, b"injected error\n")
            return True
        if route == "login":
            # A wrong password for about 60 % of attempts (drawn from the request id).
            rid = rec["rid"] or ""
            bad = int(hashlib.sha256(rid.encode()).hexdigest()[:4], 16) % 10 < 6
            rec["status"] = 401 if bad else 200
            self.send(writer, rec["status"], b"login\n")
            return True
        if route == "chat":
            try:
                req = json.loads(body)
            except ValueError:
                req = {}
            cap = int(req.get("max_tokens", 256))
            prompt = max(1, len(body) // 8)
            completion = self.rng.randint(1, cap)
            rec["tokens"] = prompt + completion
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
            if req.get("stream"):
                events = [json.dumps({"choices": [{"delta": {"content": "tok "}}]})
                          for _ in range(3)]
                events.append(json.dumps({"choices": [], "usage": usage}))
                payload = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                # Streamed in pieces, a little apart, as a model would.
                # A long answer takes longer than the limit's window (5 s): its settlement
                # comes after every other entry of its identity may have left the window.
                gap = 1.5 if "long" in json.dumps(req.get("messages")) else 0.01
                for piece in payload.split("\n\n")[:-1]:
                    data = (piece + "\n\n").encode()
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(gap)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            self.send(writer, 200, json.dumps({"choices": [], "usage": usage}).encode(),
                      "application/json")
            return True
        self.send(writer, 200, b"ok\n")
        return True

    async def answer_conc(self, rec, fault, parts, reader, writer):
        """/conc/hold/<ms> (200 after ms) or /conc/stream/<n>/<ms> (n events ms apart, chunked).
        The request counts as served from its head's arrival until the last byte of its answer
        is handed to the kernel, or until its connection is gone: sluice closes it when it
        gives up on the answer (its client left, its upstream timeout, a lease it could not
        renew, its death), as a real server's slot is freed then. Injected faults as for any
        route: an abort, a 500, an answer slower than sluice's upstream timeout."""
        self.conc.append((rec["t"], 1, rec))
        rec["end"] = "closed"
        try:
            if fault == "abort":
                rec["status"] = None
                rec["end"] = "aborted"
                writer.transport.abort()
                return False
            if fault == "slow":
                rec["status"] = "late"
                if not await self.hold(reader, UPSTREAM_TIMEOUT + 1.0):
                    return False
                self.send(writer, 200, b"late\n")
            elif fault == "error":
                rec["status"] = 500
                self.send(writer, 500, b"injected error\n")
            elif len(parts) > 5 and parts[3] == "stream":
                n, gap = int(parts[4]), int(parts[5]) / 1000
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(n):
                    data = f"data: {i}\n\n".encode()
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    if not await self.hold(reader, gap):
                        return False
                writer.write(b"0\r\n\r\n")
            else:
                ms = int(parts[4]) if len(parts) > 4 and parts[3] == "hold" else 0
                if not await self.hold(reader, ms / 1000):
                    return False
                self.send(writer, 200, b"held\n")
            await self.flushed(writer)
            rec["end"] = "answered"
            return True
        finally:
            rec["t_end"] = now()
            self.conc.append((rec["t_end"], -1, rec))

    @staticmethod
    async def hold(reader, seconds):
        """Waits `seconds`, or less if the peer closes the connection first (False then).
        sluice sends nothing more on the connection before the answer ends (no pipelining), so
        a read here can only see its close."""
        if reader.at_eof():
            return False
        rd = asyncio.ensure_future(reader.read(1))
        done, _ = await asyncio.wait({rd}, timeout=seconds)
        if not done:
            rd.cancel()
        try:
            return bool(await rd)
        except asyncio.CancelledError:
            return True
        except (ConnectionError, OSError):
            return False

    @staticmethod
    async def flushed(writer):
        """Returns once every byte written is in the kernel (sent on loopback)."""
        await writer.drain()
        while writer.transport.get_write_buffer_size() and not writer.transport.is_closing():
            await asyncio.sleep(0.001)

    @staticmethod
    def send(writer, status, body, ctype="text/plain"):
        reason = {200: "OK", 401: "Unauthorized", 500: "Internal Server Error"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)


# --------------------------------------------------------------------------------------------
# Clients.


class ClientError(Exception):
    pass


class H1Conn:
    """One HTTP/1.1 client connection (keep-alive or not)."""

    def __init__(self, port, source_ip=None):
        self.port, self.source_ip = port, source_ip
        self.reader = self.writer = None
        self.used = 0

    async def ensure(self):
        if self.writer is None or self.reader.at_eof():
            self.close()
            try:
                local = (self.source_ip, 0) if self.source_ip else None
                self.reader, self.writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=local)
            except ConnectionRefusedError:
                raise ClientError("refused")
            except OSError as e:
                raise ClientError(f"connect:{e.errno}")
            self.used = 0

    def close(self):
        if self.writer is not None:
            try:
                self.writer.transport.abort()
            except Exception:
                pass
        self.reader = self.writer = None

    async def request(self, method, path, headers, body, keepalive, abandon=False):
        """The answer's status (its headers in self.headers). A ClientError carries the status
        when the answer was cut after its head (`status`). `abandon`: a chunked answer is left
        after its first chunk, the connection closed (a client that goes away)."""
        await self.ensure()
        reused = self.used > 0
        status = None
        self.headers = {}
        self.closed_at = None
        self.used += 1
        h = {"host": "soak", **headers}
        if body:
            h["content-length"] = str(len(body))
        if not keepalive:
            h["connection"] = "close"
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
        try:
            self.writer.write(head.encode() + b"\r\n" + (body or b""))
            await self.writer.drain()
            status_line = await self.reader.readline()
            if not status_line:
                raise ClientError("eof_reused" if reused else "eof")
            status = int(status_line.split(b" ", 2)[1])
            rh = self.headers
            while True:
                line = await self.reader.readline()
                if line in (b"\r\n", b""):
                    break
                k, _, v = line.decode("latin-1").partition(":")
                rh[k.strip().lower()] = v.strip()
            if abandon and rh.get("transfer-encoding", "").lower() == "chunked":
                size = int((await self.reader.readline()).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                self.closed_at = now()
                self.close()
                return status
            if "content-length" in rh:
                await self.reader.readexactly(int(rh["content-length"]))
            elif rh.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await self.reader.readline()).split(b";")[0], 16)
                    await self.reader.readexactly(size + 2)
                    if size == 0:
                        break
            else:
                await self.reader.read()
            if not keepalive or rh.get("connection", "").lower() == "close":
                self.close()
            return status
        except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError) as e:
            self.close()
            err = ClientError(("reset_reused" if reused else "reset")
                              if not isinstance(e, asyncio.IncompleteReadError)
                              else ("eof_reused" if reused else "eof_mid"))
            err.status = status
            raise err
        except (ValueError, IndexError):
            self.close()
            raise ClientError("garbled")


CHAT_PROMPTS = ["Say hello.", "Summarise the plot of a short film in two lines.",
                "List three prime numbers.", "Why is the sky blue? Answer briefly."]


def make_request(route, ident, rng):
    """method, path, headers, body for one request of `route` by `ident`."""
    headers = {}
    kind = route_key_kind(route)
    if kind == "key":
        headers["x-api-key"] = ident
    body = None
    method = "GET"
    path = f"/{route}/{rng.randrange(1000)}"
    if route == "chat":
        method, path = "POST", "/v1/chat/completions"
        prompt = rng.choice(CHAT_PROMPTS)
        rare = "rare" in ident
        if rare and rng.random() < 0.5:
            prompt = "Tell a long story."
        req = {"model": "soak", "max_tokens": rng.choice([64, 128, 256]),
               "messages": [{"role": "user", "content": prompt}]}
        if rare or rng.random() < 0.5:
            req["stream"] = True
            req["stream_options"] = {"include_usage": True}
        body = json.dumps(req).encode()
        headers["content-type"] = "application/json"
    if route == "login":
        method = "POST"
        body = b"user=u&password=p"
    return method, path, headers, body


def route_key_kind(route):
    return ROUTES[route]["limits"][0]["key"]


class Load:
    def __init__(self, args, instances, rng):
        self.args, self.instances, self.rng = args, instances, rng
        self.records = []  # dicts: t0, t1, inst, route, ident, rid, status, err, proto
        self.seq = 0
        self.stop_at = None
        self.h2_ok = True

    def rid(self):
        self.seq += 1
        return f"soak-{self.args.seed}-{self.seq}"

    async def worker(self, wid, route, group, idents, rate, keepalive, source_ip=None,
                     xff=False):
        rng = random.Random(self.args.seed * 1000 + wid)
        conns = {}
        t_next = now()
        while now() < self.stop_at:
            t_next += rng.expovariate(rate)
            if t_next >= self.stop_at:
                break
            delay = t_next - now()
            if delay > 0:
                await asyncio.sleep(delay)
            inst = rng.choice(group)
            ident = rng.choice(idents)
            method, path, headers, body = make_request(route, ident, rng)
            rid = self.rid()
            headers["x-request-id"] = rid
            src = source_ip
            if route_key_kind(route) == "ip":
                if xff:
                    headers["x-forwarded-for"] = ident
                else:
                    src = ident
            conn = conns.get((inst, src))
            if conn is None:
                conn = conns[(inst, src)] = H1Conn(self.instances[inst].listen, src)
            rec = dict(t0=now(), t1=None, inst=inst, route=route, ident=ident, rid=rid,
                       status=None, err=None, proto="h1" + ("ka" if keepalive else ""))
            self.records.append(rec)
            try:
                rec["status"] = await asyncio.wait_for(
                    conn.request(method, path, headers, body, keepalive), self.args.client_timeout)
            except ClientError as e:
                rec["err"] = str(e)
            except asyncio.TimeoutError:
                rec["err"] = "timeout"
                conn.close()
            rec["t1"] = now()
            if t_next < now() - 1.0:
                t_next = now()  # do not build a backlog behind a slow answer

    async def conc_worker(self, wid, group, key, keepalive):
        """A closed-loop client of /conc for one key: one request at a time, the next right
        after an answer (0-50 ms), 0.2-0.6 s after a refusal. The upstream holds the request
        20-600 ms (57 %), or streams 2-8 events 30-150 ms apart (35 %), or 12 events 250 ms
        apart (3 %: 3 s, longer than the lease, kept by its renewals); 5 % are streams of 10
        events 100 ms apart that the client leaves after the first (closing its connection)."""
        rng = random.Random(self.args.seed * 1000 + wid)
        conns = {}
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        while now() < self.stop_at:
            inst = rng.choice(group)
            u, abandon = rng.random(), False
            if u < 0.57:
                path = f"/conc/hold/{rng.randint(20, 600)}"
            elif u < 0.92:
                path = f"/conc/stream/{rng.randint(2, 8)}/{rng.randint(30, 150)}"
            elif u < 0.95:
                path = "/conc/stream/12/250"
            else:
                path, abandon = "/conc/stream/10/100", True
            rid = self.rid()
            conn = conns.get(inst)
            if conn is None:
                conn = conns[inst] = H1Conn(self.instances[inst].listen)
            rec = dict(t0=now(), t1=None, inst=inst, route="conc", ident=key, rid=rid,
                       status=None, err=None, proto="h1" + ("ka" if keepalive else ""),
                       abandon=abandon)
            self.records.append(rec)
            try:
                rec["status"] = await asyncio.wait_for(
                    conn.request("GET", path, {"x-api-key": key, "x-request-id": rid}, None,
                                 keepalive, abandon=abandon), self.args.client_timeout)
                if rec["status"] == 429:
                    rec["policy"] = conn.headers.get("ratelimit-policy")
                rec["closed_at"] = conn.closed_at
            except ClientError as e:
                rec["err"] = str(e)
                rec["partial"] = getattr(e, "status", None)
            except asyncio.TimeoutError:
                rec["err"] = "timeout"
                conn.close()
            rec["t1"] = now()
            await asyncio.sleep(rng.uniform(0.0, 0.05) if rec["status"] == 200
                                else rng.uniform(0.2, 0.6))

    async def one(self, inst, route, ident, prompt=None, keepalive=False):
        """One request outside the workers' schedule (the faults' own)."""
        rng = random.Random(self.seq)
        method, path, headers, body = make_request(route, ident, rng)
        if prompt is not None and body:
            req = json.loads(body)
            req["messages"][0]["content"] = prompt
            body = json.dumps(req).encode()
        rid = self.rid()
        headers["x-request-id"] = rid
        rec = dict(t0=now(), t1=None, inst=inst, route=route, ident=ident, rid=rid,
                   status=None, err=None, proto="h1")
        self.records.append(rec)
        conn = H1Conn(self.instances[inst].listen)
        try:
            rec["status"] = await asyncio.wait_for(
                conn.request(method, path, headers, body, keepalive), self.args.client_timeout)
        except ClientError as e:
            rec["err"] = str(e)
        except asyncio.TimeoutError:
            rec["err"] = "timeout"
        conn.close()
        rec["t1"] = now()

    async def h2_worker(self, wid, route, group, idents, batch, period):
        """HTTP/2 (h2c, prior knowledge; the `h2` package): `batch` concurrent streams on one
        connection, then the connection is closed. (curl 7.88, Debian 12's, fails a second
        stream on an h2c connection: curl/curl#10634.)"""
        import h2.config
        import h2.connection
        import h2.events
        rng = random.Random(self.args.seed * 1000 + wid)
        while now() < self.stop_at:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * period)
            if now() >= self.stop_at:
                break
            inst = rng.choice(group)
            recs = {}
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.instances[inst].listen)
            except OSError:
                t = now()
                self.records.append(dict(t0=t, t1=t, inst=inst, route=route, ident="-",
                                         rid=self.rid(), status=None, err="refused",
                                         proto="h2"))
                continue
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            for i in range(batch):
                ident = rng.choice(idents)
                rid = self.rid()
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, [(":method", "GET"), (":scheme", "http"),
                                        (":authority", "soak"), (":path", f"/{route}/{i}"),
                                        ("x-api-key", ident), ("x-request-id", rid)],
                                  end_stream=True)
                rec = dict(t0=now(), t1=None, inst=inst, route=route, ident=ident, rid=rid,
                           status=None, err=None, proto="h2")
                recs[sid] = rec
                self.records.append(rec)
            open_streams = set(recs)

            async def exchange():
                writer.write(conn.data_to_send())
                await writer.drain()
                while open_streams:
                    data = await reader.read(65536)
                    if not data:
                        raise ClientError("eof")
                    for ev in conn.receive_data(data):
                        if isinstance(ev, h2.events.ResponseReceived):
                            for k, v in ev.headers:
                                if k == b":status":
                                    recs[ev.stream_id]["status"] = int(v)
                        elif isinstance(ev, h2.events.DataReceived):
                            conn.acknowledge_received_data(ev.flow_controlled_length,
                                                           ev.stream_id)
                        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                            recs[ev.stream_id]["t1"] = now()
                            if isinstance(ev, h2.events.StreamReset):
                                recs[ev.stream_id]["err"] = "reset"
                            open_streams.discard(ev.stream_id)
                        elif isinstance(ev, h2.events.ConnectionTerminated):
                            raise ClientError("goaway")
                    writer.write(conn.data_to_send())
                    await writer.drain()

            try:
                await asyncio.wait_for(exchange(), self.args.client_timeout)
            except asyncio.TimeoutError:
                for sid in open_streams:
                    recs[sid]["err"] = "timeout"
            except (ClientError, OSError, asyncio.IncompleteReadError) as e:
                for sid in open_streams:
                    recs[sid]["err"] = "reset" if not isinstance(e, ClientError) else str(e)
            finally:
                writer.transport.abort()
            for rec in recs.values():
                if rec["t1"] is None:
                    rec["t1"] = now()

    def tasks(self, redis_group, local_group):
        """The mix: (coroutine) for every worker. Rates are per second, scaled by --rate."""
        r = self.args.rate
        keys = lambda p, n: [f"{p}{i}" for i in range(n)]  # noqa: E731
        ips = [f"127.0.0.{i}" for i in range(2, 6)]
        xffs = [f"10.0.{i}.1" for i in range(4)]
        w = []
        wid = 0
        for group in (redis_group, local_group):
            g = "r" if group is redis_group else "l"
            # route, identities, rate per worker, workers, keep-alive, per-IP by XFF?
            mix = [
                ("slog", keys(f"{g}slog", 3), 7, 3, True, False),
                ("slog", keys(f"{g}slog", 3), 3, 2, False, False),
                ("swin", ips, 6, 2, True, False),
                ("swin", ips, 4, 2, False, False),
                ("fwin", keys(f"{g}fwin", 3), 8, 2, True, False),
                ("gcra", keys(f"{g}gcra", 3), 3, 2, True, False),
                ("chat", keys(f"{g}chat", 2), 3, 2, True, False),
                # Identities seen now and then, some answered by long streams.
                ("chat", keys(f"{g}chat-rare", 8), 0.4, 1, False, False),
                ("quota", keys(f"{g}quota", 3), 1.5, 2, False, False),
                ("shaped", keys(f"{g}shaped", 2), 6, 3, True, False),
                ("login", xffs, 3, 2, True, True),
                ("multi", keys(f"{g}multi", 4), 5, 2, True, False),
                ("multi", keys(f"{g}multi", 4), 2, 1, False, False),
            ]
            if group is local_group:
                mix = [(a, b, c * 0.5, d, e, f) for a, b, c, d, e, f in mix]
            for route, idents, rate, n, ka, xff in mix:
                for _ in range(n):
                    wid += 1
                    w.append(self.worker(wid, route, group, idents, rate * r, ka, xff=xff))
            if self.h2_ok:
                for route in ("slog", "gcra", "multi"):
                    wid += 1
                    w.append(self.h2_worker(wid, route, group,
                                            keys(f"{g}{route}", 3 if route != "multi" else 4),
                                            6, 2.0 / r))
            # /conc: 12 closed-loop clients per key on A, B and C (3 per key without
            # keep-alive) for 4 places, so each key is full most of the time; on L, 6 on one key.
            for key in (keys(f"{g}conc", 2) if group is redis_group else [f"{g}conc0"]):
                n = round((12 if group is redis_group else 6) * r)
                for i in range(n):
                    wid += 1
                    w.append(self.conc_worker(wid, group, key, keepalive=i % 4 != 3))
        return w


# --------------------------------------------------------------------------------------------
# Faults.


# The faults that keep Redis from deciding (or lose its state): the checker judges the windows
# they touch apart, and a calendar quota may count afresh after each.
REDIS_FAULTS = ("redis_kill", "redis_stop", "failover", "redis_partition", "redis_loss")

# iptables rules the soak adds (a partition, a loss period) carry this comment, so that they
# are all removed when the run ends, however it ends.
RULE_TAG = f"sluice-soak-{os.getpid()}"


def iptables(action, port, extra=()):
    """Adds (-I) or deletes (-D) the rules dropping loopback packets to and from `port`
    (OUTPUT on lo sees both directions of a loopback connection): silently, no RST, as a
    partition does; with `extra` (iptables' statistic match) only some of them, as loss."""
    for way in ("--dport", "--sport"):
        subprocess.run(["iptables", action, "OUTPUT", "-o", "lo", "-p", "tcp", way, str(port),
                        *extra, "-m", "comment", "--comment", RULE_TAG, "-j", "DROP"],
                       check=True, capture_output=True)


def remove_rules():
    """Deletes every rule this run added (a fault interrupted midway leaves its rules)."""
    try:
        listing = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return
    for rule in listing.splitlines():
        if RULE_TAG in rule and rule.startswith("-A "):
            args = rule.split()
            args = [a.strip('"') for a in args]
            subprocess.run(["iptables", "-D", *args[1:]], capture_output=True)


class Faults:
    KINDS = ["redis_kill", "redis_stop", "failover", "script_flush", "reload", "invalid_policy",
             "sluice_kill", "sluice_term", "upstream_error", "upstream_abort", "upstream_slow",
             "redis_partition", "redis_loss"]

    def __init__(self, args, redis, instances, upstream, load, rng):
        self.args, self.redis, self.instances = args, redis, instances
        self.upstream, self.load, self.rng = upstream, load, rng
        self.log = []  # dicts: kind, t0, t1 (impact end), detail
        self.slog_limit = [(0.0, SLOG_LIMITS[0])]  # (from, limit) as written
        self.problems = []

    def record(self, kind, t0, t1, detail="", effect_end=None):
        """t1: the fault is over (for Redis, the group is healthy again); effect_end: when it
        stopped affecting decisions (Redis faults)."""
        self.log.append(dict(kind=kind, t0=t0, t1=t1, detail=detail,
                             effect_end=effect_end if effect_end is not None else t1))
        log(f"fault {kind} [{t0:.1f}, {t1:.1f}] {detail}"
            + (f"; decisions affected until {effect_end:.1f}" if effect_end else ""))

    async def wait_redis(self, what, t0, old_master=None):
        """Waits until the group is healthy again (30 s at most) and returns when the fault's
        effect on decisions ended: the last moment the master (Sentinel) or slot map
        (Cluster) changed, or the first moment it was served by answering masters (after a
        change from `old_master`, when given), whichever is later."""
        deadline = now() + 30
        last_named, last_change, ok_at = None, t0, None
        while now() < deadline:
            named = await asyncio.to_thread(self.redis.named)
            if named != last_named:
                if last_named is not None:
                    last_change = now()
                last_named = named
            if ok_at is None and (old_master is None or named != old_master) \
                    and await asyncio.to_thread(self.redis.serving, named):
                ok_at = now()
            if ok_at is not None and await asyncio.to_thread(self.redis.healthy):
                return max(ok_at, last_change)
            await asyncio.sleep(0.1)
        self.problems.append(f"Redis not healthy 30 s after {what}: {self.redis.why}")
        log(f"Redis not healthy 30 s after {what}: {self.redis.why}")
        return now()

    async def run(self, start, end):
        """Faults from `start` to `end` (s), every kind at least once when time allows."""
        kinds = []
        while len(kinds) < 200:
            k = list(self.KINDS)
            self.rng.shuffle(k)
            kinds += k
        await asyncio.sleep(max(0, start - now()))
        n_first = len(self.KINDS)
        span = end - start
        gap = max(1.0, span / n_first * 0.35)
        i = 0
        while now() < end and i < len(kinds):
            await getattr(self, kinds[i])()
            i += 1
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * gap)

    async def redis_kill(self):
        m = await asyncio.to_thread(self.redis.victim, self.rng)
        t0 = now()
        self.redis.servers[m].signal(signal.SIGKILL)
        self.redis.servers[m].p.wait()
        down = self.rng.uniform(0.5, 4.0)
        waiting = asyncio.create_task(self.wait_redis("redis_kill", t0))
        await asyncio.sleep(down)
        # Restarted empty (no persistence), as a master: if the sentinels have not failed over
        # yet, it is the master again and has lost everything.
        await asyncio.to_thread(self.redis.start_server, m)
        end = await waiting
        self.record("redis_kill", t0, now(), f"master :{m} down {down:.1f} s", end)

    async def redis_stop(self):
        m = await asyncio.to_thread(self.redis.victim, self.rng)
        t0 = now()
        self.redis.servers[m].signal(signal.SIGSTOP)
        pause = self.rng.uniform(0.3, 3.0)
        await asyncio.sleep(pause)
        self.redis.servers[m].signal(signal.SIGCONT)
        end = await self.wait_redis("redis_stop", t0)
        self.record("redis_stop", t0, now(), f"master :{m} stopped {pause:.1f} s", end)

    async def redis_partition(self):
        """A silent partition of a master's port (every connection to it: sluice's, the
        replica's, the sentinels'), 1-5 s: no RST, no FIN; connections with data in flight
        wait for the kernel's retransmissions after it heals unless sluice gives them up."""
        m = await asyncio.to_thread(self.redis.victim, self.rng)
        t0 = now()
        length = self.rng.uniform(1.0, 5.0)
        await asyncio.to_thread(iptables, "-I", m)
        try:
            await asyncio.sleep(length)
        finally:
            await asyncio.to_thread(iptables, "-D", m)
        end = await self.wait_redis("redis_partition", t0)
        self.record("redis_partition", t0, now(), f"master :{m} cut {length:.1f} s", end)

    async def redis_loss(self):
        """1 % of the packets to and from a master's port dropped for 3-6 s: each lost
        segment stalls the calls behind it on its connection for 200 ms or more."""
        m = await asyncio.to_thread(self.redis.victim, self.rng)
        t0 = now()
        length = self.rng.uniform(3.0, 6.0)
        loss = ("-m", "statistic", "--mode", "random", "--probability", "0.01")
        await asyncio.to_thread(iptables, "-I", m, loss)
        try:
            await asyncio.sleep(length)
        finally:
            await asyncio.to_thread(iptables, "-D", m, loss)
        end = await self.wait_redis("redis_loss", t0)
        self.record("redis_loss", t0, now(), f"master :{m} 1 % loss {length:.1f} s", end)

    async def failover(self):
        t0 = now()
        old, detail, ok = await asyncio.to_thread(self.redis.failover, self.rng)
        end = await self.wait_redis("failover", t0, old_master=old if ok else None)
        self.record("failover", t0, now(), detail, end)

    async def script_flush(self):
        t0 = now()
        detail = await asyncio.to_thread(self.redis.script_flush)
        self.record("script_flush", t0, now(), detail)

    def live(self):
        return [s for s in self.instances.values() if s.proc.alive()]

    async def reload(self):
        cur = self.slog_limit[-1][1]
        new = SLOG_LIMITS[1] if cur == SLOG_LIMITS[0] else SLOG_LIMITS[0]
        t0 = now()
        for s in self.instances.values():
            s.write_policy(new)
        self.slog_limit.append((t0, new))
        # Every instance looks at its file every 250 ms; give the change 1.5 s to serve.
        await asyncio.sleep(1.5)
        self.record("reload", t0, now(), f"/slog per-key {cur} -> {new}")

    async def invalid_policy(self):
        t0 = now()
        cur = self.slog_limit[-1][1]
        for s in self.instances.values():
            s.write_policy(cur, invalid=True)
            if s.proc.alive():
                s.invalid_pushes += 1
        await asyncio.sleep(self.rng.uniform(1.0, 2.5))
        for s in self.instances.values():
            s.write_policy(cur)
        await asyncio.sleep(0.5)
        self.record("invalid_policy", t0, now(), "requests: 0 on /slog, then fixed")

    async def restart(self, inst, sig):
        s = self.instances[inst]
        t0 = now()
        s.down.append([t0, None])
        s.proc.signal(sig)
        await asyncio.to_thread(s.proc.p.wait)
        s.ended()
        t_exit = now()
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(s.start)
        s.down[-1][1] = now()
        return t0, t_exit

    async def sluice_kill(self):
        t0, _ = await self.restart("B", signal.SIGKILL)
        self.record("sluice_kill", t0, now(), "B SIGKILLed, restarted")

    async def sluice_term(self):
        # Requests in flight at the SIGTERM: long streamed answers (about 6 s, within the
        # 10 s shutdown grace) started on C half a second before. Each must end with its 200.
        inflight = [asyncio.create_task(self.load.one("C", "chat", f"rchat-rare-term{i}",
                                                      prompt="Tell a long story.",
                                                      keepalive=True))
                    for i in range(3)]
        await asyncio.sleep(0.5)
        t0, t_exit = await self.restart("C", signal.SIGTERM)
        await asyncio.gather(*inflight)
        self.record("sluice_term", t0, now(), f"C SIGTERMed, exited after {t_exit - t0:.2f} s")

    async def upstream_episode(self, mode, p):
        t0 = now()
        self.upstream.fault = (mode, p)
        await asyncio.sleep(self.rng.uniform(2.0, 4.0))
        self.upstream.fault = None
        self.record(f"upstream_{mode}", t0, now(), f"{int(p * 100)} % of answers")

    async def upstream_error(self):
        await self.upstream_episode("error", 0.3)

    async def upstream_abort(self):
        await self.upstream_episode("abort", 0.3)

    async def upstream_slow(self):
        await self.upstream_episode("slow", 0.3)


# --------------------------------------------------------------------------------------------
# Resources.


async def sample_resources(instances, samples, stop_at):
    while now() < stop_at:
        for s in instances.values():
            if not s.proc.alive():
                continue
            pid = s.proc.p.pid
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            samples.append((now(), s.name, pid, rss, fds))
        await asyncio.sleep(1.0)


# --------------------------------------------------------------------------------------------
# The checker.


class Checker:
    def __init__(self, args, faults, upstream, load, instances):
        self.args, self.faults, self.up, self.load = args, faults, upstream, load
        self.instances = instances
        self.lines = []
        self.violations = 0

    def line(self, ok, name, figure):
        status = "PASS" if ok else "FAIL"
        if not ok:
            self.violations += 1
        self.lines.append(f"{status} {name}: {figure}")

    def redis_impact(self):
        """Intervals during which Redis could not decide or lost state: from the fault's start
        to 3 s after the sentinels named a master that answers as one (sluice asks them every
        500 ms; the breaker probes every 250 ms; the README's bound on the switch is 1 s)."""
        return [(f["t0"], f["effect_end"] + 3.0) for f in self.faults.log
                if f["kind"] in REDIS_FAULTS]

    def slog_limit_over(self, a, b):
        """The largest /slog limit in force at any time in [a - 1.5 s, b]: a reload takes up
        to a second to serve on every instance, and entries admitted under the old limit
        stay in the window."""
        best, cur = 0, None
        for t, n in self.faults.slog_limit:
            if t <= a - 1.5:
                cur = n
            elif t <= b:
                best = max(best, n)
        return max(best, cur or 0)

    def check_windows(self):
        slack = self.args.slack
        impact = self.redis_impact()
        n_redis = 3

        def overlaps(a, b):
            return any(x < b and a < y for x, y in impact)

        series = collections.defaultdict(list)  # (group, route, limit, ident) -> [(t, w)]
        for r in self.up.records:
            if r["route"] not in ROUTES:
                continue
            group = "local" if r["inst"] == "L" else "redis"
            for lim in ROUTES[r["route"]]["limits"]:
                if lim["alg"] == "concurrent":
                    continue  # no window: check_concurrency
                ident = {"key": r["key"], "ip": r["ip"], "global": "*"}[lim["key"]]
                if lim.get("count"):
                    if r["status"] not in lim["count"]:
                        continue
                w = r["tokens"] if lim.get("tokens") else 1
                series[(group, r["route"], lim["name"], ident)].append((r["t"], w))
        per_limit = {}  # (group, route, limit) -> worst figures
        for (group, route, lname, ident), events in series.items():
            events.sort()
            lim = next(x for x in ROUTES[route]["limits"] if x["name"] == lname)
            ose = ROUTES[route]["ose"] if group == "redis" else None
            approx = 2 if lim["alg"] in ("sliding_window", "fixed_window") else 1
            agg = per_limit.setdefault((group, route, lname), dict(
                max_use=0, limit=None, worst=0.0, worst_fig="", viol=0, fault_windows=0,
                max_fault_use=0))
            if "quota" in lim:
                total = sum(w for _, w in events)
                losses = sum(1 for f in self.faults.log if f["kind"] in
                             REDIS_FAULTS) if group == "redis" else 0
                bound = lim["n"] * (1 + losses)
                agg["max_use"] = max(agg["max_use"], total)
                agg["limit"] = lim["n"]
                ratio = total / bound
                if ratio > agg["worst"]:
                    agg["worst"], agg["worst_fig"] = ratio, f"{ident}: {total} in the day, bound {bound}"
                if total > bound:
                    agg["viol"] += 1
                continue
            W = lim["window"]
            # The exact logs count each admission past its window by the store's lateness
            # bound (the store timeout: an answer later than that is not acted on), so only
            # the jitter from sluice's forwarding to this process's receipt is left to allow
            # for; the others keep their promise at the store's clock, and an admission can be
            # forwarded up to the store timeout later.
            span = W - (self.args.log_slack if lim["alg"] in ("sliding_log", "weighted_log")
                        else slack)
            if lim["alg"] == "gcra":
                # Any k admissions in a row span at least (k - burst) * T: in a window of
                # W - slack, at most burst + requests - 1 (slack < T absorbs the jitter
                # between admission and arrival).
                base = lim["burst"] + lim["n"] - 1
            else:
                base = None
            j, acc = 0, 0
            times = [t for t, _ in events]
            ws = [w for _, w in events]
            for i in range(len(events)):
                while j < len(events) and times[j] < times[i] + span:
                    acc += ws[j]
                    j += 1
                a, b = times[i], times[i] + span
                n = lim["n"] if lim["n"] != "SLOG" else self.slog_limit_over(a, b)
                bound = (base if base is not None else n * approx)
                in_fault = group == "redis" and overlaps(a - W, b)
                if in_fault:
                    agg["fault_windows"] += 1
                    agg["max_fault_use"] = max(agg["max_fault_use"], acc)
                    if ose == "deny":
                        # Redis may lose admissions (a master restarted empty, a replica
                        # promoted without the last writes): up to `requests` more.
                        bound = bound + n
                    else:
                        # `local`: every instance counts on its own during the outage, and
                        # afresh in Redis after: up to (N + 1) times the bound.
                        bound = bound * (n_redis + 1)
                if acc > agg["max_use"] and not in_fault:
                    agg["max_use"] = acc
                agg["limit"] = bound if not in_fault and base is not None else (
                    agg["limit"] or n)
                ratio = acc / bound
                if ratio > agg["worst"]:
                    agg["worst"] = ratio
                    agg["worst_fig"] = (f"{ident}: {acc} in {span:.1f} s at t={a:.1f}"
                                        f"{' (Redis fault)' if in_fault else ''}, bound {bound}")
                if acc > bound:
                    agg["viol"] += 1
                acc -= ws[i]
        for (group, route, lname), agg in sorted(per_limit.items()):
            lim = next(x for x in ROUTES[route]["limits"] if x["name"] == lname)
            unit = "tokens" if lim.get("tokens") else "requests"
            kind = lim["alg"] + (" delay" if "delay" in lim else "") + (
                " count 401" if "count" in lim else "")
            self.line(agg["viol"] == 0, f"window {group}/{route}/{lname} ({kind}, {unit})",
                      f"max use outside Redis faults {agg['max_use']} vs limit "
                      f"{'20/12 (reloaded)' if lim['n'] == 'SLOG' else lim['n']}; worst "
                      f"{agg['worst']:.2f} of its bound ({agg['worst_fig']}); windows over "
                      f"bound: {agg['viol']}" + (
                          f"; max in windows touching a Redis fault {agg['max_fault_use']}"
                          if agg["fault_windows"] else ""))

    @staticmethod
    def conc_sweep(events, n_lim):
        """Per (group, key): the most in flight at once (all; and not counting arrivals in a
        Redis fault window), instants over the limit (with the first's requests and each
        one's duration), the most in flight while an arrival of each fault window was, the
        time at the limit."""
        keys = {}
        for t, d, rec in events:
            group = "local" if rec["inst"] == "L" else "redis"
            k = keys.get((group, rec["key"]))
            if k is None:
                k = keys[(group, rec["key"])] = dict(
                    all=0, strict=0, exempt=collections.Counter(), inflight={}, max_all=0,
                    max_strict=0, max_strict_t=None, over=0, over_first=None, over_since=None,
                    over_longest=0.0, win_max=collections.Counter(), full=0.0, first=t,
                    last=t, served=0, ends=collections.Counter())
            w = rec["_win"]
            if k["all"] >= n_lim:
                k["full"] += t - k["last"]
            k["last"] = t
            k["all"] += d
            if w is None:
                k["strict"] += d
            else:
                k["exempt"][w] += d
            if d < 0:
                k["inflight"].pop(id(rec), None)
                k["ends"][rec.get("end")] += 1
                if k["over_since"] is not None and k["strict"] <= n_lim:
                    k["over_longest"] = max(k["over_longest"], t - k["over_since"])
                    k["over_since"] = None
                continue
            k["inflight"][id(rec)] = rec
            k["served"] += 1
            k["max_all"] = max(k["max_all"], k["all"])
            if k["strict"] > k["max_strict"]:
                k["max_strict"], k["max_strict_t"] = k["strict"], t
            if k["strict"] > n_lim:
                k["over"] += 1
                if k["over_since"] is None:
                    k["over_since"] = t
                if k["over_first"] is None:
                    k["over_first"] = f"{k['strict']} at t={t:.4f}: " + ", ".join(
                        f"{r['inst']} {r['rid']} {r['t']:.4f}-{r.get('t_end', 0):.4f} "
                        f"{r.get('end')}" for r in sorted(k["inflight"].values(),
                                                          key=lambda r: r["t"])
                        if r["_win"] is None)
            for wi, c in k["exempt"].items():
                if c > 0:
                    k["win_max"][wi] = max(k["win_max"][wi], k["all"])
        return keys

    def check_concurrency(self, conc_metrics, leases_left):
        """The concurrency limit, against the upstream's own record of the requests of each key
        it was serving at every instant (arrival to the end or abort of the answer), swept in
        the order the upstream saw those events.

        Strict: at no instant more than N in flight, counting every request but those that
        arrived during a Redis fault window (from the fault's start to 3 s after the sentinels
        name a working master: the redis_impact of the window check). Those are the documented
        gaps: a master restarted empty or a replica promoted without the last leases forgets
        places until each instance's next renewal (a quarter of the lease, 0.5 s, plus a
        250 ms tick, after sluice follows the new master), or, when the instance admitted
        under the key before renewing, until the forgotten requests end (found by this soak,
        see docs/src/internals/soak.md). They are counted apart, with the
        most in flight at any instant while one of them was, per fault. And the limit used
        whole (N at some instant, not a deny-all).

        An answer sluice closed (its client left, its upstream timeout, a lease cut) ends, for
        the upstream, when the connection's FIN arrives; sluice frees the place when it ends
        the request, and the FIN leaves a moment later (hyper's connection task). Such an end is
        judged CLOSE_ALLOWANCE earlier than the upstream saw it; the raw record is reported
        too (instants over N, and the longest)."""
        lim = ROUTES["conc"]["limits"][0]
        n_lim = lim["n"]
        wins = [(f["t0"], f["effect_end"] + 3.0, f"{f['kind']}@{f['t0']:.1f}")
                for f in self.faults.log if f["kind"] in REDIS_FAULTS]
        for t, d, rec in self.up.conc:
            if d > 0:
                rec["_win"] = next((i for i, (a, b, _) in enumerate(wins) if a <= t <= b),
                                   None) if rec["inst"] != "L" else None
        raw = self.conc_sweep(self.up.conc, n_lim)
        judged_events = sorted(
            ((t - CLOSE_ALLOWANCE if d < 0 and rec.get("end") == "closed" else t, i, d, rec)
             for i, (t, d, rec) in enumerate(self.up.conc)), key=lambda e: (e[0], e[1]))
        keys = self.conc_sweep([(t, d, rec) for t, _, d, rec in judged_events], n_lim)
        # How long after an abandoning client closed its connection the upstream saw it end.
        conc_by_rid = {r["rid"]: r for r in self.up.records if r["route"] == "conc"}
        fin_lag = sorted(conc_by_rid[c["rid"]]["t_end"] - c["closed_at"]
                         for c in self.load.records
                         if c.get("closed_at") is not None and c["rid"] in conc_by_rid
                         and "t_end" in conc_by_rid[c["rid"]])
        for group in ("redis", "local"):
            ks = sorted((key, k) for (g, key), k in keys.items() if g == group)
            if not ks:
                self.line(False, f"concurrency {group}/conc/per-key", "no request reached "
                          "the upstream")
                continue
            over = sum(k["over"] for _, k in ks)
            fig = "; ".join(
                f"{key}: {k['max_strict']} (at t={k['max_strict_t']:.1f}), {k['served']} served"
                + (f", {k['over']} instants over, first {k['over_first']}" if k["over"] else "")
                for key, k in ks)
            rk = [raw[(group, key)] for key, _ in ks]
            raw_over = sum(k["over"] for k in rk)
            fig += "; the upstream's raw record: " + (
                f"{max(k['max_strict'] for k in rk)} at most, {raw_over} instants over "
                f"{n_lim} (longest {1000 * max(k['over_longest'] for k in rk):.2f} ms; first "
                + "; ".join(k["over_first"] for k in rk if k["over_first"]) + ")"
                if raw_over else f"the same, {max(k['max_strict'] for k in rk)} at most")
            wfig = ""
            if group == "redis":
                wfig = "; in Redis fault windows (arrivals there not held to the limit): " + (
                    ", ".join(f"{label} [{a:.1f}, {b:.1f}] max "
                              f"{max([k['win_max'][i] for _, k in ks] or [0])}"
                              for i, (a, b, label) in enumerate(wins)) or "none")
            self.line(over == 0, f"concurrency {group}/conc/per-key (concurrent {n_lim}, "
                      f"lease {lim['lease']}s): most in flight at the upstream at once",
                      f"{fig}; limit {n_lim}{wfig}")
            self.line(all(k["max_strict"] == n_lim for _, k in ks),
                      f"concurrency {group}/conc/per-key used whole (not a deny-all)",
                      "; ".join(f"{key}: {n_lim} in flight {100 * k['full'] / max(1e-9, k['last'] - k['first']):.0f} % "
                                f"of the time, answers ended {dict(k['ends'])}"
                                for key, k in ks))
        if fin_lag:
            self.line(True, "concurrency: abandoned streams, their client's close to the "
                      "upstream's seeing it end",
                      f"{len(fin_lag)}: median {1000 * statistics.median(fin_lag):.2f} ms, "
                      f"max {1000 * fin_lag[-1]:.2f} ms (allowance for an answer sluice "
                      f"closed: {1000 * CLOSE_ALLOWANCE:.0f} ms)")
        # What the clients got: 200, 429 (naming the limit in concurrent requests), 503 on
        # A, B and C during Redis faults (deny), and the 5xx or failures check_answers explains.
        recs = [r for r in self.load.records if r["route"] == "conc"]
        statuses = collections.Counter(r["status"] if r["status"] is not None else
                                       f"cut {r['partial']}" if r.get("partial") else
                                       r["err"] for r in recs)
        odd = {k: v for k, v in statuses.items()
               if isinstance(k, int) and k not in (200, 429, 500, 502, 503, 504)}
        want = f'"{lim["name"]}";q={n_lim};qu="concurrent-requests"'
        bad_policy = collections.Counter(r.get("policy") for r in recs
                                         if r["status"] == 429 and r.get("policy") != want)
        unserved = sum(1 for r in recs if r["status"] == 200 and r["rid"] not in conc_by_rid)
        abandoned = sum(1 for r in recs if r.get("abandon") and r["status"] == 200)
        self.line(not odd and not bad_policy and unserved == 0,
                  "concurrency answers: 200 or 429 (each 5xx and failure explained below)",
                  ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str)) +
                  f"; {abandoned} streams left by their client after the first event; 429s "
                  f"with RateLimit-Policy {want}: "
                  f"{statuses[429] - sum(bad_policy.values())} of {statuses[429]}" +
                  (f" (others: {dict(bad_policy)})" if bad_policy else "") +
                  f"; 200s the upstream never saw: {unserved}" +
                  (f"; other statuses: {odd}" if odd else ""))
        # The places B held when SIGKILLed (its requests' connections to the upstream die with
        # it, but Redis counts its leases until its deadline, then reclaims them): how many,
        # and when each key next had the limit in flight at the upstream.
        kills = []
        for f in self.faults.log:
            if f["kind"] != "sluice_kill":
                continue
            held_b = collections.Counter(r["key"] for r in self.up.records
                                         if r["route"] == "conc" and r["inst"] == "B"
                                         and r["t"] <= f["t0"] < r.get("t_end", 1e18))
            full_again = []
            for key in sorted(held_b):
                cur, back = 0, None
                for t, d, rec in self.up.conc:
                    if rec["key"] != key:
                        continue
                    cur += d
                    if t > f["t0"] and cur >= n_lim:
                        back = t - f["t0"]
                        break
                full_again.append(f"{key} {n_lim} in flight again {back:.1f} s after"
                                  if back is not None else f"{key} never full again")
            kills.append(f"B SIGKILLed at {f['t0']:.1f} s holding {sum(held_b.values())} "
                         f"places" + (f" ({', '.join(full_again)})" if full_again else ""))
        # Every place given back: no lease held by any instance, none left in Redis.
        held = {name: m.get("in_flight") for name, m in conc_metrics.items()}
        events = "; ".join(f"{name} " + (", ".join(f"{e} {int(v)}" for e, v in
                                                  sorted(m["events"].items()) if v) or "none")
                           for name, m in conc_metrics.items())
        self.line(all(v == 0 for v in held.values()) and leases_left == 0,
                  "concurrency places all given back at the end",
                  f"sluice_concurrency_in_flight {held}, leases left in Redis {leases_left}; "
                  f"sluice_concurrency_leases_total (since each process started): {events}"
                  + (f"; {'; '.join(kills)}" if kills else ""))

    def in_intervals(self, t, intervals, margin=0.0):
        return any(a - margin <= t <= (b if b is not None else 1e18) + margin
                   for a, b in intervals)

    def check_answers(self):
        by_rid = {r["rid"]: r for r in self.up.records if r["rid"]}
        impact = self.redis_impact()
        causes = collections.Counter()
        bad = collections.Counter()
        examples = {}
        hanging = 0
        total = len(self.load.records)
        statuses = collections.Counter()
        for rec in self.load.records:
            inst = self.instances[rec["inst"]]
            st, err = rec["status"], rec["err"]
            statuses[st if st is not None else "none"] += 1
            cause = None
            if err == "timeout":
                hanging += 1
                cause = None
            elif err:
                if self.in_intervals(rec["t0"], inst.down, 0.05) or \
                        self.in_intervals(rec["t1"], inst.down, 0.05):
                    kill = any(f["kind"] == "sluice_kill" and f["t0"] - 0.05 <= rec["t1"] <= f["t1"]
                               for f in self.faults.log) and rec["inst"] == "B"
                    if err.startswith("refused") or err.startswith("connect"):
                        cause = "instance down: connection refused"
                    elif kill:
                        cause = "instance SIGKILLed: connection lost"
                    else:
                        # SIGTERM: requests in flight must finish. Only a request sent at or
                        # after the signal may fail, unprocessed: on a kept-alive connection
                        # closed after its last answer (the keep-alive race every HTTP/1.1
                        # server has), or a new connection reset as the listener closed.
                        term = next((d[0] for d in inst.down
                                     if d[0] - 0.05 <= rec["t1"] <= (d[1] or 1e18) + 0.05), None)
                        if term is not None and rec["t0"] >= term - 0.01 \
                                and not by_rid.get(rec["rid"]):
                            cause = ("SIGTERM: request on a kept-alive connection being closed"
                                     if err.endswith("_reused") else
                                     "SIGTERM: new connection reset as the listener closed")
                if cause is None and rec["route"] == "conc" and rec.get("partial") == 200 \
                        and rec["inst"] != "L" \
                        and any(a <= rec["t1"] and rec["t0"] <= b for a, b in impact):
                    # The instance could not renew the request's lease before its deadline in
                    # Redis: it cuts the answer rather than let it run beside the request the
                    # store will admit in its place.
                    cause = "concurrency: answer cut, lease not renewable in a Redis fault"
            elif st is not None and st >= 500:
                up = by_rid.get(rec["rid"])
                group = "local" if rec["inst"] == "L" else "redis"
                if st == 500 and up and up["fault"] == "error":
                    cause = "500 from the upstream (injected)"
                elif st == 502 and up and up["fault"] == "abort":
                    cause = "502: upstream closed without answering (injected)"
                elif st == 504 and up and up["fault"] == "slow":
                    cause = "504: upstream slower than its timeout (injected)"
                elif st == 503 and group == "redis" and ROUTES[rec["route"]]["ose"] == "deny" \
                        and any(a <= rec["t1"] and rec["t0"] <= b for a, b in impact):
                    cause = "503: Redis fault on an on_store_error: deny route"
            else:
                continue
            if cause:
                causes[cause] += 1
            else:
                what = err or f"status {st}"
                k = f"{what} on {rec['inst']}/{rec['route']}"
                bad[k] += 1
                examples.setdefault(k, f"t={rec['t0']:.2f}..{rec['t1']:.2f} rid={rec['rid']}")
        self.line(hanging == 0, "no request left hanging",
                  f"{hanging} of {total} requests got no answer within "
                  f"{self.args.client_timeout:.0f} s")
        self.line(True, "answers by status", ", ".join(
            f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))))
        self.line(True, "5xx and failed requests explained, by cause",
                  ", ".join(f"{k}: {v}" for k, v in sorted(causes.items())) or "none")
        nbad = sum(bad.values())
        self.line(nbad == 0, "no unexplained 5xx or failed request",
                  f"{nbad} unexplained" + ("; " + "; ".join(
                      f"{k}: {v} (e.g. {examples[k]})" for k, v in bad.most_common(8))
                      if nbad else ""))
        # Every upstream record was asked for by a client of the soak: sluice forwarded
        # nothing no one sent, and nothing twice.
        rids = collections.Counter(r["rid"] for r in self.up.records)
        dup = sum(1 for v in rids.values() if v > 1)
        sent = {r["rid"] for r in self.load.records}
        foreign = sum(1 for k in rids if k not in sent)
        self.line(dup == 0 and foreign == 0, "upstream received each request at most once",
                  f"{len(self.up.records)} received, {dup} twice or more, {foreign} not sent")

    def check_resources(self, samples):
        by_pid = collections.defaultdict(list)
        for t, name, pid, rss, fds in samples:
            by_pid[(name, pid)].append((t, rss, fds))
        figs, ok = [], True
        for (name, pid), ss in sorted(by_pid.items()):
            if len(ss) < 20:
                continue  # lived too short to judge drift
            life = ss[-1][0] - ss[0][0]
            warm = [s for s in ss if s[0] >= ss[0][0] + max(10.0, life * 0.25)]
            if len(warm) < 10:
                continue
            third = max(3, len(warm) // 3)
            first, last = warm[:third], warm[-third:]
            rss0 = statistics.median(s[1] for s in first)
            rss1 = statistics.median(s[1] for s in last)
            fd0 = max(s[2] for s in first)
            fd1 = max(s[2] for s in last)
            tol_rss = max(8 * 1024, rss0 * 0.20)
            good = rss1 - rss0 <= tol_rss and fd1 - fd0 <= 32
            ok &= good
            figs.append(f"{name}(pid {pid}, {life:.0f} s): RSS {rss0 / 1024:.1f}->"
                        f"{rss1 / 1024:.1f} MiB, fds {fd0}->{fd1}")
        self.line(ok, "RSS and fds flat after warm-up (RSS +max(8 MiB, 20 %), fds +32)",
                  "; ".join(figs) or "no process lived long enough")

    def check_ttls(self, ttl_result):
        no_ttl, total, samples = ttl_result
        self.line(no_ttl == {} and total > 0, "every Redis key has a TTL",
                  f"{sum(no_ttl.values())} of {total} keys without TTL" +
                  (" (" + ", ".join(f"{k}: {v}, e.g. {samples[k]}"
                                    for k, v in sorted(no_ttl.items())) + ")" if no_ttl else ""))

    def check_metrics(self, metrics):
        """For instances never killed, sluice_requests_total by route and outcome against what
        the clients saw from them."""
        outcome_of = {429: "limited", 503: "store_error", 502: "upstream_error",
                      504: "upstream_error", 400: "client_error", 413: "client_error"}
        figs, ok = [], True
        for name, m in metrics.items():
            seen = collections.Counter()
            for rec in self.load.records:
                # An answer cut after its head (a concurrency lease lost) counts by its status.
                st = rec["status"] if rec["status"] is not None else rec.get("partial")
                if rec["inst"] != name or st is None:
                    continue
                seen[(rec["route"], outcome_of.get(st, "forwarded"))] += 1
            got = collections.Counter()
            for k, v in m.items():
                if k.startswith("sluice_requests_total{"):
                    labels = dict(p.split("=", 1) for p in k[len("sluice_requests_total{"):-1]
                                  .split(","))
                    route = labels.get("route", "").strip('"')
                    outcome = labels.get("outcome", "").strip('"')
                    if route and v:
                        got[(route, outcome)] += int(v)
            diff = {k: (seen[k], got[k]) for k in set(seen) | set(got) if seen[k] != got[k]}
            ok &= not diff
            figs.append(f"{name}: clients {sum(seen.values())}, sluice "
                        f"{sum(got.values())}" + (f", differ {sorted(diff.items())[:6]}"
                                                  if diff else ""))
            errs = m.get('sluice_config_reloads_total{result="error"}', 0)
            inst = self.instances[name]
            good = errs >= inst.invalid_pushes
            ok &= good
            figs[-1] += f", invalid policies refused {int(errs)} of {inst.invalid_pushes} pushed"
        self.line(ok, "metrics equal what the clients saw (instances never killed)",
                  "; ".join(figs))


def scan_all(group):
    """scan_ttls over every master (one for Sentinel, three for a Cluster)."""
    masters = group.masters() if isinstance(group, ClusterGroup) else [group.master_port()]
    no_ttl, total, samples = collections.Counter(), 0, {}
    for m in masters:
        n, t, s = scan_ttls(m)
        no_ttl.update(n)
        total += t
        samples.update(s)
    return dict(no_ttl), total, samples


def conc_leases(group):
    """Leases held in Redis under /conc's concurrency keys (their hashes, not the `:i` ones)."""
    masters = group.masters() if isinstance(group, ClusterGroup) else [group.master_port()]
    total = 0
    for m in masters:
        cursor = "0"
        while True:
            r = redis_cmd(m, "SCAN", cursor, "MATCH", "*:conc:per-key:concurrency:*",
                          "COUNT", "1000")
            cursor, keys = r[0], [k for k in r[1] if not k.endswith(":i")]
            if keys:
                total += sum(n for n in redis_cmds(m, [["HLEN", k] for k in keys])
                             if isinstance(n, int))
            if cursor == "0":
                break
    return total


def conc_metrics_of(admin):
    """sluice_concurrency_in_flight of /conc and sluice_concurrency_leases_total by event."""
    m = parse_metrics(http_get_body(admin, "/metrics"))
    out = dict(in_flight=0, events={})
    for k, v in m.items():
        if k.startswith("sluice_concurrency_in_flight{") and 'route="conc"' in k:
            out["in_flight"] += int(v)
        elif k.startswith("sluice_concurrency_leases_total{"):
            event = k.split('event="', 1)[1].split('"', 1)[0] if 'event="' in k else k
            out["events"][event] = out["events"].get(event, 0) + v
    return out


def scan_ttls(port):
    try:
        return scan_ttls_once(port)
    except (OSError, ConnectionError, TypeError, IndexError) as e:
        log(f"scanning keys on :{port} failed: {e}")
        return {}, 0, {}


def scan_ttls_once(port):
    no_ttl, samples, total = collections.Counter(), {}, 0
    cursor = "0"
    while True:
        r = redis_cmd(port, "SCAN", cursor, "COUNT", "1000")
        cursor, keys = r[0], r[1]
        if keys:
            ttls = redis_cmds(port, [["PTTL", k] for k in keys])
            for k, ttl in zip(keys, ttls):
                total += 1
                if ttl == -1:
                    kind = ":".join(k.split(":")[1:3])
                    no_ttl[kind] += 1
                    samples.setdefault(kind, k)
        if cursor == "0":
            break
    return dict(no_ttl), total, samples


# --------------------------------------------------------------------------------------------


async def main_async(args):
    rng = random.Random(args.seed)
    state = tempfile.mkdtemp(prefix="sluice-soak.")
    log(f"seed {args.seed}, duration {args.duration} s, state in {state}")
    upstream = Upstream(args.seed)
    await upstream.start()
    redis = ClusterGroup(state) if args.mode == "cluster" else RedisGroup(state)
    instances = {}
    try:
        await asyncio.to_thread(redis.start)
        log(redis.describe())
        for name in ("A", "B", "C", "L"):
            s = Sluice(name, args.binary, state, upstream.port, redis if name != "L" else None)
            s.write_policy(SLOG_LIMITS[0])
            await asyncio.to_thread(s.start)
            instances[name] = s
        log("sluice " + ", ".join(f"{s.name} :{s.listen} (admin :{s.admin})"
                                  for s in instances.values()))
        load = Load(args, instances, rng)
        start = now()
        load.stop_at = start + args.duration
        faults = Faults(args, redis, instances, upstream, load, random.Random(args.seed + 1))
        samples = []
        warm = min(10.0, args.duration * 0.15)
        quiet = min(12.0, args.duration * 0.2)  # no fault in the last seconds: recovery
        tasks = load.tasks(["A", "B", "C"], ["L"])
        jobs = [asyncio.create_task(t) for t in tasks]
        fjob = asyncio.create_task(faults.run(start + warm, load.stop_at - quiet))
        rjob = asyncio.create_task(sample_resources(instances, samples, load.stop_at))

        async def scan_under_load():
            # Keys with a TTL vanish once idle: scan while every route is still busy too.
            await asyncio.sleep(max(0.0, load.stop_at - 2.0 - now()))
            return await asyncio.to_thread(scan_all, redis)

        sjob = asyncio.create_task(scan_under_load())
        await asyncio.gather(*jobs, rjob)
        ttl_busy = await sjob
        log(f"load done: {len(load.records)} requests")
        # Every key written so far, at once (keys with a TTL vanish as time passes).
        ttl_early = await asyncio.to_thread(scan_all, redis)
        await fjob
        log(f"{len(faults.log)} faults")
        metrics = {}
        for name in ("A", "L"):
            metrics[name] = parse_metrics(await asyncio.to_thread(
                http_get_body, instances[name].admin, "/metrics"))
        # Let the last held and slow answers finish, then scan Redis.
        await asyncio.sleep(0.5)
        conc_metrics = {}
        for name, s in instances.items():
            try:
                conc_metrics[name] = await asyncio.to_thread(conc_metrics_of, s.admin)
            except OSError as e:
                conc_metrics[name] = dict(in_flight=f"unreadable: {e}", events={})
        try:
            leases_left = await asyncio.to_thread(conc_leases, redis)
        except (OSError, ConnectionError, TypeError, IndexError) as e:
            leases_left = f"unreadable: {e}"
        ttl_result = await asyncio.to_thread(scan_all, redis)
        # Keys without a TTL never leave, so the last scan finds them all; the count of keys
        # seen is the busiest scan's.
        ttl_result = (ttl_result[0] or ttl_early[0] or ttl_busy[0],
                      max(ttl_result[1], ttl_early[1], ttl_busy[1]),
                      {**ttl_busy[2], **ttl_early[2], **ttl_result[2]})
        checker = Checker(args, faults, upstream, load, instances)
        fault_counts = collections.Counter(f["kind"] for f in faults.log)
        checker.line(not faults.problems and all(fault_counts[k] for k in Faults.KINDS)
                     or args.duration < 120,
                     "faults injected", f"{len(faults.log)}: " + ", ".join(
                         f"{k} {fault_counts[k]}" for k in Faults.KINDS) +
                     (f"; problems: {faults.problems}" if faults.problems else ""))
        if faults.problems:
            checker.violations += 1
        checker.line(True, "load", f"{len(load.records)} requests in {args.duration} s "
                     f"({collections.Counter(r['proto'] for r in load.records)}), upstream "
                     f"received {len(upstream.records)}")
        checker.check_windows()
        checker.check_concurrency(conc_metrics, leases_left)
        checker.check_answers()
        checker.check_resources(samples)
        checker.check_ttls(ttl_result)
        checker.check_metrics(metrics)
        if args.history:
            with open(args.history, "w") as f:
                json.dump(dict(seed=args.seed, faults=faults.log, upstream=upstream.records,
                               clients=load.records, samples=samples), f)
        print(f"soak: seed {args.seed}, {args.duration} s, {args.mode}")
        for line in checker.lines:
            print(line)
        print(f"soak: {'FAILED, ' + str(checker.violations) + ' check(s)' if checker.violations else 'passed'}"
              f" (seed {args.seed}" + (f"; logs in {state})" if args.keep else ")"), flush=True)
        return 1 if checker.violations else 0
    finally:
        remove_rules()
        for s in instances.values():
            s.proc.stop()
        redis.stop()
        if not args.keep:
            import shutil
            shutil.rmtree(state, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--mode", choices=["sentinel", "cluster"], default="sentinel",
                    help="the Redis behind A, B and C: Sentinel (master, replica, three "
                         "sentinels) or a Cluster (three masters, a replica each)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--rate", type=float, default=1.0, help="load multiplier")
    ap.add_argument("--slack", type=float, default=0.3,
                    help="seconds taken off every window for the jitter between a decision "
                         "and the upstream's receipt")
    ap.add_argument("--log-slack", type=float, default=0.05,
                    help="the same for the exact logs, which count the lateness bound")
    ap.add_argument("--client-timeout", type=float, default=15.0)
    ap.add_argument("--history", help="write the whole history as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the state directory (logs)")
    ap.add_argument("--seed-bug", choices=["split-prefix", "local-for-deny",
                                           "concurrent-plus-one"],
                    help="run a policy the checker must fail (to check the checker)")
    args = ap.parse_args()
    global SEED_BUG
    SEED_BUG = args.seed_bug
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    # SIGTERM stops the run like Ctrl-C: every process started is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
