"""The vLLM engine's checks that need no vLLM, so they run in every environment: a request that
cannot fit and tensors that do not fit are refused before anything reaches vLLM, the options
pass through ``make_engine`` (on CPU the KV cache is a size, never a share of the host), and
without vLLM the engine is a one-line error. The engine
itself runs in tests/vllm (``make test-vllm``)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from producers.config import GenerateConfig, VLLMSettings
from producers.engines import make_engine
from producers.engines.base import Engine, Request, RequestError
from producers.engines.vllm import (
    CPU_KV_CACHE_GIB,
    VLLMEngine,
    _ExpectedReloadWarnings,
    checkpoint_shapes,
    kv_cache_size,
)
from srl.errors import ConfigError, WeightsError
from srl.tinymodel import load_model


def unstarted(model_dir: Path, max_model_len: int = 64) -> VLLMEngine:
    """The engine's own state without a vLLM behind it (its checks only)."""
    engine = VLLMEngine.__new__(VLLMEngine)
    Engine.__init__(engine, 4)
    engine.max_model_len, engine.vocab_size = max_model_len, 260
    engine.checkpoint, engine.tied = checkpoint_shapes(model_dir), True
    return engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_engine_is_a_one_line_config_error(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="vLLM is not installed here"):
        VLLMEngine(tiny_model)


def test_a_request_that_cannot_fit_the_context_is_refused(tiny_model: Path) -> None:
    engine = unstarted(tiny_model, max_model_len=64)
    engine.validate(Request("fits", [5] * 48, 16))  # 48 + 16 = 64 positions
    with pytest.raises(RequestError, match="max_new_tokens 16 does not fit .* max_model_len 64"):
        engine.validate(Request("long", [5] * 49, 16))
    with pytest.raises(RequestError, match="vocabulary of 260"):
        engine.validate(Request("oov", [5, 260], 4))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add(Request("resumed", [5], 8, prefix=[-1]))
    assert not engine.waiting


def test_tensors_that_do_not_fit_the_checkpoint_are_refused(tiny_model: Path) -> None:
    engine = unstarted(tiny_model)
    state = {k: v for k, v in load_model(tiny_model).state_dict().items()}
    engine._fits(state, 1)  # the tied head may come along
    engine._fits({k: v for k, v in state.items() if k != "lm_head.weight"}, 1)  # or not
    name = "model.layers.0.mlp.down_proj.weight"
    cases = [
        ({**state, name: torch.zeros(2, 2)}, "1 shape mismatches"),
        ({**state, "model.extra.weight": torch.zeros(1)}, "1 unknown tensors"),
        ({k: v for k, v in state.items() if k != name}, f"1 missing tensors \\(e.g. {name}\\)"),
    ]
    for tensors, why in cases:
        with pytest.raises(WeightsError, match=f"v1 does not fit the model: {why}"):
            engine._fits(tensors, 1)


def test_make_engine_passes_the_vllm_options(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> str:
        seen.update(args=args, kwargs=kwargs)
        return "engine"

    monkeypatch.setattr("producers.engines.VLLMEngine", fake)
    cfg = GenerateConfig(
        engine="vllm",
        model=str(tiny_model),
        tensor_parallel_size=2,
        max_model_len=512,
        gpu_memory_utilization=0.5,
        kv_cache_gib=1.5,
    )
    assert make_engine(cfg) == "engine"
    assert seen["args"] == (str(tiny_model), 8, "auto", None, 0.5)
    assert seen["kwargs"] == {"tensor_parallel_size": 2, "max_model_len": 512, "kv_cache_gib": 1.5}


def test_on_cpu_the_kv_cache_is_a_size_never_a_share_of_the_host_by_default() -> None:
    assert kv_cache_size(cpu=True, kv_cache_gib=None, share=None) == CPU_KV_CACHE_GIB == 1.0
    assert kv_cache_size(cpu=True, kv_cache_gib=0.25, share=None) == 0.25
    assert kv_cache_size(cpu=True, kv_cache_gib=None, share=0.3) is None  # asked for: vLLM's
    assert kv_cache_size(cpu=False, kv_cache_gib=None, share=None) is None  # by 0.85 of the GPU
    assert VLLMSettings().gpu_memory_utilization is None and VLLMSettings().kv_cache_gib is None


def test_the_reload_warnings_about_modules_without_weights_are_dropped() -> None:
    def record(name: str) -> logging.LogRecord:
        return logging.LogRecord(
            "x", logging.WARNING, "f", 1, "%s: Failed to load weights", (name,), None
        )

    f = _ExpectedReloadWarnings()
    assert not f.filter(record("RotaryEmbedding")) and not f.filter(record("ParallelLMHead"))
    assert f.filter(record("Qwen2MLP"))
