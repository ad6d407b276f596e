"""The engine thread of ``srl serve``: every concurrent request in one continuous batch.

Owns the engine (``producers.engines``: hf, sim, vllm), the queue of requests waiting for a
batch slot, the text of each choice, and the publishing of served trajectories. One thread
runs the decode loop; the HTTP side (asyncio) prepares a request on a worker thread
(:meth:`ServeEngine.prepare`: chat template, tokenizing, the engine's checks), then only puts
commands into a thread-safe inbox (:meth:`submit`, :meth:`cancel`) and receives events through
its sink. Each iteration, in this order:

1. **weights**: re-raise a failure of the follower thread; if the follower
   (``producers.follower.WeightFollower``) has a newer verified version, publish every open
   partial chunk, then load it between two decode steps (the served policy is the newest
   verified version; running requests continue under it, their later tokens carry it); a
   version the engine rejects is refused and the old weights stay;
2. **intake**: take every command waiting (block up to 50 ms when nothing runs): a new job
   joins the queue; a cancelled job's choices are aborted (below);
3. **queue**: a job that has had no batch slot for ``max_queue_wait_s`` leaves the queue
   unserved (``Overloaded``: 503 with Retry-After); free slots go to the oldest job holding
   fewer than ``max_request_slots``, and to a job at its cap only when no other waits (fair
   share: one n = 16 request cannot take every slot from the requests behind it, and alone
   it still uses the whole batch); a job's first slot sends ``Accepted``;
4. **one decode step** for every running choice; each output goes through the choice's
   ``TextStream`` (text, stop strings: a stop ends the choice at the token that completed it)
   and through the publisher (``app.serve.publish``: chunks to ``{prefix}.trajectories``); the
   finish reason is decided once, so the API and the log always show the same one;
5. **events** of the step go to the sink in one batch (one wake-up of the event loop per step);
6. **housekeeping**: serve producer callbacks, report new delivery failures and dropped
   trajectories at once (log line, ``/health``), a ``serve_stats`` metric event every
   ``stats_interval_s``.

What must hold: one request never stops the thread. Its bad input was refused by
``prepare``; a failure while handling its outputs fails that job alone (``Failed``, counted
in ``request_errors``, its choices aborted); publishing never raises here (``Publisher``
drops and counts). A cancelled job that never had a slot leaves nothing in the log; one that
had closes every unfinished choice in the log with ``finish_reason = abort`` (its group stays
complete, and aborts are never trained). Only a failure of the engine itself (or the
follower) stops the thread: it is kept (``error``), every open job gets ``Failed`` and the
``on_failure`` callback runs (the server then stops). Called by ``app.serve.http`` (prepare,
submit, cancel, health) and ``app.serve.run`` (start, stop).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.serve.jobs import Accepted, Delta, Event, Failed, Finished, Job, Overloaded
from app.serve.protocol import Sampling
from app.serve.publish import Publisher
from app.serve.text import TextCodec, TextStream, choice_seed, token_logprobs
from app.serve.upkeep import ServeStats, Upkeep
from producers.engines.base import FINISH_ABORT, FINISH_STOP, Emitted, Engine, Request, RequestError
from producers.follower import WeightFollower
from producers.recovery import trajectory_id_for
from srl.metrics import Metrics

log = logging.getLogger("srl.serve")

Sink = Callable[[list[tuple[Job, Event]]], None]
Prompt = str | list[int] | list[dict[str, str]]  # completion text, token ids, chat messages


class Busy(Exception):
    """More choices would be pending than ``max_pending`` (HTTP 429)."""


class Stopped(Exception):
    """The engine thread does not run (HTTP 503)."""


@dataclass
class _Choice:
    job: Job
    index: int
    text: TextStream
    tokens: int = 0


@dataclass
class _Queued:
    """A job the engine thread holds: choices not yet in the engine, and how many are."""

    job: Job
    seq: int  # arrival order
    arrived: float  # time.monotonic()
    pending: deque[int] = field(default_factory=deque)  # choice indices without a slot
    running: int = 0  # choices in the engine
    unfinished: int = 0  # choices not finished
    accepted: bool = False  # had a slot (the response has started)


class _Lineup(dict[Job, _Queued]):
    """The jobs with unfinished choices, in arrival order, and who gets the next slot."""

    def __init__(self) -> None:
        super().__init__()
        self._arrivals = itertools.count()

    def add(self, job: Job) -> None:
        q = _Queued(job, next(self._arrivals), time.monotonic(), deque(range(job.sampling.n)))
        q.unfinished = job.sampling.n
        self[job] = q

    def expired(self, max_wait_s: float) -> list[_Queued]:
        """Jobs that had no slot for ``max_wait_s``, removed."""
        deadline = time.monotonic() - max_wait_s
        out = [q for q in self.values() if not q.accepted and q.arrived < deadline]
        for q in out:
            del self[q.job]
        return out

    def next(self, cap: int) -> _Queued | None:
        """The job whose next choice gets a free slot: the oldest holding fewer than ``cap``,
        else the oldest at its cap (None: no choice waits)."""
        waiting = [q for q in self.values() if q.pending]
        return min(waiting, key=lambda q: (q.running >= cap, q.seq)) if waiting else None

    def waiting(self) -> int:
        """Choices without a slot (read from other threads too: over a copy)."""
        return sum(len(q.pending) for q in self.copy().values())


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
        max_queue_wait_s: float = 60.0,
        max_request_slots: int | None = None,
    ) -> None:
        self.engine, self.codec, self.publisher = engine, codec, publisher
        self.follower, self.metrics = follower, metrics
        self.max_pending, self.stats_interval_s = max_pending, stats_interval_s
        self.max_queue_wait_s = max_queue_wait_s
        self.max_request_slots = max_request_slots or max(1, engine.max_batch // 2)
        self.stats = ServeStats()
        self.error: BaseException | None = None
        self.on_failure: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
        self._jobs = _Lineup()
        self._choices: dict[str, _Choice] = {}  # running choices by trajectory id
        self._out: list[tuple[Job, Event]] = []
        self._sink: Sink | None = None
        self._pending = 0  # choices submitted and not finished (HTTP side's admission bound)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.upkeep = Upkeep(engine, publisher, self.stats, follower, metrics, stats_interval_s)

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

    def prepare(self, prompt: Prompt, chat: bool, s: Sampling) -> list[int]:
        """The prompt's token ids, checked against the engine; RequestError for a request
        that can never run. Runs on a worker thread of the HTTP side (chat templates and
        tokenizers take time, never on the event loop or the decode loop)."""
        if chat:
            assert isinstance(prompt, list)
            try:
                text = self.codec.chat_prompt(prompt)  # type: ignore[arg-type]
            except Exception as e:  # a template that refuses the conversation (jinja raises)
                raise RequestError(f"chat template: {e}") from None
            ids = self.codec.encode(text, chat=True)
        elif isinstance(prompt, str):
            ids = self.codec.encode(prompt, chat=False)
        else:
            vocab = self.codec.vocab_size
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad[0]}")
            ids = list(prompt)  # type: ignore[arg-type]
        probe = Request("prompt", ids, s.max_tokens, s.temperature, s.top_p)
        self.engine.validate(probe)
        return ids

    def submit(self, job: Job) -> None:
        """Hand a job to the engine thread; Busy or Stopped if it cannot take it now."""
        if not self.alive:
            raise Stopped("the server is not accepting requests")
        with self._lock:
            if self._pending + job.sampling.n > self.max_pending:
                self.stats.busy += 1
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
            "waiting": self._waiting(),
            "pending": self._pending,
            "publish": self.publisher.enabled,
            "published_chunks": self.publisher.chunks,
        } | self.stats.to_dict()

    def _waiting(self) -> int:
        """Choices without a batch slot (read from other threads too: a copy of the jobs)."""
        return len(self.engine.waiting) + self._jobs.waiting()

    def _release(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.upkeep.swap()
                self._take_inbox(wait=not (self.engine.has_work or self._jobs))
                self._schedule()
                if self.engine.has_work:
                    self._emit(self.engine.step())
                self._send()
                self.upkeep.tick(self._waiting())
        except BaseException as e:  # kept for the server, reported to every open job
            self.error = e
            log.error("serve engine failed: %s", e, exc_info=True)
        finally:
            try:
                self._close_all()
            finally:
                if self.error is not None and self.on_failure is not None:
                    self.on_failure()

    def _take_inbox(self, wait: bool) -> None:
        try:
            cmd, job = self._inbox.get(timeout=0.05) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "submit":
                self.stats.requests += 1
                self._jobs.add(job)
            else:
                self._cancel(job)
            try:
                cmd, job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _schedule(self) -> None:
        """Queue-wait bound, then free batch slots to the jobs by fair share."""
        for late in self._jobs.expired(self.max_queue_wait_s):
            self._release(late.job.sampling.n)
            self.stats.queue_timeouts += 1
            wait = f"{self.max_queue_wait_s:g}"
            self._out.append((late.job, Overloaded(f"no capacity within {wait} s; retry later")))
        free = self.engine.max_batch - self.engine.running - len(self.engine.waiting)
        while free > 0 and (q := self._jobs.next(self.max_request_slots)) is not None:
            self._guard(q.job, functools.partial(self._start, q))
            free -= 1

    def _start(self, q: _Queued) -> None:
        """The next choice of ``q``'s job into the engine (and into the log)."""
        job, s, index = q.job, q.job.sampling, q.pending[0]
        key = trajectory_id_for(job.completion_id, index)
        self.engine.add(
            Request(
                key,
                job.prompt_ids,
                s.max_tokens,
                s.temperature,
                s.top_p,
                seed=choice_seed(s.seed, index),
                top_logprobs=s.logprobs or 0,
            )
        )
        q.pending.popleft()
        q.running += 1
        if not q.accepted:
            q.accepted = True
            self.stats.queue_waits += 1
            self.stats.queue_wait_ms += round((time.monotonic() - q.arrived) * 1000)
            self._out.append((job, Accepted(len(job.prompt_ids))))
        self.publisher.open(job, index, key)
        self._choices[key] = _Choice(job, index, TextStream(self.codec.decode, s.stop))

    def _cancel(self, job: Job) -> None:
        """Abort every unfinished choice of ``job``: nothing in the log if it never had a slot
        (nothing was served), else each one closed with ``abort`` (the group stays whole)."""
        q = self._jobs.pop(job, None)
        if q is None:  # finished, failed or timed out already
            return
        if not q.accepted:
            self._release(job.sampling.n)
            return
        for key in [k for k, c in self._choices.items() if c.job is job]:
            self._abort(key)
        for index in q.pending:  # never started: an empty trajectory that ends as an abort
            key = trajectory_id_for(job.completion_id, index)
            self.publisher.open(job, index, key)
            self.publisher.add(key, [], [], self.engine.version, FINISH_ABORT)
            self._release(1)
            self.stats.cancelled += 1
        q.pending.clear()

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
                self._guard(c.job, functools.partial(self._advance, c, e))

    def _advance(self, c: _Choice, e: Emitted) -> None:
        used, text, stopped = c.text.feed(e.tokens)
        reason: str | None = FINISH_STOP if stopped else None
        if stopped and e.finish_reason is None:
            self.engine.abort(e.key)  # the stop string ends it here, not the engine
        elif e.finish_reason is not None:  # a stop string may still complete in held text
            rest, stopped = c.text.finish()
            text += rest
            reason = FINISH_STOP if stopped else e.finish_reason
        c.tokens += used
        self.stats.tokens += used
        logprobs = None
        if c.job.sampling.logprobs is not None:
            logprobs = token_logprobs(self.codec.decode, e.tokens[:used], e.logprobs, e.top)
        self.publisher.add(e.key, e.tokens[:used], e.logprobs[:used], self.engine.version, reason)
        if reason is None:
            if text or logprobs:
                self._out.append((c.job, Delta(c.index, text, logprobs)))
            return
        version = self.engine.version
        self._out.append((c.job, Finished(c.index, text, reason, c.tokens, version, logprobs)))
        del self._choices[e.key]
        self._release(1)
        self.stats.completions += 1
        q = self._jobs[c.job]
        q.running -= 1
        q.unfinished -= 1
        if not q.unfinished:
            del self._jobs[c.job]

    def _guard(self, job: Job, work: Callable[[], None]) -> None:
        """``work()`` for one job; if it raises, that job alone fails (its choices aborted)."""
        try:
            work()
        except Exception as e:
            log.error("request %s failed: %s", job.completion_id, e, exc_info=True)
            self.stats.request_errors += 1
            self._fail(job)

    def _fail(self, job: Job) -> None:
        try:
            self._cancel(job)
        except Exception as e:  # its log is incomplete: the trainer expires it
            log.error("request %s: aborting failed too: %s", job.completion_id, e)
            self._jobs.pop(job, None)
            for key in [k for k, c in self._choices.items() if c.job is job]:
                del self._choices[key]
        self._out.append((job, Failed("the server could not complete this request")))

    def _send(self) -> None:
        if self._out and self._sink is not None:
            out, self._out = self._out, []
            self._sink(out)

    def _close_all(self) -> None:
        """On the way out: open choices end as aborts in the log, their jobs get ``Failed``."""
        why = "the server failed" if self.error else "the server is stopping"
        failed = list(self._jobs)
        for job in failed:
            try:
                self._cancel(job)
            except Exception as e:
                log.error("closing request %s: %s", job.completion_id, e)
        while True:
            try:
                cmd, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd == "submit":
                self._release(job.sampling.n)
                failed.append(job)
        self._out += [(job, Failed(f"{why}; retry later", status=503)) for job in failed]
        self._send()


def user_message(error: str) -> str:
    """An engine RequestError without the internal request key (``request KEY: …``)."""
    head, sep, rest = error.partition(": ")
    return rest if sep and head.startswith("request ") else error
