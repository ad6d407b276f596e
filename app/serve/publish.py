"""Served completions → ``{prefix}.trajectories``, exactly as dispatched work is published.

Owns how a served choice becomes a trajectory in the log. What must hold:

* the same ``producers.chunker.Chunker`` cuts it (a chunk every ``chunk_tokens`` tokens and a
  last one, behaviour log-probs and policy version per chunk, a chunk never mixes versions),
  and the same partitioning places it: key = trajectory id, partition =
  ``Layout.partition_for(bucket, trajectory_id)``, bucket = the one of the request's
  ``max_tokens`` (the bound on its length: serving has no length prediction);
* the ``n`` choices of one request are one group: ``prompt_id`` = ``task_id`` = the completion
  id, ``group_size`` = n, ``sample_index`` = the choice index, trajectory id
  ``producers.recovery.trajectory_id_for(completion_id, index)``;
* the seq-0 chunk's ``metadata`` is ``{"source": "serve", "completion_id": …, "request":
  {…}}`` (``serve_metadata``), so any consumer tells served traffic from dispatched work and
  keeps what the application asked for;
* publishing never blocks and never fails serving: records are produced with
  ``block=False``, and a record the producer does not take (over the broker's record limit,
  a full local queue while the broker is slow or gone, a failed producer) drops its
  trajectory: counted in ``dropped``, nothing more of it is published, its request is still
  answered (a trajectory with a gap would never assemble; the trainer expires what was sent);
* a delivery failure is counted by the producer (``failures``) and reported by the engine
  loop (log line, ``/health``, ``serve_stats``, ``/metrics``), never dropped silently;
* tokens wait in a per-trajectory buffer and reach the chunker a chunk at a time (a full
  chunk, a new policy version, the end, or a weight swap), which cuts exactly the chunks
  token-by-token calls would, for a list append per token on the decode loop.

With publishing off (``producer=None``) every method does nothing. Called by the engine
thread of ``app.serve.core`` only. :class:`Lossy` gives the engine thread's metric events the
same never-block rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.serve.jobs import Job
from producers.chunker import Chunker, TrajectoryStart
from schemas.records import ABORTED, TrajectoryChunk, encode, pack_tokens
from srl.kafka import Producer
from srl.topics import Layout

log = logging.getLogger("srl.serve")
SOURCE = "serve"


def serve_metadata(completion_id: str, request: dict[str, Any]) -> str:
    """The seq-0 metadata JSON of a served trajectory."""
    return orjson.dumps(
        {"source": SOURCE, "completion_id": completion_id, "request": request}
    ).decode()


def trajectory_start(job: Job, index: int, trajectory_id: str, layout: Layout) -> TrajectoryStart:
    """Choice ``index`` of ``job`` as the chunker's trajectory."""
    return TrajectoryStart(
        trajectory_id=trajectory_id,
        prompt_id=job.completion_id,
        task_id=job.completion_id,
        sample_index=index,
        group_size=job.sampling.n,
        bucket=layout.bucket_for(job.sampling.max_tokens),
        prompt_tokens=pack_tokens(job.prompt_ids),
        metadata=serve_metadata(job.completion_id, job.request),
        temperature=job.sampling.temperature,
        top_p=job.sampling.top_p,
    )


@dataclass
class _Pending:
    version: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Publisher:
    """Chunks of served trajectories into the producer (or nowhere, when off)."""

    def __init__(
        self, producer: Producer | None, layout: Layout, chunk_tokens: int, worker_id: str
    ) -> None:
        self.producer = producer
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.chunker = Chunker(chunk_tokens, worker_id)
        self.chunks = 0
        self.trajectories = 0  # finished (not aborted) ones whose last chunk the producer took
        self.dropped = 0  # trajectories the producer refused a record of (not published)
        self.last_drop = ""  # why the last one was dropped
        self._pending: dict[str, _Pending] = {}  # open trajectories

    @property
    def enabled(self) -> bool:
        return self.producer is not None

    @property
    def failures(self) -> int:
        """Records the broker did not take (chunks and metric events)."""
        return self.producer.failed if self.producer is not None else 0

    @property
    def last_error(self) -> str:
        errors = self.producer.errors if self.producer is not None else []
        return errors[-1] if errors else ""

    def open(self, job: Job, index: int, trajectory_id: str) -> None:
        if self.producer is not None:
            self.chunker.open(trajectory_start(job, index, trajectory_id, self.layout))
            self._pending[trajectory_id] = _Pending()

    def add(
        self,
        trajectory_id: str,
        tokens: list[int],
        logprobs: list[float],
        version: int,
        finish_reason: str | None = None,
    ) -> None:
        """Tokens of one trajectory, all sampled by ``version``; the end with a finish reason.
        A trajectory that is not open (dropped, or publishing off) is ignored."""
        p = self._pending.get(trajectory_id)
        if p is None:
            return
        if p.tokens and p.version != version:
            self._drain(trajectory_id, p)
        p.version = version
        p.tokens += tokens
        p.logprobs += logprobs
        if finish_reason is not None:
            self._drain(trajectory_id, p, finish_reason)
            self._pending.pop(trajectory_id, None)
        elif len(p.tokens) >= self.chunk_tokens:
            self._drain(trajectory_id, p)

    def flush_open(self) -> None:
        """Every open partial chunk (before a weight swap: no chunk mixes versions)."""
        for tid, p in list(self._pending.items()):
            self._drain(tid, p)
        if self.producer is not None:
            for chunk in self.chunker.flush_all():
                self._publish(chunk)

    def poll(self) -> None:
        """Serve the producer's delivery reports; a failed producer's error is not the
        engine's (each later record of it drops its trajectory)."""
        if self.producer is not None:
            try:
                self.producer.poll(0)
            except Exception as e:  # a failed producer; counted as it drops records
                self.last_drop = f"{type(e).__name__}: {e}"

    def _drain(self, tid: str, p: _Pending, finish_reason: str | None = None) -> None:
        chunks = self.chunker.add(tid, p.tokens, p.logprobs, p.version, finish_reason)
        p.tokens, p.logprobs = [], []
        for chunk in chunks:
            if not self._publish(chunk):
                return

    def _publish(self, chunk: TrajectoryChunk) -> bool:
        """Produce one chunk; False, its trajectory dropped, if the producer did not take it."""
        assert self.producer is not None
        tid = chunk.trajectory_id
        try:
            self.producer.produce(
                self.layout.trajectories,
                encode(chunk),
                key=tid,
                partition=self.layout.partition_for(chunk.bucket, tid),
                block=False,
            )
        except Exception as e:  # any refusal costs this trajectory, not serving
            self.dropped += 1
            self.last_drop = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            self._pending.pop(tid, None)
            self.chunker.drop(tid)
            return False
        self.chunks += 1
        self.trajectories += chunk.is_last and chunk.finish_reason != ABORTED
        return True


class Lossy:
    """A producer for the engine thread's metric events and dead letters: never blocks, and
    a record it cannot queue is counted in ``lost`` instead of raised (what ``srl.metrics``
    needs of a producer: ``produce``)."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.lost = 0

    def produce(self, topic: str, value: bytes, **kw: Any) -> None:
        try:
            self.producer.produce(topic, value, block=False, **kw)
        except Exception as e:  # a metric event is not worth a request
            self.lost += 1
            log.debug("metric event not queued: %s", e)
