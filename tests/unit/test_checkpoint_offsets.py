"""Checkpoints (create-only, marker last, no pickle) and the offset commit rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from consumers import checkpoint as ckpts
from consumers.offsets import OffsetTracker
from srl.errors import StoreError
from srl.store import LocalStore


def adam_state() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_round_trips_model_optimizer_and_ledger(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    ckpts.save(
        store,
        "r",
        1,
        step=7,
        version=3,
        ledger={"t1": ["trained", 7]},
        events=[{"x": 1}],
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        extra={"lineage": 3},
    )
    assert not any(k.endswith(".pkl") or k.endswith(".pt") for k in store.list())
    c = ckpts.load(store, "r", 1)
    assert (c.step, c.version, c.ledger, c.events, c.extra) == (
        7,
        3,
        {"t1": ["trained", 7]},
        [{"x": 1}],
        {"lineage": 3},
    )
    assert all(torch.equal(c.model[k], v) for k, v in model.state_dict().items())
    model2, opt2 = adam_state()
    opt2.load_state_dict(c.optimizer)
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        a, b = opt.state[p1], opt2.state[p2]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)


def test_interrupted_checkpoints_are_ignored_then_pruned(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    kw = {"ledger": {}, "events": [], "model": model.state_dict(), "optimizer": opt.state_dict()}
    for n in (1, 2, 3):
        ckpts.save(store, "r", n, step=n, version=n, **kw)  # type: ignore[arg-type]
    store.put("checkpoints/r/c00000004/model.safetensors", b"partial")  # killed mid-write
    assert ckpts.complete(store, "r") == [1, 2, 3] and ckpts.highest_number(store, "r") == 4
    ckpts.save(store, "r", 5, step=5, version=5, **kw)  # type: ignore[arg-type]
    assert ckpts.prune(store, "r", keep=2) == [1, 2]
    assert ckpts.complete(store, "r") == [3, 5]
    assert not store.list("checkpoints/r/c00000004/") and not store.list("checkpoints/r/c00000001/")


def test_a_corrupted_checkpoint_file_refuses_to_load(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    ckpts.save(
        store,
        "r",
        1,
        step=1,
        version=0,
        ledger={},
        events=[],
        model=model.state_dict(),
        optimizer=opt.state_dict(),
    )
    path = tmp_path / "checkpoints/r/c00000001/state.json"
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b'"step":1', b'"step":9'))
    with pytest.raises(StoreError, match="state.json fails its sha256"):
        ckpts.load(store, "r", 1)


def test_offsets_commit_only_below_the_first_held_record() -> None:
    t = OffsetTracker()
    for off, holder in [(0, "a"), (1, "b"), (2, "a"), (3, None), (4, "c")]:
        t.seen("traj", 0, off, holder)
    t.seen("traj", 1, 10, "b")  # b spans two partitions (a resumed trajectory)
    assert t.committable() == {("traj", 0): 0, ("traj", 1): 10}
    t.mark_committed(t.committable())
    t.release({"a"})
    assert t.committable() == {("traj", 0): 1}  # b still holds offset 1
    t.release({"b", "c"})
    assert t.committable() == {("traj", 0): 5, ("traj", 1): 11}
    t.mark_committed(t.committable())
    assert t.committable() == {}
