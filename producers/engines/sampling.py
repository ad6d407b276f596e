"""Per-row temperature / top-p sampling with the behaviour log-prob of each sampled token.

Pure tensor math, no model: ``sample(logits, temperature, top_p, generator)`` for a batch
whose rows may each use their own parameters. What must hold:

* a row with ``temperature == 0`` is greedy (argmax): a point mass, so its log-prob is 0;
* any other row samples from ``softmax(logits / T)`` restricted to the smallest set of tokens
  whose mass reaches ``top_p`` (the most likely token is always kept), and its log-prob is
  that of the distribution actually sampled from: ``log_softmax(logits / T)`` with the tail
  beyond the nucleus cut and the rest renormalised (with ``top_p = 1``, nothing is cut, and
  it is what a trainer recomputes from the same logits and temperature; docs/serving.md,
  "Behaviour policy", says which settings the trainer trains on).

Called by the hf engine each decode step. torch is imported on the first call, so that
importing the engines (a sim worker, ``--help``) does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, logprobs [B] float32)`` for ``logits [B, V]``.

    ``temperature`` and ``top_p`` are ``[B]`` tensors on the logits' device.
    """
    import torch

    greedy = temperature <= 0
    logp = _behaviour_logp(logits, temperature)
    tokens = logp.argmax(dim=-1)
    chosen = torch.zeros(tokens.shape, dtype=torch.float32, device=logp.device)  # greedy: 0
    sampled_rows = ~greedy
    if bool(sampled_rows.any()):
        rows = logp[sampled_rows]
        drop = _top_p_drop(rows.exp(), top_p[sampled_rows])
        probs = rows.exp() if drop is None else rows.exp().masked_fill(drop, 0.0)
        draw = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = tokens.clone()
        tokens[sampled_rows] = draw
        if drop is not None:  # the nucleus renormalised: the distribution sampled from
            rows = torch.log_softmax(rows.masked_fill(drop, -torch.inf), dim=-1)
        chosen[sampled_rows] = rows.gather(-1, draw[:, None]).squeeze(-1)
    return tokens, chosen


def top_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids [B, k], log-probs [B, k])``: each row's ``k`` most likely tokens, most
    likely first, by ``log_softmax(logits / T)`` (``T = 1`` for greedy rows), before any
    top-p cut: informative alternatives, equal to :func:`sample`'s log-prob for ``T > 0``
    and ``top_p = 1``."""
    values, ids = _behaviour_logp(logits, temperature).topk(k, dim=-1)
    return ids, values


def _behaviour_logp(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row, ``T = 1`` for greedy rows (``T <= 0``)."""
    import torch

    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    return torch.log_softmax(scaled, dim=-1)


def _top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """The tail beyond mass ``top_p`` per row (rows with top_p >= 1 keep every token); None
    when no row is cut."""
    import torch

    if bool((top_p >= 1).all()):
        return None
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the most likely token
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
