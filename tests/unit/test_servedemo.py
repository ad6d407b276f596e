"""``srl demo --serve``'s plan: the one config file it writes is what both of its processes
read, with the settings the demo means."""

from __future__ import annotations

from pathlib import Path

from app.configs import ServeConfig
from app.demoplan import DemoConfig
from app.servedemo import MODEL_NAME, ServePlan
from consumers.config import TrainConfig
from srl.config import load_config


def test_the_config_file_is_read_by_the_server_and_the_trainer(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    demo = load_config(DemoConfig, cli={"serve": True, "steps": 7, "group_size": 4}, env={})
    plan = ServePlan(demo, tmp_path, tmp_path / "model", "127.0.0.1:1", "p", "serve-s0", 4321)
    path = plan.write()
    serve = load_config(ServeConfig, file=path, env={})
    train = load_config(TrainConfig, file=path, env={})
    assert (serve.port, serve.model_name, serve.max_n, serve.weights_run) == (
        4321,
        MODEL_NAME,
        4,
        "serve-s0",
    )
    assert (train.run, train.max_steps, train.batching, train.feedback_window_s > 0) == (
        "serve-s0",
        7,
        "groups",
        True,
    )
    assert serve.topic_prefix == train.topic_prefix == "p" and serve.store == train.store
    assert [r.name for r in plan.roles(path)] == ["trainer", "serve"]
