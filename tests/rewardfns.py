"""Reward functions for the tests of reward processes (``consumers.rewardpool``): importable by
the processes the trainer starts, light to import."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


def by_metadata(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """What ``metadata`` asks for: sleep ``sleep`` s, wait for the file ``wait_for``, print to
    stdout, exit the process with ``exit``, crash it with ``segfault``; then the reward
    ``reward`` (default: the completion's length)."""
    if metadata.get("segfault"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if "exit" in metadata:
        os._exit(int(metadata["exit"]))
    if "print" in metadata:
        print(metadata["print"], flush=True)  # a reward that talks on stdout
    time.sleep(float(metadata.get("sleep", 0)))
    if "wait_for" in metadata:
        deadline = time.monotonic() + 120
        while not Path(metadata["wait_for"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return float(metadata.get("reward", len(completion)))
