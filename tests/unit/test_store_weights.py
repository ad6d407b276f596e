"""Local object store (create-only, atomic) and the weights protocol on real safetensors files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from srl.errors import ConfigError, StoreError, WeightsError
from srl.store import LocalStore, ObjectExists, ObjectMissing
from srl.stores import open_store
from srl.weights import (
    Manifest,
    fetch_tensors,
    load_manifest,
    materialize,
    prune_versions,
    publish,
    shard_index,
    shard_names,
    version_prefix,
)


def test_local_store_is_create_only(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    uri = store.put("a/b.bin", b"one")
    assert uri == f"file://{tmp_path.resolve()}/a/b.bin"
    assert store.get("a/b.bin") == b"one" and store.exists("a/b.bin")
    with pytest.raises(ObjectExists):
        store.put("a/b.bin", b"two")
    assert store.get("a/b.bin") == b"one"
    assert store.list("a") == ["a/b.bin"]
    assert store.key_of(uri) == "a/b.bin"
    with pytest.raises(ObjectMissing):
        store.get("a/c.bin")
    for bad in ("", "/abs", "a/../b", "a//b"):
        with pytest.raises(StoreError):
            store.put(bad, b"x")
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(ConfigError, match="unsupported URL"):
        open_store("ftp://x")


def tiny_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8),
        "lm_head.weight": torch.randn(16, 8, dtype=torch.bfloat16),
    }


def test_publish_then_fetch_round_trips_and_writes_manifest_last(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    state = tiny_state()
    pub = publish(
        store,
        "run1",
        1,
        state,
        trainer_step=5,
        parent_version=0,
        extra_files={"config.json": b"{}"},
    )
    prefix = version_prefix("run1", 1)
    assert prefix == "weights/run1/v00000001"
    names = [f.name for f in pub.manifest.files]
    assert names == ["model.safetensors", "config.json"]
    # manifest.json is the newest file in the version directory (written last)
    files = sorted((tmp_path / prefix).iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert files[-1].name == "manifest.json"
    ann = pub.announcement()
    assert (
        ann.manifest_sha256
        == hashlib.sha256((tmp_path / prefix / "manifest.json").read_bytes()).hexdigest()
    )
    manifest = load_manifest(store, ann)
    assert manifest == pub.manifest and manifest.total_bytes == ann.total_bytes
    got = fetch_tensors(store, manifest)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    out = materialize(store, manifest, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").read_bytes() == b"{}"
    with pytest.raises(WeightsError, match="already published"):
        publish(store, "run1", 1, state, trainer_step=5, parent_version=0)


def test_sharded_publish_uses_the_hf_index(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    pub = publish(
        store, "r", 2, tiny_state(), trainer_step=1, parent_version=1, max_shard_bytes=600
    )
    names = [f.name for f in pub.manifest.files]
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert set(fetch_tensors(store, load_manifest(store, pub.announcement()))) == set(tiny_state())


def test_a_large_version_is_cut_into_one_shard_per_core_and_verified_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("srl.weights.io_workers", lambda: 3)
    monkeypatch.setattr("srl.weights.PARALLEL_MIN_BYTES", 16 * 1024**2)
    store = LocalStore(tmp_path)
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(6)}  # 24 MiB
    pub = publish(store, "r", 1, state, trainer_step=1, parent_version=0)
    shards = [f.name for f in pub.manifest.files if f.name.endswith(".safetensors")]
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for f in pub.manifest.files:  # each file's digest is of its own bytes, written in parallel
        path = tmp_path / version_prefix("r", 1) / f.name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == f.sha256
    manifest = load_manifest(store, pub.announcement())
    got = fetch_tensors(store, manifest)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    last = tmp_path / version_prefix("r", 1) / shards[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.chmod(0o644)
    last.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{shards[-1]} fails verification"):
        fetch_tensors(store, manifest)


def test_corrupted_file_or_manifest_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    pub = publish(store, "r", 1, tiny_state(), trainer_step=1, parent_version=0)
    weights = tmp_path / version_prefix("r", 1) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    manifest = load_manifest(store, pub.announcement())
    with pytest.raises(WeightsError, match="fails verification"):
        fetch_tensors(store, manifest)
    weights.unlink()
    with pytest.raises(WeightsError, match="not found"):
        fetch_tensors(store, manifest)
    bad_ann = pub.announcement().__class__(
        **{**pub.announcement().to_dict(), "manifest_sha256": "0" * 64}
    )
    with pytest.raises(WeightsError, match="sha256"):
        load_manifest(store, bad_ann)
    with pytest.raises(WeightsError, match="not a valid manifest"):
        Manifest.from_json(b"{}")


def test_publish_again_after_a_crash_before_the_manifest(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    prefix = version_prefix("r", 2)
    store.put(f"{prefix}/model.safetensors", b"half of an earlier attempt")
    store.put(f"{prefix}/config.json", b"{}")
    pub = publish(store, "r", 2, tiny_state(), trainer_step=2, parent_version=1)
    assert sorted(store.list(prefix)) == [f"{prefix}/manifest.json", f"{prefix}/model.safetensors"]
    got = fetch_tensors(store, load_manifest(store, pub.announcement()))
    assert all(torch.equal(got[k], v) for k, v in tiny_state().items())


def test_pruning_keeps_the_newest_versions_and_removes_the_others_whole(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    pubs = [
        publish(store, "r", v, tiny_state(), trainer_step=v, parent_version=v - 1)
        for v in range(1, 6)
    ]
    store.put(f"{version_prefix('other', 1)}/manifest.json", b"{}")  # another run's: untouched
    assert prune_versions(store, "r", 0) == []  # 0: keep every version
    assert prune_versions(store, "r", 2) == [1, 2, 3]
    assert [k.split("/")[2] for k in store.list("weights/r/")] == ["v00000004"] * 2 + [
        "v00000005"
    ] * 2
    assert store.list("weights/other/") == [f"{version_prefix('other', 1)}/manifest.json"]
    for pub in pubs[3:]:  # the kept ones still verify
        got = fetch_tensors(store, load_manifest(store, pub.announcement()))
        assert all(torch.equal(got[k], v) for k, v in tiny_state().items())
    assert prune_versions(store, "r", 2) == []


@pytest.mark.parametrize(
    "n, want",
    [
        (1, ["model.safetensors"]),
        (2, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
        (12, [f"model-{i:05d}-of-00012.safetensors" for i in range(1, 13)]),
    ],
)
def test_shard_names_are_the_hugging_face_layout(n: int, want: list[str]) -> None:
    assert shard_names(n) == want


def test_shard_index_maps_every_tensor_to_its_file() -> None:
    import orjson

    names = shard_names(2)
    got = orjson.loads(shard_index(names, [{"a": 0, "b": 0}, {"c": 0}], 96))
    assert got == {
        "metadata": {"total_size": 96},
        "weight_map": {"a": names[0], "b": names[0], "c": names[1]},
    }
