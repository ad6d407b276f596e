"""The trainer says at start what a per-step checkpoint and an unbounded store cost at its
model's size (``consumers.trainer.warn_sizes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from consumers.config import TrainConfig
from consumers.trainer import warn_sizes
from srl.config import load_config


class Shapes:
    """An engine's parameters on the meta device: sizes without memory."""

    def __init__(self, n: int) -> None:
        self.params = [torch.empty(n, device="meta")]


def said(cfg: TrainConfig, engine: Any, caplog: pytest.LogCaptureFixture) -> str:
    caplog.clear()
    with caplog.at_level("WARNING", logger="srl.trainer"):
        warn_sizes(cfg, engine)
    return caplog.text


def test_a_7b_model_hears_about_per_step_checkpoints_and_keeping_every_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seven_b = Shapes(7_600_000_000)
    cfg = TrainConfig(model=str(tmp_path), keep_versions=0)
    text = said(cfg, seven_b, caplog)
    assert "checkpoint writes 91 GB" in text and "--checkpoint-every-s" in text
    assert "keeps every version in the store, 15 GB each" in text
    sized = cfg.model_copy(update={"checkpoint_every_s": 900.0, "keep_versions": 4})
    assert said(sized, seven_b, caplog) == ""
    assert said(cfg, Shapes(900_000), caplog) == ""  # the tiny model: nothing to say


def test_the_documented_7b_configuration_loads_and_has_nothing_to_warn_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conf = Path(__file__).resolve().parents[2] / "deploy" / "qwen2.5-7b.toml"
    cfg = load_config(TrainConfig, conf, cli={"model": str(tmp_path)}, env={})
    assert (cfg.backend, cfg.dtype, cfg.master_dtype) == ("fsdp", "bfloat16", "float32")
    assert said(cfg, Shapes(7_615_616_512), caplog) == ""
