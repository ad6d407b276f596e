"""The generator worker: prompt tasks in, token chunks out, weights followed in the background.

Owns ``srl-producer generate``. One loop, one thread (plus the weight follower's), each
iteration in this order:

1. re-raise a failure of the follower thread or of a chunk delivery (a failed chunk is fatal:
   the worker stops without committing that task, so it is redelivered);
2. **swap weights** if the follower has a verified version: publish every open partial chunk
   first (a chunk never mixes versions), load, emit ``weights_loaded``; a version the engine
   rejects is refused (``weights_refused``) and the old weights stay;
3. **intake**: consume tasks (prompt and resume topics of the pool's buckets) while fewer
   than ``max_batch`` samples wait (otherwise the partitions are paused, so the group
   membership stays alive); while the trainer's backlog (chunks it has not read yet:
   ``producers.backlog``) is over its bound only the prompt topics are paused: resume tasks
   finish trajectories the trainer is waiting for; a task that may have been started by a
   previous owner of its partition (offset below the high watermark seen at assignment) is
   first read back (``producers.recovery``): complete samples are skipped, partial ones
   resumed from their published prefix with the same trajectory id and the next seq;
4. **admit** waiting samples into the engine's free slots, resumed ones first, then by trainer
   step and longest-predicted first, each only with weights no older than ``latest - k`` and
   its task's ``min_version`` (``producers.admission``), after reading every weights
   announcement made before the task arrived (``WeightFollower.sync``);
5. **one decode step**; its outputs go through the chunker into the producer, key =
   trajectory id, partition = ``Layout.partition_for(bucket, trajectory_id)``; with
   ``migrate_to`` set, stragglers (past ``migrate_factor`` × their prediction) are then handed
   to the long-tail bucket by prefix (``_hand_off``: hand-off chunk acknowledged, then the
   resume task acknowledged, then the slot is freed; ``producers.migration``);
6. **commit**: a task is finished when all its samples ended and every chunk was acknowledged;
   offsets are committed per partition up to the first unfinished task (``OffsetTracker``);
7. every ``stats_interval_s``: a ``gen_stats`` event and the counters.

Revocation of a partition and SIGTERM hand off unfinished work: open partial chunks are
published, the producer is flushed, finished tasks are committed and unfinished ones are
left uncommitted, so the next owner resumes them from their prefix. SIGTERM first lets
running sequences finish for up to ``drain_timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from producers.admission import may_start, order_key
from producers.backlog import GroupLag
from producers.chunker import Chunker, TrajectoryStart
from producers.config import GenerateConfig
from producers.engines import make_engine
from producers.engines.base import Emitted, Engine, Request, RequestError
from producers.follower import WeightFollower
from producers.migration import Stragglers
from producers.recovery import read_prefixes, take_over_offsets, trajectory_id_for
from producers.tasks import OffsetTracker, SamplePlan, TaskState, TopicPart
from schemas.records import (
    PromptTask,
    SchemaError,
    TrajectoryChunk,
    decode_as,
    encode,
    now_ms,
    pack_tokens,
    unpack_tokens,
)
from srl.errors import SrlError, WeightsError
from srl.kafka import Producer, commit_sync, create_topics, make_consumer, position_group
from srl.metrics import Metrics, dead_letter
from srl.stores import store_from_config
from srl.topics import Layout

log = logging.getLogger("srl.generate")


class BadTask(ValueError):
    """A prompt task no engine can run (goes to the DLQ)."""


@dataclass
class GenSummary:
    worker_id: str
    engine: str
    simulated: bool
    tasks: int = 0  # tasks finished (all samples acknowledged)
    trajectories: int = 0
    tokens: int = 0
    chunks: int = 0
    resumed: int = 0  # samples continued from a prefix read back from the topic
    skipped_complete: int = 0  # redelivered samples found already complete
    handed_off: int = 0  # trajectories left to another worker (revocation, shutdown)
    migrated: int = 0  # stragglers handed to the long-tail pool by prefix
    dead_letters: int = 0
    weights_loaded: int = 0
    weights_refused: int = 0
    policy_version: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GeneratorWorker:
    def __init__(self, cfg: GenerateConfig, engine: Engine) -> None:

        self.cfg = cfg
        self.layout = Layout.from_config(cfg)
        self.engine = engine
        self.buckets = list(cfg.buckets) or self.layout.buckets  # checked by GenerateConfig
        self.stragglers = Stragglers.from_config(cfg)
        self.summary = GenSummary(cfg.worker_name, engine.name, engine.simulated)
        self.chunker = Chunker(cfg.chunk_tokens, cfg.worker_name)
        self.tracker = OffsetTracker()
        self.live: dict[tuple[TopicPart, int], TaskState] = {}  # consumed, not finished
        self.pending: list[TaskState] = []  # tasks with samples not yet in the engine
        self.by_tid: dict[str, TaskState] = {}  # trajectories in the engine
        self.assigned_high: dict[TopicPart, int] = {}
        self.paused = "none"  # which task partitions are paused: none, fresh (prompts), all
        self._resume_prefix = f"{cfg.topic_prefix}.resume."
        self.backlog: int | None = None
        self.stopping = False
        self._delivery_error: str | None = None
        self._last_commit = self._last_stats = self._last_backlog = time.monotonic()
        self._trainer_committed, self._trainer_moved = -1, time.monotonic()
        self._stats_base = (0, 0)

    # -- lifecycle -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> GenSummary:

        create_topics(self.cfg)
        with contextlib.ExitStack() as stack:
            self.producer = stack.enter_context(Producer(self.cfg, "generator"))
            self.metrics = Metrics(self.producer, self.layout, self.cfg.run, self.summary.worker_id)
            self.follower = WeightFollower(
                self.cfg, self.layout, store_from_config(self.cfg)
            ).start()
            stack.callback(self.follower.stop)
            # the furthest of the trainer's read position (shared by the trainer) and its
            # committed offsets (a trainer that shares no position still bounds us)
            group = self.cfg.trainer_group
            self.lag = GroupLag(
                self.cfg, [group, position_group(group)], [self.layout.trajectories]
            )
            stack.callback(self.lag.close)
            topics = [
                t for b in self.buckets for t in (self.layout.prompts(b), self.layout.resumes(b))
            ]
            if self.cfg.take_over_from:
                try:
                    copied = take_over_offsets(
                        self.cfg, self.cfg.take_over_from, self.cfg.consumer_group, topics
                    )
                    log.info(
                        "took over %d committed positions from %s",
                        len(copied),
                        self.cfg.take_over_from,
                    )
                except KafkaException as e:  # e.g. our group is already active: it has them
                    log.warning("taking over from %s: %s", self.cfg.take_over_from, e)
            self.consumer = make_consumer(self.cfg, self.cfg.consumer_group, "generator")
            stack.callback(self.consumer.close)
            self.consumer.subscribe(
                topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
            )
            idle_since = time.monotonic()
            while not stop.is_set():
                self._iterate()
                if self.live or self.engine.has_work:
                    idle_since = time.monotonic()
                elif self.cfg.idle_exit_s and time.monotonic() - idle_since > self.cfg.idle_exit_s:
                    log.info("idle for %.0fs: exiting", self.cfg.idle_exit_s)
                    break
            self._drain()
        return self.summary

    def _iterate(self) -> None:
        self.follower.check()
        if self._delivery_error is not None:
            raise SrlError(
                f"chunk delivery failed ({self._delivery_error}); stopping without committing the "
                f"task"
            )
        self._swap()
        self._check_backlog()
        if self._intake():
            self.follower.sync()
        self._admit()
        self._publish(self.engine.step())
        if self.stragglers is not None and not self.stopping:
            self._migrate()
        self.producer.poll(0)
        self._commit()
        self._stats()

    def _drain(self) -> None:
        """Stop intake, let running sequences finish (bounded), hand off the rest, commit."""
        self.stopping = True
        self._set_paused("all")
        for st in self.pending:
            st.todo.clear()  # never started: the task stays uncommitted and is redelivered
        self.pending.clear()
        for r in list(self.engine.waiting):
            self.engine.abort(r.key)
            self.chunker.drop(r.key)
            self.by_tid.pop(r.key, None)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.engine.has_work and time.monotonic() < deadline:
            self._publish(self.engine.step())
            self.producer.poll(0)
        self._handoff(list(self.live.values()))
        self.producer.flush()
        for _ in range(10):  # a pool stopping together rebalances under our final commit
            if self._commit(force=True):
                break
            self.consumer.poll(0.5)  # serve the rebalance (paused: no new tasks are fetched)
        else:
            log.warning("final commit failed; the next owner redoes the unacknowledged tasks")
        self._stats(force=True)
        self.producer.flush()

    # -- weights and backlog ---------------------------------------------------------------
    def _swap(self) -> None:
        for version, reason in self.follower.drain_refusals():
            self.summary.weights_refused += 1
            self.metrics.emit(
                "weights_refused",
                {"version": version},
                {"worker_id": self.summary.worker_id, "reason": reason[:500]},
            )
        ready = self.follower.take()
        if ready is None or ready.version <= self.engine.version:
            return
        t0 = time.perf_counter()
        for chunk in self.chunker.flush_all():
            self._produce(chunk, self.by_tid[chunk.trajectory_id])
        try:
            self.engine.load_weights(ready.tensors, ready.version)
        except WeightsError as e:
            self.follower.refuse(ready.version, str(e))
            return
        pause_ms = (time.perf_counter() - t0) * 1000
        self.follower.swapped(ready.version)
        self.summary.weights_loaded += 1
        self.summary.policy_version = ready.version
        self.metrics.emit(
            "weights_loaded",
            {
                "version": ready.version,
                "load_s": ready.fetch_s + pause_ms / 1000,
                "pause_ms": pause_ms,
            },
            {"worker_id": self.summary.worker_id},
        )
        log.info(
            "weights v%d loaded (fetch %.2fs, pause %.0f ms)",
            ready.version,
            ready.fetch_s,
            pause_ms,
        )

    def _check_backlog(self) -> None:
        if self.cfg.max_backlog_chunks is None or time.monotonic() - self._last_backlog < 1.0:
            return
        self._last_backlog = time.monotonic()
        self.backlog = self.lag.lag()
        if self.lag.committed != self._trainer_committed:
            self._trainer_committed, self._trainer_moved = self.lag.committed, time.monotonic()

    @property
    def backlog_exceeded(self) -> bool:
        """Over the bound, unless the trainer has moved neither its read position nor its
        committed offsets for ``backlog_stall_s``: then it is waiting for groups that paused
        intake would never finish, so intake goes on."""
        bound = self.cfg.max_backlog_chunks
        if bound is None or self.backlog is None or self.backlog <= bound:
            return False
        return time.monotonic() - self._trainer_moved < self.cfg.backlog_stall_s

    # -- intake ----------------------------------------------------------------------------
    def _intake(self) -> bool:
        """Consume tasks when there is room; True if any was accepted."""
        waiting = sum(len(st.todo) for st in self.pending)
        if self.stopping or waiting >= self.cfg.max_batch:
            self._set_paused("all")
        else:  # resume tasks are in-flight work: the backlog bound holds back fresh ones only
            self._set_paused("fresh" if self.backlog_exceeded else "none")
        want = self.paused != "all"
        timeout = 0.0 if self.engine.has_work else 0.05
        msgs = self.consumer.consume(
            num_messages=self.cfg.max_batch if want else 1, timeout=timeout
        )
        fresh = []
        for msg in msgs:
            if (err := msg.error()) is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("prompt topic: %s", err.str())
                continue
            st = self._accept(msg)
            if st is not None:
                fresh.append(st)
        maybe_started = [st for st in fresh if st.offset < self.assigned_high.get(st.tp, -1)]
        if maybe_started:
            self._recover(maybe_started)
        for st in fresh:
            if st.todo:
                self.pending.append(st)
            self._maybe_finished(st)
        return bool(fresh)

    def _accept(self, msg: Any) -> TaskState | None:
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        try:
            self.tracker.add(tp, offset)
        except ValueError:  # the client rewound to a task this worker already holds
            log.debug("%s@%d: already in flight here", tp, offset)
            return None
        try:
            task = decode_as(msg.value() or b"", PromptTask)
            st = self._plan(task, tp, offset)
        except (SchemaError, BadTask, RequestError) as e:
            self._dead_letter(msg.value(), msg.key(), str(e), tp, offset)
            return None
        self.live[(tp, offset)] = st
        return st

    def _plan(self, task: PromptTask, tp: TopicPart, offset: int) -> TaskState:
        samples = task.samples()
        if task.group_size < 1 or any(not 0 <= s < task.group_size for s in samples):
            raise BadTask(
                f"task {task.task_id}: sample indices {samples} outside group of {task.group_size}"
            )
        meta: Any = {}
        if task.metadata:
            try:
                meta = orjson.loads(task.metadata)
            except orjson.JSONDecodeError:
                meta = None
            if not isinstance(meta, dict):
                raise BadTask(f"task {task.task_id}: metadata is not a JSON object")
        sim_length = meta.get("sim_length")
        target = int(sim_length) if isinstance(sim_length, int | float) else None
        prompt_ids = (
            unpack_tokens(task.prompt_tokens).tolist()
            if task.prompt_tokens
            else self.engine.tokenize(task.prompt)
        )
        if task.resume is not None:
            r = task.resume
            plans = [
                SamplePlan(
                    r.trajectory_id, r.sample_index, unpack_tokens(r.tokens).tolist(), r.next_seq
                )
            ]
        else:
            plans = [SamplePlan(trajectory_id_for(task.task_id, s), s) for s in samples]
        for p in plans:
            self.engine.validate(self._request(task, prompt_ids, target, p))
        return TaskState(
            task, tp, offset, prompt_ids, target, plans, {p.trajectory_id for p in plans}
        )

    def _recover(self, states: list[TaskState]) -> None:
        """Read back what a previous owner published of these tasks' trajectories."""

        wanted = {
            p.trajectory_id: (
                self.layout.partition_for(st.task.bucket, p.trajectory_id),
                p.next_seq,
            )
            for st in states
            for p in st.todo
        }
        since = min(st.task.created_ms for st in states) - int(self.cfg.recovery_slack_s * 1000)
        found = read_prefixes(self.cfg, self.layout, wanted, since)
        for st in states:
            todo = []
            for p in st.todo:
                f = found[p.trajectory_id]
                state = f.state(p.next_seq)
                if state == "gap":
                    st.todo = []
                    self._kill_task(
                        st, f"trajectory {p.trajectory_id} has a gap in its seq numbers"
                    )
                    break
                if state in ("complete", "migrated"):  # migrated: the long-tail pool has it
                    st.generating.discard(p.trajectory_id)
                    self.summary.skipped_complete += 1
                    continue
                if state == "prefix":
                    run = f.contiguous(p.next_seq)
                    p.prefix = p.prefix + [t for c in run for t in c.token_ids().tolist()]
                    p.next_seq, p.started_ms = run[-1].seq + 1, run[0].started_ms
                    self.summary.resumed += 1
                todo.append(p)
            else:
                st.todo = todo

    # -- admission and output --------------------------------------------------------------
    def _admit(self) -> None:
        if not self.pending or self.stopping:
            return
        room = self.cfg.max_batch - self.engine.running - len(self.engine.waiting)
        if room <= 0:
            return
        self.pending.sort(key=lambda s: order_key(s.task))  # resumes, earliest step, LPT
        loaded, latest, k = self.engine.version, self.follower.latest, self.cfg.max_staleness
        for st in [st for st in self.pending if may_start(st.task, loaded, latest, k)]:
            while room > 0 and st.todo:
                self._start(st, st.todo.pop(0))
                room -= 1
        self.pending = [st for st in self.pending if st.todo]

    def _start(self, st: TaskState, plan: SamplePlan) -> None:
        t = st.task
        self.engine.add(self._request(t, st.prompt_ids, st.target_length, plan))
        self.chunker.open(
            TrajectoryStart(
                plan.trajectory_id,
                t.prompt_id,
                t.task_id,
                plan.sample_index,
                t.group_size,
                t.bucket,
                t.predicted_length,
                plan.next_seq,
                len(plan.prefix),
                pack_tokens(st.prompt_ids),
                t.metadata,
                plan.started_ms or now_ms(),
                t.step,
                t.step_groups,
            )
        )
        self.by_tid[plan.trajectory_id] = st
        if self.stragglers is not None:
            self.stragglers.start(t, plan.trajectory_id, plan.sample_index, plan.prefix)

    @staticmethod
    def _request(
        task: PromptTask, prompt_ids: list[int], target: int | None, plan: SamplePlan
    ) -> Request:
        return Request(
            plan.trajectory_id,
            prompt_ids,
            task.max_new_tokens,
            task.temperature,
            task.top_p,
            plan.prefix,
            float(task.predicted_length or 0),
            target,
        )

    def _publish(self, outputs: list[Emitted]) -> None:
        for e in outputs:
            st = self.by_tid.get(e.key)
            if st is None:
                continue
            for chunk in self.chunker.add(
                e.key, e.tokens, e.logprobs, self.engine.version, e.finish_reason
            ):
                self._produce(chunk, st)
            self.summary.tokens += len(e.tokens)
            if self.stragglers is not None:
                self.stragglers.add(e.key, e.tokens, self.engine.version)
            if e.finish_reason is not None:
                if self.stragglers is not None:
                    self.stragglers.forget(e.key)
                del self.by_tid[e.key]
                st.generating.discard(e.key)
                self.summary.trajectories += 1
                self._maybe_finished(st)

    def _produce(self, chunk: TrajectoryChunk, st: TaskState) -> None:
        st.unacked += 1

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            st.unacked -= 1
            if err is not None:
                st.failed = st.failed or err.str()
                self._delivery_error = self._delivery_error or err.str()
            self._maybe_finished(st)

        self.producer.produce(
            self.layout.trajectories,
            encode(chunk),
            key=chunk.trajectory_id,
            partition=self.layout.partition_for(chunk.bucket, chunk.trajectory_id),
            on_delivery=delivered,
        )
        self.summary.chunks += 1

    def _migrate(self) -> None:
        assert self.stragglers is not None
        for tid in self.stragglers.due():
            if tid in self.by_tid and tid in self.chunker:
                self._hand_off(tid)
            self.stragglers.forget(tid)

    def _hand_off(self, tid: str) -> None:
        """Move one straggler to the long-tail pool, in ``ranker.migrate``'s exactly-once order.

        A crash before the hand-off chunk is acknowledged: the task is redelivered and resumed
        here (plain recovery). After it, before the resume task is acknowledged: a redelivered
        task skips the trajectory (recovery sees ``MIGRATED``) and nobody continues it; the
        trainer expires the prefix and counts it (``expired``), never trains it twice.
        """
        assert self.stragglers is not None
        st = self.by_tid[tid]
        self.engine.abort(tid)
        chunk = self.chunker.hand_off(tid, self.engine.version)
        self._produce(chunk, st)
        self.producer.flush()  # 1. the prefix and its MIGRATED chunk are on the broker
        if self._delivery_error is not None:
            raise SrlError(f"hand-off chunk of {tid} not delivered ({self._delivery_error})")
        task, generated = self.stragglers.task(
            st.task, tid, chunk.seq + 1, st.prompt_ids, self.engine.version
        )
        self.producer.produce(self.layout.resumes(task.bucket), encode(task), key=task.prompt_id)
        self.producer.flush()  # 2. the resume task is on the broker (raises if it failed)
        del self.by_tid[tid]  # 3. only now: the slot is free and the sample done here
        st.generating.discard(tid)
        self.summary.migrated += 1
        self.metrics.emit(
            "migrated",
            {
                "generated": float(generated),
                "predicted": float(st.task.predicted_length or 0),
                "next_seq": float(chunk.seq + 1),
            },
            {"worker_id": self.summary.worker_id, "trajectory_id": tid, "to": task.bucket},
        )
        log.info(
            "migrated %s to %s after %d tokens (predicted %s)",
            tid,
            task.bucket,
            generated,
            st.task.predicted_length,
        )
        self._maybe_finished(st)

    def _maybe_finished(self, st: TaskState) -> None:
        if st.finished and self.tracker.finish(st.tp, st.offset):
            self.live.pop((st.tp, st.offset), None)
            self.summary.tasks += 1

    # -- failure paths -----------------------------------------------------------------------
    def _dead_letter(
        self, value: bytes | None, key: Any, reason: str, tp: TopicPart, offset: int
    ) -> None:

        dead_letter(
            self.producer,
            self.layout,
            value,
            key,
            reason,
            f"{tp[0]}/{tp[1]}@{offset}",
            self.metrics,
        )
        self.summary.dead_letters += 1
        self.tracker.finish(tp, offset)

    def _kill_task(self, st: TaskState, reason: str) -> None:
        for tid in list(st.generating):
            self.engine.abort(tid)
            self.chunker.drop(tid)
            self.by_tid.pop(tid, None)
        st.generating.clear()
        self.live.pop((st.tp, st.offset), None)
        self._dead_letter(encode(st.task), st.task.prompt_id, reason, st.tp, st.offset)

    def _handoff(self, states: list[TaskState]) -> None:
        """Leave unfinished trajectories to the partition's next owner: publish their open
        chunks."""
        for st in states:
            for tid in list(st.generating):
                if tid in self.by_tid:
                    self.engine.abort(tid)
                    if (chunk := self.chunker.flush(tid)) is not None:
                        self._produce(chunk, st)
                    self.chunker.drop(tid)
                    del self.by_tid[tid]
                    self.summary.handed_off += 1
            st.todo.clear()
        self.pending = [st for st in self.pending if st.todo]

    # -- consumer group --------------------------------------------------------------------
    def _held(self, tp: TopicPartition, mode: str) -> bool:
        """Whether ``mode`` ('none', 'fresh': prompt topics only, 'all') pauses ``tp``."""
        return mode == "all" or (mode == "fresh" and not tp.topic.startswith(self._resume_prefix))

    def _set_paused(self, mode: str) -> None:
        if mode != self.paused:
            parts = self.consumer.assignment()
            hold = [tp for tp in parts if self._held(tp, mode)]
            free = [tp for tp in parts if not self._held(tp, mode)]
            if hold:
                self.consumer.pause(hold)
            if free:
                self.consumer.resume(free)
            self.paused = mode

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            _low, high = consumer.get_watermark_offsets(
                tp, timeout=self.cfg.connect_timeout_s, cached=False
            )
            self.assigned_high[(tp.topic, tp.partition)] = high
        self.tracker.retain({(tp.topic, tp.partition) for tp in partitions})
        if hold := [tp for tp in partitions if self._held(tp, self.paused)]:
            consumer.pause(hold)

    def _on_revoke(
        self, consumer: Any, partitions: list[TopicPartition], lost: bool = False
    ) -> None:
        tps = {(tp.topic, tp.partition) for tp in partitions}
        self._handoff([st for st in self.live.values() if st.tp in tps])
        try:
            self.producer.flush()
        except SrlError as e:  # the tasks stay uncommitted; the next owner reads back what arrived
            log.warning("handing off %s: %s", sorted(tps), e)
            lost = True
        committed = not lost and self._commit(force=True)
        for key in [k for k in self.live if k[0] in tps]:
            del self.live[key]
        self.tracker.forget(list(tps), keep_positions=not committed)
        for tp in tps:
            self.assigned_high.pop(tp, None)

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions, lost=True)

    def _commit(self, force: bool = False) -> bool:
        """Commit finished tasks' positions; False when a synchronous (forced) commit failed."""
        if not force and time.monotonic() - self._last_commit < self.cfg.commit_interval_s:
            return True
        self._last_commit = time.monotonic()
        moved = self.tracker.committable()
        if not moved and not force:
            return True
        # every owned position, not only the moved ones: an async commit that failed in a
        # rebalance (ILLEGAL_GENERATION) is otherwise never sent again
        offsets = [TopicPartition(t, p, off) for (t, p), off in self.tracker.positions().items()]
        if not offsets:
            return True
        try:
            if force:
                commit_sync(self.consumer, offsets)
            else:
                self.consumer.commit(offsets=offsets, asynchronous=True)
        except (
            KafkaException
        ) as e:  # e.g. a rebalance meanwhile: retried, or redone by the next owner
            log.info("commit failed: %s", e)
            return False
        return True

    def _stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < self.cfg.stats_interval_s:
            return
        dt = max(now - self._last_stats, 1e-9)
        tokens, trajs = (
            self.summary.tokens - self._stats_base[0],
            self.summary.trajectories - self._stats_base[1],
        )
        self._last_stats, self._stats_base = now, (self.summary.tokens, self.summary.trajectories)
        if self.cfg.max_backlog_chunks is None:
            self.backlog = self.lag.lag()
        values = {
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "trajectories": trajs,
            "running": self.engine.running,
            "policy_version": self.engine.version,
            "paused": float(self.paused != "none"),
            "backlog": float(self.backlog or 0),
        }
        labels = {
            "pool": self.cfg.pool,
            "engine": self.engine.name,
            "worker_id": self.summary.worker_id,
            "simulated": "true" if self.engine.simulated else "false",
        }
        self.metrics.emit("gen_stats", values, labels)
        counts = {k: float(v) for k, v in self.summary.to_dict().items() if type(v) is int}
        self.metrics.emit("counter", counts, {"worker_id": self.summary.worker_id})


def run_generator(
    cfg: GenerateConfig, stop: threading.Event | None = None, engine: Engine | None = None
) -> GenSummary:
    """Build the engine (unless given) and run one worker until ``stop`` is set or it goes idle."""

    engine = engine or make_engine(cfg)
    return GeneratorWorker(cfg, engine).run(stop or threading.Event())
