"""The broker processes srl starts (``srl.broker.process``): a node SIGKILLed and waited for
leaves no zombie behind (``srl chaos`` kills and restarts Kafka nodes many times in one run)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from srl.broker import process


def test_a_killed_child_is_waited_for(tmp_path: Path) -> None:
    """A dying process's command line empties before it can be reaped: ``alive`` says no
    while ``poll`` cannot reap it yet (a race: several tries)."""
    marker = f"srl-test-{tmp_path.name}"
    code = f"import time; time.sleep(60)  # {marker}"
    pids = [process.spawn([sys.executable, "-c", code], tmp_path / "log", tmp_path)]
    pids += [process.spawn([sys.executable, "-c", code], tmp_path / "log", tmp_path)]
    pids += [process.spawn([sys.executable, "-c", code], tmp_path / "log", tmp_path)]
    for pid in pids:
        deadline = time.monotonic() + 10  # until it has exec'd python
        while not process.alive(pid, marker.encode()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.alive(pid, marker.encode()) and process.owned(pid)
    for pid in pids:
        assert process.signal_pid(pid, signal.SIGKILL, marker.encode())
        process.wait_gone(pid, marker.encode())
    zombies = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert zombies == [], "left behind, unreaped"
    assert not any(process.owned(pid) for pid in pids)
