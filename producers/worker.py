"""The generator worker: prompt tasks in, token chunks out, weights followed in the background.

Owns ``srl-producer generate``'s one loop (one thread, plus the weight follower's): the order
of the steps below, the tasks whose samples wait for the engine, the summary and the stats.
The parts it drives, each owning one concern: ``producers.intake`` (the group membership,
pausing, the tasks in flight, commits, the rebalance callbacks), ``producers.planning``
(pure: sample plans, what recovery leaves of them), ``producers.recovery`` (reading prefixes
back), ``producers.admission`` (pure: who starts when), ``producers.outlet`` (trajectories
in the engine: chunker, deliveries, hand-offs, migration), ``producers.follower`` (weights)
and ``producers.backlog`` (the trainer's backlog). Each iteration, in this order:

0. follow the pool's orders (``Intake.follow_pool``, pool epochs): release or take
   partitions when the pool's members changed; a fenced worker drops its work unpublished;
1. re-raise a failure of the follower thread or of a chunk delivery (a failed chunk is fatal:
   the worker stops without committing that task, so it is redelivered);
2. **swap weights** if the follower has a verified version: publish every open partial chunk
   first (a chunk never mixes versions), load, emit ``weights_loaded``; a version the engine
   rejects is refused (``weights_refused``) and the old weights stay;
3. **intake**: the trainer's backlog (chunks it has not read yet) as last measured by its
   background thread (``producers.backlog``; never waited for here); consume tasks (prompt and
   resume topics of the pool's buckets) while fewer than ``max_batch`` samples wait (otherwise
   the partitions are paused, so the group membership stays alive); while the backlog is over
   its bound only the prompt topics are paused: resume tasks finish trajectories the trainer is
   waiting for (``producers.intake.pause_mode``); each task is planned (``producers.planning``)
   and its samples validated by the engine, or dead-lettered; a task that may have been started
   by a previous owner of its partition (offset below the high watermark seen at assignment) is
   first read back (``producers.recovery``): complete samples are skipped, partial ones resumed
   from their published prefix with the same trajectory id and the next seq;
4. **admit** waiting samples into the engine's free slots, resumed ones first, then by trainer
   step and longest-predicted first, each only with weights no older than ``latest - k`` and
   its task's ``min_version`` (``producers.admission``), after reading every weights
   announcement made before the task arrived (``WeightFollower.sync``; while the broker does
   not answer, nothing is admitted and the sync is tried again next iteration);
5. **one decode step**; its outputs go through the chunker into the producer, key =
   trajectory id, partition = ``Layout.partition_for(bucket, trajectory_id)``; with
   ``migrate_to`` set, stragglers (past ``migrate_factor`` × their prediction) are then handed
   to the long-tail bucket by prefix (``Outlet.migrate``: hand-off chunk acknowledged, then
   the resume task acknowledged, then the sample is done here, each step on a delivery
   report, so decoding never waits for the broker; ``producers.migration``);
6. **commit**: a task is finished when all its samples ended and every chunk was acknowledged;
   offsets are committed per partition up to the first unfinished task (``Intake.commit``,
   ``OffsetTracker``);
7. every ``stats_interval_s``: a ``gen_stats`` event and the counters.

Revocation of a partition (``Intake``'s callback, which calls ``_release`` here) and
SIGTERM hand off unfinished work (``Outlet.hand_off``): open partial chunks are published,
the producer is flushed, finished tasks are committed and unfinished ones are left
uncommitted, so the next owner resumes them from their prefix. SIGTERM first lets running
sequences finish for up to ``drain_timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from producers.ackguard import lost_trajectories
from producers.admission import may_start, order_key
from producers.backlog import GroupLag, TrainerBacklog
from producers.config import GenerateConfig
from producers.engines import make_engine
from producers.engines.base import Engine, RequestError
from producers.follower import WeightFollower
from producers.intake import Intake, pause_mode
from producers.outlet import Outlet
from producers.planning import (
    BadTask,
    check_versions,
    prefix_query,
    recovered,
    request_for,
    task_state,
    task_target,
)
from producers.recovery import read_prefixes
from producers.tasks import TaskState, TopicPart
from schemas.records import (
    PromptTask,
    SchemaError,
    decode_as,
    encode,
    unpack_tokens,
)
from srl.codecs import use_schema_registry
from srl.errors import ProducerFailed, SrlError, StartOver
from srl.kafka import (
    KafkaException,
    Message,
    Producer,
    Throttle,
    describe,
    ensure_topics,
    position_group,
    produced_ms,
    start_over,
)
from srl.metrics import MAX_RECORD_BYTES, Metrics, dead_letter
from srl.stores import store_from_config
from srl.topics import Layout
from srl.weights import KnownVersions

log = logging.getLogger("srl.generate")


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
    throttled_s: float = 0.0  # the brokers' quota throttle times, summed
    held_s: float = 0.0  # time the producer held the engine back under a quota

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def quota(self, throttle: Throttle) -> None:
        """The quota figures, from the producer's ``Throttle``."""
        self.throttled_s = round(throttle.throttled_s, 3)
        self.held_s = round(throttle.waited_s, 3)


class GeneratorWorker:
    """One worker's loop (the module docstring's steps) over its parts; it holds the tasks
    whose samples wait for the engine."""

    def __init__(self, cfg: GenerateConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.layout = Layout.from_config(cfg)
        self.engine = engine
        self.buckets = list(cfg.buckets) or self.layout.buckets  # checked by GenerateConfig
        self.summary = GenSummary(cfg.worker_name, engine.name, engine.simulated)
        self.outlet = Outlet(cfg, self.layout, engine, self.summary, self._maybe_finished)
        topics = [t for b in self.buckets for t in (self.layout.prompts(b), self.layout.resumes(b))]
        self.intake = Intake(cfg, topics, self._release, self._drop)
        self.pending: list[TaskState] = []  # tasks with samples not yet in the engine
        # measured every second while bounded; unbounded, never (a shared cluster is not
        # asked for the trainer's offsets when no bound needs them)
        self.backlog = TrainerBacklog(cfg.max_backlog_chunks, cfg.backlog_stall_s, 1.0)
        self.stopping = False
        self._unsynced = False  # tasks accepted since the last weights sync: admit none yet
        self._last_stats = time.monotonic()
        self._stats_base = (0, 0)

    # -- lifecycle -----------------------------------------------------------------------
    def topics(self) -> list[str]:
        """Every topic this worker reads or writes (``ensure_topics`` checks them at start)."""
        lay, cfg = self.layout, self.cfg
        out = [t for b in self.buckets for t in (lay.prompts(b), lay.resumes(b))]
        out += [lay.resumes(cfg.migrate_to)] if cfg.migrate_to else []
        out += [lay.trajectories, lay.weights, lay.metrics, lay.dlq]
        out += [lay.pool_epochs, lay.pool_beats] if cfg.pool_liveness else []
        return list(dict.fromkeys(out))

    def run(self, stop: threading.Event) -> GenSummary:
        ensure_topics(self.cfg, self.topics(), "generator")
        with contextlib.ExitStack() as stack:
            self._open(stack)
            idle_since = time.monotonic()
            while not stop.is_set():
                self._iterate()
                if self.intake.live or self.engine.has_work:
                    idle_since = time.monotonic()
                elif self.cfg.idle_exit_s and time.monotonic() - idle_since > self.cfg.idle_exit_s:
                    log.info("idle for %.0fs: exiting", self.cfg.idle_exit_s)
                    break
            self._drain()
            self.summary.quota(self.producer.throttle)
        return self.summary

    def _open(self, stack: contextlib.ExitStack) -> None:
        """The producer, the weight follower, the trainer's lag and the group membership;
        ``stack`` closes them in reverse order."""
        self.producer = stack.enter_context(Producer(self.cfg, "generator"))
        self.metrics = Metrics(
            self.producer, self.layout, self.cfg.run, self.summary.worker_id, best_effort=True
        )
        self.outlet.open(self.producer, self.metrics)
        store = store_from_config(self.cfg)
        self.follower = WeightFollower(self.cfg, self.layout, store, run=self.cfg.weights_run)
        self.known = KnownVersions(store, floor=lambda: self.follower.latest)
        self.follower.start()
        stack.callback(self.follower.stop)
        # the furthest of the trainer's read position (shared by the trainer) and its
        # committed offsets (a trainer that shares no position still bounds us)
        if self.cfg.max_backlog_chunks is not None:
            group = self.cfg.trainer_group
            lag = GroupLag(self.cfg, [group, position_group(group)], [self.layout.trajectories])
            stack.callback(self.backlog.start(lag).stop)  # measured off the decode thread
        stack.callback(self.intake.close)
        self.intake.join()

    def _iterate(self) -> None:
        """One pass of the module docstring's steps 0-7."""
        self.intake.follow_pool()  # 0.
        self.follower.check()  # 1.
        self.outlet.check()
        self._swap()  # 2.
        self.backlog.check()  # 3.
        if self._intake():
            self._unsynced = True
        if self._unsynced:  # 4.
            self._unsynced = not self._sync()
        self._admit()
        self.outlet.publish(self.engine.step())  # 5.
        if not self.stopping:
            self.outlet.migrate()
        self.producer.poll(0)
        self._guard()
        self.intake.commit()  # 6.
        self._stats()  # 7.

    def _drain(self) -> None:
        """Stop intake, let running sequences finish (bounded), hand off the rest, commit."""
        self.stopping = True
        self.intake.pause("all")
        for st in self.pending:
            st.todo.clear()  # never started: the task stays uncommitted and is redelivered
        self.pending.clear()
        self.outlet.abort_waiting()
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.engine.has_work and time.monotonic() < deadline:
            self.outlet.publish(self.engine.step())
            self.producer.poll(0)
        self._handoff(self.intake.in_flight())
        self.producer.flush()
        self.intake.commit_final()
        self._stats(force=True)
        self.producer.flush()

    # -- weights ---------------------------------------------------------------------------
    def _swap(self) -> None:
        for p in self.follower.drain_poison():  # sent here: delivery reports are this thread's
            dead_letter(
                self.producer, self.layout, p.value, p.key, p.reason, p.origin, self.metrics
            )
            self.summary.dead_letters += 1
        for version, reason in self.follower.drain_refusals():
            self.summary.weights_refused += 1
            labels = {"worker_id": self.summary.worker_id, "reason": reason[:500]}
            self.metrics.emit("weights_refused", {"version": version}, labels)
        swap = self.follower.swap_into(self.engine, self.outlet.flush_open)
        if swap is None:
            return
        self.summary.weights_loaded += 1
        self.summary.policy_version = swap.version
        values = {"load_s": swap.load_s, **vars(swap)}  # version, fetch (+ verify), pause
        self.metrics.emit("weights_loaded", values, {"worker_id": self.summary.worker_id})
        log.info(
            "weights v%d loaded (fetch %.2fs, pause %.0f ms)",
            swap.version,
            swap.fetch_s,
            swap.pause_ms,
        )

    # -- intake ----------------------------------------------------------------------------
    def _intake(self) -> bool:
        """Consume tasks when there is room; True if any was accepted."""
        waiting = sum(len(st.todo) for st in self.pending)
        mode = pause_mode(self.stopping, waiting, self.cfg.max_batch, self.backlog.exceeded())
        self.intake.pause(mode)
        taken = self.intake.take(0.0 if self.engine.has_work else 0.05)
        fresh = [st for tp, off, msg in taken if (st := self._accept(tp, off, msg)) is not None]
        if maybe_started := [st for st in fresh if self.intake.maybe_started(st)]:
            self._recover(maybe_started)
        for st in fresh:
            if st.todo:
                self.pending.append(st)
            self._maybe_finished(st)
        return bool(fresh)

    def _accept(self, tp: TopicPart, offset: int, msg: Message) -> TaskState | None:
        """Plan a task (``producers.planning``) and let the engine validate every sample."""
        try:
            value = msg.value() or b""
            if len(value) > MAX_RECORD_BYTES:
                raise BadTask(f"oversized: {len(value)} bytes > {MAX_RECORD_BYTES}")
            task = decode_as(value, PromptTask)
            target = task_target(task)  # a bad task is refused before the engine tokenizes
            check_versions(task, self.known.exists, produced_ms(msg))
            prompt_ids = (
                unpack_tokens(task.prompt_tokens).tolist()
                if task.prompt_tokens
                else self.engine.tokenize(task.prompt)
            )
            st = task_state(task, tp, offset, prompt_ids, target)
            for p in st.todo:
                self.engine.validate(request_for(st, p))
        except (SchemaError, BadTask, RequestError) as e:
            why = f"undecodable: {e}" if isinstance(e, SchemaError) else str(e)
            self._dead_letter(msg.value(), msg.key(), why, tp, offset)
            return None
        self.intake.hold(st)
        return st

    def _recover(self, states: list[TaskState]) -> None:
        """Read back what a previous owner published of these tasks' trajectories; what to do
        with each sample is ``producers.planning.recovered``'s decision."""
        slack_s = self.cfg.recovery_slack_s
        wanted, since = prefix_query(states, self.layout.partition_for, slack_s)
        found = read_prefixes(self.cfg, self.layout, wanted, since)
        for st in states:
            r = recovered(st.todo, found, st.writer)
            st.todo = r.todo
            st.generating.difference_update(r.skipped)
            self.summary.skipped_complete += len(r.skipped)
            self.summary.resumed += r.resumed
            if r.gap is not None:
                self._kill_task(st, f"trajectory {r.gap} has a gap in its seq numbers")

    def _guard(self) -> None:
        """6. After every broker went away, tasks finished just before are committed only once
        read back complete (``producers.ackguard``); if not, exit with them uncommitted."""
        guard = self.intake.guard
        if not guard.watch(self.producer.outages, time.monotonic()):
            return
        slack = self.cfg.recovery_slack_s
        if lost := guard.verify(lambda s: lost_trajectories(self.cfg, self.layout, s, slack)):
            raise StartOver(
                f"the broker lost acknowledged chunks of {len(lost)} finished trajectories "
                f"(e.g. {lost[0]}) when it went away: leaving their tasks uncommitted, "
                "so they are generated again"
            )

    def _sync(self) -> bool:
        """Read every weights announcement made so far (``WeightFollower.sync``); False while
        the broker does not answer (nothing is admitted meanwhile)."""
        try:
            self.follower.sync()
        except (KafkaException, SrlError) as e:
            log.warning("reading the weights topic: %s", describe(e))
            return False
        return True

    def _admit(self) -> None:
        if not self.pending or self.stopping or self._unsynced:
            return
        room = self.cfg.max_batch - self.engine.running - len(self.engine.waiting)
        if room <= 0:
            return
        self.pending.sort(key=lambda s: order_key(s.task))  # resumes, earliest step, LPT
        loaded, latest, k = self.engine.version, self.follower.latest, self.cfg.max_staleness
        waiting = self.follower.refused_within(self.cfg.refused_wait_s)
        for st in [st for st in self.pending if may_start(st.task, loaded, latest, k, waiting)]:
            while room > 0 and st.todo:
                self.outlet.start(st, st.todo.pop(0))
                room -= 1
        self.pending = [st for st in self.pending if st.todo]

    # -- task outcomes -------------------------------------------------------------------------
    def _maybe_finished(self, st: TaskState) -> None:
        if self.intake.finished(st):
            self.summary.tasks += 1

    def _dead_letter(
        self, value: bytes | None, key: Any, reason: str, tp: TopicPart, offset: int
    ) -> None:
        where = f"{tp[0]}/{tp[1]}@{offset}"
        dead_letter(self.producer, self.layout, value, key, reason, where, self.metrics)
        self.summary.dead_letters += 1
        self.intake.dropped(tp, offset)

    def _kill_task(self, st: TaskState, reason: str) -> None:
        self.outlet.kill(st)
        self._dead_letter(encode(st.task), st.task.prompt_id, reason, st.tp, st.offset)

    def _handoff(self, states: list[TaskState]) -> None:
        """Leave unfinished work to the partition's next owner (shutdown, revocation)."""
        self.outlet.hand_off(states)
        self.pending = [st for st in self.pending if st.todo]

    def _release(self, tps: set[TopicPart], states: list[TaskState]) -> bool:
        """The intake's hand-off of revoked partitions: their unfinished trajectories' open
        chunks published and flushed; False if the flush failed."""
        try:
            self._handoff(states)  # migrations under way are finished first (Outlet.settle)
            self.producer.flush()
        except SrlError as e:  # the tasks stay uncommitted; the next owner reads back what arrived
            log.warning("handing off %s: %s", sorted(tps), e)
            return False
        return True

    def _drop(self, states: list[TaskState]) -> None:
        """The intake's drop of a fenced worker's tasks: their trajectories stop here, nothing
        more of them is published (their new owners resume them from the published prefix)."""
        for st in states:
            self.outlet.kill(st)
            st.todo.clear()
        self.pending.clear()
        n = self.producer.purge_queued()  # chunks still queued locally never go out
        log.warning("dropped %d trajectories; %d chunks, queued unsent, purged", len(states), n)

    def _stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < self.cfg.stats_interval_s:
            return
        dt = max(now - self._last_stats, 1e-9)
        s = self.summary
        tokens, trajs = s.tokens - self._stats_base[0], s.trajectories - self._stats_base[1]
        self._last_stats, self._stats_base = now, (s.tokens, s.trajectories)
        values = {
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "trajectories": trajs,
            "running": self.engine.running,
            "policy_version": self.engine.version,
            "paused": float(self.intake.paused != "none"),
            "quota_held_s": self.producer.throttle.waited_s,  # held back under a quota, in all
        }
        if self.backlog.bound is not None:  # measured only where a bound needs it
            values["backlog"] = float(self.backlog.value or 0)
        labels = {
            "pool": self.cfg.pool,
            "engine": self.engine.name,
            "worker_id": s.worker_id,
            "simulated": "true" if self.engine.simulated else "false",
        }
        self.metrics.emit("gen_stats", values, labels)
        counts = {k: float(v) for k, v in s.to_dict().items() if type(v) is int}
        self.metrics.emit("counter", counts, {"worker_id": s.worker_id})


def run_generator(
    cfg: GenerateConfig, stop: threading.Event | None = None, engine: Engine | None = None
) -> GenSummary:
    """Build the engine (unless given) and run one worker until ``stop`` is set or it goes idle."""
    use_schema_registry(cfg)

    engine = engine or make_engine(cfg)
    stop = stop or threading.Event()

    def attempt() -> GenSummary:
        worker = GeneratorWorker(cfg, engine)
        try:
            return worker.run(stop)
        except (StartOver, KafkaException) as e:
            producer = getattr(worker, "producer", None)
            if isinstance(e, KafkaException) and not (producer and producer.fatal):
                raise
            engine.abort_all()  # their tasks are uncommitted: whoever owns them resumes them
            if isinstance(e, StartOver):
                raise
            raise ProducerFailed(f"the generator's producer failed for good: {describe(e)}") from e

    # a broker that lost what this worker wrote: leave the pool, join it again (no second
    # engine start: minutes for a large vLLM model)
    return start_over(attempt, f"generator {cfg.worker_name}")
