#!/usr/bin/env python3
"""Where a proxy's CPU goes, by kind of work: reads a `perf record -e cpu-clock` profile of one
process and sums its samples' self time into classes (kernel, hyper, sluice's own code,
copies, the allocator, ...), then shares out a CPU-per-request figure measured without perf
in the same proportions.

    perf record -e cpu-clock -F 4000 -p PID -o plain.data -- sleep 10   # while wrk runs
    python3 bench/profile_groups.py plain.data 23.0                     # 23.0 µs per request

Not part of run.sh: bench/RESULTS.md's issue-29 profile tables were made with it. A symbol
falls in the first class whose pattern matches "DSO SYMBOL"; the order of CLASSES matters
(hyper's client role before hyper in general, tokio's timers and sync before the runtime).
"""

import re
import subprocess
import sys

CLASSES = [
    ("kernel", r"^\[kernel"),
    ("copies (memmove/memcpy: moved futures, buffers)", r"memmove|memcpy|memset"),
    ("allocator (malloc/free)", r"malloc|_int_free|unlink_chunk|cfree|\bfree\b|realloc|consolidate|tcache"),
    ("hyper client role (upstream side)", r"role::Client|hyper::client|client::conn|dispatch::Client|want::|dispatch::Receiver|dispatch::Sender"),
    ("hyper server, dispatch and HTTP/1 codec", r"hyper::|httparse|hyper_util"),
    ("http's HeaderMap, Uri, Request", r"http::header|http::uri|http::request|http::response|http::extensions"),
    ("tokio timers", r"tokio::time|Sleep|TimerEntry"),
    ("tokio sync (mpsc, oneshot, Notify, watch, AtomicWaker)", r"tokio::sync"),
    ("tokio runtime and I/O driver", r"tokio::|mio::"),
    ("the proxy's own code", r"sluice::|sluice_floor::"),
    ("futures combinators", r"futures_util|futures_core|core::future"),
    ("libc syscall wrappers", r"writev|__libc_recv|epoll|__libc_send"),
    ("bytes", r"bytes::"),
    ("clock reads (vDSO)", r"\[vdso\]"),
]


def groups(data: str) -> dict[str, float]:
    out = subprocess.run(
        ["perf", "report", "-i", data, "--no-children", "--stdio", "--sort", "dso,symbol",
         "-g", "none", "--percent-limit", "0"],
        capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*?)\s*$", line)
        if not m:
            continue
        pct, dso, sym = float(m[1]), m[2], m[4]
        key = f"{dso} {sym}"
        name = next((n for n, rx in CLASSES if re.search(rx, key)), f"other ({dso})")
        shares[name] = shares.get(name, 0.0) + pct
    return shares


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data, per_request = sys.argv[1], float(sys.argv[2])
    shares = groups(data)
    total = sum(shares.values())
    for name, pct in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"{name:56s} {100 * pct / total:6.2f} %  {pct / total * per_request:6.2f} µs")


if __name__ == "__main__":
    main()
