"""The generator's intake: its membership of the pool, pausing, and task commits.

Owns, for one worker, the consumer of the prompt and resume topics of its buckets, which
commits to the pool's group (``{prefix}.gen.{pool}``, or ``--group-id``), and everything that
touches it:

* **joining**: with ``take_over_from`` set, the old group's committed positions are first
  copied where ours has none (``producers.recovery.take_over_offsets``); then, with
  ``pool_liveness`` (the default), the worker joins its pool's epochs
  (``producers.pool_member``: the pool assigns its partitions itself, so a broker that never
  evicts a dead member cannot wedge it, docs/reliability.md) and is *assigned* its share;
  otherwise it subscribes to the pool's consumer group and the broker assigns;
* **the pool's orders** (:meth:`Intake.follow_pool`, every iteration): release every
  partition as on a revocation (below) when the pool's members changed, or, *fenced* (the
  pool went on without this worker: it was silent for the session timeout, so others already
  resume its trajectories), drop every task unpublished and commit nothing (the worker's
  ``drop`` callback stops its trajectories); take the partitions of a new epoch as on an
  assignment;
* **assignment** (``on_assign``): the high watermark of every assigned partition is noted
  (a task below it may have been started by the previous owner: :meth:`Intake.maybe_started`,
  so the worker reads it back first; when the broker does not tell, every task is read
  back), positions kept from a failed commit are dropped for partitions not owned again,
  and the current pause mode is applied to the new partitions;
* **pausing** (:func:`pause_mode`, :func:`held`, pure): ``all`` while stopping or while
  ``max_batch`` samples wait for the engine (the membership stays alive: paused partitions
  are not fetched); ``fresh`` (the prompt topics only) while the trainer's backlog is over
  its bound (``producers.backlog``): resume tasks finish trajectories the trainer waits for;
  otherwise ``none``;
* **the tasks in flight** (:attr:`Intake.live`) and the ``OffsetTracker``: a task's offset
  becomes committable only when it is finished (every sample ended, every chunk
  acknowledged) or dead-lettered, in offset order per partition, and a finished one only
  once the broker surely kept its chunks (``producers.ackguard``);
* **commits**: every ``commit_interval_s`` asynchronously, forced ones synchronously
  (``Consumer.commit_sync``, which fails if any partition failed); every owned position is
  sent each time, so one lost in a rebalance is sent again; under pool epochs only while
  the worker's lease holds (a zombie's commit could move its successor's position back);
* **revocation** (``on_revoke``, ``on_lost``): the worker's ``hand_off`` callback publishes the
  open chunks of the partitions' unfinished tasks and flushes the producer (it touches the
  engine and the chunker, so it is the worker's); then finished tasks are committed unless
  the partitions were lost or the flush failed, and the partitions' tasks are forgotten
  (the next owner resumes them from their prefix).

Not thread-safe: the rebalance callbacks run inside :meth:`Intake.take`/:meth:`Intake.serve`,
and the pool's orders in :meth:`Intake.follow_pool`, on the worker's thread. Called by
``producers.worker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from producers.ackguard import AckGuard
from producers.config import GenerateConfig
from producers.pool import Release, Take
from producers.pool_member import PoolMember
from producers.recovery import take_over_offsets
from producers.tasks import OffsetTracker, TaskState, TopicPart
from srl.kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
    describe,
    forgets_acknowledged,
    make_consumer,
)

log = logging.getLogger("srl.generate")

PauseMode = Literal["none", "fresh", "all"]  # which task partitions are paused
UNKNOWN_HIGH = 2**63 - 1  # a high watermark not known: any task may have been started
Taken = tuple[TopicPart, int, Message]  # a task record consumed: partition, offset, record
HandOff = Callable[[set[TopicPart], list[TaskState]], bool]  # True: all reached the broker
Drop = Callable[[list[TaskState]], None]  # stop these tasks' trajectories, publish nothing


class Membership(Protocol):
    """A worker's part in its pool's epochs (``producers.pool_member.PoolMember``)."""

    def tick(self) -> Release | Take | None: ...

    def holds(self) -> bool: ...

    def released(self, order: Release) -> None: ...

    def taken(self, order: Take) -> None: ...

    def close(self) -> None: ...


def pause_mode(stopping: bool, waiting: int, max_batch: int, backlog_exceeded: bool) -> PauseMode:
    """Which partitions to pause: all while stopping or with ``max_batch`` samples waiting;
    the prompt topics only while the trainer's backlog is over its bound (resume tasks are
    in-flight work); none otherwise."""
    if stopping or waiting >= max_batch:
        return "all"
    return "fresh" if backlog_exceeded else "none"


def held(topic: str, mode: PauseMode, resume_prefix: str) -> bool:
    """Whether ``mode`` pauses the partitions of ``topic`` (resume topics start with
    ``resume_prefix``)."""
    return mode == "all" or (mode == "fresh" and not topic.startswith(resume_prefix))


class Intake:
    """One worker's consumer of its pool's group, the tasks it holds and their commits."""

    def __init__(
        self, cfg: GenerateConfig, topics: Sequence[str], hand_off: HandOff, drop: Drop
    ) -> None:
        self.cfg = cfg
        self.topics = list(topics)
        self.tracker = OffsetTracker()
        self.guard = AckGuard()  # which finished tasks may be committed yet
        self.live: dict[tuple[TopicPart, int], TaskState] = {}  # consumed, not finished
        self.assigned_high: dict[TopicPart, int] = {}
        self.paused: PauseMode = "none"
        self._hand_off, self._drop = hand_off, drop
        self.pool: Membership | None = None
        self.epoch: int | None = None  # the pool epoch whose partitions it holds
        self._resume_prefix = f"{cfg.topic_prefix}.resume."
        self._last_commit = time.monotonic()
        self._consumer: Consumer | None = None

    # -- membership -------------------------------------------------------------------------------
    def join(self, consumer: Consumer | None = None, pool: Membership | None = None) -> Intake:
        """Take over the old group's positions (if asked), then join the pool's epochs
        (``pool_liveness``: ``pool``, default a started ``PoolMember``) or subscribe
        ``consumer`` (default: a client of ``consumer_group``; tests pass fakes)."""
        cfg = self.cfg
        if cfg.take_over_from:
            try:
                copied = take_over_offsets(cfg, cfg.take_over_from, cfg.consumer_group, self.topics)
                log.info(
                    "took over %d committed positions from %s", len(copied), cfg.take_over_from
                )
            except KafkaException as e:  # e.g. our group is already active: it has them
                log.warning("taking over from %s: %s", cfg.take_over_from, e)
        if consumer is None:
            # quiet (srl.kafka.quiet): partitions read to their end are probed, not fetched
            consumer = make_consumer(cfg, cfg.consumer_group, "generator")
            # a finished task is committable at once on a broker that keeps what it
            # acknowledged (Apache Kafka), UNSURE_S later on the embedded one (producers.ackguard)
            if not forgets_acknowledged(cfg):
                self.guard.unsure_s = 0.0
        self._consumer = consumer
        if cfg.pool_liveness:  # assigned by the pool's epochs, never a group member
            self.pool = pool if pool is not None else PoolMember(cfg, self.topics).start()
        else:
            self._consumer.subscribe(
                self.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        return self

    @property
    def consumer(self) -> Consumer:
        assert self._consumer is not None, "Intake.join() first"
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
        if self.pool is not None:
            self.pool.close()  # after the final commit: the pool hands our share on

    def follow_pool(self) -> None:
        """Do what the pool says (``producers.pool``): release every partition as on a
        revocation, or, fenced, drop every task unpublished and commit nothing; or take this
        worker's share of a new epoch as on an assignment."""
        if self.pool is None or (order := self.pool.tick()) is None:
            return
        if isinstance(order, Take):
            parts = [TopicPartition(t, p) for t, p in order.partitions]
            self.consumer.assign(parts)
            self.consumer.resume(parts)  # a partition paused before it was released stays so
            self._on_assign(self.consumer, parts)
            self.epoch = order.epoch
            self.pool.taken(order)
            return
        self.epoch = None
        if order.fenced:
            log.warning("fenced (the pool went on without this worker): its work is dropped")
            self._drop(self.in_flight())
            self.live.clear()
            self.tracker = OffsetTracker()
            self.guard.forget()
            self.assigned_high.clear()
        else:
            self._on_revoke(self.consumer, self.consumer.assignment())
        self.consumer.unassign()
        self.pool.released(order)

    # -- the worker's loop ------------------------------------------------------------------------
    def pause(self, mode: PauseMode) -> None:
        if mode != self.paused:
            parts = self.consumer.assignment()
            hold = [tp for tp in parts if held(tp.topic, mode, self._resume_prefix)]
            free = [tp for tp in parts if not held(tp.topic, mode, self._resume_prefix)]
            if hold:
                self.consumer.pause(hold)
            if free:
                self.consumer.resume(free)
            self.paused = mode

    def take(self, timeout_s: float) -> list[Taken]:
        """New tasks (up to ``max_batch``, or one poll's worth while all is paused), each
        registered with the offset tracker; records this worker already holds are skipped."""
        want = self.paused != "all"
        msgs = self.consumer.consume(
            num_messages=self.cfg.max_batch if want else 1, timeout=timeout_s
        )
        out: list[Taken] = []
        for msg in msgs:
            if (err := msg.error()) is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("prompt topic: %s", err.str())
                continue
            tp, offset = (msg.topic() or "", msg.partition() or 0), msg.offset() or 0
            try:
                self.tracker.add(tp, offset)
            except ValueError:  # the client rewound to a task this worker already holds
                log.debug("%s@%d: already in flight here", tp, offset)
                continue
            out.append((tp, offset, msg))
        return out

    @property
    def writer(self) -> tuple[str, int] | None:
        """(pool, epoch) that chunks of tasks taken now carry (``srl.lineage``); None outside
        pool epochs."""
        return None if self.epoch is None else (self.cfg.consumer_group, self.epoch)

    def hold(self, st: TaskState) -> None:
        """Keep a planned task until it is finished; its chunks carry the current writer."""
        st.writer = self.writer
        self.live[(st.tp, st.offset)] = st

    def maybe_started(self, st: TaskState) -> bool:
        """Whether a previous owner of the task's partition may have started it (its offset is
        below the high watermark seen at assignment)."""
        return st.offset < self.assigned_high.get(st.tp, -1)

    def finished(self, st: TaskState) -> bool:
        """True once, when ``st`` is finished: its offset may then be committed."""
        now = time.monotonic()
        if st.finished and self.tracker.finish(st.tp, st.offset, now):
            self.live.pop((st.tp, st.offset), None)
            self.guard.finished(st, now)
            return True
        return False

    def dropped(self, tp: TopicPart, offset: int) -> None:
        """A task that was dead-lettered: no longer held, its offset may be committed."""
        self.live.pop((tp, offset), None)
        self.tracker.finish(tp, offset)

    def in_flight(self) -> list[TaskState]:
        return list(self.live.values())

    def serve(self, timeout_s: float) -> None:
        """Serve the group (a rebalance) without taking tasks (all partitions paused)."""
        self.consumer.poll(timeout_s)

    # -- commits ----------------------------------------------------------------------------------
    def commit(self, force: bool = False) -> bool:
        """Commit finished tasks' positions; False when a synchronous (forced) commit failed."""
        if not force and time.monotonic() - self._last_commit < self.cfg.commit_interval_s:
            return True
        if self.pool is not None and not self.pool.holds():
            return False  # a zombie's commit could move a successor's position back
        self._last_commit = time.monotonic()
        moved = self.tracker.committable(self.guard.cutoff(time.monotonic(), final=force))
        if not moved and not force:
            return True
        # every owned position, not only the moved ones: an async commit that failed in a
        # rebalance (ILLEGAL_GENERATION) is otherwise never sent again
        offsets = [TopicPartition(t, p, off) for (t, p), off in self.tracker.positions().items()]
        if not offsets:
            return True
        try:
            if force:
                self.consumer.commit_sync(offsets)
            else:
                self.consumer.commit_async(offsets)
        except (
            KafkaException
        ) as e:  # e.g. a rebalance meanwhile: retried, or redone by the next owner
            log.info("commit failed: %s", e)
            return False
        return True

    def commit_final(self, tries: int = 10) -> bool:
        """Commit synchronously, serving the group between tries: a pool stopping together
        rebalances under our final commit."""
        for _ in range(tries):
            if self.commit(force=True):
                return True
            self.serve(0.5)  # paused: no new tasks are fetched
        log.warning("final commit failed; the next owner redoes the unacknowledged tasks")
        return False

    # -- rebalance callbacks ----------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            try:
                _low, high = consumer.get_watermark_offsets(
                    tp, timeout=self.cfg.connect_timeout_s, cached=False
                )
            except KafkaException as e:  # the broker is slow to come back: read every task back
                log.warning("%s/%d: no high watermark (%s)", tp.topic, tp.partition, describe(e))
                high = UNKNOWN_HIGH
            self.assigned_high[(tp.topic, tp.partition)] = high
        self.tracker.retain({(tp.topic, tp.partition) for tp in partitions})
        if hold := [tp for tp in partitions if held(tp.topic, self.paused, self._resume_prefix)]:
            consumer.pause(hold)

    def _on_revoke(
        self, consumer: Consumer, partitions: list[TopicPartition], lost: bool = False
    ) -> None:
        tps = {(tp.topic, tp.partition) for tp in partitions}
        if not self._hand_off(tps, [st for st in self.live.values() if st.tp in tps]):
            lost = True  # the tasks stay uncommitted; the next owner reads back what arrived
        committed = not lost and self.commit(force=True)
        for key in [k for k in self.live if k[0] in tps]:
            del self.live[key]
        self.tracker.forget(list(tps), keep_positions=not committed)
        self.guard.forget(tps)
        for tp in tps:
            self.assigned_high.pop(tp, None)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions, lost=True)
