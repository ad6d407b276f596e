"""``srl-producer bench --engines hf,vllm`` at a tiny size: both engines in one run on the same
model and broker, identical fixed-length work in every case (vLLM's ``ignore_eos``, the hf
engine's masked end-of-sequence logit), and each engine's weight-swap pause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.bench.engine import run_engines
from app.configs import EngineBenchConfig
from srl.config import load_config

pytestmark = pytest.mark.embedded


def test_hf_and_vllm_side_by_side_do_the_same_fixed_length_work(
    bootstrap: str, prefix: str, vllm_model: Path
) -> None:
    values: dict[str, Any] = dict(
        bootstrap_servers=bootstrap,
        topic_prefix=prefix,
        engines=("hf", "vllm"),
        model=str(vllm_model),
        dtype="float32",
        max_batch=4,
        chunk_tokens=4,
        threads=1,
        seed=0,
        kv_cache_gib=0.25,
        max_model_len=256,
    )
    cfg = load_config(EngineBenchConfig, cli=values, env={})
    out = run_engines(cfg, requests_n=8, max_new_tokens=12, repeats=1, swaps=3)
    assert set(out["engines"]) == {"hf", "vllm"}
    for name, r in out["engines"].items():
        cases = r["cases"]
        assert r["engine"] == name and set(cases) == {"batch1", "batch4", "batch4+publish"}
        assert cases["batch1"]["tokens"] == 2 * 12, name  # no sequence ends early
        assert cases["batch4"]["tokens"] == cases["batch4+publish"]["tokens"] == 8 * 12, name
        assert all(c["tokens_per_s"] > 0 and c["tokens_per_cpu_s"] > 0 for c in cases.values())
        assert r["swaps"] == 3 and 0 < r["swap_pause_ms"] <= r["swap_pause_ms_max"]
        assert r["swap_batch"] == 4 and r["simulated"] is False
