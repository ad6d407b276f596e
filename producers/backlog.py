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

The generator's side of the bound: :class:`TrainerBacklog` measures in a background thread
(``start``: at once, then every ``interval_s``; a ``GroupLag`` call is about 11 broker round
trips, ~0.5 s across a 50 ms link, which the decode loop must never wait for) and hands the
worker's loop the last number and when the trainer last moved; reading them never blocks.
A measurement that fails with a Kafka error keeps the last number (logged); any other error
is handed to the worker (:meth:`TrainerBacklog.check`). :func:`backlog_exceeded` (pure) is the
rule that pauses the prompt topics (``producers.intake``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from srl.config import CommonConfig
from srl.kafka import KafkaException, Lag, describe

log = logging.getLogger("srl.generate")


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


class LagSource(Protocol):
    """What :class:`TrainerBacklog` measures with (a :class:`GroupLag`)."""

    committed: int

    def lag(self) -> int: ...

    def close(self) -> None: ...


class TrainerBacklog:
    """The trainer's backlog, measured off the caller's thread; see the module docstring."""

    def __init__(self, bound: int | None, stall_s: float, interval_s: float = 1.0) -> None:
        self.bound, self.stall_s, self.interval_s = bound, stall_s, interval_s
        self.value: int | None = None  # chunks the trainer has not read, as last measured
        self.measurements = 0
        self._committed, self._moved = -1, time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, lag: LagSource) -> TrainerBacklog:
        """Measure with ``lag`` in a background thread until :meth:`stop` (which closes it)."""
        self._thread = threading.Thread(
            target=self._run, args=(lag,), name="trainer-backlog", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)

    def check(self) -> None:
        """Re-raise what broke the measuring thread (a Kafka error does not)."""
        if self._error is not None:
            raise self._error

    def _run(self, lag: LagSource) -> None:
        try:
            while not self._stop.is_set():
                self.measure(lag)
                self._stop.wait(self.interval_s)
        except BaseException as e:  # handed to the worker's loop by check()
            self._error = e
        finally:
            lag.close()

    def measure(self, lag: LagSource) -> None:
        """One measurement (the thread's; tests call it directly)."""
        try:
            value = lag.lag()
        except KafkaException as e:  # the last number stands; the next try may succeed
            log.info("measuring the trainer's backlog: %s", describe(e))
            return
        with self._lock:
            self.value = value
            self.measurements += 1
            if lag.committed != self._committed:
                self._committed, self._moved = lag.committed, time.monotonic()

    def exceeded(self) -> bool:
        """:func:`backlog_exceeded` now, from the last measurement."""
        with self._lock:
            value, stalled_s = self.value, time.monotonic() - self._moved
        return backlog_exceeded(value, self.bound, stalled_s, self.stall_s)
