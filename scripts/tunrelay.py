#!/usr/bin/env python3
"""A link with delay and loss, for tests and benches of Redis across a network (this kernel
has no `tc netem`): copies IP packets between two TUN devices, each after DELAY_MS, dropping
each with probability LOSS (a seeded random generator, so a run can be repeated).

    tunrelay.py TUN_A TUN_B DELAY_MS LOSS [SEED]

Attaches to both devices (which must exist: `ip tuntap add mode tun name ...`), prints
`ready`, then relays until killed. The caller may then move one device into another network
namespace: the attachment follows it. Python's own wake-ups add about 0.6 ms to each packet's
delay on the 2-core test machine: tests measure the round trip they got and say it.
"""

import fcntl
import heapq
import os
import random
import selectors
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def attach(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main() -> None:
    a, b = attach(sys.argv[1]), attach(sys.argv[2])
    delay = float(sys.argv[3]) / 1000.0
    loss = float(sys.argv[4])
    rng = random.Random(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(a, selectors.EVENT_READ, b)
    selector.register(b, selectors.EVENT_READ, a)
    due: list[tuple[float, int, int, bytes]] = []
    sequence = 0
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, target, packet = heapq.heappop(due)
            try:
                os.write(target, packet)
            except OSError:
                pass  # the device went down: the packet is lost, as on a wire
        timeout = max(0.0, due[0][0] - now) if due else 1.0
        for key, _ in selector.select(timeout):
            while True:
                try:
                    packet = os.read(key.fd, 65536)
                except BlockingIOError:
                    break
                if rng.random() < loss:
                    continue
                sequence += 1
                heapq.heappush(due, (time.monotonic() + delay, sequence, key.data, packet))


if __name__ == "__main__":
    main()
