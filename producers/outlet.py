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
  (:meth:`Outlet.migrate`): hand-off chunk acknowledged, then the resume task acknowledged,
  then the slot freed.

The producer and the metrics come with :meth:`Outlet.open`, once the worker runs. Called by
``producers.worker`` on its one thread (delivery reports arrive inside ``producer.poll`` /
``flush`` on that thread too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from producers.chunker import Chunker
from producers.config import GenerateConfig
from producers.engines.base import Emitted, Engine
from producers.migration import Stragglers
from producers.planning import request_for, trajectory_start
from producers.tasks import SamplePlan, TaskState
from schemas.records import TrajectoryChunk, encode
from srl.errors import SrlError
from srl.kafka import KafkaError, Producer
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
        self.by_tid: dict[str, TaskState] = {}  # trajectories in the engine
        self.delivery_error: str | None = None
        self._done = done
        self.producer: Producer
        self.metrics: Metrics

    def open(self, producer: Producer, metrics: Metrics) -> None:
        self.producer, self.metrics = producer, metrics

    def check(self) -> None:
        """A failed chunk is fatal: the worker stops without committing its task."""
        if self.delivery_error is not None:
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
            for chunk in self.chunker.add(
                e.key, e.tokens, e.logprobs, self.engine.version, e.finish_reason
            ):
                self.produce(chunk, st)
            self.counts.tokens += len(e.tokens)
            if self.stragglers is not None:
                self.stragglers.add(e.key, e.tokens, self.engine.version)
            if e.finish_reason is not None:
                if self.stragglers is not None:
                    self.stragglers.forget(e.key)
                del self.by_tid[e.key]
                st.generating.discard(e.key)
                self.counts.trajectories += 1
                self._done(st)

    def produce(self, chunk: TrajectoryChunk, st: TaskState) -> None:
        st.unacked += 1

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            st.unacked -= 1
            if err is not None and not st.abandoned:
                st.failed = st.failed or err.str()
                self.delivery_error = self.delivery_error or err.str()
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
        """Leave unfinished trajectories to the partition's next owner: publish their open
        chunks."""
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
        """Hand every straggler due to the long-tail pool."""
        if self.stragglers is None:
            return
        for tid in self.stragglers.due():
            if tid in self.by_tid and tid in self.chunker:
                self._migrate(self.stragglers, tid)
            self.stragglers.forget(tid)

    def _migrate(self, stragglers: Stragglers, tid: str) -> None:
        """Move one straggler to the long-tail pool, in ``ranker.migrate``'s exactly-once order.

        A crash before the hand-off chunk is acknowledged: the task is redelivered and resumed
        here (plain recovery). After it, before the resume task is acknowledged: a redelivered
        task skips the trajectory (recovery sees ``MIGRATED``) and nobody continues it; the
        trainer expires the prefix and counts it (``expired``), never trains it twice.
        """
        st = self.by_tid[tid]
        self.engine.abort(tid)
        chunk = self.chunker.hand_off(tid, self.engine.version)
        self.produce(chunk, st)
        self.producer.flush()  # 1. the prefix and its MIGRATED chunk are on the broker
        if self.delivery_error is not None:
            raise SrlError(f"hand-off chunk of {tid} not delivered ({self.delivery_error})")
        task, generated = stragglers.task(
            st.task, tid, chunk.seq + 1, st.prompt_ids, self.engine.version
        )
        self.producer.produce(self.layout.resumes(task.bucket), encode(task), key=task.prompt_id)
        self.producer.flush()  # 2. the resume task is on the broker (raises if it failed)
        del self.by_tid[tid]  # 3. only now: the slot is free and the sample done here
        st.generating.discard(tid)
        self.counts.migrated += 1
        predicted = st.task.predicted_length
        values = {
            "generated": float(generated),
            "predicted": float(predicted or 0),
            "next_seq": float(chunk.seq + 1),
        }
        labels = {"worker_id": self.counts.worker_id, "trajectory_id": tid, "to": task.bucket}
        self.metrics.emit("migrated", values, labels)
        log.info(
            "migrated %s to %s after %d tokens (predicted %s)",
            tid,
            task.bucket,
            generated,
            predicted,
        )
        self._done(st)
