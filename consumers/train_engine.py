"""What the trainer needs of a training backend: the ``TrainEngine`` protocol, and the
micro-batch and step-statistics types that cross it.

The trainer (``consumers.trainer``), the other ranks (``consumers.distributed``) and the
benchmarks talk to a backend only through this protocol, never through its model:
``consumers.engine.Engine`` (plain torch) and ``consumers.engine_deepspeed.DeepSpeedEngine``
implement it; ``consumers.backends.make_engine`` picks one; the pipeline benchmark's simulated
trainer implements it too. torch is imported only when a micro-batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from consumers.batcher import Row

if TYPE_CHECKING:
    import torch


class TrainEngine(Protocol):
    """A training backend: gradients of micro-batches, steps, and the state to save."""

    @property
    def max_length(self) -> int:
        """The longest sequence (prompt + completion) the model takes."""
        ...

    def backward(self, mb: MicroBatch) -> None: ...

    def step(self, normalizer: float) -> StepStats: ...

    def discard(self) -> None:
        """Drop the gradients of a partial step."""
        ...

    def tensors(self) -> dict[str, Any]:
        """The HF state dict to publish or checkpoint."""
        ...

    def load_tensors(self, tensors: dict[str, Any]) -> None: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class MicroBatch:
    """Tensors of one micro-batch, in the shifted frame: position j predicts token j + 1."""

    ids: torch.Tensor  # [B, L] int64, right-padded
    attn: torch.Tensor  # [B, L] int64
    behav: torch.Tensor  # [B, L-1] float32 behaviour log-prob of token j+1 (0 off the loss)
    adv: torch.Tensor  # [B] float32
    weight: torch.Tensor  # [B, L-1] float32 loss weight (0 off the loss)
    prox: torch.Tensor | None = None  # [B, L-1] log-probs of the first pass (updates_per_step > 1)

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.attn, self.behav, self.adv, self.weight]


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
