"""``make_engine``: the training backend ``cfg.backend`` names (docs/trainer.md)."""

from __future__ import annotations

from consumers.config import TrainConfig
from consumers.distributed import Dist
from consumers.engine import Engine
from consumers.engine_deepspeed import DeepSpeedEngine
from consumers.engine_fsdp import FSDPEngine
from consumers.engine_zero3 import ZeRO3Engine
from consumers.train_engine import TrainEngine


def backend_name(cfg: TrainConfig, world: int) -> str:
    """``auto``: FSDP2 (sharded) with several ranks, the replicated torch backend with one."""
    if cfg.backend == "auto":
        return "fsdp" if world > 1 else "torch"
    return cfg.backend


def make_engine(cfg: TrainConfig, dist: Dist | None = None) -> TrainEngine:
    """Plain torch, FSDP2, or DeepSpeed ZeRO."""
    name = backend_name(cfg, dist.world if dist is not None else 1)
    engine: TrainEngine
    if name == "deepspeed":
        engine = (ZeRO3Engine if cfg.zero_stage == 3 else DeepSpeedEngine)(cfg, dist)
    elif name == "fsdp":
        engine = FSDPEngine(cfg, dist)
    else:
        engine = Engine(cfg, dist)
    if dist is not None:
        dist.lockstep = engine.lockstep  # how rank 0 hands out micro-batches
    return engine
