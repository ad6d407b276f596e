"""Engine outputs → ``TrajectoryChunk`` records: the pure half of the generator worker.

Owns the chunk numbering of every trajectory a worker is generating. What must hold (the
contract of ``schemas/trajectory_chunk.avsc``):

* ``seq`` runs from the trajectory's first seq (0, or a resume's ``next_seq``) without gaps,
  and ``token_offset`` is the number of completion tokens before the chunk's first token;
* a chunk holds at most ``chunk_tokens`` tokens, one behaviour log-prob per token, and tokens
  of a single policy version: tokens of a new version close the open chunk first (so does
  ``flush_all`` before a weight swap);
* ``prompt_tokens``, ``metadata``, ``step``, ``step_groups`` and the sampling settings
  (``temperature``, ``top_p``) ride on seq 0 only;
  ``finish_reason`` and ``is_last`` on the last chunk only; the last chunk may be empty only
  when it carries nothing but the end (an abort); ``pool`` and ``pool_epoch`` (the writer's,
  under pool epochs: ``srl.lineage``) on every chunk;
* the one exception: :meth:`Chunker.hand_off` closes a trajectory this worker gives to another
  pool with a non-last chunk whose ``finish_reason`` is ``MIGRATED`` (possibly empty), so
  whoever reads the topic back knows the prefix has a new owner.

No Kafka here: the worker's outlet drains the returned records into its producer. Called by
``producers.outlet`` and ``app.bench.engine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.records import MIGRATED, TrajectoryChunk, now_ms, pack_logprobs, pack_tokens


@dataclass(frozen=True)
class TrajectoryStart:
    """What every chunk of one trajectory repeats, and where its numbering starts."""

    trajectory_id: str
    prompt_id: str
    task_id: str
    sample_index: int
    group_size: int
    bucket: str
    predicted_length: int | None = None
    next_seq: int = 0  # first seq this worker publishes (a resume's next_seq)
    token_offset: int = 0  # completion tokens before it (a resume's prefix length)
    prompt_tokens: bytes | None = None  # packed int32; sent on seq 0 only
    metadata: str | None = None  # task metadata JSON; sent on seq 0 only
    started_ms: int = field(default_factory=now_ms)
    step: int | None = None  # the task's trainer step; sent on seq 0 only
    step_groups: int | None = None  # groups released for that step; seq 0 only
    pool: str | None = None  # the writer's pool and epoch (pool epochs), on every chunk
    pool_epoch: int | None = None
    temperature: float | None = None  # sampling settings (null: the run's); seq 0 only
    top_p: float | None = None


@dataclass
class _Open:
    start: TrajectoryStart
    seq: int
    offset: int
    version: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Chunker:
    def __init__(self, chunk_tokens: int, worker_id: str) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.chunk_tokens = chunk_tokens
        self.worker_id = worker_id
        self._open: dict[str, _Open] = {}

    def open(self, start: TrajectoryStart) -> None:
        if start.trajectory_id in self._open:
            raise ValueError(f"trajectory {start.trajectory_id} is already open")
        self._open[start.trajectory_id] = _Open(start, start.next_seq, start.token_offset)

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def add(
        self,
        trajectory_id: str,
        tokens: list[int],
        logprobs: list[float],
        version: int,
        finish_reason: str | None = None,
    ) -> list[TrajectoryChunk]:
        """Chunks that ``tokens`` (all sampled by ``version``) complete; the last one if
        finished."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} log-probs")
        t = self._open[trajectory_id]
        out: list[TrajectoryChunk] = []
        if t.tokens and t.version != version:
            out.append(self._emit(t, len(t.tokens)))
        if tokens:
            t.version = version
            t.tokens.extend(tokens)
            t.logprobs.extend(logprobs)
        n = self.chunk_tokens
        while len(t.tokens) > n or (len(t.tokens) == n and finish_reason is None):
            out.append(self._emit(t, n))
        if finish_reason is not None:
            if t.version < 0:
                t.version = version
            out.append(self._emit(t, len(t.tokens), finish_reason))
            del self._open[trajectory_id]
        return out

    def flush(self, trajectory_id: str) -> TrajectoryChunk | None:
        """The open partial chunk of one trajectory as a non-last chunk (None if it is empty)."""
        t = self._open[trajectory_id]
        return self._emit(t, len(t.tokens)) if t.tokens else None

    def hand_off(self, trajectory_id: str, version: int) -> TrajectoryChunk:
        """Close a trajectory that continues elsewhere: its open tokens in a ``MIGRATED`` chunk."""
        t = self._open.pop(trajectory_id)
        if t.version < 0:
            t.version = version
        return self._emit(t, len(t.tokens), MIGRATED, is_last=False)

    def flush_all(self) -> list[TrajectoryChunk]:
        """Every open partial chunk (before a weight swap, so no chunk mixes versions)."""
        return [c for k in list(self._open) if (c := self.flush(k)) is not None]

    def drop(self, trajectory_id: str) -> None:
        """Forget a trajectory (after its hand-off flush); later chunks come from another worker."""
        self._open.pop(trajectory_id, None)

    def _emit(
        self, t: _Open, n: int, finish_reason: str | None = None, is_last: bool | None = None
    ) -> TrajectoryChunk:
        s = t.start
        tokens, logprobs = t.tokens[:n], t.logprobs[:n]
        del t.tokens[:n], t.logprobs[:n]
        first = t.seq == 0
        chunk = TrajectoryChunk(
            trajectory_id=s.trajectory_id,
            prompt_id=s.prompt_id,
            task_id=s.task_id,
            sample_index=s.sample_index,
            group_size=s.group_size,
            seq=t.seq,
            token_offset=t.offset,
            tokens=pack_tokens(tokens),
            logprobs=pack_logprobs(logprobs),
            policy_version=t.version,
            is_last=finish_reason is not None if is_last is None else is_last,
            finish_reason=finish_reason,
            worker_id=self.worker_id,
            bucket=s.bucket,
            started_ms=s.started_ms,
            predicted_length=s.predicted_length,
            prompt_tokens=s.prompt_tokens if first else None,
            metadata=s.metadata if first else None,
            step=s.step if first else None,
            step_groups=s.step_groups if first else None,
            pool=s.pool,
            pool_epoch=s.pool_epoch,
            temperature=s.temperature if first else None,
            top_p=s.top_p if first else None,
        )
        t.seq += 1
        t.offset += n
        return chunk
