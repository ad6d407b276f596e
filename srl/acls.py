"""What each role may do on the cluster: the ACLs a principal of that role needs, and no more.

The one source of docs/security.md's ACL table (``tests/unit/test_acls.py`` checks that the two
agree), of ``srl topics plan --format acls`` (``kafka-acls.sh`` commands) and of the ACLs
``tests/integration/test_secured_kafka.py`` gives its principals before it runs the pipeline
with ``allow.everyone.if.no.acl.found=false``. Each grant says why the role needs it.

Kafka implies Describe from Read and Write, so a role that reads or writes a topic may also
look it up (``srl.kafka.topiccheck`` does, at start); a consumer group needs Read to join and
commit, Describe to look up its coordinator and read its offsets. Every srl client that only
reads assigned partitions uses the group ``{prefix}.reader`` (librdkafka looks up its
coordinator although it never joins): Describe on it.

Pure: names and operations only (``srl.kafka.acls`` creates them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from srl.topics import Layout, pool_group, trainer_group

Resource = Literal["topic", "group", "cluster"]
Pattern = Literal["literal", "prefixed"]

ROLES = ("dispatcher", "generator", "trainer", "serve", "ranker", "top", "admin")


@dataclass(frozen=True)
class Grant:
    """One ACL: allow ``operations`` on the resource ``name`` (a prefix where ``prefixed``)."""

    resource: Resource
    name: str
    pattern: Pattern
    operations: tuple[str, ...]  # Kafka's names: Read, Write, Describe, Create, DescribeConfigs
    why: str


def _topic(name: str, ops: str, why: str, prefixed: bool = False) -> Grant:
    return Grant("topic", name, "prefixed" if prefixed else "literal", tuple(ops.split()), why)


def _group(name: str, ops: str, why: str, prefixed: bool = False) -> Grant:
    return Grant("group", name, "prefixed" if prefixed else "literal", tuple(ops.split()), why)


def _reader(layout: Layout) -> Grant:
    return _group(f"{layout.prefix}.reader", "Describe", "readers of assigned partitions")


def _events(layout: Layout) -> list[Grant]:
    return [
        _topic(layout.metrics, "Write", "metric events"),
        _topic(layout.dlq, "Write", "records it cannot use, with the reason"),
    ]


def dispatcher(layout: Layout, pools: Sequence[str] = ()) -> list[Grant]:
    """``pools``: the pools whose backlog bounds an unpaced dispatcher (``--max-pending``)."""
    p = layout.prefix
    out = [
        _topic(f"{p}.prompts.", "Write Read", "publishes tasks; reads them back at start", True),
        _topic(layout.trajectories, "Read", "what was generated of tasks a broker lost"),
        _topic(layout.weights, "Read", "paced: the steps the trainer announced"),
        *_events(layout),
        _reader(layout),
    ]
    why = "unpaced: the pool's backlog (--max-pending)"
    return out + [_group(pool_group(p, pool), "Describe", why) for pool in pools]


def generator(layout: Layout, pool: str = "regular", run: str = "default") -> list[Grant]:
    """A worker of ``pool`` that follows ``run``'s weights and backlog."""
    p, trainer = layout.prefix, trainer_group(layout.prefix, run)
    return [
        _topic(f"{p}.prompts.", "Read", "tasks of its buckets", True),
        _topic(f"{p}.resume.", "Read Write", "resumed tasks; stragglers it hands on", True),
        _topic(layout.trajectories, "Write Read", "chunks; a redelivered task's prefix"),
        _topic(layout.weights, "Read", "the run's weights announcements"),
        *_events(layout),
        _topic(layout.pool_epochs, "Read Write", "pool epochs (pool_liveness)"),
        _topic(layout.pool_beats, "Read Write", "pool heartbeats (pool_liveness)"),
        _group(pool_group(p, pool), "Read", "the pool's committed task positions"),
        _group(trainer, "Describe", "the trainer's backlog (its commits)"),
        _group(f"{trainer}.position", "Describe", "the trainer's backlog (its read position)"),
        _reader(layout),
    ]


def trainer(layout: Layout, run: str = "default") -> list[Grant]:
    group = trainer_group(layout.prefix, run)
    return [
        _topic(layout.trajectories, "Read", "the chunks it trains on"),
        _topic(layout.feedback, "Read", "rewards of served completions"),
        _topic(layout.weights, "Write", "announces each version"),
        *_events(layout),
        _group(group, "Read", "its consumer group"),
        _group(f"{group}.position", "Read", "shares how far it has read"),
    ]


def serve(layout: Layout) -> list[Grant]:
    return [
        _topic(layout.trajectories, "Write", "served completions, chunk by chunk"),
        _topic(layout.feedback, "Write", "POST /v1/feedback"),
        _topic(layout.weights, "Read", "the lead run's weights"),
        *_events(layout),
        _reader(layout),
    ]


def ranker(layout: Layout, run: str = "default") -> list[Grant]:
    return [
        _topic(layout.trajectories, "Read", "the lengths generated"),
        *_events(layout),
        _group(f"{layout.prefix}.ranker.{run}", "Read", "its consumer group"),
    ]


def top(layout: Layout) -> list[Grant]:
    p = layout.prefix
    return [
        _topic(f"{p}.", "Describe", "partitions and watermarks of every srl topic", True),
        _topic(layout.metrics, "Read", "the metric events"),
        _topic(layout.trajectories, "Read", "samples the backlog's chunks"),
        _topic(layout.weights, "Read", "the run's newest announcement"),
        _group(f"{p}.", "Describe", "lists the prefix's groups, their members and offsets", True),
    ]


def admin(layout: Layout) -> list[Grant]:
    """``srl topics create|check``: the admin step."""
    p = layout.prefix
    return [_topic(f"{p}.", "Create Describe DescribeConfigs", "creates and checks topics", True)]


def grants(
    role: str,
    layout: Layout,
    run: str = "default",
    pool: str = "regular",
    pools: Sequence[str] = (),
) -> list[Grant]:
    """The grants of ``role`` (one of :data:`ROLES`)."""
    if role == "dispatcher":
        return dispatcher(layout, pools)
    if role == "generator":
        return generator(layout, pool, run)
    if role in ("trainer", "ranker"):
        return trainer(layout, run) if role == "trainer" else ranker(layout, run)
    by_layout = {"serve": serve, "top": top, "admin": admin}
    if role not in by_layout:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    return by_layout[role](layout)
