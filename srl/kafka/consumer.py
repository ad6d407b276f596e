"""``Consumer``: the one consumer type srl uses, a typed wrapper of ``confluent_kafka.Consumer``.

What must hold:

* every consumer is made here (``make_consumer`` for a group member, ``reader`` for a client
  that is only assigned partitions and never joins or commits), with ``srl.kafka.settings``;
* ``commit_sync`` fails when the request *or any partition* failed: librdkafka raises only
  when the whole request fails, and returns a refused partition (UNKNOWN_MEMBER_ID,
  OFFSET_METADATA_TOO_LARGE …) with its ``error`` set, which would otherwise pass for committed;
* rebalance callbacks receive this wrapper, not the raw client.

The method names and arguments are confluent-kafka's, so its documentation applies. Not
thread-safe (as librdkafka's consumer): one thread per consumer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from srl.config import KafkaSettings
from srl.errors import AccessDenied, ConsumerFailed, SrlError
from srl.kafka.callbacks import callback
from srl.kafka.probe import idle_fetches_spin
from srl.kafka.quiet import Quiet, key
from srl.kafka.settings import (
    SESSION_TIMEOUT_MS,
    base_settings,
    consumer_settings,
    error_of,
    for_group_protocol,
    reader_group,
    user_settings,
)

log = logging.getLogger("srl.kafka")

# A partition whose leader is moving (a topic just created, a node of a cluster lost) refuses
# offsets requests for a moment: Apache Kafka answers NOT_LEADER_OR_FOLLOWER until the new
# leader has taken it, and a request to a dead leader times out; librdkafka reports the
# error instead of retrying.
MOVING_LEADER = (
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._DESTROY_BROKER,  # the dead leader's connection, removed by a refresh
    KafkaError.OFFSET_NOT_AVAILABLE,  # a new leader whose high watermark is not caught up
)
LEADER_ASK_S = 2.0  # one offsets request waits this long before the leader is looked up again
# A group's coordinator is not there yet on a fresh cluster (its first group request creates
# __consumer_offsets: NOT_COORDINATOR until that topic's leader has loaded it) or for a moment
# after it moved; librdkafka reports an offsets fetch's error instead of asking again.
COORDINATOR_MOVING = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
)
COORDINATOR_ASK_S = 0.2  # the pause before a committed-offsets fetch is asked again


def _alive(msg: Any, group: str = "") -> Any:
    """``msg``, unless it is a fatal error event: then this member is fenced for good (a
    static member whose coordinator moved, docs/broker.md) and its owner starts over; or an
    authorization error (an ACL missing): ``AccessDenied``, one line, at once, instead of a
    role that sits idle."""
    err = msg.error() if msg is not None else None
    if err is None:
        return msg
    if err.fatal() or err.code() == KafkaError._FATAL:
        raise ConsumerFailed(f"the Kafka consumer failed for good: {err.str()}")
    if err.code() in DENIED:
        raise AccessDenied(denied_line(err, msg.topic(), group))
    return msg


# What an ACL missing looks like to a consumer (a poll's error event)
DENIED = (
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
)


def denied_line(err: KafkaError, topic: str | None, group: str) -> str:
    """One line for an authorization error: what the principal lacks, with the ACL to add."""
    if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return (
            f"kafka: not authorized for consumer group {group} ({err.str()}): the principal "
            f"needs Read on Group {group} to join and commit, Describe to look it up "
            "(docs/security.md)"
        )
    if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED and topic:
        return (
            f"kafka: not authorized to read topic {topic}: the principal needs Read on Topic "
            f"{topic} (docs/security.md)"
        )
    return f"kafka: not authorized: {err.str()} (docs/security.md)"


def leader_moving(e: KafkaException) -> bool:
    """Whether ``e`` says the partition's leader is moving (worth asking again)."""
    err = error_of(e)
    return err is not None and (err.code() in MOVING_LEADER or err.retriable())


Rebalance = Callable[["Consumer", list[TopicPartition]], None]
QUIET_PROBE_S = 0.02  # a group member's probe of the partitions it has read to their end
QUIET_METADATA_MS = 100  # and its metadata refresh (``make_consumer``)


class Consumer:
    """A librdkafka consumer with srl's settings; use it in a ``with`` block (closes on exit)."""

    def __init__(self, settings: dict[str, Any], quiet_s: float | None = None) -> None:
        self._c = confluent_kafka.Consumer(settings)
        self.settings = settings  # what it was made with (the broker-kind probe asks with them)
        self.bootstrap = str(settings.get("bootstrap.servers", ""))
        # stop fetching partitions read to their end, probe them every quiet_s (srl.kafka.quiet)
        self._quiet = Quiet(self._c, quiet_s) if quiet_s else None
        # incremental (cooperative, or KIP-848) rebalances add partitions; eager ones replace all
        strategy = str(settings.get("partition.assignment.strategy", ""))
        protocol = settings.get("group.protocol")
        self._incremental = "cooperative" in strategy or protocol == "consumer"
        self._closing = False
        self.group = str(settings.get("group.id", ""))

    # -- membership and assignment ------------------------------------------------------------
    def subscribe(
        self,
        topics: Sequence[str],
        on_assign: Rebalance | None = None,
        on_revoke: Rebalance | None = None,
        on_lost: Rebalance | None = None,
    ) -> None:
        callbacks = {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}
        kwargs = {k: self._bound(cb) for k, cb in callbacks.items() if cb is not None}
        self._c.subscribe(list(topics), **kwargs)

    def _bound(self, cb: Rebalance) -> Callable[[Any, list[TopicPartition]], None]:
        @callback
        def call(_raw: Any, partitions: list[TopicPartition]) -> None:
            self._forget(partitions)
            if self._closing:  # a rebalance that completes inside close(): nothing to take
                try:
                    cb(self, partitions)
                except Exception as e:  # logged: the consumer is going away
                    log.warning("rebalance callback failed while closing: %s", e)
                return
            cb(self, partitions)

        return call

    def assign(self, partitions: Sequence[TopicPartition]) -> None:
        self._c.assign(list(partitions))
        self._forget(partitions)

    def _forget(self, partitions: Sequence[TopicPartition]) -> None:
        """Assigned, revoked or sought: what ``Quiet`` knew of them no longer holds."""
        if self._quiet is not None:
            self._quiet.assigned(partitions)

    def assign_from(
        self,
        partitions: Sequence[TopicPartition],
        floor: Mapping[tuple[str, int], int],
        timeout: float = 10.0,
    ) -> None:
        """Inside ``on_assign``: take ``partitions``, each from its committed offset, or from
        ``floor`` where the group has committed less or nothing there (its offsets were lost,
        or it is a new group id for state that already finished those records)."""
        parts = list(partitions)
        asked = [tp for tp in parts if (tp.topic, tp.partition) in floor]
        have = {
            (tp.topic, tp.partition): tp.offset
            for tp in (self.committed(asked, timeout=timeout) if asked else [])
        }
        out = []
        for tp in parts:
            low = floor.get((tp.topic, tp.partition))
            if low is not None and have.get((tp.topic, tp.partition), -1) < low:
                out.append(TopicPartition(tp.topic, tp.partition, low))
            else:  # no offset: the committed one, or auto.offset.reset
                out.append(TopicPartition(tp.topic, tp.partition))
        if self._incremental:
            self._c.incremental_assign(out)
        else:
            self._c.assign(out)
        self._forget(out)

    def unassign(self) -> None:
        self._forget(self._c.assignment())
        self._c.unassign()

    def assignment(self) -> list[TopicPartition]:
        return list(self._c.assignment())

    def pause(self, partitions: Sequence[TopicPartition]) -> None:
        self._c.pause(list(partitions))
        if self._quiet is not None:
            self._quiet.paused(key(tp) for tp in partitions)

    def resume(self, partitions: Sequence[TopicPartition]) -> None:
        if self._quiet is None:
            self._c.resume(list(partitions))
        elif wake := self._quiet.resumable(key(tp) for tp in partitions):
            self._c.resume([TopicPartition(t, p) for t, p in wake])

    def seek(self, partition: TopicPartition) -> None:
        self._forget([partition])
        self._c.seek(partition)

    # -- records --------------------------------------------------------------------------------
    def poll(self, timeout: float = -1) -> Message | None:
        """The next record or error event, or None after ``timeout``; a fatal error (this
        member is fenced for good) raises ``ConsumerFailed``."""
        if self._quiet is None:
            return _alive(self._c.poll(timeout), self.group)
        out = self._quietly(lambda t: [m] if (m := self._c.poll(t)) is not None else [], timeout)
        return _alive(out[0], self.group) if out else None

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        """Up to ``num_messages`` records within ``timeout`` (quiet: returns with the first
        probe interval that brought any); a fatal error raises ``ConsumerFailed``."""
        if self._quiet is None:
            return [
                _alive(m, self.group)
                for m in self._c.consume(num_messages=num_messages, timeout=timeout)
            ]
        n = num_messages
        out = self._quietly(lambda t: self._c.consume(num_messages=n, timeout=t), timeout)
        return [_alive(m, self.group) for m in out]

    def _quietly(self, get: Callable[[float], list[Message]], timeout: float) -> list[Message]:
        """``get(t)`` in slices of the probe interval, probing between them (``Quiet``)."""
        assert self._quiet is not None
        deadline = time.monotonic() + (timeout if timeout >= 0 else 1e9)
        while True:
            self._quiet.tick()
            left = max(0.0, deadline - time.monotonic())
            msgs = list(get(min(left, self._quiet.probe_s)))
            if msgs:
                self._quiet.saw(msgs)
                return msgs
            if time.monotonic() >= deadline:
                return []

    def next_batch(self, max_messages: int, timeout_s: float) -> list[Message]:
        """Up to ``max_messages`` records, returning as soon as one has arrived.

        ``consume(n, timeout)`` waits for ``n`` records or the whole timeout, which adds up to
        ``timeout`` of latency to every record when traffic is light; here the wait ends at
        the first record and whatever else is already fetched comes with it.
        """
        first = self.poll(timeout_s)
        if first is None:
            return []
        if max_messages <= 1:
            return [first]
        rest = [_alive(m, self.group) for m in self._c.consume(max_messages - 1, 0)]
        if self._quiet is not None:
            self._quiet.saw(rest)
        return [first, *rest]

    # -- offsets --------------------------------------------------------------------------------
    def position(self, partitions: Sequence[TopicPartition]) -> list[TopicPartition]:
        return list(self._c.position(list(partitions)))

    def committed(
        self, partitions: Sequence[TopicPartition], timeout: float = 10.0
    ) -> list[TopicPartition]:
        """The group's committed offsets, asked again while its coordinator is moving or not
        there yet (``COORDINATOR_MOVING``) until ``timeout`` is spent."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                left = max(0.1, deadline - time.monotonic())
                return list(self._c.committed(list(partitions), timeout=left))
            except KafkaException as e:
                err = error_of(e)
                moving = err is not None and err.code() in COORDINATOR_MOVING
                if not moving or time.monotonic() + COORDINATOR_ASK_S >= deadline:
                    raise
                time.sleep(COORDINATOR_ASK_S)

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = 10.0, cached: bool = False
    ) -> tuple[int, int]:
        """``(low, high)`` of ``partition``. Asked of its leader (``cached`` False), again
        until ``timeout`` while the leader moves: a node of a cluster lost, a topic just
        created. librdkafka neither retries these requests nor refreshes its metadata of a
        topic this client does not consume, so it would ask the dead leader until its
        metadata expires (minutes); each retry refreshes the topic's metadata first."""
        if cached:
            low, high = self._c.get_watermark_offsets(partition, cached=True)
            return int(low), int(high)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ask = max(0.1, min(left, LEADER_ASK_S))
                low, high = self._c.get_watermark_offsets(partition, timeout=ask, cached=False)
                return int(low), int(high)
            except KafkaException as e:
                if not leader_moving(e) or time.monotonic() >= deadline:
                    raise
            with contextlib.suppress(KafkaException):  # where the leader is now
                self._c.list_topics(partition.topic, timeout=max(0.1, min(left, LEADER_ASK_S)))
            time.sleep(0.1)

    def offsets_for_times(
        self, partitions: Sequence[TopicPartition], timeout: float = 10.0
    ) -> list[TopicPartition]:
        return list(self._c.offsets_for_times(list(partitions), timeout=timeout))

    def commit_sync(self, offsets: Sequence[TopicPartition]) -> None:
        """Commit ``offsets`` now; KafkaException if the request or any partition failed."""
        result = self._c.commit(offsets=list(offsets), asynchronous=False) or []
        bad = [tp for tp in result if tp.error is not None]
        if bad:
            err = bad[0].error
            if not isinstance(err, KafkaError):
                err = KafkaError(KafkaError._FAIL, f"{len(bad)} partition(s): {err}")
            raise KafkaException(err)

    def commit_async(self, offsets: Sequence[TopicPartition]) -> None:
        """Send a commit without waiting (a failure shows in the next commit's outcome)."""
        self._c.commit(offsets=list(offsets), asynchronous=True)

    # -- metadata and lifetime --------------------------------------------------------------------
    def list_topics(self, topic: str | None = None, timeout: float = 10.0) -> Any:
        return self._c.list_topics(topic, timeout=timeout)

    def partitions_of(self, topics: Sequence[str], timeout: float = 10.0) -> list[TopicPartition]:
        """Every partition of ``topics`` that exists, in order. Metadata of the named topics
        only, one request each: on a shared cluster of thousands of topics a full-cluster
        request per measurement is the cost, and the principal may not Describe the rest."""
        out: list[TopicPartition] = []
        for t in dict.fromkeys(topics):
            tm = self._c.list_topics(t, timeout=timeout).topics.get(t)
            if tm is not None and tm.error is None:  # a missing topic: UNKNOWN_TOPIC_OR_PART
                out += [TopicPartition(t, p) for p in sorted(tm.partitions)]
        return out

    def close(self) -> None:
        self._closing = True
        self._c.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def produced_ms(msg: Message) -> int | None:
    """When a consumed record was produced (its timestamp, ms), if the broker says."""
    kind, ts = msg.timestamp()
    return int(ts) if kind != confluent_kafka.TIMESTAMP_NOT_AVAILABLE else None


KIP848_EVICT_S = 60.0  # longest wait for a dead static member's eviction (KIP-848 groups)
AUTO = -1.0  # make_consumer's quiet_s: quiet on a broker whose idle fetches spin


def make_consumer(
    cfg: KafkaSettings,
    group_id: str,
    role: str = "consumer",
    quiet_s: float | None = AUTO,
    **overrides: Any,
) -> Consumer:
    """A member of ``group_id`` with manual offset storage (``srl.kafka.settings``). On a
    broker that answers a fetch at the end of a partition at once (the embedded one:
    ``idle_fetches_spin``) it stops fetching partitions read to their end and probes them
    every ``quiet_s`` (``srl.kafka.quiet``); on Apache Kafka, which holds such a fetch, it
    fetches continuously. An explicit ``quiet_s`` (None: never quiet) decides instead."""
    if quiet_s == AUTO:
        quiet_s = QUIET_PROBE_S if idle_fetches_spin(cfg) else None
    if quiet_s:
        # librdkafka fetches a resumed partition it has read nothing from only after its next
        # metadata refresh (measured: ~0.9 s at the default 5 min, ~0 at 100 ms): an empty
        # partition woken by its first record would wait that long
        overrides = {"topic.metadata.refresh.interval.ms": QUIET_METADATA_MS} | overrides
    settings = consumer_settings(cfg, group_id, role, **overrides)
    instance = settings.get("group.instance.id")
    if instance and settings.get("group.protocol") == "consumer":
        # the broker evicts a dead holder after its session: 10 s with srl's
        # server.properties, Kafka's default 45 s
        wait_instance_released(cfg, group_id, str(instance), timeout_s=KIP848_EVICT_S)
    return Consumer(settings, quiet_s)


def wait_instance_released(
    cfg: KafkaSettings, group: str, instance_id: str, timeout_s: float
) -> None:
    """Until no member of ``group`` holds the static ``instance_id``; SrlError after
    ``timeout_s``. A KIP-848 group (``group.protocol=consumer``) refuses a static member
    whose instance id a member that did not leave still holds (UNRELEASED_INSTANCE_ID, fatal
    for librdkafka's consumer), where a classic group hands the place to the newcomer: a
    trainer restarted after a SIGKILL waits here for the broker to evict its predecessor
    (``group.consumer.session.timeout.ms``); a second live trainer of the run is refused."""
    client = AdminClient(base_settings(cfg, "admin") | user_settings(cfg))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            desc = client.describe_consumer_groups([group], request_timeout=10)[group].result()
            held = [m for m in desc.members if m.group_instance_id == instance_id]
        except KafkaException:
            held = []  # no such group yet: nobody holds it
        if not held:
            return
        if time.monotonic() >= deadline:
            raise SrlError(
                f"consumer group {group}: static member {instance_id} is still held by a live "
                f"member after {timeout_s:g}s (another process of this run?)"
            )
        log.info("waiting for the broker to evict the previous holder of %s", instance_id)
        time.sleep(0.5)


def reader(cfg: KafkaSettings, role: str) -> Consumer:
    """A client that is only assigned partitions (reads, watermarks, offsets of other groups);
    it never joins a group and never commits. Every reader of a prefix has the same group id,
    ``{prefix}.reader`` (``reader_group``): one literal ACL (Describe) covers them all."""
    settings = base_settings(cfg, role) | {
        "group.id": reader_group(cfg.topic_prefix),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "session.timeout.ms": SESSION_TIMEOUT_MS,  # else -X max.poll.interval.ms<45000 fails
    }
    return Consumer(for_group_protocol(settings | user_settings(cfg)))


def commit_sync(consumer: Consumer, offsets: list[TopicPartition]) -> None:
    """``consumer.commit_sync(offsets)`` (kept for callers that hold a function)."""
    consumer.commit_sync(offsets)


class QuietTail:
    """Reads one assigned partition as it grows, without fetching while caught up.

    A Kafka broker holds a fetch at the end of a partition for ``fetch.wait.max.ms``; the
    embedded broker (noida-db 0.2.3) answers it at once, so an idle consumer re-fetches
    continuously: about 0.4 core on each side per idle consumer on a 2-core machine
    (docs/broker.md). So while the position is at the high watermark the partition is paused,
    and the watermark is probed every ``probe_s`` instead (one ListOffsets request): an idle
    tail costs ~1 % of a core, the delay to a new record at most ``probe_s``. It fetches
    normally until the first record is read (a partition resumed from a logical start offset is
    fetched only ~1 s later). For low-rate single-partition topics (the weights topic); the
    consumer must be assigned ``tp`` and used from one thread.

    On a broker that holds idle fetches (Apache Kafka: ``idle_fetches_spin``) it only polls;
    ``caught_up`` tells, on either broker, whether it has read to the end it knows of.
    """

    def __init__(
        self,
        consumer: Consumer,
        tp: TopicPartition,
        probe_s: float = 0.01,
        start: int | None = None,
    ) -> None:
        self.consumer, self.tp, self.probe_s = consumer, tp, probe_s
        self.start = start  # the concrete offset ``tp`` was assigned at, if it was
        # Apache Kafka holds an idle fetch itself: nothing to do there but poll
        self.enabled = idle_fetches_spin(consumer.settings)
        self.paused = False
        self.end = -1  # the highest high watermark seen (probed or fetched)
        self._at_end = False  # not enabled: the last poll found nothing past the end

    @property
    def caught_up(self) -> bool:
        """Read to the high watermark as far as it knows (paused, where it pauses)."""
        return self.paused if self.enabled else self._at_end

    def _read_to_end(self) -> bool:
        self.end = max(self.end, self.consumer.get_watermark_offsets(self.tp, cached=True)[1])
        pos = self._position()
        return pos >= 0 and self.end >= 0 and pos >= self.end

    def _position(self) -> int:
        """The next offset to read; before the first record the concrete ``start`` it was
        assigned at (so an empty partition pauses too), else -1 (a logical start offset)."""
        pos = self.consumer.position([self.tp])[0].offset
        if pos < 0 and self.start is not None:
            return self.start
        return pos if pos >= 0 else -1

    def _wake(self) -> None:
        """Paused: resume if the partition grew past our position. A probe that fails (the
        broker is away) finds nothing new; the next one tries again."""
        try:
            _low, high = self.consumer.get_watermark_offsets(self.tp, timeout=10, cached=False)
        except KafkaException:
            return
        self.end = max(self.end, high)
        pos = self._position()
        if self.end > pos:
            self.consumer.resume([self.tp])
            # a resumed partition waits for the next fetch cycle (~500 ms) unless sought
            self.consumer.seek(TopicPartition(self.tp.topic, self.tp.partition, pos))
            self.paused = False

    def _maybe_pause(self) -> None:
        """Caught up: pause. Not before the first record: a partition resumed from a logical
        start offset is fetched only ~1 s later, even when sought."""
        if self._read_to_end():
            self.consumer.pause([self.tp])
            self.paused = True

    def poll(self, timeout_s: float) -> Message | None:
        """The next record, or None after at most ``timeout_s``."""
        if not self.enabled:
            msg = self.consumer.poll(timeout_s)
            self._at_end = msg is None and self._read_to_end()
            return msg
        deadline = time.monotonic() + timeout_s
        while True:
            if self.paused:
                self._wake()
            left = max(0.0, deadline - time.monotonic())
            msg = self.consumer.poll(min(left, self.probe_s) if self.paused else left)
            if msg is not None:
                return msg
            if not self.paused:
                self._maybe_pause()
            if time.monotonic() >= deadline:
                return None


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
    if not pos:
        return
    if asynchronous:
        sharer.commit_async(pos)
    else:
        sharer.commit_sync(pos)
