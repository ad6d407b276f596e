"""Records → trajectories, for the trainer: decode, offset holds, assembly, the length check.

Owns what happens to one record of the trajectories topic before it is a trajectory. What
must hold:

* every record's offset is noted in the ``OffsetTracker``, held by its trajectory unless that
  trajectory's outcome is already durable (``Outcomes.durable``), so a commit never passes a
  record that an undecided (or not yet checkpointed) trajectory needs;
* an undecodable record, or a chunk malformed on its own, goes to ``{prefix}.dlq`` with the
  reason and its origin (``srl.metrics.dead_letter``), and training goes on;
* a trajectory that can never train (inconsistent chunks, longer than the model's
  ``max_length``) is dead-lettered and returned as :class:`Invalid`: the trainer decides it
  ``invalid`` and fills its slot in the group.

It owns the assembler (``consumers.assembler``) and the offset tracker the trainer commits from
(``consumers.offsets``). Called by ``consumers.trainer`` once per record of its hot loop;
nothing is logged per record but a consumer error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from consumers.assembler import Assembler, BadChunk, BadTrajectory, Trajectory
from consumers.offsets import OffsetTracker
from consumers.outcomes import Outcomes
from schemas.codec import SchemaError
from schemas.records import TrajectoryChunk, decode_as
from srl.kafka import Producer
from srl.metrics import Metrics, dead_letter

log = logging.getLogger("srl.trainer")


@dataclass(frozen=True)
class Invalid:
    """A trajectory that can never train: the chunk that showed it, and why."""

    chunk: TrajectoryChunk
    reason: str


class Intake:
    """Decodes and assembles records; see the module docstring for what holds."""

    def __init__(
        self,
        outcomes: Outcomes,
        max_len: int,
        expire_s: float,
        producer: Producer,
        metrics: Metrics,
    ) -> None:
        self.outcomes = outcomes
        self.assembler = Assembler(outcomes.ledger, expire_s)  # the ledger's ids are duplicates
        self.tracker = OffsetTracker()
        self.max_len = max_len  # the model's longest sequence (prompt + completion)
        self.producer, self.metrics = producer, metrics

    def add(self, msg: Any) -> Trajectory | Invalid | None:
        """The trajectory record ``msg`` (a ``srl.kafka.Message``) completes, an invalid one,
        or None (an incomplete trajectory, a duplicate, a dead letter, a consumer error)."""
        if msg.error():
            log.warning("consumer: %s", msg.error())
            return None
        chunk = self._decode(msg)
        if chunk is None:
            return None
        tid = chunk.trajectory_id
        holder = None if self.outcomes.durable(tid) else tid
        self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), holder)
        try:
            traj = self.assembler.add(chunk)
        except BadChunk as e:
            self._dead_letter(msg, f"bad chunk {tid}/{chunk.seq}: {e}")
            return None
        except BadTrajectory as e:
            return self._invalid(msg, chunk, str(e))
        if traj is not None and traj.length > self.max_len:
            reason = f"trajectory {tid}: {traj.length} tokens > the model's {self.max_len}"
            return self._invalid(msg, chunk, reason)
        return traj

    def _decode(self, msg: Any) -> TrajectoryChunk | None:
        try:
            return decode_as(msg.value() or b"", TrajectoryChunk)
        except SchemaError as e:
            self._dead_letter(msg, f"undecodable: {e}")
            self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), None)
            return None

    def _invalid(self, msg: Any, chunk: TrajectoryChunk, reason: str) -> Invalid:
        self._dead_letter(msg, reason)
        return Invalid(chunk, reason)

    def _dead_letter(self, msg: Any, reason: str) -> None:
        origin = f"{msg.topic()}/{msg.partition()}@{msg.offset()}"
        dead_letter(
            self.producer, self.metrics.layout, msg.value(), msg.key(), reason, origin, self.metrics
        )
