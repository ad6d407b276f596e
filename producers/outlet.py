"""The generator's output side: trajectories from their start in the engine to acknowledged chunks.

Owns, for one worker, the trajectories in its engine (:attr:`Outlet.by_tid`: trajectory id →
its task), their chunker, the straggler tracking (``producers.migration``) and the delivery
accounting of every chunk. What must hold:

* every chunk is produced with key = trajectory id to ``Layout.partition_for(bucket,
  trajectory_id)``, counted in its task's ``unacked`` until its delivery report; a failed
  delivery marks the task failed (it is never committed) and is fatal to the worker
  (:meth:`Outlet.check`), unless the task was abandoned meanwhile (:meth:`Outlet.kill`);
* a task is reported back (the ``done`` callback: the worker asks the intake whether it is
  finished) whenever one of its trajectories ends, a chunk of it is acknowledged, or one of
  its trajectories migrates;
* a trajectory leaving this worker unfinished (revocation, shutdown: :meth:`Outlet.hand_off`)
  has its open partial chunk published first, so the next owner resumes from its prefix;
* a straggler moves to the long-tail pool in ``ranker.migrate``'s exactly-once order
  (:meth:`Outlet.migrate`): hand-off chunk acknowledged, then the resume task sent and
  acknowledged, then the sample counted done; each step follows a delivery report, so the
  decode loop never waits for the broker (revocation and shutdown wait: :meth:`Outlet.settle`).

The producer and the metrics come with :meth:`Outlet.open`, once the worker runs. Called by
``producers.worker`` on its one thread (delivery reports arrive inside ``producer.poll`` /
``flush`` on that thread too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from producers.chunker import Chunker
from producers.config import GenerateConfig
from producers.engines.base import Emitted, Engine
from producers.migration import Stragglers
from producers.planning import request_for, trajectory_start
from producers.tasks import SamplePlan, TaskState
from schemas.records import PromptTask, TrajectoryChunk, encode
from srl.errors import ProducerFailed, SrlError
from srl.kafka import DeliveryCallback, KafkaError, Producer
from srl.metrics import Metrics
from srl.topics import Layout

log = logging.getLogger("srl.generate")


class Counts(Protocol):
    """What the outlet counts (the worker's ``GenSummary``)."""

    worker_id: str
    tokens: int
    trajectories: int
    chunks: int
    handed_off: int
    migrated: int


class Outlet:
    """The trajectories one worker generates, their chunks, deliveries and hand-offs."""

    def __init__(
        self,
        cfg: GenerateConfig,
        layout: Layout,
        engine: Engine,
        counts: Counts,
        done: Callable[[TaskState], None],
    ) -> None:
        self.layout, self.engine, self.counts = layout, engine, counts
        self.chunker = Chunker(cfg.chunk_tokens, cfg.worker_name)
        self.stragglers = Stragglers.from_config(cfg)
        self.by_tid: dict[str, TaskState] = {}  # trajectories in the engine or migrating
        self.moving: dict[str, _Move] = {}  # migrations under way, by trajectory id
        self.delivery_error: str | None = None
        self._done = done
        self.producer: Producer
        self.metrics: Metrics

    def open(self, producer: Producer, metrics: Metrics) -> None:
        self.producer, self.metrics = producer, metrics

    def check(self) -> None:
        """A failed chunk is fatal: the worker stops without committing its task."""
        if self.delivery_error is not None:
            if self.producer.fatal:  # every undelivered record failed with the producer
                raise ProducerFailed(
                    f"the generator's producer failed for good: {self.delivery_error}"
                )
            raise SrlError(
                f"chunk delivery failed ({self.delivery_error}); stopping without committing the "
                f"task"
            )

    # -- trajectories ---------------------------------------------------------------------------
    def start(self, st: TaskState, plan: SamplePlan) -> None:
        self.engine.add(request_for(st, plan))
        self.chunker.open(trajectory_start(st, plan))
        self.by_tid[plan.trajectory_id] = st
        if self.stragglers is not None:
            self.stragglers.start(st.task, plan.trajectory_id, plan.sample_index, plan.prefix)

    def publish(self, outputs: list[Emitted]) -> None:
        """One decode step's outputs, through the chunker into the producer."""
        for e in outputs:
            st = self.by_tid.get(e.key)
            if st is None:
                continue
            version = self.engine.version if e.version is None else e.version
            for chunk in self.chunker.add(e.key, e.tokens, e.logprobs, version, e.finish_reason):
                self.produce(chunk, st)
            self.counts.tokens += len(e.tokens)
            if self.stragglers is not None:
                self.stragglers.add(e.key, e.tokens, version)
            if e.finish_reason is not None:
                if self.stragglers is not None:
                    self.stragglers.forget(e.key)
                del self.by_tid[e.key]
                st.generating.discard(e.key)
                self.counts.trajectories += 1
                self._done(st)

    def produce(
        self, chunk: TrajectoryChunk, st: TaskState, on_acked: Callable[[], None] | None = None
    ) -> None:
        """Send one chunk of ``st``'s; ``on_acked`` is called once the broker has it."""
        st.unacked += 1

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            st.unacked -= 1
            if err is not None and not st.abandoned:
                st.failed = st.failed or err.str()
                self.delivery_error = self.delivery_error or err.str()
            elif on_acked is not None:
                on_acked()
            self._done(st)

        self.producer.produce(
            self.layout.trajectories,
            encode(chunk),
            key=chunk.trajectory_id,
            partition=self.layout.partition_for(chunk.bucket, chunk.trajectory_id),
            on_delivery=delivered,
        )
        self.counts.chunks += 1

    def flush_open(self) -> None:
        """Publish every open partial chunk (before a weight swap: no chunk mixes versions)."""
        for chunk in self.chunker.flush_all():
            self.produce(chunk, self.by_tid[chunk.trajectory_id])

    # -- leaving this worker unfinished ---------------------------------------------------------
    def abort_waiting(self) -> None:
        """Drop what the engine has queued but not started (shutdown: it is redelivered)."""
        for r in list(self.engine.waiting):
            self.engine.abort(r.key)
            self.chunker.drop(r.key)
            self.by_tid.pop(r.key, None)

    def hand_off(self, states: list[TaskState]) -> None:
        """Leave unfinished trajectories to the partition's next owner: finish the migrations
        under way, then publish the open chunks."""
        self.settle()
        for st in states:
            for tid in list(st.generating):
                if tid in self.by_tid:
                    self.engine.abort(tid)
                    if (chunk := self.chunker.flush(tid)) is not None:
                        self.produce(chunk, st)
                    self.chunker.drop(tid)
                    del self.by_tid[tid]
                    self.counts.handed_off += 1
            st.todo.clear()

    def kill(self, st: TaskState) -> None:
        """Stop every trajectory of a task that goes to the DLQ or is dropped (a fenced worker),
        publishing nothing more; its chunks still in flight no longer matter."""
        st.abandoned = True
        for tid in list(st.generating):
            self.engine.abort(tid)
            self.chunker.drop(tid)
            self.by_tid.pop(tid, None)
        st.generating.clear()

    # -- migration -------------------------------------------------------------------------------
    def migrate(self) -> None:
        """Move migrations under way one step on, then start one for every straggler due."""
        if self.stragglers is None:
            return
        self._advance()
        for tid in self.stragglers.due():
            if tid in self.by_tid and tid in self.chunker:
                self._start_move(self.stragglers, tid)
            self.stragglers.forget(tid)

    def settle(self) -> None:
        """Finish every migration under way, waiting for the broker (revocation, shutdown:
        a straggler's prefix is never left without its resume task). SrlError if a record of
        one failed."""
        while self.moving:
            self.producer.flush()
            self.check()
            self._advance()

    def _start_move(self, stragglers: Stragglers, tid: str) -> None:
        """Step 1 of ``ranker.migrate``'s exactly-once order: the hand-off chunk goes out; the
        resume task follows once the broker has acknowledged it (:meth:`_advance`), so decoding
        never waits for either.

        A crash before the hand-off chunk is acknowledged: the task is redelivered and resumed
        here (plain recovery). After it, before the resume task is acknowledged: a redelivered
        task skips the trajectory (recovery sees ``MIGRATED``) and nobody continues it; the
        trainer expires the prefix and counts it (``expired``), never trains it twice.
        """
        st = self.by_tid[tid]
        self.engine.abort(tid)  # its engine slot is free now; the sample is done here at step 3
        chunk = self.chunker.hand_off(tid, self.engine.version)
        task, generated = stragglers.task(
            st.task, tid, chunk.seq + 1, st.prompt_ids, self.engine.version
        )
        move = _Move(tid, st, chunk, task, generated)
        self.moving[tid] = move
        self.produce(chunk, st, on_acked=move.acked)

    def _advance(self) -> None:
        """2. once a hand-off chunk (and so its prefix, earlier on its partition) is on the
        broker, its resume task goes out; 3. once that is acknowledged, the slot is freed."""
        for move in list(self.moving.values()):
            if move.chunk_acked and not move.task_sent and self.delivery_error is None:
                self.producer.produce(
                    self.layout.resumes(move.task.bucket),
                    encode(move.task),
                    key=move.task.prompt_id,
                    on_delivery=self._task_delivered(move),
                )
                move.task_sent = True
            if move.task_acked:
                self._moved(move)

    def _task_delivered(self, move: _Move) -> DeliveryCallback:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                move.task_acked = True
            else:
                self.delivery_error = self.delivery_error or f"resume task: {err.str()}"

        return delivered

    def _moved(self, move: _Move) -> None:
        st, tid, chunk, task = move.st, move.tid, move.chunk, move.task
        del self.moving[tid]
        self.by_tid.pop(tid, None)
        st.generating.discard(tid)
        self.counts.migrated += 1
        predicted = st.task.predicted_length
        values = {
            "generated": float(move.generated),
            "predicted": float(predicted or 0),
            "next_seq": float(chunk.seq + 1),
        }
        labels = {"worker_id": self.counts.worker_id, "trajectory_id": tid, "to": task.bucket}
        self.metrics.emit("migrated", values, labels)
        log.info(
            "migrated %s to %s after %d tokens (predicted %s)",
            tid,
            task.bucket,
            move.generated,
            predicted,
        )
        self._done(st)


@dataclass
class _Move:
    """A straggler on its way to the long-tail pool: its hand-off chunk and resume task."""

    tid: str
    st: TaskState
    chunk: TrajectoryChunk
    task: PromptTask
    generated: int
    chunk_acked: bool = False
    task_sent: bool = False
    task_acked: bool = False

    def acked(self) -> None:
        self.chunk_acked = True
