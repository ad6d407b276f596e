"""Kafka clients against a real broker: partitions, groups, commits, restarts, failures."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from app.smoke import synthetic_chunks
from schemas.records import TrajectoryChunk, decode_as, encode
from srl.broker import embedded as broker
from srl.broker import free_port
from srl.config import CommonConfig, load_config
from srl.errors import BrokerUnavailable, SrlError
from srl.kafka import (
    Consumer,
    KafkaException,
    Producer,
    QuietTail,
    TopicPartition,
    commit_sync,
    committed_offsets,
    create_topics,
    make_consumer,
    reader,
    topic_config,
    watermarks,
)
from srl.metrics import Metrics, dead_letter
from srl.topics import Layout


def produce_chunks(cfg: CommonConfig, chunks: list[TrajectoryChunk]) -> None:
    layout = Layout.from_config(cfg)
    with Producer(cfg, "test") as p:
        for c in chunks:
            p.produce(
                layout.trajectories,
                encode(c),
                key=c.trajectory_id,
                partition=layout.partition_for(c.bucket, c.trajectory_id),
            )
    assert p.delivered == len(chunks) and p.failed == 0


def consume(cfg: CommonConfig, group: str, limit: int, timeout_s: float = 30.0) -> list:
    """Consume up to ``limit`` records in ``group``, store their offsets, commit, close."""
    layout = Layout.from_config(cfg)
    consumer = make_consumer(cfg, group)
    got = []
    try:
        consumer.subscribe([layout.trajectories])
        deadline = time.monotonic() + timeout_s
        while len(got) < limit and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            got.append((msg.partition(), msg.offset(), decode_as(msg.value(), TrajectoryChunk)))
        if got:
            ends: dict[int, int] = {}
            for part, offset, _chunk in got:
                ends[part] = max(ends.get(part, 0), offset + 1)
            consumer.commit_sync(
                [TopicPartition(layout.trajectories, p, o) for p, o in ends.items()]
            )
    finally:
        consumer.close()
    return got


def test_consumer_resumes_exactly_after_committed_offsets(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    chunks = synthetic_chunks(40, layout, chunk_tokens=64, seed=1)
    produce_chunks(cfg, chunks)
    parts = {layout.partition_for(c.bucket, c.trajectory_id) for c in chunks}
    assert len(parts) >= 3, "records span several partitions"

    first = consume(cfg, "g1", limit=len(chunks) // 2)
    committed = committed_offsets(
        cfg, "g1", [(layout.trajectories, p) for p in range(layout.trajectory_partition_count)]
    )
    for p in range(layout.trajectory_partition_count):
        mine = [o for (pp, o, _) in first if pp == p]
        assert committed[(layout.trajectories, p)] == (max(mine) + 1 if mine else None)

    second = consume(cfg, "g1", limit=len(chunks) - len(first))
    seen = [(p, o) for p, o, _ in first + second]
    assert len(seen) == len(set(seen)) == len(chunks), "nothing twice, nothing lost"
    for p in parts:
        resumed = [o for (pp, o, _) in second if pp == p]
        if resumed:
            assert min(resumed) == (committed[(layout.trajectories, p)] or 0)
    # a trajectory's chunks arrive in seq order on one partition
    by_traj: dict[str, list[tuple[int, int]]] = {}
    for p, _o, c in sorted(first + second, key=lambda x: (x[0], x[1])):
        by_traj.setdefault(c.trajectory_id, []).append((p, c.seq))
    for traj in by_traj.values():
        assert len({p for p, _ in traj}) == 1
        assert [s for _, s in traj] == list(range(len(traj)))


def test_watermarks_match_what_was_produced(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    chunks = synthetic_chunks(25, layout, seed=2)
    produce_chunks(cfg, chunks)
    marks = watermarks(cfg, [layout.trajectories])
    assert len(marks) == layout.trajectory_partition_count
    for p in range(layout.trajectory_partition_count):
        n = sum(1 for c in chunks if layout.partition_for(c.bucket, c.trajectory_id) == p)
        assert marks[(layout.trajectories, p)] == (0, n)


def test_producer_with_no_broker_fails_fast_with_a_clear_error() -> None:
    dead = load_config(
        CommonConfig,
        # 1 s: the up-front check gives up after it, a delivery after 3 s (message.timeout.ms)
        cli={"bootstrap_servers": f"127.0.0.1:{free_port()}", "connect_timeout_s": 1},
        env={},
    )
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="no Kafka broker answered at 127.0.0.1"):
        Producer(dead)
    assert time.monotonic() - t0 < 10
    # without the up-front check, delivery fails within the bounded message timeout
    t0 = time.monotonic()
    p = Producer(dead, check=False)
    p.produce("x.trajectories", b"v")
    with pytest.raises(SrlError, match="failed delivery|not delivered"):
        p.flush(timeout_s=20)
    assert time.monotonic() - t0 < 20
    # a record with its own callback is its caller's to account for: reported there only
    seen: list[object] = []
    p.produce("x.trajectories", b"v", on_delivery=lambda err, _msg: seen.append(err))
    p.flush(timeout_s=20)
    assert len(seen) == 1 and seen[0] is not None and p.failed_handled == 1


def test_purged_records_never_go_out_and_are_not_failures() -> None:
    """A fenced generator purges the chunks it queued while cut off (``purge_queued``): they
    must not reach the broker once the cut heals, and a purge is no delivery failure (the
    next flush would end the worker)."""
    dead = load_config(CommonConfig, cli={"bootstrap_servers": f"127.0.0.1:{free_port()}"}, env={})
    p = Producer(dead, check=False)
    seen: list[object] = []
    for _ in range(5):
        p.produce("x.trajectories", b"v")
    p.produce("x.trajectories", b"v", on_delivery=lambda err, _msg: seen.append(err))
    assert p.purge_queued() == 6  # what it dropped, counted as it returns
    p.flush(timeout_s=5)  # nothing left, nothing failed
    assert (p.purged, p.failed, p.pending()) == (6, 0, 0)
    assert len(seen) == 1 and seen[0] is not None  # the caller still hears of its record


def test_dead_letters_carry_reason_and_origin(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    with Producer(cfg, "test") as p:
        metrics = Metrics(p, layout, cfg.run, "test")
        dead_letter(
            p, layout, b"\x01garbage", b"k", "not an srl record", "x.trajectories/3@17", metrics
        )
    assert metrics.counters["dead_letters"] == 1
    c = make_consumer(cfg, "dlq-reader")
    try:
        c.subscribe([layout.dlq])
        deadline = time.monotonic() + 20
        msg = None
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                break
        assert msg is not None and msg.value() == b"\x01garbage"
        headers = dict(msg.headers())
        assert (
            headers["srl.reason"] == b"not an srl record"
            and headers["srl.origin"] == b"x.trajectories/3@17"
        )
    finally:
        c.close()


def test_weights_topic_is_compacted_and_latest_announcement_wins(
    cfg: CommonConfig, tmp_path
) -> None:
    import torch

    from srl.stores import store_from_config
    from srl.weights import announce, latest_announcement, publish

    layout = Layout.from_config(cfg)
    create_topics(cfg)
    store = store_from_config(cfg)
    with Producer(cfg, "test") as p:
        for v in (1, 2):
            announce(
                p,
                layout,
                publish(
                    store,
                    cfg.run,
                    v,
                    {"w": torch.ones(2) * v},
                    trainer_step=v,
                    parent_version=v - 1,
                ),
            )
    latest = latest_announcement(cfg, layout, cfg.run)
    assert latest is not None and latest.version == 2
    assert topic_config(cfg, layout.weights)["cleanup.policy"] == "compact"


def test_commit_sync_fails_when_a_partition_is_refused(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    group = f"commit-{time.monotonic_ns()}"
    consumer = make_consumer(cfg, group)
    try:
        good = TopicPartition(layout.trajectories, 0, 0)
        commit_sync(consumer, [good])  # an existing partition: committed
        assert committed_offsets(cfg, group, [(layout.trajectories, 0)]) == {
            (layout.trajectories, 0): 0
        }
        missing = TopicPartition(layout.trajectories, 999, 1)  # no such partition
        with pytest.raises(KafkaException):
            commit_sync(consumer, [TopicPartition(layout.trajectories, 0, 1), missing])
    finally:
        consumer.close()


def test_quiet_tail_reads_every_record_in_order_while_idle_in_between(cfg: CommonConfig) -> None:
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    c = reader(cfg, "tail-test")
    tp = TopicPartition(layout.weights, 0)
    c.assign([TopicPartition(layout.weights, 0, -2)])
    tail = QuietTail(c, tp)
    try:
        assert tail.poll(0.3) is None and not tail.paused  # nothing read yet: fetching normally
        assert not tail.caught_up
        got = []
        with Producer(cfg, "test") as p:
            for i in range(3):
                p.produce(layout.weights, f"r{i}".encode(), key=b"k", partition=0)
                p.flush()
                deadline = time.monotonic() + 10
                while len(got) < i + 1 and time.monotonic() < deadline:
                    msg = tail.poll(0.2)
                    if msg is not None and not msg.error():
                        got.append(msg.value())
                for _ in range(25):  # caught up after a record: paused (no fetching) where
                    assert tail.poll(0.1) is None  # idle fetches spin, polling on Apache Kafka
                    if tail.caught_up:
                        break
                assert tail.caught_up and tail.paused == tail.enabled
        assert got == [b"r0", b"r1", b"r2"]
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_a_producer_fails_with_one_error_when_the_broker_lost_what_it_acknowledged(
    tmp_path: Path,
) -> None:
    """The embedded broker SIGKILLed and restarted on its data loses the records it
    acknowledged in its last ~0.5 s (docs/broker.md), so an idempotent producer's next
    sequence number is refused for good (librdkafka's fatal OUT_OF_ORDER_SEQUENCE_NUMBER).
    confluent-kafka still serves the delivery reports with that error pending, and the
    first method call in a callback raises SystemError: the counting callback left its lock
    held and the next flush hung forever (found by ``srl chaos``, broker-restart: the
    dispatcher and a generator hung). Now the producer fails with one SrlError."""
    data = tmp_path / "broker"
    port = free_port()
    info = broker.start(port, data)
    try:
        cfg = load_config(CommonConfig, cli={"bootstrap_servers": f"127.0.0.1:{port}"}, env={})
        create_topics(cfg)
        time.sleep(1.0)  # the topics are on disk
        p = Producer(cfg, "test")
        with pytest.raises(SrlError, match="for good"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for _ in range(10):
                    p.produce(Layout.from_config(cfg).metrics, b"x" * 100, key="k")
                p.flush(30)
                if info is not None and time.monotonic() > deadline - 58:
                    os.kill(info.pid, signal.SIGKILL)  # mid-stream: the last ~0.5 s are lost
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(info.pid, 0)
                    broker.stop(data)
                    info = None
                    broker.start(port, data)
                time.sleep(0.01)
    finally:
        broker.stop(data)


def test_an_error_in_a_rebalance_callback_comes_out_of_poll_as_itself(cfg: CommonConfig) -> None:
    """confluent-kafka on Python < 3.12 re-raises a callback's exception as a bare
    ``KafkaError`` object that no ``except`` clause (not even ``BaseException``) matches: a
    trainer's ``on_assign`` whose ``committed()`` timed out during ``close()`` escaped pytest
    itself. The wrapper keeps the error and raises it, as itself, when the call returns."""
    layout = Layout.from_config(cfg)
    create_topics(cfg)

    def refuse(c: Consumer, _parts: list[TopicPartition]) -> None:
        c.seek(TopicPartition("not-assigned", 0, 5))  # raises KafkaException, from C

    consumer = make_consumer(cfg, "g-callback")
    try:
        consumer.subscribe([layout.trajectories], on_assign=refuse)
        deadline = time.monotonic() + 30
        with pytest.raises(KafkaException, match="not-assigned|Erroneous state|UNKNOWN"):
            while time.monotonic() < deadline:
                consumer.poll(0.2)
    finally:
        consumer.close()
