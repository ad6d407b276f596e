"""``dtype = "bfloat16"`` is mixed precision: bf16 compute over fp32 master weights and AdamW
state, so a small learning rate still moves the weights (pure-bf16 storage, which rounds most
such updates away, only on explicit request)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.batcher import Row
from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.train_engine import make_micro_batch


def one_step(engine: Engine) -> dict[str, torch.Tensor]:
    """The master weights before one step on a fixed micro-batch."""
    before = {k: v.clone() for k, v in engine.tensors().items()}
    rng = np.random.default_rng(0)
    rows = [
        Row(f"t{i}", rng.integers(0, 64, 9), 4, np.full(5, -2.0, dtype="float32"), a)
        for i, a in enumerate((1.0, -1.0))
    ]
    engine.backward(make_micro_batch(rows, seq_mean=False))
    assert engine.step(10.0).grad_norm > 0
    return before


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The fraction of weights an update changed."""
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    return changed / sum(t.numel() for t in before.values())


def test_bfloat16_is_mixed_precision_and_lr_1e_6_moves_the_weights(tiny_model: Path) -> None:
    cfg = TrainConfig(model=str(tiny_model), device="cpu", dtype="bfloat16", lr=1e-6)
    engine = Engine(cfg)
    assert {p.dtype for p in engine.params} == {torch.float32}  # the fp32 masters
    logits = engine._forward(engine.model, torch.ones((1, 4), dtype=torch.int64), None)
    assert logits.dtype == torch.bfloat16  # computed in bf16
    before = one_step(engine)
    after = engine.tensors()
    # AdamW moves each weight by about lr: every fp32 master sees it
    assert moved(before, after) > 0.9
    published = engine.export(torch.bfloat16)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert all(torch.equal(published[k], after[k].to(torch.bfloat16)) for k in after)
    state = engine.optimizer.state[engine.params[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_pure_bfloat16_storage_rounds_small_updates_away_and_warns(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = TrainConfig(
        model=str(tiny_model), device="cpu", dtype="bfloat16", master_dtype="bfloat16", lr=1e-6
    )
    with caplog.at_level("WARNING", logger="srl.trainer"):
        engine = Engine(cfg)
    assert "round away" in caplog.text
    assert {p.dtype for p in engine.params} == {torch.bfloat16}
    before = one_step(engine)
    # what `dtype = bfloat16` did before mixed precision: most of the update is lost
    assert moved(before, engine.tensors()) < 0.2


def test_the_export_is_a_snapshot_even_in_the_parameters_dtype(tiny_model: Path) -> None:
    # the upload runs while the next step trains: the export must not alias a parameter
    engine = Engine(TrainConfig(model=str(tiny_model), device="cpu", lr=1e-2))
    published = engine.export(torch.float32)
    frozen = {k: v.clone() for k, v in published.items()}
    one_step(engine)
    assert all(torch.equal(published[k], frozen[k]) for k in frozen)
    assert not all(torch.equal(published[k], v) for k, v in engine.tensors().items())
