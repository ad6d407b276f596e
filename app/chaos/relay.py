"""``python -m app.chaos.relay --netns NAME --port PORT [--port PORT …]``: the generators' only
way to the broker.

Listens on 127.0.0.1:PORT *inside* network namespace NAME and relays each connection to
127.0.0.1:PORT outside it, where the broker listens; one such port per broker node (the
embedded broker has one, three Apache Kafka nodes three). Each node advertises
127.0.0.1:PORT, which inside the namespace is this relay, so every Kafka connection of a
process in the namespace passes through it, and a partition of the namespace's loopback
(``app.chaos.netns``) cuts them all. The listening socket is made after ``setns(2)`` into the
namespace; the process itself (and every upstream socket) stays in the root namespace.
Prints ``ready`` once listening. Started and killed by pid by ``app.chaos.netns``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def listen_in(netns: str, port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` in namespace ``netns``."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        _setns(there)
        try:
            return socket.create_server(("127.0.0.1", port), backlog=64)
        finally:
            _setns(home)
    finally:
        os.close(home)
        os.close(there)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:  # the broker is down (a restart): the client reconnects
        client.close()
        return
    upstream.settimeout(None)
    threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
    _pump(upstream, client)
    client.close()
    upstream.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--netns", required=True)
    ap.add_argument("--port", type=int, action="append", required=True)
    args = ap.parse_args()
    servers = [(listen_in(args.netns, port), port) for port in args.port]
    for server, port in servers[1:]:
        threading.Thread(target=_accept, args=(server, port), daemon=True).start()
    print("ready", flush=True)
    _accept(*servers[0])


def _accept(server: socket.socket, port: int) -> None:
    while True:
        client, _ = server.accept()
        threading.Thread(target=_serve, args=(client, port), daemon=True).start()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(0)
