"""Topics, offsets and lag: administration and the reads every monitoring path shares.

* ``create_topics``: the layout's topics (``srl.topics``), created if missing;
* ``watermarks`` / ``committed_offsets``: one-shot reads; ``start_group_at``: where a group
  that has committed nothing starts (``--from latest|TIME`` of a trainer added to a run);
* ``Lag``: per-partition lag of consumer groups, in the columns of ``kafka-consumer-groups.sh``
  (``log_end_offset - current_offset``); the one lag computation of the generators' backlog
  bound, the demo's progress line and the monitor. A partition no group has committed counts
  from its low watermark (srl consumers start at ``earliest``). ``Lag`` is one long-lived
  client that never joins the groups it inspects, so measuring changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from srl.config import KafkaSettings, TopicsConfig, TopicSettings
from srl.errors import SrlError
from srl.kafka.consumer import Consumer, reader
from srl.kafka.probe import wait_for_broker
from srl.kafka.ranges import watermarks_of
from srl.kafka.settings import (
    SESSION_TIMEOUT_MS,
    base_settings,
    describe,
    for_group_protocol,
    user_settings,
)
from srl.topicplan import topic_config as created_config
from srl.topics import Layout, TopicSpec


def admin(cfg: KafkaSettings) -> AdminClient:
    return AdminClient(base_settings(cfg, "admin") | user_settings(cfg))


def create_topics(cfg: TopicsConfig, specs: Iterable[TopicSpec] | None = None) -> list[str]:
    """Create missing topics (all of the layout's by default); returns the names created.
    Where ``cfg`` has them (``TopicSettings``), its replication factor, ``min.insync.replicas``
    and ``topic_configs``; else the broker's. A topic that exists is left as it is
    (``srl topics check`` and the roles compare it with the layout)."""
    wait_for_broker(cfg)
    rf, isr, configs = None, None, "srl"
    if isinstance(cfg, TopicSettings):
        rf, isr, configs = cfg.replication_factor, cfg.min_insync_replicas, cfg.topic_configs
    specs = list(specs) if specs is not None else Layout.from_config(cfg).specs(configs)
    client = admin(cfg)
    existing = client.list_topics(timeout=cfg.connect_timeout_s).topics
    todo = [s for s in specs if s.name not in existing]
    created = _create(client, todo, cfg.connect_timeout_s, rf, isr)
    if created:
        _wait_for_leaders(client, created, cfg.connect_timeout_s)
    return created


def _create(
    client: AdminClient,
    todo: list[TopicSpec],
    timeout_s: float,
    replication: int | None = None,
    min_insync: int | None = None,
) -> list[str]:
    if not todo:
        return []
    # replication_factor -1: the broker's default.replication.factor (1 on one node, 3 on the
    # three-node cluster srl starts; KIP-464), so the same layout fits any cluster
    rf = -1 if replication is None else replication
    new = [
        NewTopic(s.name, s.partitions, replication_factor=rf, config=created_config(s, min_insync))
        for s in todo
    ]
    futures = client.create_topics(new, operation_timeout=timeout_s, request_timeout=timeout_s)
    created = []
    for name, fut in futures.items():
        try:
            fut.result()
            created.append(name)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise SrlError(f"cannot create topic {name}: {describe(e)}") from None
    return created


def _wait_for_leaders(client: AdminClient, names: list[str], timeout_s: float) -> None:
    """Until every partition of ``names`` has a leader that answers for it. Apache Kafka
    creates a topic's partitions asynchronously: its metadata can name a leader that still
    refuses a ListOffsets (NOT_LEADER_OR_FOLLOWER) for a moment after CreateTopics returned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = client.list_topics(timeout=timeout_s)
        topics = md.topics
        if all(
            n in topics
            and topics[n].partitions
            and topics[n].error is None
            and all(p.leader >= 0 and p.error is None for p in topics[n].partitions.values())
            for n in names
        ) and _leaders_answer(client, {n: len(topics[n].partitions) for n in names}):
            return
        time.sleep(0.05)


def _leaders_answer(client: AdminClient, partitions: dict[str, int]) -> bool:
    """Whether a ListOffsets of every partition succeeds (one request per leader)."""
    asked = {
        TopicPartition(t, p): OffsetSpec.latest() for t, n in partitions.items() for p in range(n)
    }
    try:
        for fut in client.list_offsets(asked, request_timeout=5).values():
            fut.result()
    except KafkaException:
        return False
    return True


def watermarks(
    cfg: KafkaSettings, topics: Iterable[str], timeout_s: float = 10.0
) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(topic, partition): (low, high)}`` for every partition of ``topics``."""
    with reader(cfg, "watermarks") as c:
        return {
            (tp.topic, tp.partition): watermarks_of(c, tp, time.monotonic() + timeout_s)
            for tp in c.partitions_of(list(topics), timeout_s)
        }


def committed_offsets(
    cfg: KafkaSettings,
    group_id: str,
    partitions: Iterable[tuple[str, int]],
    timeout_s: float = 10.0,
) -> dict[tuple[str, int], int | None]:
    """Committed offset of ``group_id`` per partition; None where nothing is committed."""
    settings = base_settings(cfg, "offsets") | {
        "group.id": group_id,
        "session.timeout.ms": SESSION_TIMEOUT_MS,
    }
    with Consumer(for_group_protocol(settings | user_settings(cfg))) as c:
        tps = c.committed([TopicPartition(t, p) for t, p in partitions], timeout=timeout_s)
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in tps}


def start_group_at(
    cfg: KafkaSettings, group_id: str, topics: Sequence[str], start: int | str
) -> dict[tuple[str, int], int]:
    """Commit a starting position for ``group_id`` on every partition of ``topics`` it has
    committed nothing on: the high watermark (``"latest"``) or the first record at or after
    ``start`` ms since the epoch (the high watermark where none is); ``"earliest"`` commits
    nothing (srl consumers start there). Partitions with a commit are left alone, so a
    restarted member resumes where it was. Returns what was committed."""
    if start == "earliest":
        return {}
    timeout_s = cfg.connect_timeout_s
    with Consumer(base_settings(cfg, "start") | {"group.id": group_id} | user_settings(cfg)) as c:
        parts = c.partitions_of(list(topics), timeout_s)
        mine = c.committed(parts, timeout=timeout_s)
        todo = [TopicPartition(tp.topic, tp.partition) for tp in mine if tp.offset < 0]
        if not todo:
            return {}
        at = {(tp.topic, tp.partition): c.get_watermark_offsets(tp, timeout_s)[1] for tp in todo}
        if isinstance(start, int):
            found = c.offsets_for_times([TopicPartition(t, p, start) for t, p in at], timeout_s)
            at |= {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}
        c.commit_sync([TopicPartition(t, p, off) for (t, p), off in at.items()])
        return at


@dataclass(frozen=True)
class PartitionLag:
    """One partition's offsets for a set of groups (the furthest committed among them)."""

    topic: str
    partition: int
    low: int
    high: int
    committed: int | None  # None: no group has committed here

    @property
    def lag(self) -> int:
        """Records not yet committed: from the low watermark where nothing is committed."""
        return max(0, self.high - (self.low if self.committed is None else self.committed))


class Lag:
    """The lag of consumer groups on topics, measured by one client that never joins them."""

    def __init__(self, cfg: KafkaSettings, timeout_s: float = 10.0) -> None:
        self.cfg, self.timeout_s = cfg, timeout_s
        self._reader = reader(cfg, "lag")
        self._groups: dict[str, Consumer] = {}

    def _group(self, group: str) -> Consumer:
        if group not in self._groups:
            settings = base_settings(self.cfg, "lag") | {
                "group.id": group,
                "session.timeout.ms": SESSION_TIMEOUT_MS,
            }
            self._groups[group] = Consumer(for_group_protocol(settings | user_settings(self.cfg)))
        return self._groups[group]

    def partitions(self, groups: Sequence[str], topics: Sequence[str]) -> list[PartitionLag]:
        """Every partition of ``topics``, with the furthest offset any of ``groups`` committed."""
        tps = self._reader.partitions_of(topics, self.timeout_s)
        if not tps:
            return []
        furthest: dict[tuple[str, int], int] = {}
        for g in groups:
            for tp in self._group(g).committed(tps, timeout=self.timeout_s):
                key = (tp.topic, tp.partition)
                furthest[key] = max(furthest.get(key, -1), tp.offset)
        rows = []
        for tp in tps:
            low, high = watermarks_of(self._reader, tp, time.monotonic() + self.timeout_s)
            done = furthest.get((tp.topic, tp.partition), -1)
            rows.append(
                PartitionLag(tp.topic, tp.partition, low, high, done if done >= 0 else None)
            )
        return rows

    def total(self, groups: Sequence[str], topics: Sequence[str]) -> int:
        """Records on ``topics`` that none of ``groups`` has committed yet."""
        return sum(r.lag for r in self.partitions(groups, topics))

    def close(self) -> None:
        for c in [self._reader, *self._groups.values()]:
            c.close()
        self._groups.clear()

    def __enter__(self) -> Lag:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def lag(cfg: KafkaSettings, groups: Sequence[str], topics: Sequence[str]) -> int:
    """One-shot ``Lag(cfg).total(groups, topics)``."""
    with Lag(cfg) as measure:
        return measure.total(groups, topics)


def topic_watermarks(
    client: AdminClient, prefix: str, timeout_s: float = 10.0
) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(topic, partition): (low, high)}`` of every topic named ``{prefix}.…``, with two
    ListOffsets round trips in all (for monitors polling many partitions)."""
    md = client.list_topics(timeout=timeout_s)
    tps = [
        TopicPartition(t, p)
        for t, tm in md.topics.items()
        if t.startswith(f"{prefix}.")
        for p in tm.partitions
    ]
    if not tps:
        return {}
    ends: dict[str, dict[tuple[str, int], int]] = {}
    for name, spec in (("low", OffsetSpec.earliest()), ("high", OffsetSpec.latest())):
        futures = client.list_offsets({tp: spec for tp in tps}, request_timeout=timeout_s)
        ends[name] = {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
    return {k: (ends["low"][k], ends["high"][k]) for k in sorted(ends["high"])}


@dataclass(frozen=True)
class Member:
    member_id: str
    host: str
    client_id: str


@dataclass(frozen=True)
class GroupState:
    """A consumer group as ``kafka-consumer-groups.sh --describe`` shows it."""

    group: str
    state: str  # STABLE, EMPTY, PREPARING_REBALANCE …
    members: int
    committed: dict[tuple[str, int], int]  # partitions with a committed offset
    owners: dict[tuple[str, int], Member]  # partitions assigned to a member


def describe_groups(
    client: AdminClient, timeout_s: float = 10.0, prefix: str | None = None
) -> list[GroupState]:
    """Every consumer group the broker lists (with ``prefix``: only those named
    ``{prefix}.…``, a deployment's own on a shared cluster), with its committed offsets and
    assignment (groups that vanish between the calls are left out)."""
    listed = client.list_consumer_groups(request_timeout=timeout_s).result()
    ids = sorted(
        g.group_id for g in listed.valid if prefix is None or g.group_id.startswith(f"{prefix}.")
    )
    if not ids:
        return []
    described = client.describe_consumer_groups(ids, request_timeout=timeout_s)
    out = []
    for gid in ids:
        try:
            desc = described[gid].result()
            req = [ConsumerGroupTopicPartitions(gid)]
            offsets = client.list_consumer_group_offsets(req, request_timeout=timeout_s)
            parts = offsets[gid].result().topic_partitions
        except KafkaException:
            continue  # the group went away between the calls
        committed = {(tp.topic, tp.partition): tp.offset for tp in parts if tp.offset >= 0}
        owners = {
            (tp.topic, tp.partition): Member(m.member_id, m.host, m.client_id)
            for m in desc.members
            for tp in (m.assignment.topic_partitions if m.assignment else [])
        }
        state = str(desc.state).split(".")[-1]
        out.append(GroupState(gid, state, len(desc.members), committed, owners))
    return out


def topic_config(cfg: KafkaSettings, topic: str) -> dict[str, str]:
    """The broker's configuration of ``topic`` (``cleanup.policy``, ``retention.ms`` …)."""
    client = admin(cfg)  # held until the result is in: a dropped client cancels the request
    res = client.describe_configs([ConfigResource("topic", topic)])
    entries = next(iter(res.values())).result(timeout=cfg.connect_timeout_s)
    return {name: str(entry.value) for name, entry in entries.items()}


@dataclass
class PartitionReplicas:
    """Where one partition lives: its leader (-1: none), replicas and in-sync replicas."""

    topic: str
    partition: int
    leader: int
    replicas: list[int]
    isrs: list[int]

    @property
    def under_replicated(self) -> bool:
        return len(self.isrs) < len(self.replicas)


def replicas(cfg: KafkaSettings, topic: str | None = None) -> list[PartitionReplicas]:
    """The partitions of ``topic`` (of every topic when None) with their leaders and in-sync
    replicas, from the cluster's metadata (what ``kafka-topics --describe`` shows)."""
    client = admin(cfg)
    md = client.list_topics(topic, timeout=cfg.connect_timeout_s)
    return [
        PartitionReplicas(name, p.id, p.leader, list(p.replicas), list(p.isrs))
        for name, t in md.topics.items()
        for p in t.partitions.values()
    ]
