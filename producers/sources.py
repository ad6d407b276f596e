"""Prompt sources for the dispatcher: a JSONL file or a simulated workload (the demo task's
prompts come from the app layer: ``app.sources.load_source``).

Owns the one shape every source yields (:class:`PromptLike`: ``prompt_id``, ``text``,
``metadata``), so the dispatcher takes any iterable of such objects as an argument:

* ``read_jsonl(path)``: one JSON object per line, ``{"prompt_id": str, "prompt": str,
  "metadata": {...}}`` (metadata optional; it reaches the reward function through the seq-0
  chunk). A bad line stops the dispatcher with ``file:line: reason``; ids must be unique.
* ``sim_prompts(n, lengths, seed)``: prompts whose ``metadata.sim_length`` is drawn from a
  length histogram: the oracle length the sim engine generates and the oracle predictor reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import orjson

from ranker.api import BaselinePredictor, LengthPredictor, OraclePredictor, RankerPredictor
from srl.errors import ConfigError
from srl.stores import store_from_config
from srl.workload import LengthHistogram

if TYPE_CHECKING:
    from producers.config import DispatchConfig


class PromptLike(Protocol):
    @property
    def prompt_id(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def metadata(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SourcePrompt:
    prompt_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def read_jsonl(path: str | Path) -> list[SourcePrompt]:
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(f"prompts file {path}: {e.strerror or e}") from None
    out: list[SourcePrompt] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        pid, text, meta = d.get("prompt_id"), d.get("prompt"), d.get("metadata") or {}
        if not isinstance(pid, str) or not pid:
            raise ConfigError(f"{where}: prompt_id must be a non-empty string")
        if not isinstance(text, str):
            raise ConfigError(f"{where}: prompt must be a string")
        if not isinstance(meta, dict):
            raise ConfigError(f"{where}: metadata must be a JSON object")
        if pid in seen:
            raise ConfigError(f"{where}: duplicate prompt_id {pid!r}")
        seen.add(pid)
        out.append(SourcePrompt(pid, text, meta))
    if not out:
        raise ConfigError(f"prompts file {path}: no prompts")
    return out


def sim_prompts(n: int, lengths: LengthHistogram, seed: int = 0) -> list[SourcePrompt]:
    """``n`` simulated prompts, each with its oracle output length in ``metadata.sim_length``."""
    drawn = lengths.sample(n, np.random.default_rng(seed))
    return [
        SourcePrompt(
            f"sim-{seed}-{i:07d}",
            f"simulated prompt {i} (seed {seed})",
            {"sim_length": int(length)},
        )
        for i, length in enumerate(drawn)
    ]


def make_predictor(cfg: DispatchConfig, prompts: list[PromptLike]) -> LengthPredictor:
    default = cfg.baseline_length or cfg.max_new_tokens
    if cfg.predictor == "baseline":
        return BaselinePredictor(default)
    if cfg.predictor == "ranker":
        return RankerPredictor(store_from_config(cfg), cfg.run, BaselinePredictor(default))
    known = {
        p.text: int(p.metadata["sim_length"])
        for p in prompts
        if isinstance(p.metadata.get("sim_length"), int)
    }
    if not known:
        raise ConfigError("--predictor oracle: no prompt carries metadata.sim_length")
    return OraclePredictor(known, default)
