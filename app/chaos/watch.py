"""What a chaos run's topics say while it runs: the facts every recovery condition is read from.

Owns :class:`Watch`, a thread that reads the run's metrics, trajectories, prompts and
dead-letter topics as they grow (:class:`Tail`) and keeps, with the time each happened (the
writer's timestamp, wall-clock seconds): the trainer's steps, published versions, each
generator's loaded and refused versions, the online ranker's versions, the
steps the dispatcher released, which trajectories are open (chunks seen, no last chunk) and
when each was finished, and every dead letter by origin. Injections are stamped with
``time.time()`` on the same machine, so the two compare directly. Nothing here decides
anything: ``app.chaos.faults`` asks. Records that do not decode (the poison fault's) are
skipped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from app.chaos.audit import Recorded
from schemas.records import (
    MetricEvent,
    PromptTask,
    SchemaError,
    TrajectoryChunk,
    decode_as,
)
from srl.config import CommonConfig
from srl.kafka import KafkaException, Message, TopicPartition, reader, watermarks
from srl.topics import Layout

log = logging.getLogger("app.chaos")
KEEP_DONE_S = 900.0  # finished trajectories older than this are forgotten (long soaks)
# a record reaches the audit this long after it was read: a SIGKILLed broker forgets its
# last ~0.5 s of records, and the watch sees that when the restarted broker answers (~2 s)
HOLD_S = 20.0
REREAD_S = 10.0


class Tail:
    """Reads every partition of ``topics`` from offset 0 as it grows.

    The embedded broker answers a fetch at the end of a partition at once, so an idle
    consumer costs about 0.4 core on each side (docs/broker.md): a partition read to its end
    is paused, and the paused ones' high watermarks are probed every ``probe_s`` instead.
    Offsets are concrete (never logical), so a resumed partition is fetched at once.

    A SIGKILLed embedded broker forgets the records it acknowledged last (docs/broker.md) and
    gives their offsets to the next records: without a rewind the records written at the
    reused offsets would never be read. A probe that finds a high watermark below what was
    read, and ``reread`` (after a restart the harness made), call ``on_rewind(topic,
    partition, high)`` and read on from there.
    """

    def __init__(
        self,
        cfg: CommonConfig,
        topics: list[str],
        probe_s: float = 0.5,
        on_rewind: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.on_rewind = on_rewind
        self.c = reader(cfg, "chaos-watch")
        self.tps = [(tp.topic, tp.partition) for tp in self.c.partitions_of(topics)]
        self.next = dict.fromkeys(self.tps, 0)
        self.c.assign([TopicPartition(t, p, 0) for t, p in self.tps])
        self.c.pause([TopicPartition(t, p) for t, p in self.tps])
        self.paused = set(self.tps)
        self.probe_s, self.next_probe = probe_s, 0.0

    def poll(self, timeout_s: float) -> list[Message]:
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + self.probe_s
            with contextlib.suppress(KafkaException):  # the broker may be down: probe again
                self._wake()
        msgs = [m for m in self.c.consume(500, timeout_s) if m.error() is None]
        for m in msgs:
            self.next[(m.topic() or "", m.partition() or 0)] = (m.offset() or 0) + 1
        for key in set(self.tps) - self.paused:
            _low, high = self.c.get_watermark_offsets(TopicPartition(*key), cached=True)
            if high >= 0 and self.next[key] >= high:
                self.c.pause([TopicPartition(*key)])
                self.paused.add(key)
        return msgs

    def _wake(self) -> None:
        for key in self.tps:
            tp = TopicPartition(*key)
            _low, high = self.c.get_watermark_offsets(tp, timeout=2, cached=False)
            if 0 <= high < self.next[key]:  # the broker forgot what it acknowledged last
                if self.on_rewind is not None:
                    self.on_rewind(key[0], key[1], high)
                self.next[key] = high
                if key not in self.paused:
                    self.c.seek(TopicPartition(key[0], key[1], high))
            if key in self.paused and high > self.next[key]:
                self.c.resume([tp])
                self.c.seek(TopicPartition(key[0], key[1], self.next[key]))
                self.paused.discard(key)

    def reread(self, since_ms: int) -> None:
        """Read every partition again from its first record at or after ``since_ms`` (after a
        broker restart: what it forgot is gone, and its offsets went to newer records)."""
        asked = [TopicPartition(t, p, since_ms) for t, p in self.tps]
        for tp in self.c.offsets_for_times(asked, timeout=10):
            key = (tp.topic, tp.partition)
            _low, high = self.c.get_watermark_offsets(TopicPartition(*key), timeout=10)
            if 0 <= high < self.next[key] and self.on_rewind is not None:
                self.on_rewind(key[0], key[1], high)  # read, then forgotten: nobody reused them
            start = min(self.next[key], high if tp.offset < 0 else tp.offset)
            self.next[key] = max(start, 0)
            if key in self.paused:
                self.c.resume([TopicPartition(*key)])
                self.paused.discard(key)
            self.c.seek(TopicPartition(key[0], key[1], self.next[key]))

    def close(self) -> None:
        self.c.close()


@dataclass
class Seen:
    """The facts, each with its time (wall-clock seconds)."""

    steps: list[tuple[float, int]] = field(default_factory=list)
    published: list[tuple[float, int]] = field(default_factory=list)
    loaded: list[tuple[float, str, int]] = field(default_factory=list)
    refused: list[tuple[float, str, int, str]] = field(default_factory=list)
    ranker: list[float] = field(default_factory=list)
    released: dict[int, float] = field(default_factory=dict)  # step -> its first task
    open: dict[str, set[str]] = field(default_factory=dict)  # trajectory -> its workers
    done: dict[str, float] = field(default_factory=dict)  # trajectory -> its last chunk
    dlq: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # origin -> letters
    gen_stats: dict[str, float] = field(default_factory=dict)  # worker -> last gen_stats


class Watch(threading.Thread):
    """Reads the run's topics into :class:`Seen`; ask it under ``with watch.lock``."""

    def __init__(
        self, cfg: CommonConfig, recorded: Recorded | None = None, probe_s: float = 0.5
    ) -> None:
        super().__init__(name="chaos-watch", daemon=True)
        self.cfg, self.layout = cfg, Layout.from_config(cfg)
        self.seen = Seen()
        self.probe_s = probe_s
        self.recorded = recorded  # the audit's records, gathered as they arrive
        # what the audit gets, held HOLD_S first: (topic, partition) -> offset -> (read at,
        # the record's bytes, its fold)
        self.held: dict[tuple[str, int], dict[int, tuple[float, bytes, Callable[[], None]]]] = {}
        self.forgotten = 0  # records read, then forgotten by a restarted broker
        self.replaced = 0  # records read at an offset that held another (reread after a restart)
        self.reread_since_ms: int | None = None  # set by ``broker_restarted``
        self.read_to: dict[tuple[str, int], int] = {}  # next offset of each partition, handled
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.error: str | None = None
        lay = self.layout
        self.handlers: dict[str, Callable[[Message], None]] = {}
        self.handlers[lay.metrics] = self._metric
        self.handlers[lay.trajectories] = self._chunk
        self.handlers[lay.dlq] = self._dead_letter
        for b in lay.buckets:
            self.handlers[lay.prompts(b)] = self._task

    def run(self) -> None:  # noqa: D102 (thread body)
        try:
            tail = Tail(self.cfg, list(self.handlers), self.probe_s, self._rewound)
        except KafkaException as e:
            self.error = str(e)
            return
        try:
            while not self.halt.is_set():
                since, self.reread_since_ms = self.reread_since_ms, None
                if since is not None:
                    try:
                        tail.reread(since)
                    except KafkaException:  # not quite back: again at the next turn
                        self.reread_since_ms = since
                msgs = tail.poll(0.2)
                with self.lock:
                    for m in msgs:
                        with contextlib.suppress(SchemaError):
                            self.handlers[m.topic() or ""](m)
                    self.read_to = dict(tail.next)
                    self._release(time.monotonic() - HOLD_S)
                    self._forget()
        except Exception as e:  # reported with the run; recovery conditions then time out
            self.error = f"{type(e).__name__}: {e}"
            log.exception("chaos watch failed")
        finally:
            tail.close()

    def _metric(self, m: Message) -> None:
        e = decode_as(m.value() or b"", MetricEvent)
        if e.run != self.cfg.run:
            return
        if self.recorded is not None:
            self._hold(m, functools.partial(self.recorded.event, e))
        t, s = e.ts_ms / 1000.0, self.seen
        worker = e.labels.get("worker_id", e.source)
        if e.kind == "train_step" and e.step is not None:
            s.steps.append((t, int(e.step)))
        elif e.kind == "weights_published":
            s.published.append((t, int(e.values.get("version", 0))))
        elif e.kind == "weights_loaded":
            s.loaded.append((t, worker, int(e.values.get("version", 0))))
        elif e.kind == "weights_refused":
            reason = e.labels.get("reason", "")
            s.refused.append((t, worker, int(e.values.get("version", 0)), reason))
        elif e.kind == "ranker_published":
            s.ranker.append(t)
        elif e.kind == "gen_stats":
            s.gen_stats[worker] = t

    def _chunk(self, m: Message) -> None:
        c = decode_as(m.value() or b"", TrajectoryChunk)
        if self.recorded is not None:
            p, o = m.partition() or 0, m.offset() or 0
            self._hold(m, functools.partial(self.recorded.chunk, p, o, c))
        tid, s = c.trajectory_id, self.seen
        if c.is_last:
            s.open.pop(tid, None)
            s.done.setdefault(tid, c.created_ms / 1000.0)
        elif tid not in s.done:
            s.open.setdefault(tid, set()).add(c.worker_id)

    def _task(self, m: Message) -> None:
        task = decode_as(m.value() or b"", PromptTask)
        if self.recorded is not None:
            self._hold(m, functools.partial(self.recorded.task, task))
        if task.step is not None:
            t = task.created_ms / 1000.0
            self.seen.released[task.step] = min(t, self.seen.released.get(task.step, t))

    def _dead_letter(self, m: Message) -> None:
        raw = m.headers() or []
        headers = {k: _text(v) for k, v in (raw.items() if isinstance(raw, dict) else raw)}
        origin, reason = headers.get("srl.origin", ""), headers.get("srl.reason", "")
        t = m.timestamp()[1] / 1000.0
        self.seen.dlq.setdefault(origin, []).append((t, reason))

    def _hold(self, m: Message, fold: Callable[[], None]) -> None:
        """Give ``fold`` (the record's part of the audit) HOLD_S from now; a record read again
        at the same offset (the broker forgot the first) replaces it."""
        key = (m.topic() or "", m.partition() or 0)
        part, value = self.held.setdefault(key, {}), m.value() or b""
        old = part.get(m.offset() or 0)
        self.replaced += int(old is not None and old[1] != value)
        part[m.offset() or 0] = (time.monotonic(), value, fold)

    def _release(self, before: float) -> None:
        for part in self.held.values():
            for offset in [o for o, (at, _v, _f) in part.items() if at <= before]:
                part.pop(offset)[2]()

    def broker_restarted(self, killed_at: float) -> None:
        """The broker was SIGKILLed at ``killed_at`` (wall clock) and is back: read again what
        was written from REREAD_S before the kill (what it forgot, or what took its offsets)."""
        self.reread_since_ms = int((killed_at - REREAD_S) * 1000)

    def _rewound(self, topic: str, partition: int, high: int) -> None:
        with self.lock:
            part = self.held.get((topic, partition), {})
            gone = [o for o in part if o >= high]
            for o in gone:
                del part[o]
            self.forgotten += len(gone)
        log.warning(
            "%s/%d: the broker forgot offsets %d on (%d read)", topic, partition, high, len(gone)
        )

    def _forget(self) -> None:
        done = self.seen.done
        if len(done) > 20_000:
            cutoff = time.time() - KEEP_DONE_S
            for tid in [t for t, at in done.items() if at < cutoff]:
                del done[tid]

    # -- questions (call under ``self.lock``) ----------------------------------------------
    def open_on(self, workers: Iterable[str]) -> set[str]:
        """Trajectories in flight on any of ``workers`` (their worker ids)."""
        ws = set(workers)
        return {tid for tid, by in self.seen.open.items() if by & ws}

    def finished(self, tids: set[str]) -> float | None:
        """When the last of ``tids`` was finished; None while any is open."""
        if any(t not in self.seen.done for t in tids):
            return None
        return max((self.seen.done[t] for t in tids), default=0.0)

    def first_step_after(self, t: float) -> float | None:
        return min((at for at, _ in self.seen.steps if at > t), default=None)

    def last_step(self) -> int:
        return max((s for _, s in self.seen.steps), default=0)

    def catch_up(self, timeout_s: float = 120.0) -> bool:
        """Wait until every record written so far has been handled (call once the roles have
        stopped, before reading ``recorded``); False if that took longer than ``timeout_s``.
        Read exactly to each high watermark: past it, the broker forgot what was read and a
        rewind is still to come."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.is_alive():
            with contextlib.suppress(KafkaException):
                ends = watermarks(self.cfg, self.handlers)
                with self.lock:
                    done = self.reread_since_ms is None and all(
                        self.read_to.get(k, 0) == high for k, (_low, high) in ends.items()
                    )
                    if done:
                        self._release(float("inf"))
                        return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        self.halt.set()
        self.join(15)


def _text(v: str | bytes | None) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else (v or "")


def first_after(times: Iterable[float], t: float) -> float | None:
    return min((x for x in times if x > t), default=None)
