"""The generators' network namespace, and the two kernel-level faults of the suite's runs.

:class:`GenNamespace`: a network namespace with only its loopback, joined to the broker's
ports by the relay (``app.chaos.relay``). Processes started with :meth:`GenNamespace.prefix` reach
Kafka only through it. :meth:`partition` makes the namespace's loopback drop every packet (a
token-bucket qdisc whose bucket is smaller than any TCP segment: neither data, ACKs nor SYNs
pass), so connections see silence, not resets, as across a real partition; :meth:`heal`
removes it. This is the cross-datacenter harness's idea (tests/netns.py) reduced to what a
partition needs; nothing is set up in the root namespace.

:class:`FullDisk`: a size-limited tmpfs for the object store, and :meth:`FullDisk.fill` that
leaves almost no space in it (ENOSPC for the next write) until :meth:`FullDisk.free`.

``unavailable()`` of each says why it cannot run here (not root, no ``ip``/``tc``, namespaces
or mounts refused), or None; the row of a fault that needs it then says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

# every packet over 64 bytes dropped, and the bucket refills at one byte per second
DROP_ALL = ["tbf", "rate", "8bit", "burst", "64", "mtu", "64", "limit", "1"]


def _sh(*args: str) -> None:
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip() or out.returncode}")


class GenNamespace:
    """See the module docstring. ``up`` before use, ``down`` always."""

    def __init__(self, ports: list[int], log_path: Path) -> None:
        self.ports, self.log_path = ports, log_path
        self.name = f"srl-chaos-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.relay: subprocess.Popen[bytes] | None = None
        self.partitioned = False

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (ip, tc) is not installed"
        probe = GenNamespace([], Path(os.devnull))
        try:
            _sh("ip", "netns", "add", probe.name)
            probe.partition()
        except RuntimeError as e:
            return f"cannot build a partitionable namespace here: {e}"
        finally:
            subprocess.run(["ip", "netns", "del", probe.name], capture_output=True)
        return None

    def up(self) -> GenNamespace:
        _sh("ip", "netns", "add", self.name)
        try:
            _sh("ip", "-n", self.name, "link", "set", "lo", "up")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "app.chaos.relay", "--netns", self.name]
            with self.log_path.open("ab") as log:
                self.relay = subprocess.Popen(
                    [*argv, *(a for p in self.ports for a in ("--port", str(p)))],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    start_new_session=True,
                )
            assert self.relay.stdout is not None
            if self.relay.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the relay did not start (see {self.log_path})")
        except BaseException:
            self.down()
            raise
        return self

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def partition(self) -> None:
        qdisc = ["tc", "qdisc", "add", "dev", "lo", "root", *DROP_ALL]
        _sh("ip", "netns", "exec", self.name, *qdisc)
        self.partitioned = True

    def heal(self) -> None:
        if self.partitioned:
            _sh("ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", "lo", "root")
            self.partitioned = False

    def down(self) -> None:
        if self.relay is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.relay.pid, signal.SIGKILL)
            self.relay.wait(10)
            if self.relay.stdout is not None:
                self.relay.stdout.close()
            self.relay = None
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class FullDisk:
    """A tmpfs of ``size_mb`` at ``path`` for the object store; ``fill`` / ``free`` it."""

    FILLER = ".chaos-filler"
    PIECE = 16 * 1024 * 1024  # the filler grows by at most this much at a time
    MIN_PIECE = 4096  # ENOSPC for a piece this small: the disk is full

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb = path, size_mb
        self.mounted = False

    @staticmethod
    def unavailable(where: Path) -> str | None:
        if os.geteuid() != 0:
            return "mounting a size-limited tmpfs needs root"
        probe = where / f".chaos-mount-probe-{uuid.uuid4().hex[:6]}"
        probe.mkdir(parents=True)
        try:
            _sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
            _sh("umount", str(probe))
        except RuntimeError as e:
            return f"cannot mount a tmpfs here: {e}"
        finally:
            probe.rmdir()
        return None

    def mount(self) -> FullDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        _sh("mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path))
        self.mounted = True
        return self

    def fill(self, leave_bytes: int = 64 * 1024) -> int:
        """Take all but about ``leave_bytes`` of the free space; the bytes taken.

        The store's writers go on meanwhile (a checkpoint, a publish), so the space can shrink
        between ``statvfs`` and the allocation: ENOSPC is the goal reached, not a failure. The
        filler grows by pieces of at most :attr:`PIECE` bytes (a tmpfs gives back all of a
        ``fallocate`` that fails, so one piece for everything could end with nothing taken);
        a piece refused with ENOSPC is tried again halved, down to :attr:`MIN_PIECE`, so what
        is left free is about ``leave_bytes``, or less than ``2 * MIN_PIECE`` after ENOSPC."""
        st = os.statvfs(self.path)
        want = max(0, st.f_bavail * st.f_frsize - leave_bytes)
        taken, piece = 0, self.PIECE
        fd = os.open(self.path / self.FILLER, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while taken < want and piece >= self.MIN_PIECE:
                n = min(piece, want - taken)
                try:
                    os.posix_fallocate(fd, taken, n)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    piece = n // 2  # full, or all but less than n: take what is left
                    continue
                taken += n
        finally:
            os.close(fd)
        return taken

    def free(self) -> None:
        (self.path / self.FILLER).unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False
