"""Advantages and policy losses: pure functions of tensors, no state, no I/O.

Owns the algorithms' math. Every loss returns a **per-token** loss tensor of the shape of its
log-prob inputs ``[B, T]``; the trainer multiplies by a per-token weight (mask and
normalisation) and sums, so micro-batches that run at different times add up to exactly the
gradient of the whole step (see ``consumers.engine``).

Notation (DESIGN.md): ``mu`` is the behaviour policy that sampled the tokens (its log-probs
travel in the chunks), ``pi`` the trainer's policy being updated (with gradient), ``prox``
the trainer's policy at the start of the step (detached; the proximal policy of decoupled PPO).

* ``tis``: truncated importance-weighted policy gradient,
  ``-min(pi/mu, C) · A · log pi`` with the weight detached (Ionides' truncated IS; the
  "TIS" fix for mismatched samplers).
* ``ppo``: PPO's clipped surrogate with the behaviour policy as the old policy,
  ``-min(r·A, clip(r, 1-eps_lo, 1+eps_hi)·A)``, ``r = pi/mu``.
* ``decoupled``: decoupled PPO (Hilton et al. 2021),
  ``-min(prox/mu, C) · min(r·A, clip(r)·A)``, ``r = pi/prox``: the clip bounds the update
  against the trainer's own recent policy, the truncated weight corrects for staleness.
* ``k3_kl``: Schulman's k3 estimator of KL(pi || ref), unbiased and non-negative.

Called by ``consumers.engine``; tested against hand-computed values in
``tests/unit/test_losses.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

LossKind = Literal["tis", "ppo", "decoupled"]


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(r_i - mean(r)) / (std(r) + eps)`` over one group, population std."""
    mean = rewards.mean()
    std = rewards.std(correction=0) if rewards.numel() > 1 else rewards.new_zeros(())
    return (rewards - mean) / (std + eps)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: ``r_i - mean of the other n-1 rewards``; zeros for a group of one."""
    n = rewards.numel()
    if n < 2:
        return rewards.new_zeros(rewards.shape)
    return rewards - (rewards.sum() - rewards) / (n - 1)


def advantages(kind: Literal["grpo", "rloo"], rewards: Tensor) -> Tensor:
    return grpo_advantages(rewards) if kind == "grpo" else rloo_advantages(rewards)


LOGPROB_POSITIONS = 2048  # positions per slice: at most this many x V fp32 values at once


def _slice_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    import torch

    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    picked = torch.gather(x, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, positions: int = LOGPROB_POSITIONS
) -> Tensor:
    """``log softmax(logits / T)[target]`` per position: ``[B, T, V], [B, T] -> [B, T]``.

    Computed in fp32 over slices of about ``positions`` positions (views of ``logits``, all
    rows at once), each recomputed in the backward pass (activation checkpointing), so the
    fp32 upcast of the whole ``[B, T, V]`` never exists: a 150k vocabulary over 16k positions
    would be 9.6 GB; a slice is ``positions × V`` (1.2 GB at 2048 × 150k).
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    rows, length = targets.shape
    step = max(1, positions // max(1, rows))
    if length <= step:
        return _slice_logprobs(logits, targets, temperature)
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for t0 in range(0, length, step):
        x, y = logits[:, t0 : t0 + step], targets[:, t0 : t0 + step]
        if grad:
            parts.append(checkpoint(_slice_logprobs, x, y, temperature, use_reentrant=False))
        else:
            parts.append(_slice_logprobs(x, y, temperature))
    return torch.cat(parts, dim=1)


def truncated_weight(logp: Tensor, behav_logp: Tensor, cap: float) -> Tensor:
    """``min(exp(logp - behav_logp), cap)``, detached: the TIS weight."""
    return (logp.detach() - behav_logp).exp().clamp(max=cap)


def tis_loss(logp: Tensor, behav_logp: Tensor, adv: Tensor, cap: float) -> Tensor:
    """Per-token ``-min(pi/mu, C) · A · log pi``; ``adv`` is ``[B]`` or ``[B, T]``."""
    a = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    return -truncated_weight(logp, behav_logp, cap) * a * logp


def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> Tensor:
    """Per-token ``-min(r·A, clip(r, 1-clip_low, 1+clip_high)·A)`` with ``r = exp(logp - old)``."""
    import torch

    a = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    ratio = (logp - old_logp).exp()
    return -torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    adv: Tensor,
    clip_low: float,
    clip_high: float,
    cap: float,
) -> Tensor:
    """Per-token ``min(prox/mu, C) ·`` PPO clip of ``pi/prox`` (decoupled PPO)."""
    w = (prox_logp.detach() - behav_logp).exp().clamp(max=cap)
    return w * ppo_clip_loss(logp, prox_logp.detach(), adv, clip_low, clip_high)


def policy_loss(
    kind: LossKind,
    logp: Tensor,
    behav_logp: Tensor,
    adv: Tensor,
    *,
    prox_logp: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float = 2.0,
) -> Tensor:
    """The per-token loss of ``kind``; ``prox_logp`` defaults to ``logp`` detached."""
    if kind == "tis":
        return tis_loss(logp, behav_logp, adv, cap)
    if kind == "ppo":
        return ppo_clip_loss(logp, behav_logp, adv, clip_low, clip_high)
    prox = logp.detach() if prox_logp is None else prox_logp
    return decoupled_ppo_loss(logp, prox, behav_logp, adv, clip_low, clip_high, cap)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    d = ref_logp.detach() - logp
    return d.exp() - d - 1
