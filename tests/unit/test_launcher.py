"""A trainer rank whose launcher ended before the rank asked to die with it ends itself
(``consumers.distributed.die_with_launcher``), instead of joining the next launcher's
rendezvous: real processes, a launcher SIGKILLed while its rank is still starting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumers.distributed import is_launcher

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="prctl and /proc are Linux's")

# the rank: waits (its imports), then asks to die with its launcher, then would go on
RANK = """
import sys, time
from pathlib import Path
time.sleep(float(sys.argv[1]))
from consumers.distributed import die_with_launcher
die_with_launcher()
Path(sys.argv[2]).write_text("went on")
time.sleep(30)
"""
# the launcher: named like torchrun in its argv; starts the rank and prints its pid
LAUNCHER = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True)
print(p.pid, flush=True)
time.sleep(60)
"""


def _launch(tmp_path: Path, wait_s: float) -> tuple[subprocess.Popen[str], int, Path]:
    marker = tmp_path / "went-on"
    env = os.environ | {"TORCHELASTIC_RUN_ID": "test", "RANK": "1"}
    argv = [sys.executable, "-c", LAUNCHER, RANK, str(wait_s), str(marker), "torchrun"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert launcher.stdout is not None
    with launcher.stdout:
        return launcher, int(launcher.stdout.readline()), marker


def _ended(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # ended, not yet reaped by its new parent
            return True
        time.sleep(0.05)
    return False


def test_a_rank_whose_launcher_died_before_it_asked_ends_itself(tmp_path: Path) -> None:
    launcher, rank, marker = _launch(tmp_path, wait_s=1.5)
    try:
        launcher.kill()  # before the rank asks: no parent-death signal will ever come
        launcher.wait()
        assert _ended(rank, within_s=20), "the orphaned rank went on"
        assert not marker.exists()
    finally:
        with_kill(rank)


def test_a_rank_dies_with_a_launcher_killed_after_it_asked(tmp_path: Path) -> None:
    launcher, rank, marker = _launch(tmp_path, wait_s=0)
    try:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the rank did not go on under its live launcher"
        launcher.kill()
        launcher.wait()
        assert _ended(rank, within_s=10), "the rank outlived its launcher"
    finally:
        with_kill(rank)
        launcher.kill()


def exec_done(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` shows its own argv: Popen returns once the exec has closed the child's
    close-on-exec pipe, before the kernel has set up the new argument pages, so a read of
    /proc/PID/cmdline just then finds no arguments yet."""
    deadline = time.monotonic() + timeout_s
    while b"sleep(30)" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} never showed its arguments"
        time.sleep(0.01)


def test_what_counts_as_a_launcher() -> None:
    assert not is_launcher(os.getpid())  # pytest
    assert not is_launcher(1 << 30)  # no such process
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torchrun"])
    q = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torch.x"])
    try:
        for x in (p, q):
            exec_done(x.pid)
        assert is_launcher(p.pid)
        assert not is_launcher(q.pid)
    finally:
        for x in (p, q):
            x.kill()
            x.wait()


def with_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
