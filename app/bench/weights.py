"""``srl bench weights``: the weights protocol end to end against a plain file copy.

Owns the weight-sync figures of docs/benchmarks.md. For each model size (random weights of
a Qwen2-shaped config with the byte tokenizer, bf16, untied embeddings) it times, one after
the other in this process:

* ``publish_s``: ``srl.weights.publish`` into a local create-only store (safetensors
  serialisation, sha256 of every file, fsync'd create-only puts, manifest last);
* ``fetch_verify_s``: ``load_manifest`` (manifest sha256) + ``fetch_tensors`` (every file's
  sha256, then safetensors parsing), as the generator's weight follower does;
* ``load_s``: ``HFEngine.load_weights`` (the generator engine's own swap: checks, then
  ``load_state_dict``) into an engine built from the same config;

against ``plain_copy_s``: ``shutil.copyfile`` of the published safetensors file plus an
fsync of the copy (the same bytes, the same durability as a store put). The announcement on
the weights topic (one small Kafka record) is not in these figures.

``swap_pause_ms``: how long a generator stops decoding to swap, measured as the worker does
it (``producers.worker``: flush the chunker's open chunks, then ``engine.load_weights``)
between two ``engine.step()`` calls of an ``HFEngine`` decoding a batch, on the demo model's
shape (``TinyModelSpec()``, fp32); the median over ``swaps`` swaps. Temporary files live in
one directory that is removed at the end. Called by ``app.bench.cli``.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.publisher import Publisher, Upload
from producers.chunker import Chunker, TrajectoryStart
from producers.engines.base import Request
from producers.engines.hf import HFEngine
from srl.config import load_config
from srl.store import LocalStore
from srl.tinymodel import TinyModelSpec, build_config, build_tiny_model, build_tokenizer
from srl.topics import Layout
from srl.weights import fetch_tensors, load_manifest, publish

# about 10M, 100M and 500M parameters with the 260-token byte vocabulary
SIZES: dict[str, TinyModelSpec] = {
    "10M": TinyModelSpec(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "100M": TinyModelSpec(
        hidden_size=768,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "500M": TinyModelSpec(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # Qwen2-1.5B's layers (28 there, 32 here for the byte vocabulary): 3.0 GB in bf16
    "1.5B": TinyModelSpec(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=32,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "1M": TinyModelSpec(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
}


def _model_dir(out: Path, spec: TinyModelSpec, dtype: Any, seed: int) -> Path:
    """An HF model directory (config, tokenizer, random weights in ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(spec, len(tok)), dtype=dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _fsync_copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_size(name: str, spec: TinyModelSpec, work: Path, repeats: int = 1) -> dict[str, Any]:
    import torch

    model_dir = _model_dir(work / f"model-{name}", spec, torch.bfloat16, seed=0)
    engine = HFEngine(model_dir, max_batch=1, dtype="bfloat16", seed=0)
    shutil.rmtree(model_dir)
    torch.manual_seed(1)
    tensors = {k: torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    params = sum(t.numel() for t in tensors.values())
    store = LocalStore(work / f"store-{name}")
    runs = []
    for version in range(1, repeats + 1):
        t0 = time.perf_counter()
        pub = publish(store, "bench", version, tensors, trainer_step=version, parent_version=None)
        t1 = time.perf_counter()
        fetched = fetch_tensors(store, load_manifest(store, pub.announcement()))
        t2 = time.perf_counter()
        engine.load_weights(fetched, version)
        t3 = time.perf_counter()
        del fetched
        gc.collect()
        files = [
            store.local_path(f"weights/bench/v{version:08d}/{e.name}") for e in pub.manifest.files
        ]
        c0 = time.perf_counter()
        for i, src in enumerate(files):
            assert src is not None
            _fsync_copy(src, work / f"copy-{name}-{version}-{i}")
        c1 = time.perf_counter()
        for i in range(len(files)):
            (work / f"copy-{name}-{version}-{i}").unlink()
        runs.append(
            {
                "publish_s": t1 - t0,
                "fetch_verify_s": t2 - t1,
                "load_s": t3 - t2,
                "publish_load_s": t3 - t0,
                "plain_copy_s": c1 - c0,
                "bytes": pub.manifest.total_bytes,
            }
        )
    shutil.rmtree(store.root)
    del engine, tensors
    gc.collect()
    best = min(runs, key=lambda r: r["publish_load_s"])
    copy = min(r["plain_copy_s"] for r in runs)
    return {
        "name": name,
        "params": params,
        "bytes": best["bytes"],
        "dtype": "bfloat16",
        "publish_s": round(best["publish_s"], 6),
        "fetch_verify_s": round(best["fetch_verify_s"], 6),
        "load_s": round(best["load_s"], 6),
        "publish_load_s": round(best["publish_load_s"], 6),
        "plain_copy_s": round(copy, 6),
        "ratio": round(best["publish_load_s"] / copy, 2),
    }


class _NoBroker:
    """The announcement's producer in a bench without a broker: one small record, not timed."""

    def produce(self, *_: Any, **__: Any) -> None:
        return None

    def flush(self, *_: Any, **__: Any) -> None:
        return None


def trainer_side(name: str, spec: TinyModelSpec, work: Path) -> dict[str, Any]:
    """The trainer's view of a publish: ``snapshot_s`` (``Engine.export`` of fp32 masters into
    bf16 copies: all the step waits for) and ``upload_s`` (``consumers.publisher``: files,
    hashes, manifest, in its background thread), then a follower's ``fetch_verify_s`` and
    ``load_s`` into an ``HFEngine``; ``e2e_gb_per_s``: the version's bytes over the four."""
    import torch

    model_dir = _model_dir(work / f"trainer-{name}", spec, torch.bfloat16, seed=0)
    cli = {"model": str(model_dir), "device": "cpu", "dtype": "bfloat16"}
    cfg = load_config(TrainConfig, cli=cli, env={})
    engine = Engine(cfg)  # fp32 master weights, bf16 compute
    store = LocalStore(work / f"trainer-store-{name}")
    pub = Publisher(store, "bench", _NoBroker(), Layout(), {}, background=True)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    snapshot = engine.export(torch.bfloat16)
    snapshot_s = time.perf_counter() - t0
    pub.start(Upload(1, 1, 0, snapshot_s, 0.0), snapshot)
    del snapshot, engine
    up = pub.wait()
    assert up is not None and up.published is not None, up and up.error
    gc.collect()
    follower = HFEngine(model_dir, max_batch=1, dtype="bfloat16", seed=0)
    t1 = time.perf_counter()
    fetched = fetch_tensors(store, load_manifest(store, up.published.announcement()))
    t2 = time.perf_counter()
    follower.load_weights(fetched, 1)
    t3 = time.perf_counter()
    nbytes = up.published.manifest.total_bytes
    del fetched, follower
    shutil.rmtree(store.root)
    shutil.rmtree(model_dir)
    gc.collect()
    e2e = snapshot_s + up.upload_s + (t3 - t1)
    # microseconds: at the test size (1M parameters) a snapshot takes well under a millisecond
    return {
        "snapshot_s": round(snapshot_s, 6),
        "upload_s": round(up.upload_s, 6),
        "step_wait_s": round(snapshot_s, 6),
        "step_wait_sync_s": round(snapshot_s + up.upload_s, 6),
        "follower_fetch_verify_s": round(t2 - t1, 6),
        "follower_load_s": round(t3 - t2, 6),
        "e2e_s": round(e2e, 6),
        "e2e_gb_per_s": round(nbytes / e2e / 1e9, 3),
    }


def swap_pause(work: Path, swaps: int = 20, batch: int = 8) -> dict[str, Any]:
    """Decode-stop time of a swap on the demo model's shape (HFEngine, fp32), median of
    ``swaps``."""
    import torch

    model_dir = build_tiny_model(work / "demo-model", TinyModelSpec())
    engine = HFEngine(model_dir, max_batch=batch, seed=0)
    versions = [
        {k: v.clone() + 0.001 * i for k, v in engine.model.state_dict().items()}
        for i in range(1, 3)
    ]
    chunker = Chunker(32, "bench-swap")
    for i in range(batch):
        key = f"r{i}"
        engine.add(Request(key, engine.tokenize(f"swap {i} ="), 10_000, temperature=1.0))
        chunker.open(TrajectoryStart(key, f"p{i}", "bench", 0, 1, "b0"))
    pauses, steps = [], []
    with torch.inference_mode():
        for s in range(swaps + 3):
            t0 = time.perf_counter()
            for e in engine.step():
                chunker.add(
                    e.key, list(e.tokens), list(e.logprobs), engine.version, e.finish_reason
                )
            steps.append((time.perf_counter() - t0) * 1000)
            if s >= 3:  # the batch is decoding: swap between this step and the next
                t0 = time.perf_counter()
                chunker.flush_all()
                engine.load_weights(versions[s % 2], s)
                pauses.append((time.perf_counter() - t0) * 1000)
    return {
        "swap_pause_ms": round(statistics.median(pauses), 3),
        "swap_pause_ms_max": round(max(pauses), 3),
        "decode_step_ms_median": round(statistics.median(steps[3:]), 3),
        "swap_model_params": sum(t.numel() for t in versions[0].values()),
        "swaps": len(pauses),
    }


def run(
    sizes: list[str], repeats: int = 1, swaps: int = 20, under: str | None = None
) -> dict[str, Any]:
    """Every size, then the swap pause; the store, models and copies in a temporary directory
    under ``under`` (a tmpfs takes the disk out of the figures), removed at the end."""
    work = Path(tempfile.mkdtemp(prefix="srl-bench-weights-", dir=under))
    try:
        out = [bench_size(n, SIZES[n], work, repeats) for n in sizes]
        for row in out:
            row["trainer"] = trainer_side(row["name"], SIZES[row["name"]], work)
        swap = swap_pause(work, swaps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "work_dir": str(work.parent),
        "sizes": out,
        **swap,
        "swap_path": "producers.worker swap: chunker.flush_all + HFEngine.load_weights",
    }
