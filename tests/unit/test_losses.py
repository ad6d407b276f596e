"""Losses and advantages against values computed by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from consumers.losses import (
    decoupled_ppo_loss,
    grpo_advantages,
    k3_kl,
    policy_loss,
    ppo_clip_loss,
    rloo_advantages,
    tis_loss,
    token_logprobs,
)

L = math.log


def t(*v: float) -> torch.Tensor:
    return torch.tensor([list(v)], dtype=torch.float64)


def test_grpo_advantages_are_group_normalised() -> None:
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    assert adv.tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # mean 2, std 1
    assert grpo_advantages(torch.tensor([3.0, 1.0])).tolist() == pytest.approx([1, -1], abs=1e-5)
    # all equal: no signal, no division by zero
    assert grpo_advantages(torch.tensor([0.7, 0.7, 0.7])).tolist() == pytest.approx([0, 0, 0])
    assert grpo_advantages(torch.tensor([5.0])).tolist() == [0.0]


def test_rloo_baseline_leaves_one_out() -> None:
    # r_i - mean(others): 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2
    assert rloo_advantages(torch.tensor([1.0, 2.0, 3.0])).tolist() == pytest.approx([-1.5, 0, 1.5])
    assert rloo_advantages(torch.tensor([4.0])).tolist() == [0.0]


def test_tis_truncates_the_importance_weight() -> None:
    # pi = 0.5, mu = 0.25 -> ratio 2, truncated at C = 1.5; A = 2
    logp = t(L(0.5)).requires_grad_()
    loss = tis_loss(logp, t(L(0.25)), torch.tensor([2.0], dtype=torch.float64), cap=1.5)
    assert loss.item() == pytest.approx(-1.5 * 2 * L(0.5))  # 2.0794
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-3.0)  # -w·A: the weight carries no gradient
    # below the cap the weight is the plain ratio: pi = 0.2, mu = 0.4 -> 0.5
    loss = tis_loss(t(L(0.2)), t(L(0.4)), torch.tensor([1.0], dtype=torch.float64), cap=1.5)
    assert loss.item() == pytest.approx(-0.5 * L(0.2))


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad"),
    [
        (1.5, 1.0, -1.2, 0.0),  # above 1 + eps with A > 0: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # above with A < 0: unclipped (the pessimistic side)
        (0.5, 1.0, -0.5, -0.5),  # below 1 - eps with A > 0: unclipped
        (0.5, -1.0, 0.8, 0.0),  # below with A < 0: clipped
        (1.1, 1.0, -1.1, -1.1),  # inside the range
    ],
)
def test_ppo_clip(ratio: float, adv: float, loss: float, grad: float) -> None:
    old = t(L(0.4))
    logp = t(L(0.4 * ratio)).requires_grad_()
    out = ppo_clip_loss(logp, old, torch.tensor([adv], dtype=torch.float64), 0.2, 0.2)
    assert out.item() == pytest.approx(loss)
    out.sum().backward()
    assert logp.grad.item() == pytest.approx(grad)  # d(-r·A)/dlogp = -r·A when unclipped


def test_ppo_asymmetric_clip() -> None:
    old = t(L(0.4), L(0.4), L(0.4))
    logp = t(L(0.4 * 1.25), L(0.4 * 1.35), L(0.4 * 0.7))
    adv = torch.tensor([1.0], dtype=torch.float64)
    # clip_high 0.3: 1.25 is inside, 1.35 is clipped to 1.3; 0.7 with A > 0 is never clipped
    out = ppo_clip_loss(logp, old, adv, 0.2, 0.3)
    assert out.tolist()[0] == pytest.approx([-1.25, -1.3, -0.7])


def test_decoupled_ppo_weights_by_prox_over_behaviour_and_clips_against_prox() -> None:
    # prox 0.5, mu 0.1 -> weight 5 truncated to 2; pi 0.55 -> r = 1.1 inside the clip
    logp = t(L(0.55)).requires_grad_()
    out = decoupled_ppo_loss(
        logp, t(L(0.5)), t(L(0.1)), torch.tensor([1.0], dtype=torch.float64), 0.2, 0.2, cap=2.0
    )
    assert out.item() == pytest.approx(-2 * 1.1)
    out.sum().backward()
    assert logp.grad.item() == pytest.approx(-2 * 1.1)
    # pi 0.7 -> r = 1.4 clipped at 1.2: loss -2 * 1.2, no gradient
    out = decoupled_ppo_loss(
        t(L(0.7)), t(L(0.5)), t(L(0.1)), torch.tensor([1.0], dtype=torch.float64), 0.2, 0.2, 2.0
    )
    assert out.item() == pytest.approx(-2.4)


def test_policy_loss_dispatches_and_decoupled_defaults_prox_to_current() -> None:
    logp, mu = t(L(0.5)), t(L(0.25))
    adv = torch.tensor([1.0], dtype=torch.float64)
    assert policy_loss("tis", logp, mu, adv, cap=1.5).item() == pytest.approx(-1.5 * L(0.5))
    assert policy_loss("ppo", logp, mu, adv).item() == pytest.approx(-1.2)
    # prox = pi (one update per batch): weight min(2, 1.5), r = 1 -> -1.5
    assert policy_loss("decoupled", logp, mu, adv, cap=1.5).item() == pytest.approx(-1.5)


def test_k3_kl() -> None:
    # d = log(0.25) - log(0.5) = -log 2: exp(d) - d - 1 = 0.5 + 0.6931 - 1
    assert k3_kl(t(L(0.5)), t(L(0.25))).item() == pytest.approx(0.5 + L(2) - 1)
    assert k3_kl(t(L(0.3)), t(L(0.3))).item() == pytest.approx(0.0)


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[0.0, L(3.0)]]])
    target = torch.tensor([[1]])
    assert token_logprobs(logits, target).item() == pytest.approx(L(3 / 4))
    # T = 2: logits / 2 -> p = sqrt(3) / (1 + sqrt(3))
    s3 = math.sqrt(3)
    assert token_logprobs(logits, target, 2.0).item() == pytest.approx(L(s3 / (1 + s3)), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_in_slices_equals_the_whole_with_gradients(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 7, 11, generator=g).to(dtype)
    target = torch.randint(0, 11, (3, 7), generator=g)
    whole_in = base.clone().requires_grad_(True)
    sliced_in = base.clone().requires_grad_(True)
    whole = token_logprobs(whole_in, target, 0.7, positions=10_000)  # one slice
    sliced = token_logprobs(sliced_in, target, 0.7, positions=4)  # slices of 1 position x 3 rows
    assert sliced.dtype == torch.float32 and sliced.shape == (3, 7)
    assert torch.allclose(whole, sliced, atol=1e-6)
    weights = torch.randn(3, 7, generator=g)
    (whole * weights).sum().backward()
    (sliced * weights).sum().backward()
    assert whole_in.grad is not None and sliced_in.grad is not None
    assert torch.allclose(whole_in.grad.float(), sliced_in.grad.float(), atol=1e-6)
    with torch.no_grad():  # the reference model's path: no checkpointing
        assert torch.allclose(
            token_logprobs(base, target, 0.7, positions=4), whole.detach(), atol=1e-6
        )
