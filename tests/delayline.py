"""A packet delay line on a TUN device: every IP packet the kernel routes into the device comes
back out of it ``--delay-ms`` later, in order. The long-link emulator of the datacenter harness.

Why not ``tc qdisc … netem delay``: this machine's kernel is built without sch_netem (and
without fq, so no EDT pacing either), so the delay is applied in user space. The harness
routes traffic between datacenter namespaces through the device with policy routing
(``ip rule … iif LINK lookup TABLE``, whose default route is the TUN device); a packet written
back has the TUN device as its input interface, so the main table forwards it to its
destination. Bandwidth is capped separately by ``tbf`` on the links.

Run inside the router namespace: ``python -m tests.delayline --dev NAME --delay-ms 50``. It
attaches to an existing persistent TUN device and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd: int, delay_s: float) -> None:
    queue: deque[tuple[float, bytes]] = deque()  # (due time, packet); one delay keeps it sorted
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stop:
        now = time.monotonic()
        wait = min(0.5, max(0.0, queue[0][0] - now)) if queue else 0.5
        try:
            ready, _, _ = select.select([fd], [], [], wait)
        except InterruptedError:
            continue
        if ready:
            arrived = time.monotonic()
            for _ in range(256):  # drain what is there, then serve the queue
                try:
                    queue.append((arrived + delay_s, os.read(fd, 65535)))
                except BlockingIOError:
                    break
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            # a packet the kernel will not take (unroutable) is dropped, as on a real link
            with contextlib.suppress(OSError):
                os.write(fd, queue.popleft()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", required=True, help="existing persistent TUN device")
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay per packet")
    args = ap.parse_args()
    fd = open_tun(args.dev)
    print(f"delay line on {args.dev}: {args.delay_ms:g} ms", file=sys.stderr, flush=True)
    try:
        run(fd, args.delay_ms / 1000)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
