"""Per-row temperature / top-p sampling with the behaviour log-prob of each sampled token.

Pure tensor math, no model: ``sample(logits, temperature, top_p, generator)`` for a batch
whose rows may each use their own parameters. What must hold:

* a row with ``temperature == 0`` is greedy (argmax) and its log-prob is
  ``log_softmax(logits)`` at the argmax;
* any other row samples from ``softmax(logits / T)`` restricted to the smallest set of tokens
  whose mass reaches ``top_p`` (the most likely token is always kept), and its log-prob is
  ``log_softmax(logits / T)`` at the sampled token, i.e. *before* the top-p truncation, which
  is what a trainer recomputes from the same logits and temperature.

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
    sampled_rows = ~greedy
    if bool(sampled_rows.any()):
        probs = logp[sampled_rows].exp()
        probs = _top_p_filter(probs, top_p[sampled_rows])
        draw = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = tokens.clone()
        tokens[sampled_rows] = draw
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen


def top_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids [B, k], log-probs [B, k])``: each row's ``k`` most likely tokens, most
    likely first, in the distribution whose log-prob :func:`sample` reports."""
    values, ids = _behaviour_logp(logits, temperature).topk(k, dim=-1)
    return ids, values


def _behaviour_logp(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row, ``T = 1`` for greedy rows (``T <= 0``)."""
    import torch

    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    return torch.log_softmax(scaled, dim=-1)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail beyond mass ``top_p`` per row (rows with top_p >= 1 are untouched)."""
    import torch

    if bool((top_p >= 1).all()):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
