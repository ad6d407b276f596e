"""Ports for the servers the project starts (``srl.ports``): what a JVM's listener could bind."""

from __future__ import annotations

import socket
from pathlib import Path

from srl.ports import bindable, free_ports


def test_a_port_held_by_a_listener_or_by_a_live_connection_is_not_bindable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not bindable(port)
        with socket.create_connection(("127.0.0.1", port)) as client:
            # an outgoing connection's source port: what "Address already in use" hit when a
            # Kafka node's controller took --port + 1 inside the ephemeral range
            assert not bindable(client.getsockname()[1])


def test_free_ports_are_consecutive_bindable_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = free_ports(2)
    assert base >= 10_000 and base + 1 < low
    assert bindable(base) and bindable(base + 1)
