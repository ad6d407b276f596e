"""What both brokers' lifecycles share: loopback ports, a broker process in its own session,
signalled only while its command line is still the broker's, and the last line of its log.

Used by ``srl.broker.embedded`` and ``srl.broker.apache``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

# Brokers started by this process, kept referenced so they are reaped (not warned about).
_children: dict[int, subprocess.Popen[bytes]] = {}


def alive(pid: int, marker: bytes) -> bool:
    """Whether ``pid`` runs (not a zombie) and its command line contains ``marker``: a pid
    recycled by another program is never taken for the broker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    return marker in cmdline and stat[0] != "Z"


def spawn(cmd: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Start ``cmd`` in its own session, stdout and stderr appended to ``log_path``."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=cwd,
            env=env,
        )
    _children[proc.pid] = proc
    return proc.pid


def owned(pid: int) -> bool:
    """Whether this process started ``pid`` (and has not reaped it yet)."""
    return pid in _children


def exit_code(pid: int) -> int | None:
    """The exit code of a broker this process started, once it has exited; else None."""
    proc = _children.get(pid)
    return None if proc is None else proc.poll()


def signal_pid(pid: int, sig: int, marker: bytes) -> bool:
    """Send ``sig`` to ``pid`` if it is still the broker; False if it was not."""
    if not alive(pid, marker):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    return True


def kill(pids: list[int], marker: bytes, grace_s: float = 10.0) -> None:
    """SIGTERM every one of ``pids`` that is still the broker, wait up to ``grace_s`` for all,
    then SIGKILL what is left (a Kafka node that lost its quorum can hang in its controlled
    shutdown)."""
    live = [p for p in pids if signal_pid(p, signal.SIGTERM, marker)]
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        for p in live:
            reap(p)
        live = [p for p in live if alive(p, marker)]
        if live:
            time.sleep(0.05)
    for p in live:
        signal_pid(p, signal.SIGKILL, marker)
    for p in pids:
        wait_gone(p, marker)


def wait_gone(pid: int, marker: bytes, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reap(pid)
        if not alive(pid, marker):
            # a child of ours is a zombie until waited for (alive() already says no)
            proc = _children.pop(pid, None)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
            return
        time.sleep(0.02)


def reap(pid: int) -> None:
    proc = _children.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            _children.pop(pid, None)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def last_line(log_path: Path, skip: tuple[str, ...] = ()) -> str:
    """The last non-empty line of a broker's log (what it said before it died), one line."""
    try:
        lines = [
            ln
            for ln in log_path.read_text(errors="replace").splitlines()
            if ln.strip() and not any(s in ln for s in skip)
        ]
    except OSError:
        return "no log"
    return lines[-1].strip()[:300] if lines else "no output"
