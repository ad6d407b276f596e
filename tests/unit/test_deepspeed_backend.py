"""The DeepSpeed backend trains to the torch backend's weights and shares its checkpoints.

Runs where ``deepspeed`` is installed (``make test`` installs it, as does
``pip install -e '.[deepspeed]'``); elsewhere these tests skip with that reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consumers import checkpoint as ckpts
from consumers import engine_deepspeed
from consumers.backends import make_engine
from consumers.batcher import Row
from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.engine_deepspeed import DeepSpeedEngine
from consumers.train_engine import MicroBatch, make_micro_batch
from srl.errors import ConfigError
from srl.store import LocalStore

pytest.importorskip("deepspeed", reason="deepspeed is not installed (the .[deepspeed] extra)")
pytestmark = [
    # deepspeed's first ZeRO engine imports its Muon optimizer, which imports torch's inductor
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    # ZeRO-3 gathers and reduce-scatters through the torch.distributed names 2.13 deprecates
    pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_scatter_tensor` is deprecated"),
]


def micro_batches(seed: int, n: int, vocab: int) -> list[tuple[MicroBatch, float]]:
    """``n`` micro-batches of 3 rows each, with their loss-token counts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = []
        for j in range(3):
            prompt, completion = int(rng.integers(2, 6)), int(rng.integers(3, 9))
            ids = rng.integers(0, vocab, prompt + completion)
            behav = rng.uniform(-4.0, -0.5, completion).astype("float32")
            rows.append(Row(f"t{j}", ids, prompt, behav, float(rng.normal())))
        out.append(
            (make_micro_batch(rows, seq_mean=False), float(sum(r.loss_tokens for r in rows)))
        )
    return out


def config(model: Path, **kw: object) -> TrainConfig:
    # lr and a small clipping norm so that three steps move the weights and clipping acts
    base: dict[str, object] = {
        "model": str(model),
        "device": "cpu",
        "lr": 1e-3,
        "max_grad_norm": 0.1,
        "weight_decay": 0.01,
        "loss": "ppo",
    }
    return TrainConfig(**(base | kw))


def train(
    engine: Engine, steps: list[list[tuple[MicroBatch, float]]], discard_at: int = -1
) -> list[float]:
    """Backward each step's micro-batches, then step with their token count; returns grad norms."""
    norms = []
    for s, step in enumerate(steps):
        if s == discard_at:  # a partial step forgotten (its records would be re-read)
            engine.backward(step[0][0])
            engine.discard()
        for mb, _ in step:
            engine.backward(mb)
        norms.append(engine.step(sum(n for _, n in step)).grad_norm)
    return norms


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def plan(vocab: int) -> list[list[tuple[MicroBatch, float]]]:
    mbs = micro_batches(0, 6, vocab)
    return [mbs[0:2], mbs[2:4], mbs[4:6]]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_to_the_torch_backends_weights(tiny_model: Path, stage: int) -> None:
    linear = torch.nn.functional.linear
    ref = Engine(config(tiny_model))
    steps = plan(ref.model.config.vocab_size)
    start = {k: v.clone() for k, v in ref.tensors().items()}
    ref_norms = train(ref, steps, discard_at=1)
    ds = make_engine(config(tiny_model, backend="deepspeed", zero_stage=stage))
    assert isinstance(ds, DeepSpeedEngine)
    if stage == 3:  # every parameter partitioned; torch's linear left alone for other models
        assert all(p.numel() == 0 for p in ds.params)
        assert torch.nn.functional.linear is linear
    ds_norms = train(ds, steps, discard_at=1)
    moved, diff = max_diff(ref.tensors(), start), max_diff(ref.tensors(), ds.tensors())
    print(
        f"ZeRO-{stage}: weights moved {moved:.2e}, differ from torch by {diff:.2e}; "
        f"grad norms torch {ref_norms} deepspeed {ds_norms}"
    )
    assert moved > 1e-3 and diff < 1e-6
    assert max(ref_norms) > 0.1, "clipping did not act; the test would not see a wrong norm"
    assert np.allclose(ref_norms, ds_norms, rtol=1e-4)
    published = ds.export(torch.bfloat16)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert max_diff(ref.export(torch.bfloat16), published) < 1e-2  # one bf16 spacing


def through_checkpoint(src: Engine, dst: Engine, root: Path) -> None:
    """``src``'s state into ``dst`` through a checkpoint shard in a store."""
    store = LocalStore(root)
    tensors, meta = src.checkpoint_state()
    entry = ckpts.write_shard(store, "r", 1, 0, 1, tensors, meta)
    ckpts.save(store, "r", 1, step=2, version=2, ledger={}, events=[], shards=[entry])
    dst.load_checkpoint_state(ckpts.load(store, "r", 1).shards)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoints_resume_under_either_backend(
    tiny_model: Path, tmp_path: Path, stage: int
) -> None:
    """Two steps under one backend, the state through a checkpoint into a fresh engine of the
    other, a third step."""
    steps = plan(64)
    straight = Engine(config(tiny_model))
    train(straight, steps)

    ds = make_engine(config(tiny_model, backend="deepspeed", zero_stage=stage))
    train(ds, steps[:2])
    state = ds.optimizer_state()
    assert len(state["state"]) == len(ds.params) and state["state"][0]["exp_avg"].abs().sum() > 0
    torch_after = Engine(config(tiny_model))
    through_checkpoint(ds, torch_after, tmp_path / "a")
    train(torch_after, steps[2:])
    assert max_diff(straight.tensors(), torch_after.tensors()) < 1e-6

    first = Engine(config(tiny_model))
    train(first, steps[:2])
    ds = make_engine(config(tiny_model, backend="deepspeed", zero_stage=stage))
    through_checkpoint(first, ds, tmp_path / "b")
    train(ds, steps[2:])
    assert max_diff(straight.tensors(), ds.tensors()) < 1e-6


def test_16_bit_masters_are_refused_in_one_line(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="keeps float32 master weights"):
        make_engine(config(tiny_model, backend="deepspeed", master_dtype="bfloat16"))


@pytest.mark.parametrize("stage", [1, 3])
def test_bfloat16_compute_keeps_float32_masters(tiny_model: Path, stage: int) -> None:
    """``dtype bfloat16`` on DeepSpeed: autocast compute over its fp32 parameters."""
    cfg = config(tiny_model, backend="deepspeed", dtype="bfloat16", lr=1e-6, zero_stage=stage)
    ds = make_engine(cfg)
    assert {p.dtype for p in ds.params} == {torch.float32}  # type: ignore[attr-defined]
    start = {k: v.clone() for k, v in ds.tensors().items()}  # type: ignore[attr-defined]
    step = plan(260)[0]
    for mb, _ in step:
        ds.backward(mb)
    ds.step(sum(n for _, n in step))
    after = ds.tensors()  # type: ignore[attr-defined]
    changed = sum(int((after[k] != start[k]).sum()) for k in start)
    assert changed > 0.9 * sum(t.numel() for t in start.values())


def test_cpu_ranks_build_no_op_and_reduce_through_gloo(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce op here first
    (83 s of CPU on 2 cores, once per install): CPU ranks use gloo, and nothing is built."""
    import deepspeed.comm.comm as ds_comm

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    make_engine(config(tiny_model, backend="deepspeed", zero_stage=0))
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert not (tmp_path / engine_deepspeed.SHM_COMM_OP).exists()
