"""Running model-written code: a subprocess in its own network and PID namespaces, with limits.

Owns what the code reward (``consumers.coderewards``) may let a program do. What must hold,
whatever the program does:

* **no network**: a network namespace of its own (``consumers.sandboxinit``); where one cannot
  be made the run is refused with the reason (``SandboxRefused``), never run without it;
* **bounded**: CPU seconds (``RLIMIT_CPU``, a SIGKILL), wall time (the whole process group
  killed), address space (``RLIMIT_AS``: a 10 GB allocation is a ``MemoryError``), file size,
  processes (``RLIMIT_NPROC``, binding in a user namespace even for root: a fork bomb stops at
  the limit), open files, and output (stdout past ``output_bytes`` kills the run);
* **nothing left behind**: the program is PID 1 of its PID namespace, so its exit (or its kill)
  ends every process it started; its working directory is a fresh empty one, removed after;
* the caller's environment is not passed on (``python -I -S``, ``PATH`` only).

Called by ``consumers.coderewards`` inside a reward process (``consumers.rewardpool``), whose
own timeout bounds the call as a whole. Linux only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from consumers.sandboxinit import REFUSED, pids_base, sandbox_cgroup
from srl.errors import SrlError


class SandboxRefused(SrlError):
    """The sandbox cannot be made here (no namespaces): model code is not run."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 32
    output_bytes: int = 1 << 20


@dataclass
class Run:
    """What a sandboxed program did."""

    status: int  # its exit status; 128 + n: killed by signal n
    stdout: bytes
    stderr: bytes
    killed: str | None = None  # why srl killed it: "wall time", "output"
    seconds: float = 0.0
    files: dict[str, int] = field(default_factory=dict)


def run(files: dict[str, str], program: str, limits: Limits | None = None) -> Run:
    """Run ``python -I -S program`` in a fresh directory holding ``files`` (name → text)."""
    if sys.platform != "linux":
        raise SandboxRefused("the code sandbox needs Linux namespaces")
    limits = limits or Limits()
    workdir = tempfile.mkdtemp(prefix="srl-sandbox-")
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        out = _run(workdir, program, limits)
        if out.status == REFUSED and out.stderr.startswith(b"sandbox refused"):
            raise SandboxRefused(out.stderr.decode(errors="replace").strip())
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(workdir: str, program: str, limits: Limits) -> Run:
    spec = {
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_bytes,
        "file_bytes": limits.file_bytes,
        "processes": limits.processes,
    }
    argv = [sys.executable, "-m", "consumers.sandboxinit", json.dumps(spec), workdir, program]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # one process group: killed whole
    )
    out, err, killed = _drain(proc, limits, t0 + limits.wall_s)
    if killed:
        _kill(proc)
    status = proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()  # type: ignore[union-attr]
    status = 128 - status if status < 0 else status  # a signal to the launcher itself
    _remove_cgroup(sandbox_cgroup(proc.pid))
    return Run(status, out, err, killed, time.monotonic() - t0)


def _remove_cgroup(path: str | None, wait_s: float = 5.0) -> None:
    """A run's pids cgroup (a root caller's), once its processes are gone (the kernel ends
    them with PID 1 of their namespace, asynchronously); and any such directory an earlier,
    killed reward process left empty."""
    if path is None or not os.path.isdir(path):
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
    base = pids_base()
    for name in os.listdir(base) if base else []:
        if name.startswith("srl-sandbox-") and not os.path.exists(f"/proc/{name[12:]}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(base, name))  # type: ignore[arg-type]


def _drain(
    proc: subprocess.Popen[bytes], limits: Limits, deadline: float
) -> tuple[bytes, bytes, str | None]:
    """Read stdout (capped) and stderr (capped) until both close, the deadline, or the cap."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
    out_fd = proc.stdout.fileno()  # type: ignore[union-attr]
    open_fds = set(streams)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(streams[out_fd]), bytes(_other(streams, out_fd)), "wall time"
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if not data:
                open_fds.discard(fd)
                continue
            buf = streams[fd]
            if len(buf) < limits.output_bytes:
                buf += data[: limits.output_bytes - len(buf)]
            if fd == out_fd and len(buf) >= limits.output_bytes:
                return bytes(buf), bytes(_other(streams, out_fd)), "output"
    return bytes(streams[out_fd]), bytes(_other(streams, out_fd)), None


def _other(streams: dict[int, bytearray], fd: int) -> bytearray:
    return next(b for f, b in streams.items() if f != fd)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """The launcher's process group: the launcher and the program (PID 1 of its namespace,
    whose end ends everything in it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
