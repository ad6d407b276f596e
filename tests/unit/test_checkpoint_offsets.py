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


def saved(
    store: LocalStore, n: int, model: torch.nn.Linear, opt: torch.optim.AdamW, **kw: object
) -> None:
    """Checkpoint ``n`` of ``model`` and ``opt`` as one rank of one writes it."""
    names = [name for name, _ in model.named_parameters()]
    tensors, meta = ckpts.engine_state(names, list(model.parameters()), opt.state_dict())
    entry = ckpts.write_shard(store, "r", n, 0, 1, tensors, meta)
    args: dict[str, object] = {"step": n, "version": n, "ledger": {}, "events": []} | kw
    ckpts.save(store, "r", n, shards=[entry], **args)  # type: ignore[arg-type]


def test_checkpoint_round_trips_model_optimizer_and_ledger(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    saved(
        store,
        1,
        model,
        opt,
        step=7,
        version=3,
        ledger={"t1": ["trained", 7]},
        events=[{"x": 1}],
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
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    names = [name for name, _ in model2.named_parameters()]
    state = ckpts.load_engine_state(c.shards, names, list(model2.parameters()))
    opt2.load_state_dict(state)
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)
        a, b = opt.state[p1], opt2.state[p2]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)


def test_rows_of_two_shards_make_the_whole_tensor(tmp_path: Path) -> None:
    """What a rank of another world size reads: its rows, from whichever shards hold them."""
    store = LocalStore(tmp_path)
    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    entries = [
        ckpts.write_shard(
            store, "r", 1, r, 2, {"model/w": rows}, {"layout": {"model/w": [5, start]}}
        )
        for r, (start, rows) in enumerate([(0, full[:3]), (3, full[3:])])
    ]
    ckpts.save(store, "r", 1, step=1, version=0, ledger={}, events=[], shards=entries)
    shards = ckpts.load(store, "r", 1).shards
    assert torch.equal(shards.rows("model/w", 0, 5, 5), full)
    assert torch.equal(shards.rows("model/w", 2, 4, 5), full[2:4])
    with pytest.raises(StoreError, match="rows saved"):
        shards.rows("model/w", 0, 4, 4)


def test_interrupted_checkpoints_are_ignored_then_pruned(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    for n in (1, 2, 3):
        saved(store, n, model, opt)
    store.put("checkpoints/r/c00000004/shard-00000-of-00001.safetensors", b"partial")  # killed
    assert ckpts.complete(store, "r") == [1, 2, 3] and ckpts.highest_number(store, "r") == 4
    saved(store, 5, model, opt)
    assert ckpts.prune(store, "r", keep=2) == [1, 2]
    assert ckpts.complete(store, "r") == [3, 5]
    assert not store.list("checkpoints/r/c00000004/") and not store.list("checkpoints/r/c00000001/")


def test_a_corrupted_checkpoint_file_refuses_to_load(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    model, opt = adam_state()
    saved(store, 1, model, opt, version=0)
    path = tmp_path / "checkpoints/r/c00000001/state.json"
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b'"step":1', b'"step":9'))
    with pytest.raises(StoreError, match="state.json fails its sha256"):
        ckpts.load(store, "r", 1)
    shard = tmp_path / "checkpoints/r/c00000001/shard-00000-of-00001.safetensors"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    path.write_bytes(path.read_bytes().replace(b'"step":9', b'"step":1'))
    shards = ckpts.load(store, "r", 1).shards
    with pytest.raises(StoreError, match="fails its sha256"):
        shards.rows("model/weight", 0, 2, 2)


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
