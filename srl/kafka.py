"""Kafka client factory, a disciplined producer wrapper, and topic administration.

Owns every librdkafka setting srl uses, in one place:

* producers are idempotent with ``acks=all``, lz4 by default (zstd for long links), a
  configurable linger, and bounded delivery timeouts so a dead broker is an error, not a hang;
* consumers store offsets manually (``enable.auto.offset.store=false``), never auto-commit,
  and use the cooperative-sticky assignor so pools can grow and shrink without stop-the-world;
* ``cfg.kafka`` (``-X key=value``) is applied last and can override anything.

``Producer`` follows the producer discipline: ``poll(0)`` after each produce, poll-and-retry
on ``BufferError``, delivery failures counted and surfaced, flush on exit of a ``with`` block.
Called by every role; confluent_kafka is imported here and nowhere above it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from srl.config import KafkaSettings, ProducerSettings, TopicsConfig
from srl.errors import BrokerUnavailable, SrlError
from srl.topics import Layout, TopicSpec

log = logging.getLogger("srl.kafka")
# librdkafka's own log lines (connection refused, retries) go here, not to stderr.
_rdkafka_log = logging.getLogger("srl.librdkafka")
_rdkafka_log.setLevel(logging.DEBUG if os.environ.get("SRL_KAFKA_DEBUG") else logging.CRITICAL)

DeliveryCallback = Callable[[KafkaError | None, Any], None]


def client_id(role: str) -> str:
    return f"srl-{role}-{socket.gethostname()}-{os.getpid()}"


def base_settings(cfg: KafkaSettings, role: str = "client") -> dict[str, Any]:
    return {
        "bootstrap.servers": cfg.bootstrap_servers,
        "client.id": client_id(role),
        "logger": _rdkafka_log,
        "socket.connection.setup.timeout.ms": int(cfg.connect_timeout_s * 1000),
    }


def producer_settings(
    cfg: ProducerSettings, role: str = "producer", **overrides: Any
) -> dict[str, Any]:
    settings = base_settings(cfg, role)
    settings.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": cfg.compression,
            "linger.ms": cfg.linger_ms,
            # Bounded: a message that cannot be delivered fails instead of waiting forever.
            "message.timeout.ms": max(1_000, int(cfg.connect_timeout_s * 3000)),
            "queue.buffering.max.kbytes": 262_144,
        }
    )
    settings.update(overrides)
    settings.update(cfg.kafka)
    return settings


def consumer_settings(
    cfg: KafkaSettings, group_id: str, role: str = "consumer", **overrides: Any
) -> dict[str, Any]:
    settings = base_settings(cfg, role)
    settings.update(
        {
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
            "max.poll.interval.ms": 300_000,
        }
    )
    settings.update(overrides)
    settings.update(cfg.kafka)
    return settings


def wait_for_broker(cfg: KafkaSettings, timeout_s: float | None = None) -> Any:
    """Cluster metadata once a broker answers; BrokerUnavailable after ``timeout_s``."""
    timeout_s = cfg.connect_timeout_s if timeout_s is None else timeout_s
    admin = AdminClient({k: v for k, v in base_settings(cfg, "admin").items()} | cfg.kafka)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            md = admin.list_topics(timeout=min(remaining, 2.0))
            if md.brokers:
                return md
        except KafkaException as e:
            last = e
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    why = f" ({_short(last)})" if last else ""
    raise BrokerUnavailable(
        f"no Kafka broker answered at {cfg.bootstrap_servers} within {timeout_s:g}s{why}; "
        "start one with `srl broker start` or point --bootstrap at a running broker"
    )


def _short(e: BaseException | None) -> str:
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return e.args[0].str()
    return " ".join(str(e).split())[:200]


class Producer:
    """An idempotent producer with counted deliveries; use it in a ``with`` block.

    ``produce`` never drops a record on a full local queue (it polls and retries), and each
    delivery outcome is counted; ``flush`` raises if records are still undelivered after its
    timeout, so a dead broker surfaces as an error within a bounded time.
    """

    def __init__(
        self, cfg: ProducerSettings, role: str = "producer", check: bool = True, **overrides: Any
    ) -> None:
        if check:
            wait_for_broker(cfg)
        self.cfg = cfg
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.delivered = 0
        self.failed = 0
        self._failed_reported = 0
        settings = producer_settings(cfg, role, **overrides)
        settings["error_cb"] = self._on_error
        self._p = confluent_kafka.Producer(settings)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.errors.append(err.str())
        log.debug("producer error: %s", err.str())

    def _counted(self, err: KafkaError | None, _msg: Any) -> None:
        with self._lock:
            if err is None:
                self.delivered += 1
            else:
                self.failed += 1
                if len(self.errors) < 100:
                    self.errors.append(err.str())

    def produce(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, str | bytes | None]] | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        # the per-record path of every generator: no kwargs dict, no closure unless the
        # caller wants its own callback (partition -1: librdkafka's partitioner picks)
        if on_delivery is None:
            cb: DeliveryCallback = self._counted
        else:

            def cb(err: KafkaError | None, msg: Any) -> None:
                self._counted(err, msg)
                on_delivery(err, msg)

        p = self._p
        part = -1 if partition is None else partition
        while True:
            try:
                p.produce(topic, value, key, partition=part, on_delivery=cb, headers=headers)
                break
            except BufferError:
                p.poll(0.05)  # local queue full: serve callbacks, then retry
        p.poll(0)

    def poll(self, timeout: float = 0) -> int:
        return int(self._p.poll(timeout))

    def warm(self, topics: Iterable[str], timeout_s: float = 10.0) -> None:
        """Fetch ``topics``' metadata now, not at the first record (a fresh producer holds its
        first records while it looks the topic up; it also holds them ~0.5 s until it has its
        idempotent producer id, which only a delivered record shows: docs/benchmarks.md)."""
        for topic in topics:
            self._p.list_topics(topic, timeout=timeout_s)

    def pending(self) -> int:
        return len(self._p)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every outstanding delivery.

        SrlError if records are still pending after ``timeout_s`` or if any delivery failed
        since the last flush (callers that handle failures per record catch it).
        """
        timeout_s = max(10.0, self.cfg.connect_timeout_s * 4) if timeout_s is None else timeout_s
        left = self._p.flush(timeout_s)
        last = f": {self.errors[-1]}" if self.errors else ""
        if left:
            raise SrlError(
                f"{left} record(s) not delivered within {timeout_s:g}s to "
                f"{self.cfg.bootstrap_servers}{last}"
            )
        with self._lock:
            new_failures, self._failed_reported = self.failed - self._failed_reported, self.failed
        if new_failures:
            raise SrlError(
                f"{new_failures} record(s) failed delivery to {self.cfg.bootstrap_servers}{last}"
            )

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.flush()
        else:  # already failing: deliver what we can, do not mask the original error
            self._p.flush(5)


def next_batch(consumer: Consumer, max_messages: int, timeout_s: float) -> list[Any]:
    """Up to ``max_messages`` records, returning as soon as one has arrived.

    ``Consumer.consume(n, timeout)`` waits for ``n`` records or the whole timeout, which adds
    up to ``timeout`` of latency to every record when traffic is light; here the wait ends at
    the first record and whatever else is already fetched comes with it.
    """
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(max_messages - 1, 0)] if max_messages > 1 else [first]


class QuietTail:
    """Reads one assigned partition as it grows, without fetching while caught up.

    A Kafka broker holds a fetch at the end of a partition for ``fetch.wait.max.ms``; the
    embedded broker (noida-db 0.2.3) answers it at once, so an idle consumer re-fetches
    continuously: about 0.4 core on each side per idle consumer on a 2-core machine, measured
    (docs/broker.md). So while the position is at the high watermark the partition is paused,
    and the watermark is probed every ``probe_s`` instead (one ListOffsets request): the cost
    of an idle tail drops to ~1 % of a core, the delay to a new record to at most ``probe_s``.
    It fetches normally until the first record is read (a partition resumed from a logical
    start offset is fetched only ~1 s later). For low-rate single-partition topics (the
    weights topic); the consumer must be assigned ``tp`` and used from one thread.
    """

    def __init__(self, consumer: Consumer, tp: TopicPartition, probe_s: float = 0.01) -> None:
        self.consumer, self.tp, self.probe_s = consumer, tp, probe_s
        self.paused = False
        self.end = -1  # the highest high watermark seen (probed or fetched)

    def _position(self) -> int:
        """The next offset to read; -1 until the first record (a logical start offset)."""
        pos = self.consumer.position([self.tp])[0].offset
        return pos if pos >= 0 else -1

    def poll(self, timeout_s: float) -> Any:
        """The next record, or None after at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.paused:
                _low, high = self.consumer.get_watermark_offsets(self.tp, timeout=10, cached=False)
                self.end = max(self.end, high)
                pos = self._position()
                if self.end > pos:
                    self.consumer.resume([self.tp])
                    # a resumed partition waits for the next fetch cycle (~500 ms) unless sought
                    self.consumer.seek(TopicPartition(self.tp.topic, self.tp.partition, pos))
                    self.paused = False
            left = max(0.0, deadline - time.monotonic())
            msg = self.consumer.poll(min(left, self.probe_s) if self.paused else left)
            if msg is not None:
                return msg
            if not self.paused:
                self.end = max(
                    self.end, self.consumer.get_watermark_offsets(self.tp, cached=True)[1]
                )
                # caught up: pause. Not before the first record: a partition resumed from a
                # logical start offset is fetched only ~1 s later, even when sought
                pos = self._position()
                if pos >= 0 and self.end >= 0 and pos >= self.end:
                    self.consumer.pause([self.tp])
                    self.paused = True
            if time.monotonic() >= deadline:
                return None


def commit_sync(consumer: Consumer, offsets: list[TopicPartition]) -> None:
    """Commit ``offsets`` synchronously; KafkaException if the request or any partition failed.

    librdkafka raises only when the whole request fails; a partition the coordinator refused
    (e.g. UNKNOWN_MEMBER_ID, OFFSET_METADATA_TOO_LARGE) comes back with its ``error`` set in
    the returned list, and would otherwise pass for committed.
    """
    result = consumer.commit(offsets=offsets, asynchronous=False) or []
    bad = [tp for tp in result if tp.error is not None]
    if bad:
        first = bad[0]
        raise KafkaException(
            first.error
            if isinstance(first.error, KafkaError)
            else KafkaError(KafkaError._FAIL, f"{len(bad)} partition(s): {first.error}")
        )


def make_consumer(
    cfg: KafkaSettings, group_id: str, role: str = "consumer", **overrides: Any
) -> Consumer:
    """A group consumer with manual offset storage (see module docstring)."""
    settings = consumer_settings(cfg, group_id, role, **overrides)
    return Consumer(settings)


def admin(cfg: KafkaSettings) -> AdminClient:
    return AdminClient(base_settings(cfg, "admin") | cfg.kafka)


def create_topics(cfg: TopicsConfig, specs: Iterable[TopicSpec] | None = None) -> list[str]:
    """Create missing topics (all of the layout's by default); returns the names created."""
    wait_for_broker(cfg)
    specs = list(specs) if specs is not None else Layout.from_config(cfg).specs()
    client = admin(cfg)
    existing = client.list_topics(timeout=cfg.connect_timeout_s).topics
    todo = [s for s in specs if s.name not in existing]
    created: list[str] = []
    if todo:
        futures = client.create_topics(
            [
                NewTopic(s.name, num_partitions=s.partitions, replication_factor=1, config=s.config)
                for s in todo
            ],
            operation_timeout=cfg.connect_timeout_s,
            request_timeout=cfg.connect_timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                created.append(name)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise SrlError(f"cannot create topic {name}: {_short(e)}") from None
    for s in specs:
        if s.name in existing and len(existing[s.name].partitions) < s.partitions:
            log.warning(
                "topic %s has %d partitions, layout wants %d",
                s.name,
                len(existing[s.name].partitions),
                s.partitions,
            )
    if created:
        _wait_for_leaders(client, created, cfg.connect_timeout_s)
    return created


def _wait_for_leaders(client: AdminClient, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = client.list_topics(timeout=timeout_s)
        if all(
            n in md.topics and md.topics[n].partitions and md.topics[n].error is None for n in names
        ):
            return
        time.sleep(0.05)


def watermarks(
    cfg: KafkaSettings, topics: Iterable[str], timeout_s: float = 10.0
) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(topic, partition): (low, high)}`` for every partition of ``topics``."""
    c = Consumer(
        base_settings(cfg, "watermarks")
        | {"group.id": "srl-watermarks", "enable.auto.commit": False}
        | cfg.kafka
    )
    try:
        md = c.list_topics(timeout=timeout_s)
        out = {}
        for t in topics:
            if t not in md.topics:
                continue
            for p in sorted(md.topics[t].partitions):
                out[(t, p)] = c.get_watermark_offsets(
                    TopicPartition(t, p), timeout=timeout_s, cached=False
                )
        return out
    finally:
        c.close()


POSITION_SUFFIX = ".position"


def position_group(group: str) -> str:
    """Where the consumer group ``group`` shares how far it has *read* (not how far it has
    made durable): its members commit their positions there, nobody consumes with it (it
    never has members). Lag against it is the unconsumed backlog; against ``group``, the
    undurable one."""
    return group + POSITION_SUFFIX


def share_positions(sharer: Consumer, consumer: Consumer, asynchronous: bool = True) -> None:
    """Commit ``consumer``'s current read positions to ``sharer``'s group (partitions with no
    position yet are skipped). ``sharer`` is a consumer that never subscribes, made with
    ``make_consumer(cfg, position_group(group))``."""
    parts = consumer.assignment()
    if not parts:
        return
    pos = [tp for tp in consumer.position(parts) if tp.offset >= 0]
    if pos:
        if asynchronous:
            sharer.commit(offsets=pos, asynchronous=True)
        else:
            sharer.commit(offsets=pos, asynchronous=False)


def committed_offsets(
    cfg: KafkaSettings,
    group_id: str,
    partitions: Iterable[tuple[str, int]],
    timeout_s: float = 10.0,
) -> dict[tuple[str, int], int | None]:
    """Committed offset of ``group_id`` per partition; None where nothing is committed."""
    c = Consumer(
        base_settings(cfg, "offsets")
        | {"group.id": group_id, "enable.auto.commit": False}
        | cfg.kafka
    )
    try:
        tps = c.committed([TopicPartition(t, p) for t, p in partitions], timeout=timeout_s)
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in tps}
    finally:
        c.close()
