"""docs/recipes/gsm8k.md's GPU config file, and it with the MATH changes, are valid for every
command the recipe runs with it (the e2e test runs the CPU form; this one cannot run here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from app.evalconfig import EvalConfig
from consumers.config import TrainConfig
from producers.config import DispatchConfig, GenerateConfig
from srl.config import PlanConfig, Settings, TopicsAdminConfig, load_config
from tests.conftest import ROOT

RECIPE = ROOT / "docs" / "recipes" / "gsm8k.md"
COMMANDS: list[type[Settings]] = [
    PlanConfig,
    TopicsAdminConfig,
    DispatchConfig,
    GenerateConfig,
    TrainConfig,
    EvalConfig,
]


def toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", RECIPE.read_text(), re.S)


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in change.items():
        out[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def write(data: dict[str, Any], path: Path) -> Path:
    lines = [f"{k} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for table, values in data.items():
        if isinstance(values, dict):
            lines += [f"[{table}]", *(f"{k} = {_value(v)}" for k, v in values.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


@pytest.mark.parametrize("what", ["gsm8k", "math"])
def test_the_recipes_config_loads_for_every_command(what: str, tmp_path: Path) -> None:
    gsm8k, math = (tomllib.loads(b) for b in toml_blocks())
    data = gsm8k if what == "gsm8k" else merged(gsm8k, math)
    path = write(data, tmp_path / f"{what}.toml")
    cfgs = {cls: load_config(cls, path, env={}) for cls in COMMANDS}
    dispatch, train, ev = cfgs[DispatchConfig], cfgs[TrainConfig], cfgs[EvalConfig]
    generate = cfgs[GenerateConfig]
    assert isinstance(dispatch, DispatchConfig) and isinstance(train, TrainConfig)
    assert isinstance(ev, EvalConfig) and isinstance(generate, GenerateConfig)
    assert train.reward == ev.reward == "consumers.rewards:math_answer"
    assert train.groups_per_step == dispatch.groups_per_step
    assert ev.from_run and ev.run == train.run == dispatch.run == generate.run
    assert dispatch.chat_template and ev.chat_template
    assert dispatch.system_prompt == ev.system_prompt
    assert dispatch.max_new_tokens == ev.max_new_tokens
    # GenerateConfig itself refuses bucket names the layout (bucket_bounds) does not have
    if what == "math":
        assert dispatch.answer_field == ev.answer_field == "solution"
        assert "boxed" in (ev.system_prompt or "")
