"""Bookkeeping of prompt tasks in flight: which samples are done, which offsets may be committed.

Owns the rule "a prompt task's offset is committed only after every chunk of all its samples
is acknowledged by the broker", per partition and in offset order:

* :class:`TaskState` counts, for one consumed task, the samples still generating and the
  chunks produced but not yet acknowledged; it is finished when both are zero;
* :class:`OffsetTracker` holds, per prompt-topic partition, the consumed offsets in order; the
  committable position is one past the longest finished prefix, so a task finished early
  never lets the commit pass an older one still running (that one would be lost on a crash).

Pure logic; ``producers.intake`` holds the tracker (consumed offsets, commits), the worker
and ``producers.outlet`` update the task states (delivery reports, finished samples), and the
sample plans come from ``producers.planning``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from schemas.records import PromptTask

TopicPart = tuple[str, int]


@dataclass
class SamplePlan:
    """One trajectory of a task, as it will be started: from scratch or after a prefix."""

    trajectory_id: str
    sample_index: int
    prefix: list[int] = field(default_factory=list)  # completion tokens already published
    next_seq: int = 0
    started_ms: int | None = None  # the prefix's, when resuming


@dataclass
class TaskState:
    task: PromptTask
    tp: TopicPart
    offset: int
    prompt_ids: list[int] = field(default_factory=list)
    target_length: int | None = None  # metadata.sim_length (oracle length for the sim engine)
    todo: list[SamplePlan] = field(default_factory=list)  # not yet handed to the engine
    generating: set[str] = field(default_factory=set)  # trajectory ids not yet finished
    unacked: int = 0  # chunks produced, delivery not yet reported
    failed: str | None = None  # first delivery error, if any
    writer: tuple[str, int] | None = None  # (pool, epoch) it was taken in (pool epochs)
    abandoned: bool = False  # dropped unfinished (dead-lettered, fenced): deliveries moot

    @property
    def finished(self) -> bool:
        return not self.generating and self.unacked == 0 and self.failed is None


class OffsetTracker:
    def __init__(self) -> None:
        # offset -> when it finished (None: not yet), in offset order
        self._open: dict[TopicPart, dict[int, float | None]] = {}
        self._next: dict[TopicPart, int] = {}  # committable position per partition
        self._last: dict[TopicPart, int] = {}  # last offset consumed per partition

    def add(self, tp: TopicPart, offset: int) -> None:
        if offset <= self._last.get(tp, -1):
            raise ValueError(f"{tp}: offset {offset} is not after the last one consumed")
        self._last[tp] = offset
        self._open.setdefault(tp, {})[offset] = None

    def finish(self, tp: TopicPart, offset: int, at: float = -math.inf) -> bool:
        """Mark a consumed offset finished (``at``: when, for :meth:`committable`'s cutoff);
        True the first time (False if unknown or already)."""
        offsets = self._open.get(tp)
        if offsets is None or offset not in offsets or offsets[offset] is not None:
            return False
        offsets[offset] = at
        return True

    def committable(self, before: float = math.inf) -> dict[TopicPart, int]:
        """Positions that moved since the last call: one past each partition's prefix of
        offsets finished (at or) before ``before`` (``producers.ackguard``)."""
        moved: dict[TopicPart, int] = {}
        for tp, offsets in self._open.items():
            last = None
            for offset, done in list(offsets.items()):
                if done is None or done > before:
                    break
                del offsets[offset]
                last = offset
            if last is not None:
                self._next[tp] = moved[tp] = last + 1
        return moved

    def positions(self) -> dict[TopicPart, int]:
        """Every committable position this worker owns (recommitting one is harmless)."""
        return dict(self._next)

    def forget(self, tps: list[TopicPart], keep_positions: bool = False) -> None:
        """Drop partitions this worker no longer owns (their unfinished tasks are redelivered).

        ``keep_positions``: their commit failed (a rebalance, a lost assignment); keep the finished
        positions so they are committed if the partition comes back (:meth:`retain`).
        """
        for tp in tps:
            self._open.pop(tp, None)
            self._last.pop(tp, None)
            if not keep_positions:
                self._next.pop(tp, None)

    def retain(self, owned: set[TopicPart]) -> None:
        """After an assignment: keep kept positions only for partitions owned again."""
        for tp in [tp for tp in self._next if tp not in owned and tp not in self._open]:
            del self._next[tp]

    def in_flight(self) -> int:
        return sum(len(v) for v in self._open.values())
