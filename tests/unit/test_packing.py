"""Packed micro-batches (``consumers.packing``) train exactly as the padded ones, and a packed
sample sees nothing of the others.

Equal means ``torch.testing.assert_close`` at rtol 1e-5, atol 1e-6 in fp32 on the CPU: measured,
gradients of up to 0.4 differ by 3e-7 at most (the matmuls run over other shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch

from consumers.batcher import Row, StepBatcher, pack
from consumers.config import TrainConfig
from consumers.distributed import Dist
from consumers.engine import Engine
from consumers.losses import token_logprobs
from consumers.packing import packed, packed_inputs
from consumers.train_engine import balanced, empty_micro_batch, make_micro_batch, split_rows
from srl.tinymodel import TinyModelSpec, build_tiny_model

TOL = {"rtol": 1e-5, "atol": 1e-6}

# (prompt_len, completion_len): an empty prompt, a one-token sample, the longest one last
SHAPES = [(3, 5), (0, 9), (6, 2), (1, 1), (4, 11)]


def rows(seed: int = 0, shapes: list[tuple[int, int]] = SHAPES) -> list[Row]:
    rng = np.random.default_rng(seed)
    out = []
    for j, (prompt, completion) in enumerate(shapes):
        ids = rng.integers(4, 200, prompt + completion)
        behav = rng.uniform(-4.0, -0.5, completion).astype("float32")
        out.append(Row(f"t{j}", ids, prompt, behav, float(rng.normal())))
    return out


def test_the_packed_row_holds_the_padded_loss_terms_in_order() -> None:
    rs = rows()
    mb = make_micro_batch(rs, seq_mean=True)
    p = packed(mb)
    lengths = [r.length for r in rs]
    t = sum(lengths)
    assert p.ids.shape == (1, t) and p.weight.shape == p.behav.shape == p.adv.shape == (1, t - 1)
    assert p.ids[0].tolist() == [int(x) for r in rs for x in r.input_ids]
    assert p.positions is not None
    assert p.positions[0].tolist() == [j for n in lengths for j in range(n)]
    on = mb.weight > 0
    # the same weighted terms, in the same order (row-major in both frames)
    assert torch.equal(p.weight[p.weight > 0], mb.weight[on])
    assert torch.equal(p.behav[p.weight > 0], mb.behav[on])
    assert torch.equal(p.adv[p.weight > 0], mb.adv[:, None].expand_as(mb.weight)[on])
    # a sample's last token would predict the next sample's first: nothing there
    ends = np.cumsum(lengths)[:-1] - 1
    assert p.weight[0, ends].eq(0).all() and p.behav[0, ends].eq(0).all()
    assert packed(p) is p
    with pytest.raises(AssertionError):
        p.tensors()  # ranks send the padded form


def test_the_budget_counts_what_the_engine_computes() -> None:
    assert pack([4, 4, 4, 9, 2, 2], budget=12) == [[0, 1, 2], [3], [4, 5]]  # rows x longest
    assert pack([4, 4, 4, 9, 2, 2], budget=12, packed=True) == [[0, 1, 2], [3, 4], [5]]
    assert pack([20, 1], budget=10, packed=True) == [[0], [1]]  # an over-long row runs alone
    padded, tight = StepBatcher(24, pipeline=False), StepBatcher(24, pipeline=False, packed=True)
    for b in (padded, tight):
        b.pending = rows(shapes=[(2, 6), (1, 3), (1, 3), (2, 2), (1, 1)])
    assert [len(m) for m in padded.drain()] == [3, 2]  # 3 x 8, then 2 x 4
    assert [len(m) for m in tight.drain()] == [5]  # 8 + 4 + 4 + 4 + 2


def engine(model: Path, packing: bool, **kw: Any) -> Engine:
    e = Engine(TrainConfig(model=str(model), device="cpu", packing=packing, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the policy moves off the reference: KL and ratios are not trivial
        for p in e.params:
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return e


def grads(e: Engine) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in e.params]
    e.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {"loss": "tis"},
        {"loss": "ppo", "kl_coef": 0.1},
        {"loss": "decoupled", "kl_coef": 0.1, "updates_per_step": 2},
    ],
    ids=["tis", "ppo-kl", "decoupled-kl-prox"],
)
def test_packed_and_padded_give_the_same_loss_and_gradients(
    tiny_model: Path, kw: dict[str, Any]
) -> None:
    mb = make_micro_batch(rows(), seq_mean=False)
    runs = []
    for packing in (False, True):
        e = engine(tiny_model, packing, **kw)
        e.backward(mb)
        first = grads(e)
        second = []
        if e.stored:  # the next pass, after an update, against the first pass's log-probs
            stored = e.stored[0]
            assert stored.prox is not None and stored.prox.shape == stored.weight.shape
            assert (stored.positions is not None) == packing
            with torch.no_grad():
                for p in e.params:
                    p.mul_(1.01)
            e._backprop(e._loss(stored, first_pass=False))
            second = grads(e)
        runs.append((e.stats, first, second))
    (pad, pad_first, pad_second), (pk, pk_first, pk_second) = runs
    assert pk.padded_tokens == sum(r.length for r in rows()) < pad.padded_tokens
    for name in ("loss", "kl", "ratio_mean", "ratio_max", "_n"):
        torch.testing.assert_close(getattr(pk, name), getattr(pad, name), **TOL)
    assert pad.kl > 0 if kw.get("kl_coef") else pad.kl == 0
    assert max(float(g.abs().max()) for g in pad_first) > 1e-3
    torch.testing.assert_close(pk_first, pad_first, **TOL)
    torch.testing.assert_close(pk_second, pad_second, **TOL)


def sample_logprobs(e: Engine, ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = e.model(input_ids=ids, use_cache=False, **inputs).logits[:, :-1]
        return token_logprobs(logits, ids[:, 1:])[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_packed_sample_sees_nothing_of_the_others(
    tmp_path: Path, arch: Literal["qwen2", "llama"]
) -> None:
    spec = TinyModelSpec(arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    e = engine(build_tiny_model(tmp_path, spec), packing=True)
    shapes = [(2, 6), (3, 4)]
    first, other = rows(0, shapes), rows(1, shapes)  # sample 0's tokens differ, sample 1's not
    other[1] = first[1]
    n0 = first[0].length
    mbs = [packed(make_micro_batch(r, seq_mean=False)) for r in (first, other)]
    assert not torch.equal(mbs[0].ids[0, :n0], mbs[1].ids[0, :n0])
    alone = make_micro_batch(first[1:], seq_mean=False)
    expect = sample_logprobs(e, alone.ids, attention_mask=alone.attn)
    for mb in mbs:
        # per-sample attention, and transformers' block-diagonal mask it would fall back to
        full = packed_inputs(mb, "cpu")
        for inputs in (full, {"position_ids": full["position_ids"]}):
            torch.testing.assert_close(sample_logprobs(e, mb.ids, **inputs)[n0:], expect, **TOL)
        # the same positions in one causal row (a mask, no bounds): sample 1 sees sample 0,
        # as the assertions above would notice
        positions = full["position_ids"]
        crossed = sample_logprobs(e, mb.ids, attention_mask=mb.attn, position_ids=positions)
        assert crossed[n0:].sub(expect).abs().max() > 1e-3


def test_a_lockstep_ranks_padding_packs_and_adds_no_gradient(tiny_model: Path) -> None:
    e = engine(tiny_model, packing=True)
    e.backward(empty_micro_batch())
    assert all(float(g.abs().max()) == 0 for g in grads(e))
    assert e.stats.padded_tokens == 2


@pytest.mark.parametrize("packing", [True, False])
def test_a_micro_batch_split_by_rows_gives_the_same_gradient(
    tiny_model: Path, packing: bool
) -> None:
    """A lockstep round shorter than the ranks splits its biggest micro-batch (rank 1 had no
    work in `srl demo --trainer-ranks 2`: a step's tokens fit one packed micro-batch)."""
    mb = make_micro_batch(rows(), seq_mean=False)
    a, b = split_rows(mb)
    assert a.ids.shape[0] + b.ids.shape[0] == mb.ids.shape[0] and a.ids.shape[0] >= 1
    assert int(a.attn.sum()) + int(b.attn.sum()) == int(mb.attn.sum())
    assert a.ids.shape[1] == int(a.attn.sum(dim=1).max())  # trimmed to its own longest row
    e = engine(tiny_model, packing)
    e.backward(mb)
    whole = grads(e)
    e.backward(a)
    e.backward(b)
    for x, y in zip(whole, grads(e), strict=True):
        torch.testing.assert_close(x, y, **TOL)
    # the last round of a step on 3 ranks with one micro-batch: three, by rows
    d = Dist(0, 3)
    d.round = [mb]
    d._spread()
    assert len(d.round) == 3 and sum(m.ids.shape[0] for m in d.round) == mb.ids.shape[0]
    one = make_micro_batch(rows()[:1], seq_mean=False)
    d.round = [one]
    d._spread()
    assert d.round == [one]  # one row: nothing to split


def test_the_last_round_is_regrouped_into_parts_of_equal_tokens(tiny_model: Path) -> None:
    """A step's remainder on 2 ranks: a full micro-batch and a small one. Dealt as they are,
    rank 1 idles while rank 0 computes 3x its tokens; regrouped by rows, the ranks get 27 and
    27 tokens, and the same gradient."""
    big = make_micro_batch(rows(2, [(4, 10), (3, 9), (5, 7), (2, 1)]), seq_mean=False)
    small = make_micro_batch(rows(3, [(3, 6), (2, 2)]), seq_mean=False)
    parts = balanced([big, small], 2)
    assert parts is not None and len(parts) == 2
    before = sorted(int(m.attn.sum()) for m in (big, small))
    after = sorted(int(m.attn.sum()) for m in parts)
    assert (before, after) == ([13, 41], [27, 27])
    for m in parts:
        assert m.ids.shape[1] == int(m.attn.sum(dim=1).max())  # trimmed to its own longest row
    e = engine(tiny_model, packing=True)
    for m in (big, small):
        e.backward(m)
    whole = grads(e)
    for m in parts:
        e.backward(m)
    for x, y in zip(whole, grads(e), strict=True):
        torch.testing.assert_close(x, y, **TOL)
    # the Dist does it at the step: each rank gets one part
    d = Dist(0, 2)
    d.round = [big, small]
    d._balance()
    assert sorted(int(m.attn.sum()) for m in d.round) == [27, 27]
    # one row longer than all the others together: no regrouping beats dealing them as they are
    lop = make_micro_batch(rows(4, [(5, 30)]), seq_mean=False)
    assert balanced([lop, small], 2) is not None  # 35 vs 13: already as even as rows allow
    assert balanced([make_micro_batch(rows()[:1], seq_mean=False)], 2) is None  # one row
