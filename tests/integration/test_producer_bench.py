"""``srl-producer bench`` on the tiny model: fixed-length work in every case, sane shape, and
the swap pause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.bench.engine import run_bench
from producers.config import GenerateConfig


def test_bench_runs_identical_fixed_length_work_in_every_case(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = make_cfg(
        GenerateConfig, model=str(tiny_model), max_batch=4, chunk_tokens=4, threads=1, seed=0
    )
    out = run_bench(cfg, requests_n=8, max_new_tokens=12, repeats=1, swaps=4)
    cases = out["cases"]
    assert set(cases) == {"batch1", "batch4", "batch4+publish"}
    # end-of-sequence is masked: every sequence runs its full length
    assert cases["batch1"]["tokens"] == 2 * 12
    assert cases["batch4"]["tokens"] == cases["batch4+publish"]["tokens"] == 8 * 12
    assert all(c["tokens_per_s"] > 0 and c["tokens_per_cpu_s"] > 0 for c in cases.values())
    assert all(c["cpu_seconds"] > 0 for c in cases.values())
    assert out["publish_overhead_cpu"] < 1 and out["batch_speedup_cpu"] > 0
    assert out["simulated"] is False and out["publish_overhead"] < 1
    # the swap pause: different weights loaded while the batch decodes, each swap timed
    assert out["swaps"] == 4 and out["swap_batch"] == 4
    assert 0 < out["swap_pause_ms"] <= out["swap_pause_ms_p90"] <= out["swap_pause_ms_max"]
