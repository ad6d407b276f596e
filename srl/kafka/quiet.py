"""``Quiet``: a group member that stops fetching the partitions it has read to their end.

Apache Kafka holds a fetch at the end of a partition for ``fetch.wait.max.ms``; the embedded
broker (noida-db 0.2.3) answers it at once, empty, and librdkafka fetches again at once: an
idle member costs about 0.4 core in the broker and as much in the client (docs/broker.md),
and a run has several (the trainer, every generator, the online ranker). ``QuietTail``
(``srl.kafka.consumer``) does this for one assigned partition; ``Quiet`` does it for a
group member's whole assignment, under its rebalances and its own pauses. Used by the
trainer, the generators' task intake and the online ranker. What must hold:

* a partition whose next offset is at its high watermark (not past it) is paused (*quiet*)
  and its watermark probed every ``probe_s`` instead, all quiet partitions in one ListOffsets
  request; when it grew, the partition is resumed and sought to the offset it stopped at
  (a resumed partition is fetched at once only when sought), so no record is skipped or
  read twice, and a new record waits at most ``probe_s`` longer than it would;
* a partition not read yet is quiet too when the offset its fetch starts at (its position,
  else the group's committed offset, else, with nothing committed, its low watermark: srl
  consumers start at ``earliest``) is at its high watermark: an empty or fully read
  partition (a resume topic, a bucket with no traffic) would otherwise fetch forever;
* a broker that forgot records it had acknowledged (the embedded one, SIGKILLed) gives their
  offsets to the next records: a quiet partition whose high watermark fell below where it
  stopped is read on from the new high watermark, so those records are not skipped;
* the application's own pauses win: a partition it paused is never resumed here, and one it
  resumes while quiet stays paused until it grows; an assignment, a revocation or a seek
  forgets what was known of its partitions;
* a pause of ours never outlives what we know: a quiet partition that is forgotten (also one
  found unassigned, revoked without a callback of ours) is resumed at once. librdkafka keeps
  a partition's pause across unassign and assign (measured: paused, unassigned, assigned
  again, 0 of 5 records read in 3 s; resumed while unassigned, 5), so one left paused was
  never fetched again after the group gave it back: the trainer read nothing after a broker
  restart's rebalance (a full ``srl chaos`` run at 49923c6, 4 minutes).

Used by ``srl.kafka.Consumer`` (group members made by ``make_consumer``), on its thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaException, Message, TopicPartition

Key = tuple[str, int]
OFFSET_LATEST = -1  # offsets_for_times: the high watermark


def key(tp: TopicPartition) -> Key:
    return tp.topic, tp.partition


class Quiet:
    """The quiet partitions of one consumer (the module docstring); ``raw`` is the
    ``confluent_kafka.Consumer``."""

    def __init__(self, raw: Any, probe_s: float) -> None:
        self.raw, self.probe_s = raw, probe_s
        self.at: dict[Key, int] = {}  # quiet: paused here, read on from this offset
        self.read: dict[Key, int] = {}  # the next offset, from the records handed out
        self.start: dict[Key, int] = {}  # not read yet: where its fetch starts
        self.held: set[Key] = set()  # paused by the application
        self.high: dict[Key, int] = {}  # high watermarks probed (newer than the client's)
        self.next_probe = 0.0

    # -- the application's calls --------------------------------------------------------------
    def paused(self, keys: Iterable[Key]) -> None:
        self.held.update(keys)

    def resumable(self, keys: Iterable[Key]) -> list[Key]:
        """The application resumes ``keys``: those to resume now (not the quiet ones)."""
        keys = list(keys)
        self.held.difference_update(keys)
        return [k for k in keys if k not in self.at]

    def forget(self, keys: Iterable[Key]) -> None:
        """Assigned, revoked, sought or found unassigned: nothing known of ``keys`` holds; the
        quiet ones among them that the application has not paused are resumed (assigned or
        not: librdkafka keeps a pause across assignments)."""
        wake = []
        for k in keys:
            if self.at.pop(k, None) is not None and k not in self.held:
                wake.append(TopicPartition(*k))
            self.read.pop(k, None)
            self.start.pop(k, None)
            self.high.pop(k, None)
        if wake:
            self.raw.resume(wake)

    def saw(self, msgs: Iterable[Message]) -> None:
        for m in msgs:
            if m.error() is None and (offset := m.offset()) is not None:
                self.read[(m.topic() or "", m.partition() or 0)] = offset + 1

    # -- the probe ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Every ``probe_s``: wake the quiet partitions that grew, quiet the caught-up ones."""
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + self.probe_s
        with contextlib.suppress(KafkaException):  # the broker is away: try at the next tick
            self._wake()
            self._settle()

    def _wake(self) -> None:
        asleep = [k for k in self.at if k not in self.held]
        if not asleep:
            return
        ask = [TopicPartition(t, p, OFFSET_LATEST) for t, p in asleep]
        for tp in self.raw.offsets_for_times(ask, timeout=2):
            k = key(tp)
            if tp.error is not None or k not in self.at or tp.offset < 0:
                continue
            if tp.offset < self.at[k]:
                # the broker forgot records it had acknowledged (a SIGKILLed embedded broker):
                # the next records take their offsets, and are read from there
                self.at[k] = tp.offset
            elif tp.offset > self.at[k]:
                self.high[k] = tp.offset  # the client's own (cached) one is older
                offset = self.read[k] = self.at.pop(k)
                self.raw.resume([TopicPartition(*k)])
                self.raw.seek(TopicPartition(k[0], k[1], offset))

    def _settle(self) -> None:
        assigned = {key(tp): tp for tp in self.raw.assignment()}
        for k in [k for k in {*self.at, *self.read, *self.start, *self.high} if k not in assigned]:
            self.forget([k])
            self.held.discard(k)
        awake = [k for k in assigned if k not in self.at and k not in self.held]
        self._find_starts([k for k in awake if k not in self.read and k not in self.start])
        for k in awake:
            pos = self.read.get(k, self.start.get(k))
            if pos is None:
                continue
            high = max(
                self.raw.get_watermark_offsets(assigned[k], cached=True)[1], self.high.get(k, -1)
            )
            # past the high watermark: the broker forgot records it had acknowledged; left
            # awake, so that librdkafka's own out-of-range reset reads them again
            if high >= 0 and pos == high:
                self.raw.pause([assigned[k]])
                self.at[k] = pos

    def _find_starts(self, unread: list[Key]) -> None:
        """Where the fetch of each unread partition starts: its position, else the group's
        committed offset, else (nothing committed: ``earliest``) its low watermark; left
        unknown while the client does not know it yet."""
        if not unread:
            return
        tps = [TopicPartition(*k) for k in unread]
        pos = {key(tp): tp.offset for tp in self.raw.position(tps)}
        if any(off < 0 for off in pos.values()):
            asked = [tp for tp in tps if pos[key(tp)] < 0]
            for tp in self.raw.committed(asked, timeout=2):
                pos[key(tp)] = tp.offset
        for k, off in pos.items():
            if off < 0:
                off = self.raw.get_watermark_offsets(TopicPartition(*k), cached=True)[0]
            if off >= 0:
                self.start[k] = off

    def assigned(self, partitions: Iterable[TopicPartition]) -> None:
        """An assignment of ``partitions``: forgotten (:meth:`forget`), and those given a
        concrete offset start there (a trainer's floor may lie above its commit)."""
        parts = list(partitions)
        self.forget(key(tp) for tp in parts)
        for tp in parts:
            if tp.offset >= 0:
                self.start[key(tp)] = tp.offset
