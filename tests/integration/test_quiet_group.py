"""A group member stops fetching the partitions it has read to their end (``srl.kafka.quiet``),
on the embedded broker, which answers a fetch at the end of a partition at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from srl.broker import embedded as broker
from srl.broker import free_port
from srl.config import CommonConfig, load_config
from srl.errors import SrlError
from srl.kafka import (
    Consumer,
    KafkaException,
    Producer,
    TopicPartition,
    create_topics,
    make_consumer,
)
from srl.topics import TopicSpec

# the embedded broker's tier (tests/conftest.py): quiet members are its workaround (srl.kafka.quiet)
pytestmark = pytest.mark.embedded


class Fetches:
    """Fetch requests the client sent, from librdkafka's statistics (every 100 ms)."""

    def __init__(self) -> None:
        self.sent = 0

    def stats(self, raw: str) -> None:
        brokers = json.loads(raw).get("brokers", {}).values()
        self.sent = sum(b.get("req", {}).get("Fetch", 0) for b in brokers)

    def during(self, consumer: Consumer, seconds: float) -> int:
        """Fetches sent while ``consumer`` polls for ``seconds`` (nothing may arrive)."""
        consumer.poll(0.3)  # a statistics report after what came before
        before, end = self.sent, time.monotonic() + seconds
        while time.monotonic() < end:
            assert consumer.poll(0.1) is None
        consumer.poll(0.3)
        return self.sent - before


def member(cfg: CommonConfig, topic: str, fetches: Fetches, **kw: Any) -> Consumer:
    c = make_consumer(
        cfg,
        f"{topic}-group",
        "quiet-test",
        **kw,
        **{"statistics.interval.ms": 100},
        stats_cb=fetches.stats,
    )
    c.subscribe([topic])
    return c


def take(c: Consumer, n: int, timeout_s: float = 20.0) -> list[tuple[int, int, bytes]]:
    got: list[tuple[int, int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        for m in c.next_batch(100, 0.2):
            if m.error() is None:
                got.append((m.partition() or 0, m.offset() or 0, m.value() or b""))
    return got


@pytest.mark.parametrize("quiet", [True, False])
def test_a_caught_up_member_stops_fetching_and_reads_every_record_once(
    cfg: CommonConfig, quiet: bool
) -> None:
    topic = f"{cfg.topic_prefix}.quiet-{quiet}"
    create_topics(cfg, [TopicSpec(topic, 3, {})])
    with Producer(cfg, "test") as p:  # partition 2 stays empty
        for i in range(6):
            p.produce(topic, f"a{i}".encode(), key=b"k", partition=i % 2)
    fetches = Fetches()
    c = member(cfg, topic, fetches, **({} if quiet else {"quiet_s": None}))
    try:
        first = take(c, 6)
        idle = fetches.during(c, 1.5)
        if not quiet:  # what it saves: every partition fetched again at once, empty
            assert idle > 100
            return
        assert idle <= 5, f"{idle} fetches while caught up"
        with Producer(cfg, "test") as p:  # records to every partition, the empty one too
            for i in range(9):
                p.produce(topic, f"b{i}".encode(), key=b"k", partition=i % 3)
                p.flush()
        later = take(c, 9)
    finally:
        c.close()
    assert sorted(v for _p, _o, v in first) == sorted(f"a{i}".encode() for i in range(6))
    assert sorted(v for _p, _o, v in later) == sorted(f"b{i}".encode() for i in range(9))
    for part in range(3):  # in offset order, none skipped
        offsets = [o for p, o, _v in first + later if p == part]
        assert offsets == list(range(len(offsets)))


def test_a_partition_the_member_paused_itself_stays_paused(cfg: CommonConfig) -> None:
    topic = f"{cfg.topic_prefix}.quiet-held"
    create_topics(cfg, [TopicSpec(topic, 2, {})])
    fetches = Fetches()
    c = member(cfg, topic, fetches)
    try:
        assert take(c, 1, timeout_s=1.5) == []  # assigned, both partitions quiet
        c.pause([TopicPartition(topic, 0)])
        with Producer(cfg, "test") as p:
            p.produce(topic, b"held", key=b"k", partition=0)
            p.produce(topic, b"free", key=b"k", partition=1)
        assert [v for _p, _o, v in take(c, 2, timeout_s=2.0)] == [b"free"]
        c.resume([TopicPartition(topic, 0)])
        assert [v for _p, _o, v in take(c, 1)] == [b"held"]
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_quiet_member_reads_on_after_broker_restarts(tmp_path: Path) -> None:
    """The embedded broker SIGKILLed and restarted under a member that keeps polling and
    committing while records keep coming: the group forgets the member, takes its partitions
    back and gives them out again. librdkafka keeps a partition's pause across that, so a
    partition that was quiet then was never fetched again (the trainer read nothing for 4
    minutes in a full ``srl chaos`` run at 49923c6). After the restarts, records written to
    every partition must all be read."""
    data, port = tmp_path / "broker", free_port()
    info = broker.start(port, data)
    cfg = load_config(CommonConfig, cli={"bootstrap_servers": f"127.0.0.1:{port}"}, env={})
    topic = "quiet-restarts"
    create_topics(cfg, [TopicSpec(topic, 3, {})])
    time.sleep(1.0)  # the topic is on disk
    floor: dict[tuple[str, int], int] = {}
    stop = threading.Event()

    def write() -> None:  # a record per partition every 250 ms, through the restarts
        while not stop.is_set():
            with contextlib.suppress(SrlError), Producer(cfg, "test") as p:
                while not stop.wait(0.25):
                    for i in range(3):
                        p.produce(topic, b"steady", key=b"k", partition=i)

    def on_assign(c: Consumer, parts: list[TopicPartition]) -> None:
        c.assign_from(parts, dict(floor))  # as the trainer: never below what it read

    def read(c: Consumer, seconds: float, seen: set[bytes]) -> None:
        end, last_commit = time.monotonic() + seconds, 0.0
        while time.monotonic() < end:
            for m in c.next_batch(100, 0.2):
                if m.error() is None:
                    seen.add(m.value() or b"")
                    floor[(topic, m.partition() or 0)] = (m.offset() or 0) + 1
            if floor and time.monotonic() - last_commit > 1.0:
                last_commit = time.monotonic()
                offsets = [TopicPartition(t, p, o) for (t, p), o in floor.items()]
                with contextlib.suppress(KafkaException):
                    c.commit_sync(offsets)

    c = make_consumer(cfg, "restarts", "quiet-test", **{"session.timeout.ms": 6000})
    c.subscribe([topic], on_assign=on_assign)
    writer = threading.Thread(target=write)
    writer.start()
    seen: set[bytes] = set()
    try:
        for _ in range(6):
            read(c, 4.0, seen)
            os.kill(info.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.pid, 0)
            broker.stop(data)
            info = broker.start(port, data)
        read(c, 4.0, seen)
        stop.set()
        writer.join()
        read(c, 1.5, seen)  # caught up: quiet
        with Producer(cfg, "test") as p:
            for i in range(3):
                p.produce(topic, f"last-{i}".encode(), key=b"k", partition=i)
        want = {f"last-{i}".encode() for i in range(3)}
        deadline = time.monotonic() + 30
        while not want <= seen and time.monotonic() < deadline:
            read(c, 0.5, seen)
    finally:
        stop.set()
        writer.join()
        c.close()
        broker.stop(data)
    assert want <= seen, sorted(want - seen)
