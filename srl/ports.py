"""Loopback ports: a free one to listen on, whether one answers. No imports beyond the
standard library, so that a command's ``--help`` can reach them without a Kafka client."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0
