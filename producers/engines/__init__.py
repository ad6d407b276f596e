"""Generation engines behind one interface (``base.Engine``): hf, sim (simulated), vllm.

``make_engine(cfg)`` builds the configured one; each backend is imported only when chosen.
"""

from __future__ import annotations

from producers.config import EngineSettings, VLLMSettings
from producers.engines.base import (
    Completion,
    Emitted,
    Engine,
    Request,
    RequestError,
    complete,
    generate,
)
from producers.engines.hf import HFEngine
from producers.engines.sim import SimEngine
from producers.engines.vllm import VLLMEngine
from srl.workload import LengthHistogram

__all__ = [
    "Completion",
    "Emitted",
    "Engine",
    "Request",
    "RequestError",
    "complete",
    "generate",
    "make_engine",
]


def make_engine(cfg: EngineSettings) -> Engine:
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    if cfg.engine == "hf":
        assert cfg.model is not None
        return HFEngine(cfg.model, cfg.max_batch, cfg.device, cfg.dtype or "float32", cfg.seed)
    if cfg.engine == "vllm":
        assert cfg.model is not None
        v = cfg if isinstance(cfg, VLLMSettings) else VLLMSettings.model_validate({})  # defaults
        return VLLMEngine(
            cfg.model,
            cfg.max_batch,
            cfg.dtype or "auto",
            cfg.seed,
            v.gpu_memory_utilization,
            tensor_parallel_size=v.tensor_parallel_size,
            max_model_len=v.max_model_len,
            kv_cache_gib=v.kv_cache_gib,
        )

    lengths = LengthHistogram.from_file(cfg.lengths, cfg.length_scale) if cfg.lengths else None
    return SimEngine(
        cfg.max_batch, lengths, cfg.time_scale, cfg.seed, cfg.sim_tokens_per_step, cfg.sim_vocab
    )
