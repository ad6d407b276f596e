"""SIGKILL the real ``srl ranker train --online`` and restart it: it takes its partitions back
and publishes again (found by ``srl chaos``, ranker-kill: on the embedded broker, which never
evicts a SIGKILLed member, a restarted ranker joined next to its dead predecessor and was
never assigned anything)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ranker.publish import versions
from schemas.records import encode
from srl.config import CommonConfig
from srl.kafka import Producer, create_topics
from srl.stores import open_store
from srl.topics import Layout
from tests.conftest import bin_path
from tests.integration.test_ranker_online import _trajectory


def write_pairs(cfg: CommonConfig, first: int, count: int) -> None:
    layout = Layout.from_config(cfg)
    with Producer(cfg, "test") as p:
        for i in range(first, first + count):
            for c in _trajectory(i, 1 + i % 60, layout):
                part = layout.partition_for(c.bucket, c.trajectory_id)
                p.produce(layout.trajectories, encode(c), key=c.trajectory_id, partition=part)


def ranker(cli_env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    args = ["ranker", "train", "--online", "--retrain-every", "60", "--min-pairs", "60"]
    args += ["--epochs", "3", "--hidden", "8"]
    with log.open("ab") as out:
        return subprocess.Popen(
            [bin_path("srl"), *args], env=cli_env, stdout=out, stderr=subprocess.STDOUT
        )


def wait_for(pred, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_sigkilled_ranker_restarts_and_publishes_again(
    cli_env: dict[str, str], bootstrap: str, prefix: str, tmp_path: Path
) -> None:
    cfg = CommonConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, store=cli_env["SRL_STORE"])
    create_topics(cfg)
    store = open_store(cli_env["SRL_STORE"])
    log = tmp_path / "ranker.log"
    write_pairs(cfg, 0, 130)
    procs = [ranker(cli_env, log)]
    try:
        assert wait_for(lambda: len(versions(store, "default")) >= 2, 120), log.read_text()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        before = len(versions(store, "default"))
        write_pairs(cfg, 130, 130)
        procs.append(ranker(cli_env, log))
        assert wait_for(lambda: len(versions(store, "default")) > before, 90), log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
