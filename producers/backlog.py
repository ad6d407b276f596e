"""Consumer-group lag: the unconsumed backlog the producer side keeps bounded.

Owns one measure, used in two places: the records on ``topics`` that none of ``groups`` has
committed yet (per partition: high watermark minus the furthest committed offset among the
groups, or minus the low watermark where none has committed). The dispatcher bounds the lag
of the generator pools on the prompt topics (``max_pending``); a generator pauses intake while
the trainer's lag on the trajectories topic exceeds ``max_backlog_chunks``. For the trainer
the groups are its own and ``srl.kafka.position_group`` of it, where the trainer shares how
far it has read every second: its committed offsets trail every unfinished trajectory (a long
one holds its partition's offset for steps) and every checkpoint interval, so on their own
they overstate the backlog (docs/benchmarks.md: generators idle 65 % under such a bound).

One long-lived client, never a member of the groups it inspects (it only reads their
committed offsets), so measuring changes nothing. Not thread-safe: one caller thread.

The generator's side of the bound: :class:`TrainerBacklog` keeps the last measurement (taken
at most once a second, by whoever calls :meth:`TrainerBacklog.check`; today the worker's
loop) and when the trainer last moved; :func:`backlog_exceeded` (pure) is the rule that
pauses the prompt topics (``producers.intake``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from srl.config import CommonConfig
from srl.kafka import Lag


class GroupLag:
    """``srl.kafka.Lag`` of fixed groups on fixed topics, and the committed total it saw."""

    def __init__(
        self,
        cfg: CommonConfig,
        groups: Sequence[str],
        topics: Sequence[str],
        timeout_s: float = 10.0,
    ) -> None:
        self.groups = list(groups)
        self.topics = list(topics)
        self._lag = Lag(cfg, timeout_s)
        self.committed = 0  # sum of the furthest committed offsets, as of the last ``lag()``

    def lag(self) -> int:
        """Records on the topics not yet committed by any of the groups."""
        rows = self._lag.partitions(self.groups, self.topics)
        self.committed = sum(r.committed or 0 for r in rows)
        return sum(r.lag for r in rows)

    def close(self) -> None:
        self._lag.close()


def backlog_exceeded(
    backlog: int | None, bound: int | None, stalled_s: float, stall_s: float
) -> bool:
    """Over the bound, unless the trainer has moved neither its read position nor its
    committed offsets for ``stall_s`` (``stalled_s`` is how long it has not): then it is
    waiting for groups that paused intake would never finish, so intake goes on."""
    if bound is None or backlog is None or backlog <= bound:
        return False
    return stalled_s < stall_s


class TrainerBacklog:
    """The trainer's backlog as a generator last measured it, and when the trainer last moved."""

    def __init__(self, bound: int | None, stall_s: float, interval_s: float = 1.0) -> None:
        self.bound, self.stall_s, self.interval_s = bound, stall_s, interval_s
        self.value: int | None = None  # chunks the trainer has not read, as last measured
        self._committed, self._moved = -1, time.monotonic()
        self._last = time.monotonic()

    def check(self, lag: GroupLag) -> None:
        """Measure, if the backlog is bounded and ``interval_s`` passed since the last time."""
        if self.bound is None or time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        self.value = lag.lag()
        if lag.committed != self._committed:
            self._committed, self._moved = lag.committed, time.monotonic()

    def report(self, lag: GroupLag) -> int | None:
        """The value for the stats: the last measurement while bounded; unbounded, nothing
        else measures it, so it is measured now."""
        if self.bound is None:
            self.value = lag.lag()
        return self.value

    def exceeded(self) -> bool:
        """:func:`backlog_exceeded` now."""
        stalled_s = time.monotonic() - self._moved
        return backlog_exceeded(self.value, self.bound, stalled_s, self.stall_s)
