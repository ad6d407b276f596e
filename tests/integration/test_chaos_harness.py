"""The chaos suite's harness on the real broker: the topic watch reads what arrives, also after
it paused caught-up partitions; the generators' namespace reaches the broker only through its
relay, and a partition cuts it off until it heals; the full-disk store."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.chaos.audit import Recorded, audit_run
from app.chaos.netns import FullDisk, GenNamespace
from app.chaos.watch import Watch
from schemas.records import MetricEvent, PromptTask, encode
from srl.config import CommonConfig
from srl.kafka import Producer, create_topics
from srl.metrics import dead_letter
from srl.topics import Layout
from tests.chunks import produce, traj_chunks
from tests.conftest import embedded_broker_in_use


def wait(pred, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_watch_sees_records_written_before_and_after_it_caught_up(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    done = traj_chunks("p0", 0, 2, [1, 2], list(range(20)), chunk_tokens=16, worker_id="w0")
    late = traj_chunks("p0", 1, 2, [1, 2], list(range(40)), chunk_tokens=16, worker_id="w1")
    produce(cfg, [*done, *late[:2]])  # the second trajectory is still open
    with Producer(cfg) as p:
        p.produce(layout.metrics, encode(MetricEvent("train_step", "trainer-0", cfg.run, step=1)))
    watch = Watch(cfg)
    watch.start()
    try:
        assert wait(lambda: watch.last_step() == 1 and len(watch.seen.open) == 1)
        with watch.lock:
            assert watch.open_on(["w1"]) == {late[0].trajectory_id}
            assert watch.open_on(["w0"]) == set()
        time.sleep(1.5)  # every partition read to its end: paused, probed
        produce(cfg, late[2:])
        with Producer(cfg) as p:
            p.produce(
                layout.prompts("le256"), encode(PromptTask("t", "p9", "x", 1, 8, "le256", step=7))
            )
            event = MetricEvent("train_step", "trainer-0", cfg.run, step=2)
            p.produce(layout.metrics, encode(event))
            dead_letter(p, layout, b"junk", None, "bad", f"{layout.trajectories}/0@5")
        assert wait(lambda: watch.last_step() == 2 and 7 in watch.seen.released)
        assert wait(lambda: bool(watch.seen.dlq))
        with watch.lock:
            assert watch.finished({done[0].trajectory_id, late[0].trajectory_id}) is not None
            assert watch.seen.dlq[f"{layout.trajectories}/0@5"][0][1] == "bad"
    finally:
        watch.stop()
    assert watch.error is None


def test_the_audit_gathered_as_records_arrive_is_the_one_read_back(cfg: CommonConfig) -> None:
    """The soak's data topics have a retention, so its audit is gathered by the watch as the
    records arrive (``Recorded``); ``catch_up`` waits for what was written last."""
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    a = traj_chunks("p0", 0, 2, [1, 2], list(range(20)), chunk_tokens=16, worker_id="w0")
    b = traj_chunks("p0", 1, 2, [1, 2], list(range(9)), chunk_tokens=16, worker_id="w1")

    def trained(tid: str, step: int) -> MetricEvent:
        labels = {"trajectory_id": tid, "outcome": "trained"}
        return MetricEvent("sample", "trainer-0", cfg.run, {"staleness": 1}, labels, step)

    task = PromptTask("t0", "p0", "x", 2, 8, "le256", step=1)
    with Producer(cfg) as p:
        p.produce(layout.prompts("le256"), encode(task))
    produce(cfg, a)
    watch = Watch(cfg, Recorded())
    watch.start()
    try:
        assert wait(lambda: watch.recorded is not None and watch.recorded.asked)
        produce(cfg, b)  # written after the watch caught up once
        with Producer(cfg) as p:
            for e in (trained(a[0].trajectory_id, 1), trained(b[0].trajectory_id, 1)):
                p.produce(layout.metrics, encode(e))
            step = MetricEvent("train_step", "trainer-0", cfg.run, step=1)
            p.produce(layout.metrics, encode(step))
        assert watch.catch_up(30)
        live = audit_run(cfg, finished=True, recorded=watch.recorded)
    finally:
        watch.stop()
    assert live == audit_run(cfg, finished=True)  # read back: every record is still there
    assert (live.asked, live.generated, live.trained, live.lost, live.steps) == (2, 2, 2, 0, 1)
    assert live.max_staleness == 1


def _answers(ns: GenNamespace, bootstrap: str) -> bool:
    """Whether a Kafka client inside the namespace gets metadata from ``bootstrap``."""
    code = (
        "import sys; from srl.kafka import broker_answers; "
        f"sys.exit(0 if broker_answers('{bootstrap}', 3.0) else 1)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    out = subprocess.run([*ns.prefix(), sys.executable, "-c", code], env=env, timeout=60)
    return out.returncode == 0


@pytest.mark.skipif(not embedded_broker_in_use(), reason="the relay joins a loopback broker")
def test_partition_cuts_the_namespace_off_until_it_heals(bootstrap: str, tmp_path: Path) -> None:
    why = GenNamespace.unavailable()
    if why is not None:
        pytest.skip(why)
    port = int(bootstrap.rsplit(":", 1)[1])
    ns = GenNamespace(port, tmp_path / "relay.log").up()
    try:
        assert _answers(ns, bootstrap)
        ns.partition()
        assert not _answers(ns, bootstrap)
        ns.heal()
        assert _answers(ns, bootstrap)
    finally:
        ns.down()
    assert subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True).returncode != 0


def test_full_disk_refuses_writes_until_freed(tmp_path: Path) -> None:
    why = FullDisk.unavailable(tmp_path)
    if why is not None:
        pytest.skip(why)
    disk = FullDisk(tmp_path / "store", 8).mount()
    try:
        assert disk.fill() > 4 * 1024 * 1024
        with pytest.raises(OSError, match="No space left"):
            (disk.path / "x").write_bytes(b"0" * 1024 * 1024)
        disk.free()
        (disk.path / "x").write_bytes(b"0" * 1024 * 1024)
    finally:
        disk.unmount()
