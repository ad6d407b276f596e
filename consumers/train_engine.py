"""What the trainer needs of a training backend: the ``TrainEngine`` protocol, and the
micro-batch and step-statistics types that cross it.

The trainer (``consumers.trainer``), the other ranks (``consumers.distributed``) and the
benchmarks talk to a backend only through this protocol, never through its model:
``consumers.engine.Engine`` (plain torch, replicated), ``consumers.engine_fsdp.FSDPEngine``
(FSDP2, sharded), ``consumers.engine_deepspeed.DeepSpeedEngine`` (ZeRO 0-2) and
``consumers.engine_zero3.ZeRO3Engine`` (ZeRO-3) implement it; ``consumers.backends.make_engine``
picks one; the pipeline benchmark's simulated trainer implements it too. torch is imported
only when a micro-batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from consumers.batcher import Row

if TYPE_CHECKING:
    import torch


class TrainEngine(Protocol):
    """A training backend: gradients of micro-batches, steps, and the state to save."""

    sharded: bool  # each rank holds (and checkpoints) only its shard of the state
    lockstep: bool  # every rank must run as many micro-batches as the others

    @property
    def max_length(self) -> int:
        """The longest sequence (prompt + completion) the model takes."""
        ...

    def backward(self, mb: MicroBatch) -> None: ...

    def step(self, normalizer: float) -> StepStats: ...

    def discard(self) -> None:
        """Drop the gradients of a partial step."""
        ...

    def export(self, dtype: Any = None) -> dict[str, Any]:
        """The HF state dict to publish, on the CPU in ``dtype`` (a collective where sharded;
        ranks > 0 get nothing): a snapshot, never the live parameters, since it is uploaded
        while the next step trains (``consumers.publisher``)."""
        ...

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's rows of the weights and optimizer state (``consumers.checkpoint``)."""
        ...

    def load_checkpoint_state(self, shards: Any) -> None: ...


@dataclass
class MicroBatch:
    """Tensors of one micro-batch, in the shifted frame: position j predicts token j + 1.

    Two forms of the same loss terms. Padded (``make_micro_batch``; what ranks send each other,
    ``tensors``): one row per sample, right-padded to the longest. Packed
    (``consumers.packing.packed``; an engine packs what it receives when ``packing`` is on):
    the samples' tokens concatenated into one row ``[1, T]``, T the sum of their lengths,
    ``positions`` restarting at 0 at each sample's first token, the advantage per token; the
    position of a sample's last token, which would predict the next sample's first, has weight
    0 and behav 0.
    """

    ids: torch.Tensor  # [B, L] int64, right-padded; packed: [1, T]
    attn: torch.Tensor  # [B, L] int64, 1 on a sample's tokens; packed: all 1
    behav: torch.Tensor  # [B, L-1] float32 behaviour log-prob of token j+1 (0 off the loss)
    adv: torch.Tensor  # [B] float32 per sample; packed: [1, T-1] per token
    weight: torch.Tensor  # [B, L-1] float32 loss weight (0 off the loss)
    prox: torch.Tensor | None = None  # [B, L-1] log-probs of the first pass (updates_per_step > 1)
    positions: torch.Tensor | None = None  # packed: [1, T] int64 position in the sample

    def tensors(self) -> list[torch.Tensor]:
        """The padded form's tensors, in the order ``consumers.distributed`` sends them."""
        assert self.positions is None, "ranks exchange padded micro-batches"
        return [self.ids, self.attn, self.behav, self.adv, self.weight]


def split_rows(mb: MicroBatch) -> tuple[MicroBatch, MicroBatch]:
    """A padded micro-batch of two rows or more as two, by rows, with about half its real
    tokens each, each trimmed to its own longest row: the same loss terms, so the same
    gradient summed (the step's normaliser is global). How a lockstep round shorter than the
    ranks still gives every rank work (``consumers.distributed``)."""
    lengths = mb.attn.sum(dim=1)
    cut = int((lengths.cumsum(0) < lengths.sum() / 2).sum()) + 1
    cut = min(max(cut, 1), mb.ids.shape[0] - 1)

    def part(rows: slice) -> MicroBatch:
        n = int(lengths[rows].max())
        prox = None if mb.prox is None else mb.prox[rows, : n - 1]
        return MicroBatch(
            mb.ids[rows, :n],
            mb.attn[rows, :n],
            mb.behav[rows, : n - 1],
            mb.adv[rows],
            mb.weight[rows, : n - 1],
            prox,
        )

    return part(slice(0, cut)), part(slice(cut, None))


def balanced(mbs: list[MicroBatch], parts: int) -> list[MicroBatch] | None:
    """The rows of padded micro-batches ``mbs`` regrouped into ``parts`` micro-batches of about
    equal real tokens (longest rows first, each to the emptiest part), so a lockstep round's
    ranks finish together; each part trimmed to its own longest row. The same loss terms, so
    the same gradient summed. None when it cannot help: fewer rows than parts, or a part would
    hold more tokens than the biggest of ``mbs`` (the batcher's memory bound)."""
    rows = [(int(n), i, j) for i, mb in enumerate(mbs) for j, n in enumerate(mb.attn.sum(dim=1))]
    cap = max(int(mb.attn.sum()) for mb in mbs)
    if len(rows) < parts:
        return None
    bins: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    load = [0] * parts
    for n, i, j in sorted(rows, key=lambda r: (-r[0], r[1], r[2])):
        k = min(range(parts), key=lambda b: (load[b], b))
        bins[k].append((i, j))
        load[k] += n
    if max(load) > cap:
        return None
    return [take_rows(mbs, b) for b in bins]


def take_rows(mbs: list[MicroBatch], rows: list[tuple[int, int]]) -> MicroBatch:
    """Row ``j`` of ``mbs[i]`` for each ``(i, j)``, as one padded micro-batch."""
    import torch

    lengths = [int(mbs[i].attn[j].sum()) for i, j in rows]
    b, length = len(rows), max(lengths)
    out = MicroBatch(
        torch.zeros((b, length), dtype=torch.int64),
        torch.zeros((b, length), dtype=torch.int64),
        torch.zeros((b, length - 1), dtype=torch.float32),
        torch.zeros(b, dtype=torch.float32),
        torch.zeros((b, length - 1), dtype=torch.float32),
    )
    with_prox = all(mbs[i].prox is not None for i, _ in rows)
    prox = torch.zeros((b, length - 1), dtype=torch.float32) if with_prox else None
    for r, ((i, j), n) in enumerate(zip(rows, lengths, strict=True)):
        src = mbs[i]
        out.ids[r, :n], out.attn[r, :n] = src.ids[j, :n], src.attn[j, :n]
        out.behav[r, : n - 1], out.weight[r, : n - 1] = (
            src.behav[j, : n - 1],
            src.weight[j, : n - 1],
        )
        out.adv[r] = src.adv[j]
        if prox is not None:
            prox[r, : n - 1] = src.prox[j, : n - 1]  # type: ignore[index]
    out.prox = prox
    return out


def empty_micro_batch() -> MicroBatch:
    """A one-row micro-batch whose loss weights are all zero: it adds nothing to the
    gradient, but runs the forward and backward (and their collectives) a lockstep rank owes."""
    import torch

    ids = torch.zeros((1, 2), dtype=torch.int64)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(ids, torch.ones_like(ids), zeros, torch.zeros(1), zeros.clone())


def make_micro_batch(rows: list[Row], seq_mean: bool, pad_id: int = 0) -> MicroBatch:
    """Rows → padded tensors; loss positions are the completion tokens after the first one."""
    import torch

    b, length = len(rows), max(r.length for r in rows)
    ids = torch.full((b, length), pad_id, dtype=torch.int64)
    attn = torch.zeros((b, length), dtype=torch.int64)
    behav = torch.zeros((b, length - 1), dtype=torch.float32)
    weight = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, : r.length] = torch.from_numpy(r.input_ids)
        attn[i, : r.length] = 1
        # completion token c sits at position prompt_len + c, predicted at prompt_len + c - 1;
        # with an empty prompt the first token has no predictor and is skipped
        skip = 1 if r.prompt_len == 0 else 0
        n = r.loss_tokens - skip
        if n > 0:
            start = r.prompt_len + skip - 1
            behav[i, start : start + n] = torch.from_numpy(r.behav_logp[skip:].astype("float32"))
            weight[i, start : start + n] = 1.0 / n if seq_mean else 1.0
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return MicroBatch(ids, attn, behav, adv, weight)


@dataclass
class StepStats:
    loss: float = 0.0
    kl: float = 0.0
    ratio_mean: float = 0.0
    ratio_max: float = 0.0
    truncated_frac: float = 0.0
    grad_norm: float = 0.0
    compute_s: float = 0.0
    padded_tokens: int = 0
    _w: float = field(default=0.0, repr=False)
    _n: float = field(default=0.0, repr=False)
