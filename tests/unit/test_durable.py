"""What the trainer's rank 0 writes (``consumers.durable``): versions that never repeat, the
lineage, checkpoint numbers, and the re-announcement after a restart; on a local store with
a hand-written engine and producer."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

import srl.store
from consumers import checkpoint as ckpts
from consumers.config import TrainConfig
from consumers.durable import Durable
from consumers.outcomes import Ledger, Outcomes
from schemas.records import WeightsAnnouncement, decode_as
from srl.metrics import Metrics
from srl.store import LocalStore
from srl.topics import Layout
from srl.weights import fetch_tensors, load_manifest, version_prefix


class FakeEngine:
    def __init__(self) -> None:
        self.weight = torch.zeros(4)

    def tensors(self) -> dict[str, Any]:
        return {"w": self.weight}

    def optimizer_state(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}

    sharded = False
    lockstep = False

    def export(self, dtype: Any = None) -> dict[str, Any]:
        return {"w": self.weight.to(dtype or self.weight.dtype, copy=True)}  # a snapshot

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return ckpts.engine_state(["w"], [self.weight], self.optimizer_state())


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
    tmp_path: Path, ckpt: ckpts.Checkpoint | None = None, keep_versions: int = 0
) -> tuple[Durable, FakeProducer, Recorder]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_bytes(b'{"model_type": "qwen2"}')
    cfg = TrainConfig(model=str(model), run="r", keep_checkpoints=2, keep_versions=keep_versions)
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
    assert d.collect(wait=True)
    assert (d.version, d.lineage, d.number) == (2, 2, 1)
    assert announced(producer) == [(1, 0), (2, 1)]
    manifest = orjson.loads(d.store.get(f"{version_prefix('r', 2)}/manifest.json"))
    assert (manifest["version"], manifest["trainer_step"], manifest["parent_version"]) == (2, 2, 1)
    assert any(f["name"] == "config.json" for f in manifest["files"])  # HF-loadable

    c = ckpts.load(d.store, "r", 1)
    totals = {"trained": 1, "invalid": 1}
    assert (c.step, c.version, c.extra) == (
        1,
        1,
        {"lineage": 1, "skipped": [], "ledger_floor": {}, "outcome_totals": totals},
    )
    assert c.ledger == {"a": ["trained", 1], "b": ["invalid", 2, {}]}
    assert c.events == outcomes.window

    # a restart from checkpoint 1: the next version is 3 (v2 is never reused), descending
    # from v1 (the weights it really loads); v2 is announced again; checkpoint 2 is next
    again, producer2, _ = durable(tmp_path, c)
    assert (again.version, again.lineage, again.number) == (2, 1, 1)
    assert again.skipped == {2}  # published past checkpoint 1: no update of v1's weights
    again.reannounce()
    assert announced(producer2) == [(2, 1)]
    again.publish(step=2)
    assert again.collect(wait=True) and announced(producer2)[-1] == (3, 1)
    again.save(2, Outcomes(Ledger(c.ledger), 30.0))
    assert ckpts.complete(again.store, "r") == [1, 2]
    extra = ckpts.load(again.store, "r", 2).extra
    assert (extra["lineage"], extra["skipped"]) == (3, [2])


def test_publish_emits_weights_published(tmp_path: Path) -> None:
    d, _, metrics = durable(tmp_path)
    d.publish(step=5)
    assert d.collect(wait=True)
    [(kind, values, step)] = metrics.events
    assert (kind, step, values["version"], sorted(values)) == (
        "weights_published",
        5,
        1,
        ["bytes", "publish_s", "snapshot_s", "upload_s", "version", "wait_s"],
    )
    assert values["bytes"] > 0


def test_the_store_keeps_the_newest_keep_versions_versions(tmp_path: Path) -> None:
    d, producer, metrics = durable(tmp_path, keep_versions=2)
    for step in range(1, 6):
        d.publish(step)
    assert d.collect(wait=True)
    assert ckpts.newest_published(d.store, "r") == 5
    kept = sorted({k.split("/")[2] for k in d.store.list("weights/r/")})
    assert kept == ["v00000004", "v00000005"]
    assert [v for v, _ in announced(producer)] == [1, 2, 3, 4, 5]
    assert metrics.counters["versions_pruned"] == 3


class SmallDisk:
    """``open`` for ``srl.store`` on a disk with ``free`` bytes left: a write past them fails
    with ENOSPC, as on a full filesystem (the store's write seam; tmp files count too)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115
        if "w" not in mode:
            return f
        disk, write = self, f.write

        def limited(data: Any) -> int:
            n = len(memoryview(data).cast("B"))
            if n > disk.free:
                raise OSError(errno.ENOSPC, "No space left on device")
            disk.free -= n
            return int(write(data))

        f.write = limited
        return f


def test_a_full_disk_fails_the_publish_and_the_checkpoint_not_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: a write the store refuses leaves nothing of the version or checkpoint behind,
    announces nothing, is counted and said; the next publish takes the same version number."""
    d, producer, metrics = durable(tmp_path)
    d.publish(step=1)
    assert d.collect(wait=True) and d.save(1, Outcomes(Ledger(), 30.0))
    disk = SmallDisk(free=20)  # the weights file does not fit
    monkeypatch.setattr(srl.store, "open", disk, raising=False)
    assert not d.owed
    d.publish(step=2)
    assert d.version == 2  # the weights trained from now on are v2, until the upload fails
    assert d.collect(wait=True) is False and d.version == 1
    assert d.owed  # the trainer tries it again while idle: the dispatcher waits for it
    assert d.save(2, Outcomes(Ledger(), 30.0)) is False
    assert (d.version, announced(producer)) == (1, [(1, 0)])
    assert d.store.list(version_prefix("r", 2)) == [] and not list(d.store.root.rglob(".tmp-*"))
    assert ckpts.complete(d.store, "r") == [1] and ckpts.highest_number(d.store, "r") == 1
    refused = [(v["number"], s) for k, v, s in metrics.events if k == "store_refused"]
    assert refused == [(2.0, 2), (2.0, 2)]
    # the idle trainer does not try again at once: 5 s, doubling with each refusal in a row
    assert not d.due("checkpoint") and not d.due("publish")
    assert [v["retry_s"] for k, v, _ in metrics.events if k == "store_refused"] == [5.0, 5.0]
    assert metrics.counters["publish_failures"] == metrics.counters["checkpoint_failures"] == 1
    assert d.save(2, Outcomes(Ledger(), 30.0)) is False  # a step's checkpoint: forced
    assert [v["retry_s"] for k, v, _ in metrics.events if k == "store_refused"][-1] == 10.0
    disk.free = 10**9  # space again: the same version is published, the next checkpoint saved
    d.publish(step=3)
    assert d.collect(wait=True) and d.save(3, Outcomes(Ledger(), 30.0)) and not d.owed
    assert d.due("checkpoint") and d.due("publish")
    saved = [(v["number"], s) for k, v, s in metrics.events if k == "checkpoint_saved"]
    assert saved == [(1, 1), (4, 3)]  # numbers 2 and 3 were refused, never reused
    assert announced(producer) == [(1, 0), (2, 1)] and ckpts.complete(d.store, "r") == [1, 4]


class GatedStore(LocalStore):
    """A local store whose weights files wait for ``gate``: an upload that takes as long as
    the test wants, so what happens meanwhile is seen by events, not by time."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_chunks(self, key: str, chunks: Any, **kw: Any) -> Any:
        if key.endswith(".safetensors"):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().put_chunks(key, chunks, **kw)


def test_the_upload_runs_while_the_next_step_trains_and_one_snapshot_at_a_time(
    tmp_path: Path,
) -> None:
    d, producer, metrics = durable(tmp_path)
    store = d.publisher.store = d.store = GatedStore(tmp_path / "gated")
    exports: list[float] = []
    real = d.engine.export
    d.engine.export = lambda dtype=None: (exports.append(float(d.engine.weight[0])), real(dtype))[1]  # type: ignore[method-assign]
    d.publish(step=1)  # returns with v1's files still waiting for the store
    assert store.entered.wait(30) and d.publisher.busy
    assert d.version == 1 and announced(producer) == [] and d.collect() is None
    d.engine.weight += 1.0  # the next step trains: the snapshot being uploaded does not change
    second = threading.Thread(target=d.publish, args=(2,))
    second.start()  # waits for v1's upload before it takes its snapshot
    second.join(0.5)
    assert second.is_alive() and exports == [0.0]
    store.gate.set()
    second.join(30)
    assert d.collect(wait=True) and exports == [0.0, 1.0]
    assert announced(producer) == [(1, 0), (2, 1)]
    v1 = fetch_tensors(
        store, load_manifest(store, decode_as(producer.sent[0][1], WeightsAnnouncement))
    )
    assert float(v1["w"][0]) == 0.0
    waited = [v["wait_s"] for k, v, _ in metrics.events if k == "weights_published"]
    assert len(waited) == 2 and waited[1] > 0.0


def test_an_upload_that_crashes_raises_on_the_trainers_thread(tmp_path: Path) -> None:
    d, _, _ = durable(tmp_path)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in the upload")

    d.publisher.store.put_chunks = broken  # type: ignore[method-assign]
    d.publish(step=1)
    with pytest.raises(RuntimeError, match="a bug in the upload"):
        d.collect(wait=True)
    assert not d.publisher.busy
