"""Chunks → trajectories: dedupe, stitch, validate, expire.

Owns the reassembly of ``TrajectoryChunk`` records into whole trajectories. What must hold:

* ``(trajectory_id, seq)`` is the identity of a chunk; the first copy wins and every later
  copy (producer retries, a resumed trajectory re-publishing part of its prefix, a replay
  after a trainer restart) is dropped and counted in ``duplicates``; except that a fenced
  writer's chunks (a zombie generator's, superseded by a newer pool epoch: ``srl.lineage``)
  are dropped, or removed, and counted in ``fenced``, whatever arrived first;
* a trajectory is complete when its ``is_last`` chunk and every seq below it have arrived, in
  any order, from any partition and any worker (a resumed trajectory continues the seq
  numbering of its prefix on another worker, possibly in another bucket's partitions);
* a completed trajectory's chunks are consistent: ``token_offset`` is the sum of the earlier
  chunks' token counts, and its last chunk's writer wrote no seq beyond it; otherwise
  :class:`BadTrajectory`;
* the behaviour version ``b`` is the minimum ``policy_version`` over its chunks;
* chunks of a trajectory already assembled (this session, until its outcome is durable:
  ``forget``) or finalized (the ledger, which keeps every trajectory whose records may still
  be delivered again) are duplicates;
* an incomplete trajectory with no new chunk for ``expire_s`` is expired (``expire``).

Pure logic, no Kafka: the trainer's hot loop calls ``add`` per decoded chunk.
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import orjson

from schemas.records import MIGRATED, TrajectoryChunk, now_ms, unpack_logprobs, unpack_tokens
from srl.lineage import Lineage


class BadChunk(ValueError):
    """A chunk that can never be part of a valid trajectory (goes to the DLQ)."""


class BadTrajectory(ValueError):
    """A trajectory whose chunks are inconsistent once all have arrived."""

    def __init__(self, trajectory_id: str, reason: str) -> None:
        super().__init__(f"trajectory {trajectory_id}: {reason}")
        self.trajectory_id = trajectory_id


SERVED = "serve"  # seq-0 metadata "source" of a trajectory srl serve published


@dataclass
class Trajectory:
    """One complete sample: prompt, completion and the behaviour log-prob of each token."""

    trajectory_id: str
    prompt_id: str
    task_id: str
    sample_index: int
    group_size: int
    bucket: str
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: tuple[int, ...]  # policy_version of each chunk, in seq order
    finish_reason: str | None
    metadata: dict[str, Any]
    workers: tuple[str, ...]
    started_ms: int
    last_created_ms: int
    assembled_ms: int = field(default_factory=now_ms)
    step: int | None = None  # trainer step its group was released for (null: unscheduled)
    step_groups: int | None = None  # groups released for that step
    temperature: float | None = None  # sampling settings it was drawn with (null: the run's)
    top_p: float | None = None

    @property
    def behaviour_version(self) -> int:
        """b: the oldest policy version that produced any of its tokens."""
        return min(self.versions)

    @property
    def served(self) -> bool:
        """Published by ``srl serve`` (seq-0 metadata ``source``): a user's request, which no
        admission paced by trainer steps (``consumers.gate``, the served bound)."""
        return self.metadata.get("source") == SERVED

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        """Prompt plus completion: the row length the trainer runs."""
        return int(self.prompt_tokens.shape[0]) + self.n_tokens


@dataclass
class Partial:
    """What the assembler knows of an incomplete trajectory (for expiry reports)."""

    trajectory_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    bucket: str
    chunks: dict[int, TrajectoryChunk] = field(default_factory=dict)
    last_arrival: float = 0.0
    lineage: Lineage = field(init=False)  # decides which chunks count (shares ``chunks``)

    def __post_init__(self) -> None:
        self.lineage = Lineage(self.chunks)

    @property
    def last_seq(self) -> int | None:
        return self.lineage.last_seq

    @property
    def step(self) -> tuple[int | None, int | None]:
        """``(step, step_groups)`` from seq 0, if it has arrived."""
        first = self.chunks.get(0)
        return (first.step, first.step_groups) if first is not None else (None, None)


def validate_chunk(c: TrajectoryChunk) -> None:
    """BadChunk if ``c`` is malformed on its own (before any stitching)."""
    if c.seq < 0 or c.token_offset < 0:
        raise BadChunk(f"negative seq {c.seq} or token_offset {c.token_offset}")
    if c.policy_version < 0:
        raise BadChunk(f"negative policy version {c.policy_version}")
    if c.group_size < 1 or not 0 <= c.sample_index < c.group_size:
        raise BadChunk(f"sample_index {c.sample_index} outside group of {c.group_size}")
    if len(c.tokens) % 4 or len(c.logprobs) != len(c.tokens):
        raise BadChunk(
            f"{len(c.tokens)} token bytes vs {len(c.logprobs)} log-prob bytes (int32/float32, one "
            f"each)"
        )
    if not c.tokens and not c.is_last and c.finish_reason != MIGRATED:
        raise BadChunk(f"empty chunk seq {c.seq} that is not the last")
    if not c.is_last and c.finish_reason not in (None, MIGRATED):
        raise BadChunk(
            f"finish_reason {c.finish_reason!r} on chunk seq {c.seq}, which is not the last"
        )
    lp = c.logprob_values()
    if lp.size and not (np.isfinite(lp).all() and float(lp.max()) <= 1e-3):
        raise BadChunk("behaviour log-probs must be finite and <= 0")
    if (c.step is None) != (c.step_groups is None) or (
        c.step is not None and (c.step < 1 or c.step_groups is None or c.step_groups < 1)
    ):
        raise BadChunk(f"step {c.step} / step_groups {c.step_groups}: both or neither, both >= 1")
    if c.seq == 0:
        if c.prompt_tokens is None or len(c.prompt_tokens) % 4:
            raise BadChunk("seq 0 carries no (or malformed) prompt_tokens")
        if c.metadata is not None:
            try:
                meta = orjson.loads(c.metadata)
            except orjson.JSONDecodeError as e:
                raise BadChunk(f"metadata is not JSON ({e})") from None
            if not isinstance(meta, dict):
                raise BadChunk("metadata JSON is not an object")


class Assembler:
    """Stitches chunks into trajectories; see the module docstring for what holds."""

    def __init__(self, finalized: Container[str], expire_s: float = 300.0) -> None:
        self.finalized = finalized  # the durable ledger (trajectory ids with an outcome)
        self.expire_s = expire_s
        self.open: dict[str, Partial] = {}
        self.assembled: set[str] = set()  # complete this session, outcome maybe not durable yet
        self.duplicates = 0
        self.fenced = 0  # chunks of fenced writers dropped (srl.lineage)

    def add(self, chunk: TrajectoryChunk, now: float | None = None) -> Trajectory | None:
        """The trajectory ``chunk`` completes, or None. BadChunk / BadTrajectory on bad input."""
        validate_chunk(chunk)
        tid = chunk.trajectory_id
        if tid in self.assembled or tid in self.finalized:
            self.duplicates += 1
            return None
        part = self.open.get(tid)
        if part is None:
            part = self.open[tid] = Partial(
                tid, chunk.prompt_id, chunk.sample_index, chunk.group_size, chunk.bucket
            )
        fenced = part.lineage.fenced
        verdict = part.lineage.add(chunk)
        self.fenced += part.lineage.fenced - fenced
        if verdict == "duplicate":
            self.duplicates += 1
        if verdict != "kept":
            return None
        part.last_arrival = time.monotonic() if now is None else now
        if beyond := part.lineage.beyond_last():
            self._fail(tid, f"seq {beyond[-1]} beyond the last seq {part.last_seq}")
        if not part.lineage.complete():
            return None
        return self._stitch(part)

    def _fail(self, tid: str, reason: str) -> NoReturn:
        del self.open[tid]
        self.assembled.add(tid)
        raise BadTrajectory(tid, reason)

    def _stitch(self, part: Partial) -> Trajectory:
        chunks = part.lineage.contiguous(0)  # complete: seq 0 through the last
        offset = 0
        for c in chunks:
            if c.token_offset != offset:
                self._fail(
                    part.trajectory_id, f"seq {c.seq} token_offset {c.token_offset} != {offset}"
                )
            if c.group_size != part.group_size or c.sample_index != part.sample_index:
                self._fail(part.trajectory_id, f"seq {c.seq} changes sample_index or group_size")
            offset += c.n_tokens
        del self.open[part.trajectory_id]
        self.assembled.add(part.trajectory_id)
        first, last = chunks[0], chunks[-1]
        # one join per array, not one numpy view per chunk (writable copies for the batcher)
        tokens = unpack_tokens(bytearray(b"".join(c.tokens for c in chunks)))
        logprobs = unpack_logprobs(bytearray(b"".join(c.logprobs for c in chunks)))
        return Trajectory(
            trajectory_id=part.trajectory_id,
            prompt_id=first.prompt_id,
            task_id=first.task_id,
            sample_index=part.sample_index,
            group_size=part.group_size,
            bucket=first.bucket,
            prompt_tokens=unpack_tokens(first.prompt_tokens or b""),
            tokens=tokens,
            logprobs=logprobs,
            versions=tuple(int(c.policy_version) for c in chunks),
            finish_reason=last.finish_reason,
            metadata=orjson.loads(first.metadata) if first.metadata else {},
            workers=tuple(dict.fromkeys(c.worker_id for c in chunks)),
            started_ms=first.started_ms,
            last_created_ms=max(c.created_ms for c in chunks),
            step=first.step,
            step_groups=first.step_groups,
            temperature=first.temperature,
            top_p=first.top_p,
        )

    def forget(self, tids: set[str]) -> None:
        """Trajectories whose outcome is now durable: the ledger remembers them from here on
        (and forgets them once no redelivery can bring their records back)."""
        self.assembled -= tids

    def in_flight(self) -> tuple[set[str], set[int | None]]:
        """The prompts and the steps (from seq 0, None before it) of the trajectories still
        receiving chunks: their groups and steps are not idle (``GroupBuffer.expire``,
        ``StepPlanner.alive``)."""
        parts = self.open.values()
        return {p.prompt_id for p in parts}, {p.step[0] for p in parts}

    def expire(self, now: float | None = None) -> list[Partial]:
        """Remove and return the incomplete trajectories idle for ``expire_s`` or more."""
        now = time.monotonic() if now is None else now
        dead = [p for p in self.open.values() if now - p.last_arrival >= self.expire_s]
        for p in dead:
            del self.open[p.trajectory_id]
            self.assembled.add(p.trajectory_id)
        return dead
