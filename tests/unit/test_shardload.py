"""FSDP ranks read only their rows of a checkpoint and get ``from_pretrained``'s weights.

Two gloo ranks (``torch.multiprocessing``) build each model on the meta device, shard it and
fill their rows (``consumers.shardload``); rank 0 then gathers the weights and compares them with
a whole ``from_pretrained`` load, and each rank reports how many bytes it read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from consumers import shardload
from srl.ports import free_port
from srl.tinymodel import TinyModelSpec, build_tiny_model

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def checkpoints(root: Path) -> dict[str, Path]:
    """A tied Qwen2 in fp32 (one file), and an untied Llama saved in bf16 as several shard
    files with an index (what real checkpoints look like)."""
    from transformers import AutoModelForCausalLM

    qwen = build_tiny_model(root / "qwen", TinyModelSpec(**SMALL), seed=1)  # type: ignore[arg-type]
    llama_spec = TinyModelSpec(arch="llama", tie_word_embeddings=False, **SMALL)  # type: ignore[arg-type]
    llama = build_tiny_model(root / "llama32", llama_spec, seed=2)
    bf16 = root / "llama"
    model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16)
    model.save_pretrained(bf16, max_shard_size="40KB")
    for p in llama.iterdir():
        if p.name.startswith("tokenizer"):
            (bf16 / p.name).write_bytes(p.read_bytes())
    assert (bf16 / shardload.INDEX).is_file()
    return {"qwen": qwen, "llama": bf16}


def rank_main(rank: int, port: int, models: dict[str, Path], out: Any) -> None:
    import torch.distributed as dist

    from consumers.config import TrainConfig
    from consumers.distributed import Dist
    from consumers.engine import export_tensors
    from consumers.engine_fsdp import FSDPEngine
    from srl.tinymodel import load_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name, path in models.items():
            cfg = TrainConfig(model=str(path), device="cpu", dtype="bfloat16", kl_coef=0.1)
            engine = FSDPEngine(cfg, Dist(rank, 2))
            got = engine.export()  # every rank joins; rank 0 gets the gathered fp32 masters
            ref_got = {
                k: v.full_tensor().float() for k, v in export_tensors(engine.ref).items()
            }  # the frozen reference, sharded the same way
            result: dict[str, Any] = {"loaded": engine.loaded}
            if rank == 0:
                whole = load_model(path)
                want = export_tensors(whole)
                result["keys"] = sorted(got) == sorted(want)
                result["diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
                result["dtype"] = {str(t.dtype) for t in got.values()}
                ref = {k: v.to(torch.bfloat16).float() for k, v in want.items()}
                result["ref_diff"] = max((ref_got[k] - ref[k]).abs().max().item() for k in ref)
                buffers = dict(whole.named_buffers())
                result["buffers"] = max(
                    (b.cpu() - buffers[n]).abs().max().item()
                    for n, b in engine.model.named_buffers()
                )
                tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
                result["tied"] = tied == whole.config.tie_word_embeddings
            out.put((rank, name, result))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_each_rank_reads_its_rows_and_gets_from_pretrained_weights(tmp_path: Path) -> None:
    models = checkpoints(tmp_path)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, models, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results: dict[tuple[int, str], dict[str, Any]] = {}
    while not out.empty():
        rank, name, result = out.get()
        results[(rank, name)] = result
    for name in models:
        main = results[(0, name)]
        assert main["keys"] and main["tied"], (name, main)
        assert main["diff"] == 0.0, f"{name}: the sharded load differs by {main['diff']}"
        assert main["ref_diff"] == 0.0, f"{name}: the reference differs by {main['ref_diff']}"
        assert main["buffers"] == 0.0, f"{name}: rotary buffers differ by {main['buffers']}"
        assert main["dtype"] == {"torch.float32"}, main["dtype"]  # fp32 masters from bf16 files
        # each rank read its half of the rows (of each of the model and its reference), not all
        for rank in (0, 1):
            loaded: shardload.Loaded = results[(rank, name)]["loaded"]
            assert 0.45 < loaded.read / loaded.total < 0.55, (name, rank, loaded)


def test_a_checkpoint_named_otherwise_is_unreadable_by_rows(tmp_path: Path) -> None:
    """Names the model does not have (a layout transformers renames on load), or no
    safetensors at all: the engine falls back to the whole load instead of failing."""
    from safetensors.torch import save_file

    model_dir = build_tiny_model(tmp_path / "m", TinyModelSpec(**SMALL))  # type: ignore[arg-type]
    meta = shardload.meta_model(model_dir, torch.float32)
    files = shardload.weight_files(model_dir)
    assert shardload.unreadable(meta, files) is None
    assert shardload.unreadable(meta, None) == "no safetensors weights"
    save_file({"transformer.wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    why = shardload.unreadable(meta, shardload.weight_files(tmp_path))
    assert why is not None and "not in the files under their names" in why
