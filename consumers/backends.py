"""``make_engine``: the training backend ``cfg.backend`` names (docs/trainer.md)."""

from __future__ import annotations

from consumers.config import TrainConfig
from consumers.distributed import Dist
from consumers.engine import Engine
from consumers.engine_deepspeed import DeepSpeedEngine
from consumers.train_engine import TrainEngine


def make_engine(cfg: TrainConfig, dist: Dist | None = None) -> TrainEngine:
    """Plain torch, or DeepSpeed ZeRO."""
    if cfg.backend == "deepspeed":
        return DeepSpeedEngine(cfg, dist)
    return Engine(cfg, dist)
