"""Padding-free micro-batches: a micro-batch's samples as one row, each attending only to itself.

Owns the packed form (``TrainConfig.packing``) and what keeps it equal to the padded one:

* ``packed``: a padded ``MicroBatch`` becomes one row ``[1, T]`` of its samples' real tokens
  (T the sum of their lengths), position ids restarting at 0 at each sample, the advantage per
  token, and a zero weight (and behav) where a sample's last token would predict the next
  sample's first; so the weighted loss terms are the padded form's, in the same order;
* ``use_packed_attention``: the model's attention becomes ``packed_attention``, which runs
  sdpa causally on each sample's slice (the samples' bounds arrive as ``cu_seq_lens_q``,
  transformers' varlen keyword): attention costs Σ len² rather than T², and no mask. A
  padded batch (no bounds) runs sdpa with its mask. The mask transformers builds from the
  restarting position ids (block-diagonal, T² booleans) is what attention falls back to if a
  model did not hand the bounds down, so samples never see each other either way; building it
  costs about 8% of a packed step on the tiny model.

Measured on the tiny model (2 CPU cores, app/bench/train.py): the block-diagonal mask alone
computes all T² scores and trained at half the padded rate; per-sample sdpa at about twice it.
Called by ``consumers.engine``.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from consumers.train_engine import MicroBatch
from srl.errors import ConfigError

if TYPE_CHECKING:
    import torch

ATTENTION = "srl_packed_sdpa"  # the name the attention and its mask are registered under


def packed(mb: MicroBatch) -> MicroBatch:
    """A padded micro-batch (before its first pass) as one row of its samples' real tokens:
    the same loss terms, on the sum of the lengths instead of rows x longest row."""
    import torch

    if mb.positions is not None:
        return mb
    real = mb.attn.bool()
    positions = (real.cumsum(1) - 1)[real][None]

    def flat(shifted: torch.Tensor) -> torch.Tensor:
        # one more column: a row then has one entry per real token, the last one (its final
        # token, predicting padding or nothing) at weight 0, the boundary in the packed row
        full = torch.cat([shifted, shifted.new_zeros((shifted.shape[0], 1))], dim=1)
        return full[real][None, :-1]

    ids = mb.ids[real][None]
    adv = mb.adv[:, None].expand(real.shape)[real][None, :-1]
    return MicroBatch(
        ids, torch.ones_like(ids), flat(mb.behav), adv, flat(mb.weight), positions=positions
    )


def packed_inputs(mb: MicroBatch, device: str) -> dict[str, torch.Tensor]:
    """The model's keywords for a packed micro-batch, none for a padded one: the position ids,
    and ``[0, end of sample 0, …, T]`` as ``cu_seq_lens_q``, kept on the CPU (attention slices
    by them without waiting for the device)."""
    import torch

    if mb.positions is None:
        return {}
    pos = mb.positions[0]
    bounds = torch.cat([(pos == 0).nonzero().flatten(), torch.tensor([pos.numel()])])
    return {"position_ids": mb.positions.to(device), "cu_seq_lens_q": bounds}


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, causal within each sample of a packed row
    (``cu_seq_lens_q``); without bounds, sdpa as transformers runs it (with ``attention_mask``)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    parts = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs
        )[0]
        for a, b in pairwise(bounds)
    ]
    return torch.cat(parts, dim=1), None


def use_packed_attention(model: Any) -> None:
    """Switch ``model`` (a transformers model, before any wrapping) to ``packed_attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise ConfigError(
            f"packing: {type(model).__name__} takes no attention function of ours "
            "(transformers' AttentionInterface); run it with --no-packing"
        )
