"""``srl eval``'s policy from a run: the newest published version, verified file by file,
alone (materialised) or loaded into ``--model`` as a generator loads it (``app.evalrun``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from app.evalconfig import EvalConfig
from app.evalrun import run_evaluation
from consumers.engine import extra_files
from srl.config import load_config
from srl.errors import SrlError
from srl.stores import LocalStore
from srl.tinymodel import load_model
from srl.weights import publish


def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt_id": f"q{i}", "prompt": f"What is {i} + 3?", "answer": "x"} for i in range(4)]
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def evaluate(tmp_path: Path, **values: Any) -> dict[str, Any]:
    cli = {
        "prompts": str(dataset(tmp_path)),
        "store": f"file://{tmp_path / 'store'}",
        "reward": "consumers.rewards:exact_match",
        "reward_workers": 0,
        "max_new_tokens": 6,
        **values,
    }
    cfg = load_config(EvalConfig, cli=cli, env={})
    return run_evaluation(cfg, per_prompt=True, progress=False)


def greedy_texts(rep: dict[str, Any]) -> list[str]:
    return [r["greedy"]["completion"] for r in rep["per_prompt"]]


def test_a_runs_newest_version_alone_and_into_the_model(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    store = LocalStore(tmp_path / "store")
    model = load_model(tiny_model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    files = extra_files(tiny_model)
    publish(store, "r", 1, weights, trainer_step=1, parent_version=0, extra_files=files)
    v0 = evaluate(tmp_path, model=str(tiny_model))
    assert (v0["version"], v0["run"], v0["model"]) == (0, None, str(tiny_model))
    v1 = evaluate(tmp_path, run="r")
    assert (v1["version"], v1["run"]) == (1, "r")
    assert greedy_texts(v1) == greedy_texts(v0)  # the same weights: the same greedy text

    noisy = {k: torch.flip(-v, [0]) for k, v in weights.items()}  # tied tensors stay tied
    publish(store, "r", 2, noisy, trainer_step=2, parent_version=1, extra_files=files)
    alone = evaluate(tmp_path, run="r")
    into = evaluate(tmp_path, run="r", model=str(tiny_model))
    assert alone["version"] == into["version"] == 2
    assert greedy_texts(alone) == greedy_texts(into) != greedy_texts(v0)


def test_a_version_that_fails_verification_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    weights = dict(load_model(tiny_model).state_dict())
    publish(
        store,
        "r",
        1,
        weights,
        trainer_step=1,
        parent_version=0,
        extra_files=extra_files(tiny_model),
    )
    shard = next((tmp_path / "store" / "weights" / "r").rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    for values in ({"run": "r"}, {"run": "r", "model": str(tiny_model)}):
        with pytest.raises(SrlError, match="fails verification"):
            evaluate(tmp_path, **values)
    with pytest.raises(SrlError, match="has no published weights"):
        evaluate(tmp_path, run="other")
