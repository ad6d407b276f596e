"""``PoolMember``: one generator's part in its pool's epochs (``producers.pool``), in a thread.

Owns the Kafka side of pool epochs for one worker: it beats every ``beat_s`` on
``{prefix}.pool.beats``, tails that topic and ``{prefix}.pool.epochs`` (paused at their end:
``srl.kafka.QuietTail``), and, when it is the pool's leader, announces the next epoch when
the live members change and opens it once every member it waits for is ready.

The worker's side, all from its loop's thread: ``tick()`` every iteration returns ``None``,
a ``Release`` (release every partition as on a revocation: hand off, commit; when ``fenced``,
drop the work unpublished; then call ``released()``) or a ``Take`` (assign those partitions,
then call ``taken()``). The worker's consumer never joins a group: it is assigned, and it
commits to the pool's group as a group without members. ``close()`` at exit says it left.
A failure of the thread is raised by the next ``tick``; the broker being away is not one
(the thread tries again). Every worker of a pool must run one (``pool_liveness``, on by
default): one that joins the group instead makes the broker refuse the others' commits.

The lease: the others count a worker dead once its newest beat is ``session_s`` old, so a
worker counts its own beats too (their delivery reports; clocks are monotonic, so they run on
while a process is stopped). A member whose newest acknowledged beat was sent more than
``session_s`` ago, or whose next one comes after such a silence, has lost its lease: ``tick``
fences it before the pool's verdict can reach it, ``holds()`` (asked before every commit)
is false, and it takes nothing again until a beat sent after the fence is acknowledged and
the pool topics have been read since. A worker without a recent acknowledged beat does not
lead either: cut off, its view is stale and its records would land late.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import orjson

from producers.config import GenerateConfig
from producers.pool import PoolView, Release, State, Take, TopicPart
from srl.config import KafkaSettings, TopicsConfig
from srl.errors import ProducerFailed, SrlError
from srl.kafka import (
    SESSION_TIMEOUT_MS,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    QuietTail,
    TopicPartition,
    consumer_settings,
    read_range,
    reader,
)
from srl.topics import Layout

log = logging.getLogger("srl.pool")


def session_timeout_s(cfg: KafkaSettings, group: str) -> float:
    """The consumers' ``session.timeout.ms`` (``-X`` included): silence for this long is death.
    A KIP-848 member (``group.protocol=consumer``) sets none: srl's classic one then."""
    settings = consumer_settings(cfg, group)
    return int(settings.get("session.timeout.ms", SESSION_TIMEOUT_MS)) / 1000


def current_assignment(
    cfg: TopicsConfig, pool: str, timeout_s: float = 10.0
) -> dict[str, tuple[TopicPart, ...]]:
    """The assignment of the pool's last opened epoch (``pool``: its group), from the epochs
    topic: which member key holds which task partition."""
    view = PoolView(pool, 0.0)
    opened = view.current
    with contextlib.suppress(SrlError, KafkaException):  # no epochs topic yet: nobody
        for msg in read_range(cfg, Layout.from_config(cfg).pool_epochs, timeout_s=timeout_s):
            if view.on_epoch(orjson.loads(msg.value() or b"{}")) and view.current.opened:
                opened = view.current
    return opened.assignment


class PoolMember:
    """One worker's membership of its pool; ``start()`` it, ``close()`` it."""

    def __init__(
        self, cfg: GenerateConfig, topics: Sequence[str], beat_s: float = 1.0, check_s: float = 0.5
    ) -> None:
        self.cfg, self.layout = cfg, Layout.from_config(cfg)
        self.session_s = session_timeout_s(cfg, cfg.consumer_group)
        self.beat_s, self.check_s = beat_s, check_s
        self.key = f"{cfg.worker_name}/{uuid.uuid4().hex[:8]}"
        self.view = PoolView(cfg.consumer_group, self.session_s)
        self.epoch = 0  # member: the epoch whose partitions it holds; ready: it waits for
        self.state: State = "ready"
        self._topics = list(topics)
        self._partitions: list[TopicPart] = []
        self._sent: dict[str, int] = {}  # the epochs this member announced / opened
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._error: BaseException | None = None
        # the lease: a member whose beats have not reached the broker for session_s counts as
        # dead to the others, so it fences itself (monotonic clocks run on while stopped)
        self._lease_from = time.monotonic()  # sent time of the newest acknowledged beat
        self._fenced_at: float | None = None  # fenced itself: takes again once resynced
        self._lapsed = False  # a member's lease ran out (it must fence itself first)
        self._synced_at = 0.0  # the last time both tails were read to their end
        self._thread = threading.Thread(target=self._run, name="pool-member", daemon=True)

    # -- the worker's calls ------------------------------------------------------------------
    def start(self) -> PoolMember:
        self._producer = Producer(self.cfg, "pool")
        self._tails = [self._tail(self.layout.pool_epochs, None), self._beats_tail()]
        with reader(self.cfg, "pool") as c:
            self._partitions = [(tp.topic, tp.partition) for tp in c.partitions_of(self._topics)]
        self._thread.start()
        if not self._caught_up.wait(self.cfg.connect_timeout_s * 3):
            raise SrlError("pool membership: could not read the pool topics")
        deadline = time.monotonic() + 2 * self.session_s  # like a subscribe: start with a share
        while time.monotonic() < deadline and self._error is None:
            with self._cond:
                cur = self.view.current
                if cur.opened and self.key in cur.assignment:
                    break
            time.sleep(0.05)
        return self

    def tick(self) -> Release | Take | None:
        """The worker's order now. A member whose lease ran out (no beat of its own reached the
        broker for ``session_s``: it was stopped or cut off, so the pool may have gone on
        without it) fences itself before the pool's verdict can reach it, and takes nothing
        again until a newer beat has been acknowledged and the pool topics read since."""
        if self._error is not None:
            raise SrlError(f"pool membership failed: {self._error}") from self._error
        now = time.monotonic()
        with self._cond:
            if self.state == "member" and not self._leased(now):
                log.warning(
                    "pool %s: no beat of this worker reached the broker for %.1fs: fenced",
                    self.view.pool,
                    now - self._lease_from,
                )
                self._fenced_at, self._lapsed = now, False
                return Release(self.epoch + 1, fenced=True)  # never its old epoch again
            if self._fenced_at is not None:
                if not self._fenced_at < self._lease_from < self._synced_at:
                    return None
                self._fenced_at = None
            return self.view.order(self.key, self.epoch, self.state)

    def holds(self) -> bool:
        """Whether this worker may still act on its partitions (commit): it is a member and
        its lease has not run out."""
        with self._cond:
            return self.state == "member" and self._leased(time.monotonic())

    def _leased(self, now: float) -> bool:
        return not self._lapsed and now - self._lease_from <= self.session_s

    def released(self, order: Release) -> None:
        """Every partition is released (handed off and committed, or dropped)."""
        with self._cond:
            self.state, self.epoch = "ready", order.epoch
        self._beat()
        log.info("pool %s: released for epoch %d", self.view.pool, order.epoch)

    def taken(self, order: Take) -> None:
        with self._cond:
            self.state, self.epoch = "member", order.epoch
        self._beat()
        log.info(
            "pool %s: epoch %d: %d partitions", self.view.pool, order.epoch, len(order.partitions)
        )

    def close(self) -> None:
        with self._cond:
            self.state = "left"
        with contextlib.suppress(Exception):
            self._beat()
            self._producer.flush(5)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for tail in getattr(self, "_tails", []):
            tail.consumer.close()

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = next_check = 0.0
        while not self._stop.is_set():
            try:
                self._read()
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + self.beat_s
                if now >= next_check:
                    self._lead(now)
                    next_check = now + self.check_s
            except ProducerFailed as e:  # a restarted broker lost beats it acknowledged
                log.warning("pool membership: %s: a new producer for the beats", e)
                self._producer = Producer(self.cfg, "pool", check=False)
            except (KafkaException, SrlError) as e:  # the broker is away: try again
                log.warning("pool membership: %s", e)
                self._stop.wait(1.0)
            except BaseException as e:
                self._error = e
                log.exception("pool membership failed")
                return

    def _read(self) -> None:
        started = time.monotonic()
        for tail, timeout in zip(self._tails, (0.0, 0.1), strict=True):
            while (msg := tail.poll(timeout)) is not None:
                self._apply(msg)
                timeout = 0.0
        self._producer.poll(0)  # beats' delivery reports: the lease
        if all(t.caught_up for t in self._tails):
            with self._cond:
                self._synced_at = started  # every record appended before this is read
            self._caught_up.set()

    def _apply(self, msg: Message) -> None:
        if msg.error() is not None:
            return
        try:
            rec = orjson.loads(msg.value() or b"")
        except orjson.JSONDecodeError:
            return
        with self._cond:
            if msg.topic() == self.layout.pool_epochs:
                if self.view.on_epoch(rec):
                    log.info("pool %s: %s", self.view.pool, rec)
            else:
                age_s = max(0.0, time.time() - msg.timestamp()[1] / 1000)
                self.view.on_beat(rec, time.monotonic() - age_s)

    def _beat(self) -> None:
        with self._cond:
            epoch = (
                max(self.epoch, self.view.current.epoch) if self.state == "ready" else self.epoch
            )
            rec = {"pool": self.view.pool, "key": self.key, "epoch": epoch, "state": self.state}
            sent = time.monotonic()
            self.view.on_beat(rec, sent)  # our own state needs no round trip

        def renewed(err: KafkaError | None, _msg: object) -> None:
            if err is None:
                with self._cond:  # a member's beat after a silence of a session renews nothing
                    if self.state == "member" and sent - self._lease_from > self.session_s:
                        self._lapsed = True
                    self._lease_from = max(self._lease_from, sent)

        self._producer.produce(
            self.layout.pool_beats, orjson.dumps(rec), key=self.view.pool, on_delivery=renewed
        )

    def _lead(self, now: float) -> None:
        """The leader's duties: open what this member announced once its barrier is done;
        announce the next epoch when the live members changed, or the current one cannot
        open (its announcer or a member it waits for went silent)."""
        with self._cond:
            if now - self._lease_from > self.session_s:
                return  # cut off: its view of the pool is stale, its records would land late
            cur = self.view.current
            if cur.by == self.key and not cur.opened:
                barrier = self.view.barrier(now)
                if barrier == "done":
                    self._send(cur.epoch, "open", {"epoch": cur.epoch})
                elif barrier == "lost":
                    self._announce(now, "a member it waited for went silent")
                return
            if self.view.leader(now) != self.key:
                return
            if self.view.announcer_lost(now):
                self._announce(now, "its announcer went silent")
            elif self.view.changed(now):
                live, held = set(self.view.live(now)), set(cur.assignment)
                why = f"joined {sorted(live - held)}, gone {sorted(held - live)}"
                self._announce(now, why)

    def _announce(self, now: float, why: str) -> None:
        rec = self.view.announcement(self.key, now, self._partitions)
        if self._send(rec["epoch"], "announce", rec):
            log.warning("pool %s: epoch %d: %s", self.view.pool, rec["epoch"], why)

    def _send(self, epoch: int, phase: str, rec: dict[str, object]) -> bool:
        """Publish an epochs record once per (phase, epoch), unless it fails to arrive (the
        broker is cut off: it may be sent again); True if it was sent now. Never waits for
        the broker: the thread's beats must go on."""
        if self._sent.get(phase, -1) >= epoch:
            return False
        self._sent[phase] = epoch
        rec = {"pool": self.view.pool, "phase": phase, "by": self.key, **rec}

        def lost(err: KafkaError | None, _msg: object) -> None:
            if err is not None:
                with self._cond:
                    if self._sent.get(phase) == epoch:
                        del self._sent[phase]

        self._producer.produce(
            self.layout.pool_epochs, orjson.dumps(rec), key=self.view.pool, on_delivery=lost
        )
        self._producer.poll(0)
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _tail(self, topic: str, since_ms: int | None) -> QuietTail:
        """A paused-at-the-end reader of partition 0 of ``topic``, from a concrete offset (the
        first at or after ``since_ms``, else the low watermark) so that it can pause."""
        c = reader(self.cfg, "pool")
        tp = TopicPartition(topic, 0)
        low, high = c.get_watermark_offsets(tp, timeout=self.cfg.connect_timeout_s)
        start = low
        if since_ms is not None:
            found = c.offsets_for_times([TopicPartition(topic, 0, since_ms)])[0].offset
            start = found if found >= 0 else high
        c.assign([TopicPartition(topic, 0, start)])
        tail = QuietTail(c, tp, probe_s=0.1, start=start)
        tail.end = high  # caught up (and paused) at the end as of now, even if it is empty
        return tail

    def _beats_tail(self) -> QuietTail:
        return self._tail(self.layout.pool_beats, int(time.time() * 1000 - 2000 * self.session_s))
