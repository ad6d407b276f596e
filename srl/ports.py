"""Loopback ports: a free one to listen on, whether one answers. No imports beyond the
standard library, so that a command's ``--help`` can reach them without a Kafka client."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that can all be bound at 127.0.0.1 now, below the
    kernel's ephemeral range: an Apache Kafka node given ``--port P`` takes P + 1 for its
    controller, and a P + 1 inside the ephemeral range may be any outgoing connection's source
    port by the time the node binds it ("Address already in use": a flaky test)."""
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(10_000, low - n)
        if all(bindable(base + i) for i in range(n)):
            return base
    raise OSError(f"no {n} consecutive free ports found below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def bindable(port: int) -> bool:
    """Whether a listener could bind ``port`` at 127.0.0.1 now, as a JVM's server socket does
    (``SO_REUSEADDR``: a connection of a stopped server in TIME_WAIT does not count): nothing
    listens there and no live connection holds it as its source port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0
