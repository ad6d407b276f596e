"""Rewards off the consume loop: reward processes beside the trainer, answers in order.

Owns how rank 0 scores trajectories without stopping its reads. What must hold:

* ``submit`` never waits for a reward: the trajectory is decoded (the tokenizer, in the
  trainer's process) and queued; ``reward_workers`` processes (``consumers.rewardworker``, one
  thread each here, one call in flight per process, each started with the pool, so the first
  trajectory does not wait for a Python start and the reward's imports) take the queue as
  they are free;
* ``ready`` hands results back **in submission order** (a later trajectory's result waits for
  an earlier one's), so groups complete, and steps form, exactly as with synchronous scoring:
  only later. Items submitted with nothing to score (a feedback-rewarded sample, an invalid
  trajectory) keep their place in that order too;
* a call running past ``reward_timeout_s`` is a ``Scored(None, "reward timed out …")``: its
  process is SIGKILLed and replaced before the next call; a process that dies (a segfault, an
  ``os._exit`` in the plugin) is ``Scored(None, "reward process died …")``. Both are counted
  outcomes of the sample (``failed_reward``), never a stall or a crash of the trainer;
* ``reward_workers = 0`` scores in the trainer's process at ``submit`` (synchronous, no
  timeout: for a debugger).

Each reward process starts with the trainer's ``sys.path`` (a reward importable by the trainer
is importable there) and ends with it. ``RewardPath`` is the trainer's side: what each
trajectory it reads becomes (scored, rewarded by its feedback, or invalid), in the order read.
Called by ``consumers.trainer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson

from consumers.assembler import Trajectory
from consumers.feedback import FeedbackPath
from consumers.groups import Sample
from consumers.intake import Invalid
from consumers.rewards import Scored, Scorer
from srl.metrics import Metrics

log = logging.getLogger("srl.trainer")
READ_BYTES = 1 << 16
START_S = 120.0  # a reward process's start (Python, the reward's imports): not a call's timeout


@dataclass
class Job:
    seq: int
    request: bytes  # one JSON line


class RewardProcess:
    """One ``consumers.rewardworker`` and the calls it answers, each under a deadline."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""
        self.started = 0  # processes started, replacements included

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumers.rewardworker", self.spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.buf, self.started = b"", self.started + 1
        os.set_blocking(self.proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._read_line(self.proc, time.monotonic() + START_S)  # {"ready": true}
        return self.proc

    def warm(self) -> None:
        """Start the process before the first call (a fresh Python and the reward's imports take
        seconds: the trainer's first step would wait for them); one that fails to start is
        started again, and its failure reported, by the first ``call``."""
        try:
            self._start()
        except (TimeoutError, EOFError, OSError) as e:
            log.debug("reward process did not start ahead of its first call: %r", e)
            self.stop()

    def call(self, request: bytes) -> Scored:
        try:
            alive = self.proc is not None and self.proc.poll() is None
            proc = self.proc if alive else self._start()
        except TimeoutError:
            self.stop()
            return Scored(None, f"reward process did not start within {START_S:g}s")
        except EOFError:
            return Scored(None, f"reward process died at start (exit code {self.stop()})")
        assert proc is not None
        deadline = time.monotonic() + self.timeout_s
        try:
            self._write(proc, request, deadline)
            line = self._read_line(proc, deadline)
        except TimeoutError:
            self.stop()
            return Scored(None, f"reward timed out after {self.timeout_s:g}s (process replaced)")
        except (BrokenPipeError, EOFError):
            code = self.stop()
            return Scored(None, f"reward process died (exit code {code})")
        out = orjson.loads(line)
        if "error" in out:
            return Scored(None, str(out["error"]))
        return Scored(float(out["reward"]))

    def _write(self, proc: subprocess.Popen[bytes], data: bytes, deadline: float) -> None:
        fd = proc.stdin.fileno()  # type: ignore[union-attr]
        view = memoryview(data)
        while view:
            if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                raise TimeoutError
            view = view[os.write(fd, view[:READ_BYTES]) :]

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes:
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self.buf:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                continue
            if not data:
                raise EOFError
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def stop(self) -> int | None:
        """Kill the process (if any); its exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(OSError):
            proc.kill()
        code = proc.wait()
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                f.close()  # type: ignore[union-attr]
        return code


class RewardPool:
    """See the module docstring."""

    def __init__(self, spec: str, scorer: Scorer, workers: int, timeout_s: float) -> None:
        self.scorer, self.workers = scorer, workers
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.items: dict[int, Any] = {}  # seq -> what submit was given, until ready
        self.results: dict[int, Scored | None] = {}
        self.submitted = self.released = 0
        self.closing = False
        self.procs = [RewardProcess(spec, timeout_s) for _ in range(workers)]
        self.threads = [
            threading.Thread(target=self._serve, args=(p,), name=f"reward-{i}", daemon=True)
            for i, p in enumerate(self.procs)
        ]
        for t in self.threads:
            t.start()

    @property
    def pending(self) -> int:
        """Items submitted and not yet handed back by ``ready``."""
        return self.submitted - self.released

    def submit(self, item: Any, traj: Trajectory | None = None) -> None:
        """Queue ``item``; with ``traj``, its reward comes back with it (else None does)."""
        seq = self.submitted
        self.submitted += 1
        self.items[seq] = item
        if traj is None:
            self._done(seq, None)
        elif self.workers == 0:
            self._done(seq, self.scorer.score(traj))
        else:
            prompt, completion = self.scorer.texts(traj)
            req = {"prompt": prompt, "completion": completion, "metadata": dict(traj.metadata)}
            self.jobs.put(Job(seq, orjson.dumps(req, default=str) + b"\n"))

    def score(self, traj: Trajectory) -> None:
        """Queue ``traj`` for its reward (it comes back as the item)."""
        self.submit(traj, traj)

    def ready(self) -> list[tuple[Any, Scored | None]]:
        """The items whose turn has come, in submission order, each with its reward."""
        out = []
        with self.lock:
            while self.released in self.results:
                seq = self.released
                out.append((self.items.pop(seq), self.results.pop(seq)))
                self.released += 1
        return out

    def _done(self, seq: int, scored: Scored | None) -> None:
        with self.lock:
            self.results[seq] = scored

    def _serve(self, proc: RewardProcess) -> None:
        proc.warm()
        while (job := self.jobs.get()) is not None:
            try:
                scored = proc.call(job.request)
            except Exception as e:  # never lose a result: the sample fails instead
                if self.closing:  # close() killed the call in flight
                    break
                log.warning("reward process: %s", e)
                proc.stop()
                scored = Scored(None, f"reward process: {type(e).__name__}: {e}"[:300])
            self._done(job.seq, scored)
        proc.stop()

    def close(self) -> None:
        """Stop the threads and their processes (results not yet handed back are dropped:
        their trajectories are undecided, so their records are read again after a restart)."""
        self.closing = True
        for _ in self.threads:
            self.jobs.put(None)
        for p in self.procs:  # a call in flight ends at once (its thread then sees the None)
            p.stop()
        for t in self.threads:
            t.join(timeout=5)


class RewardPath:
    """The trainer's rewards: a trajectory scored by ``--reward`` (in the pool), rewarded by its
    feedback (a served one, which may wait for it: ``consumers.feedback``), or invalid; each
    keeps its place in the pool's order, so groups complete in the order they were read."""

    def __init__(self, pool: RewardPool, feedback: FeedbackPath, metrics: Metrics) -> None:
        self.pool, self.feedback, self.metrics = pool, feedback, metrics

    @property
    def pending(self) -> int:
        return self.pool.pending

    def submit(self, traj: Trajectory | Invalid | Sample) -> None:
        if isinstance(traj, Trajectory) and self.feedback.waits_for(traj):
            sample = self.feedback.sample(traj, time.monotonic())
            if sample is not None:
                self.pool.submit(sample)
        elif isinstance(traj, Trajectory):
            self.pool.score(traj)
        else:
            self.pool.submit(traj)

    def ready(self) -> list[Sample | Invalid]:
        """What is decided, in order: samples (rewarded, or failed and counted) and invalid
        trajectories."""
        out: list[Sample | Invalid] = []
        for item, s in self.pool.ready():
            if s is None:
                out.append(item)
                continue
            if s.error is not None:  # counted and logged, never raised
                self.metrics.incr("reward_failures")
                if "timed out" in s.error:
                    self.metrics.incr("reward_timeouts")
                log.warning("reward failed for %s: %s", item.trajectory_id, s.error)
            out.append(Sample(item, s.reward, s.error))
        return out

    def close(self) -> None:
        self.pool.close()
