"""The engine thread of ``srl serve``: every concurrent request in one continuous batch.

Owns the engine (``producers.engines``: hf, sim, vllm), the text of each choice, and the
publishing of served trajectories. One thread runs the decode loop; the HTTP side (asyncio)
only puts commands into a thread-safe inbox (:meth:`ServeEngine.submit`, :meth:`cancel`) and
receives events through its sink. Each iteration, in this order:

1. **weights**: re-raise a failure of the follower thread; if the follower
   (``producers.follower.WeightFollower``) has a newer verified version, publish every open
   partial chunk, then load it between two decode steps (the served policy is the newest
   verified version; running requests continue under it, their later tokens carry it); a
   version the engine rejects is refused and the old weights stay;
2. **intake**: take every command waiting (block up to 50 ms when nothing runs): a new job
   is tokenized and checked here (``Rejected`` on a user error, else ``Accepted``) and its
   ``n`` choices join the engine's queue; a cancelled job's choices are aborted and closed
   in the log with ``finish_reason = abort``;
3. **one decode step** for every running choice; each output goes through the choice's
   ``TextStream`` (text, stop strings: a stop ends the choice at the token that completed it)
   and through the publisher (``app.serve.publish``: chunks to ``{prefix}.trajectories``);
4. **events** of the step go to the sink in one batch (one wake-up of the event loop per step);
5. **housekeeping**: serve producer callbacks, report new delivery failures at once (log line,
   ``/health``), a ``serve_stats`` metric event every ``stats_interval_s``.

A failure of the thread is kept (``error``), every open job gets ``Failed`` and the
``on_failure`` callback runs (the server then stops). Called by ``app.serve.http`` (submit,
cancel, health) and ``app.serve.run`` (start, stop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from app.serve.jobs import Accepted, Delta, Event, Failed, Finished, Job, Rejected
from app.serve.publish import Publisher
from app.serve.text import TextCodec, TextStream, choice_seed
from producers.engines.base import FINISH_ABORT, FINISH_STOP, Emitted, Engine, Request, RequestError
from producers.follower import WeightFollower
from producers.recovery import trajectory_id_for
from srl.errors import WeightsError
from srl.metrics import Metrics

log = logging.getLogger("srl.serve")

Sink = Callable[[list[tuple[Job, Event]]], None]


class Busy(Exception):
    """More choices would be pending than ``max_pending`` (HTTP 429)."""


class Stopped(Exception):
    """The engine thread does not run (HTTP 503)."""


@dataclass
class ServeStats:
    requests: int = 0  # jobs taken by the engine thread
    rejected: int = 0  # of them, refused (prompt too long, bad token ids …)
    completions: int = 0  # choices finished (stop, length)
    cancelled: int = 0  # choices aborted (client gone, server stopping)
    tokens: int = 0  # completion tokens generated
    weights_loaded: int = 0
    weights_refused: int = 0
    delivery_failures: int = 0  # records the broker did not take

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Choice:
    job: Job
    index: int
    text: TextStream
    tokens: int = 0


class ServeEngine:
    """The decode loop and its inbox; see the module docstring for the order of one step."""

    def __init__(
        self,
        engine: Engine,
        codec: TextCodec,
        publisher: Publisher,
        follower: WeightFollower | None = None,
        metrics: Metrics | None = None,
        max_pending: int = 1024,
        stats_interval_s: float = 5.0,
    ) -> None:
        self.engine, self.codec, self.publisher = engine, codec, publisher
        self.follower, self.metrics = follower, metrics
        self.max_pending, self.stats_interval_s = max_pending, stats_interval_s
        self.stats = ServeStats()
        self.error: BaseException | None = None
        self.on_failure: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
        self._choices: dict[str, _Choice] = {}  # by trajectory id
        self._out: list[tuple[Job, Event]] = []
        self._sink: Sink | None = None
        self._pending = 0  # choices submitted and not finished (HTTP side's admission bound)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_stats = time.monotonic()
        self._stats_tokens = 0

    # -- HTTP side -----------------------------------------------------------------------
    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        """Hand a job to the engine thread; Busy or Stopped if it cannot take it now."""
        if not self.alive:
            raise Stopped("the engine is not running" + (f": {self.error}" if self.error else ""))
        with self._lock:
            if self._pending + job.sampling.n > self.max_pending:
                raise Busy(f"{self._pending} choices pending (max_pending {self.max_pending})")
            self._pending += job.sampling.n
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Abort a job's unfinished choices (the client went away)."""
        self._inbox.put(("cancel", job))

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.alive else "failed",
            "engine": self.engine.name,
            "simulated": self.engine.simulated,
            "policy_version": self.engine.version,
            "running": self.engine.running,
            "waiting": len(self.engine.waiting),
            "pending": self._pending,
            "publish": self.publisher.enabled,
            "published_chunks": self.publisher.chunks,
        } | self.stats.to_dict()

    def _release(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._swap()
                self._take_inbox(wait=not self.engine.has_work)
                if self.engine.has_work:
                    self._emit(self.engine.step())
                self._send()
                self._tick()
        except BaseException as e:  # kept for the server, reported to every open job
            self.error = e
            log.error("serve engine failed: %s", e, exc_info=True)
        finally:
            self._close_all()
        if self.error is not None and self.on_failure is not None:
            self.on_failure()

    def _take_inbox(self, wait: bool) -> None:
        try:
            cmd, job = self._inbox.get(timeout=0.05) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "submit":
                self._accept(job)
            else:
                self._cancel(job)
            try:
                cmd, job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, job: Job) -> None:
        s = job.sampling
        self.stats.requests += 1
        try:
            ids = self._prompt_ids(job)
            reqs = [
                Request(
                    trajectory_id_for(job.completion_id, i),
                    ids,
                    s.max_tokens,
                    s.temperature,
                    s.top_p,
                    seed=choice_seed(s.seed, i),
                )
                for i in range(s.n)
            ]
            for r in reqs:
                self.engine.validate(r)
        except RequestError as e:
            self.stats.rejected += 1
            self._release(s.n)
            self._out.append((job, Rejected(_user_message(str(e)))))
            return
        self._out.append((job, Accepted(len(ids))))
        for i, r in enumerate(reqs):
            self.engine.add(r)
            self.publisher.open(job, i, r.key, ids)
            self._choices[r.key] = _Choice(job, i, TextStream(self.codec.decode, s.stop))

    def _prompt_ids(self, job: Job) -> list[int]:
        if isinstance(job.prompt, str):
            return self.codec.encode(job.prompt, chat=job.chat)
        vocab = self.codec.vocab_size
        bad = [t for t in job.prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad[0]}")
        return list(job.prompt)

    def _cancel(self, job: Job) -> None:
        for key in [k for k, c in self._choices.items() if c.job is job]:
            self._abort(key)

    def _abort(self, key: str) -> None:
        self.engine.abort(key)
        self.publisher.add(key, [], [], self.engine.version, FINISH_ABORT)
        del self._choices[key]
        self._release(1)
        self.stats.cancelled += 1

    def _emit(self, outputs: list[Emitted]) -> None:
        for e in outputs:
            c = self._choices.get(e.key)
            if c is not None:
                self._advance(c, e)

    def _advance(self, c: _Choice, e: Emitted) -> None:
        used, text, stopped = c.text.feed(e.tokens)
        reason = FINISH_STOP if stopped else e.finish_reason
        if stopped and e.finish_reason is None:
            self.engine.abort(e.key)  # the stop string ends it here, not the engine
        c.tokens += used
        self.stats.tokens += used
        self.publisher.add(e.key, e.tokens[:used], e.logprobs[:used], self.engine.version, reason)
        if reason is None:
            if text:
                self._out.append((c.job, Delta(c.index, text)))
            return
        if not stopped:
            rest, stopped = c.text.finish()
            text += rest
            reason = FINISH_STOP if stopped else reason
        self._out.append((c.job, Finished(c.index, text, reason, c.tokens, self.engine.version)))
        del self._choices[e.key]
        self._release(1)
        self.stats.completions += 1

    def _send(self) -> None:
        if self._out and self._sink is not None:
            out, self._out = self._out, []
            self._sink(out)

    def _close_all(self) -> None:
        """On the way out: open choices end as aborts in the log, their jobs get ``Failed``."""
        why = f"the engine failed: {self.error}" if self.error else "the server is stopping"
        failed: dict[int, Job] = {}
        for key in list(self._choices):
            failed[id(self._choices[key].job)] = self._choices[key].job
            self._abort(key)
        while True:
            try:
                cmd, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd == "submit":
                self._release(job.sampling.n)
                failed[id(job)] = job
        self._out += [(job, Failed(why)) for job in failed.values()]
        self._send()

    # -- weights and housekeeping ------------------------------------------------------------
    def _swap(self) -> None:
        if self.follower is None:
            return
        self.follower.check()
        for version, reason in self.follower.drain_refusals():
            self.stats.weights_refused += 1
            self._metric("weights_refused", {"version": version}, {"reason": reason[:500]})
        ready = self.follower.take()
        if ready is None or ready.version <= self.engine.version:
            return
        t0 = time.perf_counter()
        self.publisher.flush_open()
        try:
            self.engine.load_weights(ready.tensors, ready.version)
        except WeightsError as e:
            self.follower.refuse(ready.version, str(e))
            return
        pause_ms = (time.perf_counter() - t0) * 1000
        self.follower.swapped(ready.version)
        self.stats.weights_loaded += 1
        load_s = ready.fetch_s + pause_ms / 1000
        values = {"version": ready.version, "load_s": load_s, "pause_ms": pause_ms}
        self._metric("weights_loaded", values, {})
        log.info("weights v%d loaded (pause %.0f ms)", ready.version, pause_ms)

    def _tick(self) -> None:
        self.publisher.poll()
        failures = self.publisher.failures
        if failures > self.stats.delivery_failures:
            log.warning(
                "%d record(s) failed delivery to Kafka (%d in all; served text was not affected, "
                "the log misses them): %s",
                failures - self.stats.delivery_failures,
                failures,
                self.publisher.last_error,
            )
            self.stats.delivery_failures = failures
        now = time.monotonic()
        if now - self._last_stats >= self.stats_interval_s:
            dt, self._last_stats = now - self._last_stats, now
            tokens, self._stats_tokens = self.stats.tokens - self._stats_tokens, self.stats.tokens
            values = {k: float(v) for k, v in self.stats.to_dict().items()}
            values |= {
                "tokens_per_s": tokens / dt,
                "running": float(self.engine.running),
                "waiting": float(len(self.engine.waiting)),
                "policy_version": float(self.engine.version),
                "published_chunks": float(self.publisher.chunks),
            }
            self._metric("serve_stats", values, {"publish": str(self.publisher.enabled).lower()})

    def _metric(self, kind: str, values: dict[str, float], labels: dict[str, str]) -> None:
        if self.metrics is not None:
            common = {"engine": self.engine.name, "simulated": str(self.engine.simulated).lower()}
            self.metrics.emit(kind, values, {"worker_id": self.metrics.source} | common | labels)


def _user_message(error: str) -> str:
    """An engine RequestError without the internal trajectory id (``request KEY: …``)."""
    head, sep, rest = error.partition(": ")
    return rest if sep and head.startswith("request ") else error
