"""Records → trajectories, for the trainer: decode, offset holds, assembly, the length check.

Owns what happens to one record of the trajectories topic before it is a trajectory. What
must hold:

* every record's offset is noted in the ``OffsetTracker``, held by its trajectory unless that
  trajectory's outcome is already durable (``Outcomes.durable``), so a commit never passes a
  record that an undecided (or not yet checkpointed) trajectory needs; and in the ledger
  (``Ledger.seen``), so an entry is pruned only once the commit has passed all its records;
* an oversized or undecodable record, another record type, a chunk malformed on its own
  (a negative policy version included) or stamped with a version no run has published (from
  the future: ``srl.weights.KnownVersions``) goes to ``{prefix}.dlq`` with the reason and its
  origin (``srl.metrics``), holds nothing, and training goes on;
* a trajectory that can never train (inconsistent chunks, longer than the model's
  ``max_length`` or ``--max-train-tokens``: a restart would read it again and run out of
  memory again) is dead-lettered and returned as :class:`Invalid`: the trainer decides it
  ``invalid`` and fills its slot in the group;
* so is, without the dead letter, one aborted (``finish_reason = abort``) or sampled at
  settings the trainer does not represent (``untrainable_settings``: another temperature,
  greedy, a top-p cut; docs/serving.md, "Behaviour policy").

It owns the assembler (``consumers.assembler``) and the offset tracker the trainer commits from
(``consumers.offsets``). Called by ``consumers.trainer`` once per record of its hot loop;
nothing is logged per record but a consumer error.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

from consumers.assembler import Assembler, BadChunk, BadTrajectory, Trajectory
from consumers.offsets import OffsetTracker
from consumers.outcomes import Outcomes
from schemas.records import ABORTED, TrajectoryChunk
from srl.kafka import Consumer, Producer, TopicPartition, produced_ms
from srl.metrics import Metrics, dead_letter, origin, read_record

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
        max_len: tuple[int, str],
        expire_s: float,
        producer: Producer,
        metrics: Metrics,
        versions: Versions,
        temperature: float = 1.0,
    ) -> None:
        self.outcomes = outcomes
        self.temperature = temperature  # the trainer's: the one sampling setting it represents
        self.assembler = Assembler(outcomes.ledger, expire_s)  # the ledger's ids are duplicates
        self.tracker = OffsetTracker()
        # the longest sequence that may train (prompt + completion), and what sets it: the
        # model's positions or --max-train-tokens
        self.max_len, self.max_why = max_len
        self.producer, self.metrics = producer, metrics
        self.versions = versions  # which policy versions exist (srl.weights.KnownVersions)

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
        try:
            traj = self.assembler.add(chunk)
        except BadChunk as e:
            # dead-lettered: the record is finished once the DLQ has it, so it holds nothing
            # (a hold taken for it would wait for an outcome its trajectory may never get)
            self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), None)
            self._dead_letter(msg, f"bad chunk {tid}/{chunk.seq}: {e}")
            return None
        except BadTrajectory as e:
            self._seen(msg, tid, holder)
            return self._invalid(msg, chunk, str(e))
        self._seen(msg, tid, holder)
        if traj is not None and traj.finish_reason == ABORTED:
            # cut short (a served choice whose client went away, a shutdown): not the answer
            # the policy would have given, so never trained; decided invalid, its group slot
            # filled. Not a dead letter: nothing is wrong with the record.
            return Invalid(chunk, f"trajectory {tid}: aborted after {traj.n_tokens} tokens")
        if traj is not None and (why := untrainable_settings(traj, self.temperature)):
            return Invalid(chunk, f"trajectory {tid}: {why}")  # counted like an abort
        if traj is not None and traj.length > self.max_len:
            reason = f"trajectory {tid}: {traj.length} tokens > {self.max_why} {self.max_len}"
            return self._invalid(msg, chunk, reason)
        return traj

    def _seen(self, msg: Any, tid: str, holder: str | None) -> None:
        """A record of ``tid`` that the assembler took (or dropped as a duplicate)."""
        self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), holder)
        self.outcomes.ledger.seen(tid, msg.partition(), msg.offset())

    def assign(self, consumer: Consumer, partitions: list[TopicPartition], topic: str) -> None:
        """The group's ``on_assign``: each partition from its committed offset, the partitions
        of ``topic`` (trajectories) never below the ledger's floor (records there are finished
        and their entries pruned, so a group that lost its committed offsets, or a new group
        id, must not read them again)."""
        floor = self.outcomes.ledger.floor
        low = {
            (tp.topic, tp.partition): floor[str(tp.partition)]
            for tp in partitions
            if tp.topic == topic and str(tp.partition) in floor
        }
        consumer.assign_from(partitions, low)

    def checkpointed(self, decided: set[str], step: int) -> int:
        """After the checkpoint of trainer step ``step`` and its commit: ``decided`` (now
        durable in the ledger, its records released before the commit) no longer remembered by
        the assembler; the ledger pruned to what the committed offsets can still deliver again
        and the last ``REMEMBER_STEPS`` steps' decisions (``Ledger.prune``). Returns how many
        ledger entries were pruned."""
        self.assembler.forget(decided)
        committed = {p: off for (_t, p), off in self.tracker.committed.items()}
        return self.outcomes.ledger.prune(committed, step)

    def _decode(self, msg: Any) -> TrajectoryChunk | None:
        """The chunk, or None after dead-lettering a record that is not one (oversized,
        undecodable, another record type) or that claims a policy version no run has
        published: such a record holds nothing."""
        chunk = read_record(msg, TrajectoryChunk, self.producer, self.metrics.layout, self.metrics)
        if chunk is not None:
            v = chunk.policy_version
            if v < 0 or self.versions.exists(v, produced_ms(msg)):
                return chunk  # a negative version is the assembler's BadChunk
            why = f"policy version {v} from the future (newest published: {self.versions.newest})"
            self._dead_letter(msg, f"bad chunk {chunk.trajectory_id}/{chunk.seq}: {why}")
        self.tracker.seen(msg.topic(), msg.partition(), msg.offset(), None)
        return None

    def _invalid(self, msg: Any, chunk: TrajectoryChunk, reason: str) -> Invalid:
        self._dead_letter(msg, reason)
        return Invalid(chunk, reason)

    def _dead_letter(self, msg: Any, reason: str) -> None:
        layout, where = self.metrics.layout, origin(msg)
        dead_letter(self.producer, layout, msg.value(), msg.key(), reason, where, self.metrics)


class Versions(Protocol):
    """Which policy versions exist (``srl.weights.KnownVersions``)."""

    newest: int

    def exists(self, version: int, produced_ms: int | None = None) -> bool: ...


def untrainable_settings(traj: Trajectory, temperature: float) -> str | None:
    """Why ``traj`` was sampled at settings the trainer cannot represent, or None.

    The trainer recomputes log-probs as ``log_softmax(logits / T)`` at its own ``T`` with no
    truncation, so it trains only on samples drawn at that temperature with ``top_p = 1``;
    a greedy sample (``T = 0``, a point mass), another temperature or a nucleus cut would
    give importance and PPO ratios against a distribution that was not sampled from.
    Settings absent (null) are the generator's own: the run's, which the trainer shares.
    """
    t = traj.temperature
    top_p = 1.0 if traj.top_p is None else traj.top_p
    if t is None or (math.isclose(t, temperature, rel_tol=1e-6) and top_p >= 1):
        return None
    return (
        f"sampled at temperature {t:g}, top_p {top_p:g}; the trainer represents only"
        f" temperature {temperature:g}, top_p 1"
    )
