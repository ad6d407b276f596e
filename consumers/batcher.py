"""Dynamic batches: one step's admitted groups, micro-batches packed by token budget.

Owns when work becomes a micro-batch (StreamRL's dynamic-batch pipelining); which groups make
up a step is ``consumers.steps``'s decision. What must hold:

* a micro-batch's cost, the tokens its forward computes, stays within ``budget`` tokens, except
  a single row longer than the budget, which runs alone: ``rows × longest row`` padded, the sum
  of the rows' lengths packed (``packed``: the engine runs them as one row, ``packing``);
* streaming (``pipeline=True``): rows join the open micro-batch in arrival order and a
  micro-batch is handed out as soon as the next row would overflow it, so forward/backward
  runs while later groups are still generating; with ``eager`` the rows waiting in the open
  micro-batch are also handed out whenever the trainer has nothing more to add right now
  (``flush``: after each poll of the stream), so no complete group waits for a fuller
  micro-batch while the device is free; the rest is handed out by ``drain`` when the step's
  groups are all in. Barrier (``pipeline=False``): nothing runs before the step is
  complete; ``drain`` packs all rows longest first.

Pure logic; the trainer calls ``add`` per admitted group, ``flush`` after each poll and
``drain`` at the step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from consumers.gate import Admitted
from consumers.groups import Sample


@dataclass(frozen=True)
class Row:
    """One sequence to train: prompt + completion ids, where the completion starts, its data."""

    trajectory_id: str
    input_ids: np.ndarray  # int, prompt then completion
    prompt_len: int
    behav_logp: np.ndarray  # float32, one per completion token
    advantage: float

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return self.length - self.prompt_len

    @classmethod
    def of(cls, sample: Sample, advantage: float) -> Row:
        t = sample.traj
        ids = np.concatenate([t.prompt_tokens.astype(np.int64), t.tokens.astype(np.int64)])
        return cls(t.trajectory_id, ids, int(t.prompt_tokens.shape[0]), t.logprobs, advantage)


def padded_cost(lengths: list[int]) -> int:
    return len(lengths) * max(lengths) if lengths else 0


def cost(lengths: list[int], packed: bool) -> int:
    """The tokens a micro-batch of ``lengths`` computes: packed in one row, or padded."""
    return sum(lengths) if packed else padded_cost(lengths)


def fits(lengths: list[int], new: int, budget: int, packed: bool = False) -> bool:
    """Whether a row of length ``new`` may join a micro-batch of ``lengths``."""
    return not lengths or cost([*lengths, new], packed) <= budget


def pack(lengths: list[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Greedy in the given order: indices of ``lengths`` grouped into micro-batches."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i, n in enumerate(lengths):
        if not fits([lengths[j] for j in cur], n, budget, packed):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


class StepBatcher:
    """Accumulates one step's groups and hands out micro-batches of rows."""

    def __init__(
        self, budget: int, pipeline: bool = True, packed: bool = False, eager: bool = False
    ) -> None:
        self.budget = budget
        self.pipeline = pipeline
        self.eager = eager and pipeline
        self.packed = packed  # the engine packs each micro-batch: its cost is its real tokens
        self.reset()

    def reset(self) -> None:
        self.groups: list[Admitted] = []
        self.pending: list[Row] = []  # rows not yet handed out
        self.rows = 0
        self.loss_tokens = 0

    def add(self, admitted: Admitted) -> list[list[Row]]:
        """Take an admitted group; return the micro-batches that filled (maybe none)."""
        if not admitted.trains:
            return []
        self.groups.append(admitted)
        ready: list[list[Row]] = []
        for sample, adv in zip(admitted.train, admitted.advantages, strict=True):
            row = Row.of(sample, adv)
            self.rows += 1
            self.loss_tokens += row.loss_tokens
            if self.pipeline and not fits(
                [r.length for r in self.pending], row.length, self.budget, self.packed
            ):
                ready.append(self.pending)
                self.pending = []
            self.pending.append(row)
        return ready

    def flush(self) -> list[Row]:
        """The open micro-batch's rows, handed out now (``eager`` only; else none): the trainer
        has nothing more to add to it at the moment."""
        if not self.eager:
            return []
        rows, self.pending = self.pending, []
        return rows

    def drain(self) -> list[list[Row]]:
        """The step's remaining rows as micro-batches (call once the step is complete)."""
        rows, self.pending = self.pending, []
        if not self.pipeline:
            rows = sorted(rows, key=lambda r: -r.length)
        lengths = [r.length for r in rows]
        return [[rows[i] for i in mb] for mb in pack(lengths, self.budget, self.packed)]
