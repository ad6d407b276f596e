"""``dtype = "bfloat16"`` trains bf16 parameters (it used to be accepted and ignored)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from consumers.batcher import Row
from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.train_engine import make_micro_batch


def test_bfloat16_parameters_train_and_publish_as_bfloat16(tiny_model: Path) -> None:
    engine = Engine(TrainConfig(model=str(tiny_model), device="cpu", dtype="bfloat16", lr=1e-2))
    assert {p.dtype for p in engine.params} == {torch.bfloat16}
    before = {k: v.clone() for k, v in engine.tensors().items()}
    rng = np.random.default_rng(0)
    rows = [
        Row(f"t{i}", rng.integers(0, 64, 9), 4, np.full(5, -2.0, dtype="float32"), a)
        for i, a in enumerate((1.0, -1.0))
    ]
    engine.backward(make_micro_batch(rows, seq_mean=False))
    stats = engine.step(10.0)
    after = engine.tensors()
    assert all(t.dtype == torch.bfloat16 for t in after.values())
    assert stats.grad_norm > 0
    assert max((after[k].float() - before[k].float()).abs().max().item() for k in after) > 0
