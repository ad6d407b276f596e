"""Trajectory ids, and reading a trajectory's published prefix back from the trajectories topic.

Owns how a worker finds out what already exists of a trajectory before it generates it:

* A fresh task's trajectory ids are derived from ``(task_id, sample_index)``
  (:func:`trajectory_id_for`), so whichever worker takes a redelivered task writes the same
  trajectory, continuing the same seq numbering instead of starting a second copy.
* :func:`read_prefixes` reads the partitions those trajectories live on, from the task's
  creation time (minus a clock-skew slack, located with ``offsets_for_times``) to the high
  watermark, and returns for each trajectory the chunks that count from its first expected
  seq (as the trainer's assembler counts them, ``srl.lineage``: a zombie writer's are not):
  *complete* (contiguous through ``is_last``: nothing to do), a *prefix* to resume (prefill and
  continue at the next seq), *migrated* (a ``MIGRATED`` chunk: the previous owner handed the
  trajectory to the long-tail pool, which continues it), or nothing (generate from the
  start). A gap in the seq numbers
  cannot come from an idempotent producer; it is reported so the task goes to the DLQ.

Called by the worker for tasks that may have been started by a previous owner of their
partition (a crashed or stopped worker; what to do with what was found is the pure
``producers.planning.recovered``), by the intake (``take_over_offsets``), and by anything
that builds ``ResumePrefix`` tasks (e.g. moving stragglers to the long-tail pool).
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field

from schemas.records import MIGRATED, SchemaError, TrajectoryChunk, decode_as
from srl.config import CommonConfig
from srl.kafka import TopicPartition, committed_offsets, make_consumer, read_range
from srl.lineage import Lineage
from srl.topics import Layout

_NAMESPACE = uuid.UUID("6f1d2a8e-3c1b-4f7a-9d8e-5a4b3c2d1e0f")


def trajectory_id_for(task_id: str, sample_index: int) -> str:
    """The id of sample ``sample_index`` of task ``task_id`` (uuid5 hex: stable across
    redeliveries)."""
    return uuid.uuid5(_NAMESPACE, f"{task_id}/{sample_index}").hex


@dataclass
class Found:
    """What the topic holds of one trajectory from its first expected seq on: the chunks that
    count, as the trainer will see them (``srl.lineage``: first copy, fenced writers out)."""

    chunks: dict[int, TrajectoryChunk] = field(default_factory=dict)  # seq -> chunk that counts
    lineage: Lineage = field(init=False)  # shares ``chunks``

    def __post_init__(self) -> None:
        self.lineage = Lineage(self.chunks)

    def add(self, chunk: TrajectoryChunk) -> None:
        self.lineage.add(chunk)

    def contiguous(self, first_seq: int) -> list[TrajectoryChunk]:
        return self.lineage.contiguous(first_seq)

    def state(self, first_seq: int, writer: tuple[str, int] | None = None) -> str:
        """'none', 'prefix', 'complete', 'migrated' (handed to another pool: not ours to
        continue) or 'gap'. Chunks after a gap that ``writer`` (the resumer's pool and epoch)
        fences, an older epoch's of its pool, are a dropped writer's that failed to deliver
        some of its queue (cut off past its delivery timeout): resuming after the contiguous
        run fences them for every reader (``srl.lineage``), so that is no gap."""
        run = self.contiguous(first_seq)
        if run and run[-1].is_last:
            return "complete"
        if any(c.finish_reason == MIGRATED for c in run):
            return "migrated"
        end = run[-1].seq if run else first_seq - 1
        beyond = [c for s, c in self.chunks.items() if s > end]
        if beyond and not (writer is not None and all(fences(writer, c) for c in beyond)):
            return "gap"
        return "prefix" if run else "none"


def fences(writer: tuple[str, int], chunk: TrajectoryChunk) -> bool:
    """Whether a chunk of ``writer`` (pool, epoch) fences ``chunk`` (srl.lineage's rule)."""
    pool, epoch = writer
    return chunk.pool == pool and chunk.pool_epoch is not None and chunk.pool_epoch < epoch


def read_prefixes(
    cfg: CommonConfig,
    layout: Layout,
    wanted: dict[str, tuple[int, int]],
    since_ms: int,
    timeout_s: float = 30.0,
) -> dict[str, Found]:
    """Chunks of ``wanted`` trajectories (``{trajectory_id: (partition, first_seq)}``) written
    since ``since_ms``."""
    found = {tid: Found() for tid in wanted}
    partitions = sorted({p for p, _ in wanted.values()})
    if not partitions:
        return found
    records = read_range(
        cfg,
        layout.trajectories,
        partitions,
        since_ms=since_ms,
        timeout_s=timeout_s,
        role="recovery",
    )
    for msg in records:
        key = (msg.key() or b"").decode(errors="replace")
        if key not in found:
            continue
        with contextlib.suppress(SchemaError):  # the trainer dead-letters bad chunks; skip here
            chunk = decode_as(msg.value() or b"", TrajectoryChunk)
            if chunk.seq >= wanted[key][1]:
                found[key].add(chunk)
    return found


def take_over_offsets(
    cfg: CommonConfig, old_group: str, new_group: str, topics: list[str], timeout_s: float = 10.0
) -> dict[tuple[str, int], int]:
    """Copy ``old_group``'s committed positions on ``topics`` to ``new_group`` where it has none.

    For a pool whose group is wedged by a member the broker never evicts (the embedded broker
    after a SIGKILL, docs/broker.md): the replacement workers run under a new group that starts
    where the old one had committed, and redeliver (and resume from their prefix) the tasks the
    dead worker had not finished. Partitions ``new_group`` already committed are left alone,
    so a restarted replacement does not go back. Returns what was copied.
    """

    with make_consumer(cfg, new_group, "takeover") as c:  # commits only, never joins
        parts = [(tp.topic, tp.partition) for tp in c.partitions_of(topics, timeout_s)]
        old = committed_offsets(cfg, old_group, parts, timeout_s)
        mine = committed_offsets(cfg, new_group, parts, timeout_s)
        copy = {tp: off for tp, off in old.items() if off is not None and mine.get(tp) is None}
        if copy:
            c.commit_sync([TopicPartition(t, p, off) for (t, p), off in copy.items()])
        return copy
