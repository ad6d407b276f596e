"""What the trainer's rank 0 writes (``consumers.durable``): versions that never repeat, the
lineage, checkpoint numbers, and the re-announcement after a restart; on a local store with
a hand-written engine and producer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import torch

from consumers import checkpoint as ckpts
from consumers.config import TrainConfig
from consumers.durable import Durable
from consumers.outcomes import Ledger, Outcomes
from schemas.records import WeightsAnnouncement, decode_as
from srl.metrics import Metrics
from srl.store import LocalStore
from srl.topics import Layout
from srl.weights import version_prefix


class FakeEngine:
    def __init__(self) -> None:
        self.weight = torch.zeros(4)

    def tensors(self) -> dict[str, Any]:
        return {"w": self.weight}

    def optimizer_state(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}


class Recorder(Metrics):
    """Metrics that keep what they emit."""

    def __init__(self) -> None:
        super().__init__(None, Layout(), "r", "trainer-0")
        self.events: list[tuple[str, dict[str, float], int | None]] = []

    def emit(self, kind: str, values: Any = None, labels: Any = None, step: Any = None) -> Any:
        self.events.append((kind, dict(values or {}), step))
        return super().emit(kind, values, labels, step)


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def produce(self, topic: str, value: bytes, key: Any = None, **_: Any) -> None:
        self.sent.append((topic, value))

    def flush(self, timeout_s: float | None = None) -> None:
        pass


def durable(
    tmp_path: Path, ckpt: ckpts.Checkpoint | None = None
) -> tuple[Durable, FakeProducer, Recorder]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_bytes(b'{"model_type": "qwen2"}')
    cfg = TrainConfig(model=str(model), run="r", keep_checkpoints=2)
    producer = FakeProducer()
    metrics = Recorder()
    store = LocalStore(tmp_path / "store")
    return Durable(cfg, FakeEngine(), store, None, producer, metrics, ckpt), producer, metrics


def announced(producer: FakeProducer) -> list[tuple[int, int | None]]:
    anns = [decode_as(v, WeightsAnnouncement) for t, v in producer.sent if t == Layout().weights]
    return [(a.version, a.parent_version) for a in anns]


def test_publish_save_and_a_restart_that_continues_after_the_newest_version(
    tmp_path: Path,
) -> None:
    d, producer, _ = durable(tmp_path)
    assert (d.version, d.lineage, d.number) == (0, 0, 0)
    d.reannounce()  # nothing published yet: nothing to announce
    assert producer.sent == []

    d.publish(step=1)
    outcomes = Outcomes(Ledger({"a": ["trained", 1]}), 30.0)
    outcomes.invalid("b", "p", "le256", 2, "bad")
    d.save(1, outcomes)
    d.publish(step=2)  # published after the checkpoint; the checkpoint still says v1
    assert (d.version, d.lineage, d.number) == (2, 2, 1)
    assert announced(producer) == [(1, 0), (2, 1)]
    manifest = orjson.loads(d.store.get(f"{version_prefix('r', 2)}/manifest.json"))
    assert (manifest["version"], manifest["trainer_step"], manifest["parent_version"]) == (2, 2, 1)
    assert any(f["name"] == "config.json" for f in manifest["files"])  # HF-loadable

    c = ckpts.load(d.store, "r", 1)
    assert (c.step, c.version, c.extra) == (1, 1, {"lineage": 1, "skipped": []})
    assert c.ledger == {"a": ["trained", 1], "b": ["invalid", 2]}
    assert c.events == outcomes.window

    # a restart from checkpoint 1: the next version is 3 (v2 is never reused), descending
    # from v1 (the weights it really loads); v2 is announced again; checkpoint 2 is next
    again, producer2, _ = durable(tmp_path, c)
    assert (again.version, again.lineage, again.number) == (2, 1, 1)
    assert again.skipped == {2}  # published past checkpoint 1: no update of v1's weights
    again.reannounce()
    assert announced(producer2) == [(2, 1)]
    again.publish(step=2)
    assert announced(producer2)[-1] == (3, 1)
    again.save(2, Outcomes(Ledger(c.ledger), 30.0))
    assert ckpts.complete(again.store, "r") == [1, 2]
    assert ckpts.load(again.store, "r", 2).extra == {"lineage": 3, "skipped": [2]}


def test_publish_emits_weights_published(tmp_path: Path) -> None:
    d, _, metrics = durable(tmp_path)
    d.publish(step=5)
    [(kind, values, step)] = metrics.events
    assert (kind, step, values["version"], sorted(values)) == (
        "weights_published",
        5,
        1,
        ["bytes", "publish_s", "version"],
    )
    assert values["bytes"] > 0
