"""The weight follower: a background thread that tracks ``{prefix}.weights`` and fetches new
versions.

Owns a generator's view of the policy versions. What must hold:

* Only announcements of the followed run count (``run``: the lead's, ``--follow-run``; by
  default the config's own), and versions only move forward; the newest announced
  version is fetched (intermediate ones are skipped), its manifest and every file verified
  by sha256 (``srl.weights.load_manifest`` / ``fetch_tensors``) in this thread, off the decode
  loop. Nothing is unpickled.
* A version that fails (bad hash, missing file, a manifest that does not match, or tensors
  the engine rejects) is **refused**: one log line, counted, reported to the worker as a
  ``weights_refused`` event, and the old weights stay in use. A refused version no longer
  counts as ``latest`` for the staleness rule, so a bad upload cannot stall generation (the
  tasks released for it wait a bounded time for a newer version: ``producers.admission``),
  and the next good version is still taken (even one older than a bogus announced one).
* A record that is no announcement (oversized, undecodable, another record type, a negative
  version) is handed to the worker, which dead-letters it (:meth:`drain_poison`); the
  follower reads on.
* The worker takes a verified version with :meth:`take` and swaps it between decode steps.
* **At most one fetched version in memory** besides what the engine holds: the next version
  is fetched only once the worker is done with the last one (:meth:`swapped`, :meth:`refuse`
  or :meth:`release` after :meth:`take`). A version that is not taken yet is replaced by a
  newer one only after it is dropped, never fetched beside it (a trainer that publishes faster
  than the worker swaps costs fetches, not memory: without this a follower held the untaken
  version, the one being fetched and the one being loaded, up to three copies of the model).
* :meth:`sync` gives read-your-writes: it returns once the thread has read every
  announcement appended before the call, so a prompt task published after an announcement
  (the sync barrier) is never started with the weights before it.
* An unexpected exception in the thread is handed to the worker (:meth:`check` re-raises).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas.records import SchemaError, WeightsAnnouncement, decode_as, now_ms
from srl.errors import SrlError, StoreError, WeightsError
from srl.kafka import OFFSET_BEGINNING, KafkaException, QuietTail, TopicPartition, reader
from srl.metrics import MAX_RECORD_BYTES
from srl.weights import fetch_tensors, load_manifest

if TYPE_CHECKING:
    import torch

    from srl.config import CommonConfig
    from srl.store import ObjectStore
    from srl.topics import Layout

log = logging.getLogger("srl.follower")
# How often a caught-up follower asks the embedded broker whether the weights topic grew: a
# version is announced once per training step (seconds), and each probe is a request. At the
# quiet tail's 10 ms default an idle ``srl serve`` spent 5 % of its core on it (52 ms/s), which
# a CPU-bound engine loses in requests/s (``srl bench serve --engine hf``, embedded broker).
PROBE_S = 0.05


@dataclass
class Ready:
    version: int
    tensors: dict[str, torch.Tensor]
    fetch_s: float
    fetch_started_ms: int = 0  # wall clock when its fetch began (ms since epoch)


@dataclass(frozen=True)
class Swap:
    """A version loaded into an engine: its fetch time and the engine's pause."""

    version: int
    fetch_s: float
    pause_ms: float
    fetch_started_ms: int = 0  # wall clock when its fetch began (ms since epoch)

    @property
    def load_s(self) -> float:
        return self.fetch_s + self.pause_ms / 1000


class WeightFollower:
    def __init__(
        self,
        cfg: CommonConfig,
        layout: Layout,
        store: ObjectStore,
        current: int = 0,
        run: str | None = None,
    ) -> None:
        self.cfg, self.layout, self.store = cfg, layout, store
        self.run = run or cfg.run  # whose announcements count
        self.loaded = current  # version the engine runs (set by the worker after a swap)
        self.announced: dict[int, WeightsAnnouncement] = {}
        self.refused: dict[int, str] = {}
        self.refused_at: dict[int, float] = {}  # time.monotonic() of each refusal
        self.refusals: list[tuple[int, str]] = []  # not yet reported by the worker
        self.poison: list[Poison] = []  # unusable records, for the worker to dead-letter
        self._ready: Ready | None = None  # fetched, not yet taken
        self._in_hand: int | None = None  # taken by the worker, not yet swapped or refused
        self._fetched = current  # newest version fetched or being fetched
        self._position = 0  # next weights-topic offset to read
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weight-follower", daemon=True)
        self._consumer = reader(cfg, "weights-follower")
        self._probe = reader(cfg, "weights-follower")  # watermarks, from the worker's thread

    # -- worker side ---------------------------------------------------------------------
    def start(self) -> WeightFollower:
        """Read the weights topic from its first record, at a concrete offset where the
        broker tells it: the quiet tail pauses at the end only from a concrete position, and
        an empty weights topic (nothing announced yet: ``srl serve`` before any trainer) would
        otherwise be fetched busily forever on the embedded broker (``srl.kafka.quiet``;
        measured: 0.46 core in an idle ``srl serve``, 0.38 in the broker)."""
        tp = TopicPartition(self.layout.weights, 0)
        try:
            start: int | None = self._probe.get_watermark_offsets(tp, timeout=5)[0]
        except KafkaException:  # not answered now: from the beginning, found later
            start = None
        offset = OFFSET_BEGINNING if start is None or start < 0 else start
        self._consumer.assign([TopicPartition(tp.topic, 0, offset)])
        # a new version waits at most PROBE_S longer while the tail is paused (embedded broker)
        self._tail = QuietTail(
            self._consumer, tp, probe_s=PROBE_S, start=None if offset < 0 else offset
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._probe.close()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def latest(self) -> int:
        """Newest announced version that was not refused (or the loaded one)."""
        with self._cond:
            ok = [v for v in self.announced if v not in self.refused]
        return max([self.loaded, *ok])

    def refused_within(self, seconds: float) -> dict[int, int]:
        """Versions refused less than ``seconds`` ago, each with the trainer step it was
        announced after (``producers.admission``: their tasks wait for a newer good version
        unless their step is the trainer's next)."""
        since = time.monotonic() - seconds
        with self._cond:
            return {
                v: ann.trainer_step if (ann := self.announced.get(v)) is not None else -1
                for v, at in self.refused_at.items()
                if at > since
            }

    def take(self) -> Ready | None:
        """The newest verified version, handed over: the next one is fetched once the caller
        says it is done with it (:meth:`swapped`, :meth:`refuse` or :meth:`release`)."""
        with self._cond:
            ready, self._ready = self._ready, None
            if ready is not None:
                self._in_hand = ready.version
        return ready

    def release(self) -> None:
        """The version taken last is no longer held (loaded, refused or not wanted)."""
        with self._cond:
            self._in_hand = None
            self._cond.notify_all()

    def swapped(self, version: int) -> None:
        self.loaded = max(self.loaded, version)
        self.release()

    @property
    def held(self) -> int:
        """Fetched versions this follower holds outside the engine: fetched and not taken, or
        taken and not yet loaded (at most one)."""
        with self._cond:
            return int(self._ready is not None) + int(self._in_hand is not None)

    def swap_into(self, engine: Any, flush_open: Callable[[], None]) -> Swap | None:
        """Load the newest verified version into ``engine`` if it is newer than the engine's:
        ``flush_open`` first (what is queued of open trajectories goes out under the old
        version), then ``engine.load_weights``; a version the engine refuses is refused here.
        What was loaded and how long the engine paused, or None. On the decode thread."""
        ready = self.take()
        if ready is None:
            return None
        if ready.version <= engine.version:
            self.release()
            return None
        t0 = time.perf_counter()
        flush_open()
        try:
            engine.load_weights(ready.tensors, ready.version)
        except WeightsError as e:
            ready.tensors.clear()  # the engine copied nothing of it: drop it before the next
            self.refuse(ready.version, str(e))
            return None
        except BaseException:
            self.release()  # whoever handles it, the follower must not wait on this version
            raise
        pause_ms = (time.perf_counter() - t0) * 1000
        ready.tensors.clear()  # the engine has its own copy now: the next fetch may start
        self.swapped(ready.version)
        return Swap(ready.version, ready.fetch_s, pause_ms, ready.fetch_started_ms)

    def refuse(self, version: int, reason: str) -> None:
        with self._cond:
            self.refused[version] = reason
            self.refused_at.setdefault(version, time.monotonic())
            self.refusals.append((version, reason))
            if self._in_hand == version:
                self._in_hand = None
            self._cond.notify_all()
        log.warning("weights v%d refused: %s", version, reason)

    def drain_refusals(self) -> list[tuple[int, str]]:
        with self._cond:
            out, self.refusals = self.refusals, []
        return out

    def drain_poison(self) -> list[Poison]:
        """Records of the weights topic that are no announcement, for the worker's DLQ (its
        producer serves delivery reports on the worker's thread, so it sends them)."""
        with self._cond:
            out, self.poison = self.poison, []
        return out

    def sync(self, timeout_s: float = 10.0) -> None:
        """Wait until every announcement appended before this call has been read."""
        _low, high = self._probe.get_watermark_offsets(
            TopicPartition(self.layout.weights, 0), timeout=timeout_s, cached=False
        )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._position < high:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SrlError(
                        f"weights follower did not catch up with {self.layout.weights} in "
                        f"{timeout_s:g}s"
                    )
                self._cond.wait(min(left, 0.1))

    # -- thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                msg = self._tail.poll(0.2)
                if msg is not None and not msg.error():
                    self._on_message(msg)
                self._fetch_newest()
        except BaseException as e:  # handed to the worker's loop
            self._error = e
        finally:
            self._consumer.close()

    def _on_message(self, msg: Any) -> None:
        ann, why = announcement(msg.value() or b"")
        with self._cond:
            if why is not None:
                where = f"{msg.topic()}/{msg.partition()}@{msg.offset()}"
                self.poison.append(Poison(msg.value(), msg.key(), why, where))
            elif ann is not None and ann.run == self.run and ann.version > self.loaded:
                self.announced.setdefault(ann.version, ann)
            self._position = (msg.offset() or 0) + 1
            self._cond.notify_all()

    def _fetch_newest(self) -> None:
        """Fetch the newest announced version not refused and newer than the last fetched; a
        refused one (corrupt, deleted, never written) leaves ``_fetched`` where it was, so the
        next good version, older or newer than the refused one, is still taken."""
        with self._cond:
            candidates = [v for v in self.announced if v not in self.refused and v > self._fetched]
            if not candidates or self._in_hand is not None:
                return  # nothing newer, or the worker still holds the last one
            version = max(candidates)
            ann = self.announced[version]
            # an untaken older version is dropped before the newer one is fetched, never
            # held beside it (the worker wants the newest; intermediate ones are skipped)
            self._ready = None
        t0, started_ms = time.perf_counter(), now_ms()
        try:
            tensors = fetch_tensors(self.store, load_manifest(self.store, ann))
        except (WeightsError, StoreError) as e:
            self.refuse(version, str(e))
            with self._cond:
                self._cond.notify_all()
            return
        with self._cond:
            self._fetched = version
            self._ready = Ready(version, tensors, time.perf_counter() - t0, started_ms)
            self._cond.notify_all()


@dataclass(frozen=True)
class Poison:
    """A record of the weights topic that is no usable announcement, and why."""

    value: bytes | None
    key: Any
    reason: str
    origin: str


def announcement(value: bytes) -> tuple[WeightsAnnouncement | None, str | None]:
    """A weights-topic record as an announcement, or why it is none (oversized, undecodable,
    another record type, a negative version). Another run's announcement is no poison."""
    if len(value) > MAX_RECORD_BYTES:
        return None, f"oversized: {len(value)} bytes > {MAX_RECORD_BYTES}"
    try:
        ann = decode_as(value, WeightsAnnouncement)
    except SchemaError as e:
        return None, f"undecodable: {e}"
    if ann.version < 0:
        return None, f"announcement of {ann.run}: negative version {ann.version}"
    return ann, None
