"""The learned ranker: fitting, prediction, files, and versioned publication in the store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ranker.features import FeatureSpec, featurize
from ranker.metrics import recall_at, spearman
from ranker.model import CONFIG_FILE, MODEL_FILE, LengthRanker, RankerError, standardisation
from ranker.publish import RankerFollower, latest_version, load_version, publish, versions
from srl.store import LocalStore

SPEC = FeatureSpec(buckets=64)


def _prompts(n: int, seed: int) -> tuple[list[str], np.ndarray]:
    """Prompts whose answer length is set by what they ask and how many times."""
    rng = np.random.default_rng(seed)
    verbs = {"count to": 3.0, "repeat ab": 2.0, "spell": 1.0}
    texts, lengths = [], []
    for _ in range(n):
        verb = list(verbs)[rng.integers(len(verbs))]
        k = int(rng.integers(1, 200))
        texts.append(f"please {verb} {k}")
        lengths.append(verbs[verb] * k + rng.integers(0, 3))
    return texts, np.array(lengths, dtype=float)


@pytest.fixture(scope="module")
def fitted() -> LengthRanker:
    texts, lengths = _prompts(600, 0)
    return LengthRanker.fit(texts, lengths, spec=SPEC, hidden=(32,), epochs=40, seed=0)


def test_features_are_deterministic_and_see_numbers() -> None:
    a = featurize(["count to 12", "count to 12", "count to 900"], SPEC)
    assert a.shape == (3, SPEC.dim)
    assert np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], a[2])


def test_fitted_ranker_finds_the_long_ones(fitted: LengthRanker) -> None:
    texts, lengths = _prompts(300, 1)  # held out
    pred = fitted.predict(texts)
    assert pred.shape == (300,) and np.all(pred >= 1)
    assert spearman(lengths, pred) > 0.85
    assert recall_at(lengths, pred, 0.2) > 0.7


def test_files_roundtrip_and_validation(fitted: LengthRanker) -> None:
    files = fitted.to_files()
    again = LengthRanker.from_files(files, version=3)
    texts, _ = _prompts(50, 2)
    assert np.allclose(again.predict(texts), fitted.predict(texts))
    assert again.version == 3 and again.hidden == (32,)
    with pytest.raises(RankerError, match="unreadable"):
        LengthRanker.from_files({CONFIG_FILE: files[CONFIG_FILE]})
    with pytest.raises(RankerError, match="not a length-ranker"):
        LengthRanker.from_files({CONFIG_FILE: b"{}", MODEL_FILE: files[MODEL_FILE]})


def test_warm_start_keeps_shape_and_moves_toward_new_lengths(fitted: LengthRanker) -> None:
    texts, lengths = _prompts(300, 3)
    drifted = LengthRanker.fit(texts, lengths * 3, epochs=30, init=fitted.with_version(1))
    assert drifted.hidden == fitted.hidden and drifted.info["warm_start_from"] == 1
    assert np.median(drifted.predict(texts) / fitted.predict(texts)) > 2.0


def test_publish_versions_manifest_last(tmp_path: Path, fitted: LengthRanker) -> None:
    store = LocalStore(tmp_path)
    assert latest_version(store, "r") is None
    with pytest.raises(RankerError, match="no ranker published"):
        load_version(store, "r")
    v1 = publish(store, "r", fitted)
    v2 = publish(store, "r", fitted)
    assert (v1.version, v2.version) == (1, 2) and versions(store, "r") == [1, 2]
    # files without a manifest (a crash mid-publish) are not a version
    store.put("ranker/r/v00000003/model.safetensors", b"partial")
    assert latest_version(store, "r") == 2
    assert load_version(store, "r").version == 2
    # and the next publication skips the crashed number instead of colliding with it forever
    v4 = publish(store, "r", fitted)
    assert v4.version == 4 and versions(store, "r") == [1, 2, 4]
    # a rival that took the next number first (files only, no manifest yet): we move past it
    store.put("ranker/r/v00000005/config.json", b"{}")
    assert publish(store, "r", fitted).version == 6


def test_follower_moves_forward_and_refuses_corrupt_versions(
    tmp_path: Path, fitted: LengthRanker
) -> None:
    store = LocalStore(tmp_path)
    follower = RankerFollower(store, "r", every_s=3600)
    assert follower.poll(force=True) is None
    publish(store, "r", fitted)
    assert follower.poll() is None  # not due yet: polls are rate-limited
    got = follower.poll(force=True)
    assert got is not None and got.version == 1
    publish(store, "r", fitted)
    # corrupt version 2's model file behind the manifest's back
    (tmp_path / "ranker/r/v00000002/model.safetensors").write_bytes(b"x" * 10)
    got = follower.poll(force=True)
    assert got is not None and got.version == 1 and follower.refused == {2}


def test_publish_moves_on_when_a_rival_takes_the_number_mid_write(
    tmp_path: Path, fitted: LengthRanker
) -> None:
    class RacingStore(LocalStore):
        """A rival trainer writes v1's manifest between our listing and our first put."""

        raced = False

        def put(self, key: str, data: bytes | memoryview) -> str:
            if not self.raced and key.startswith("ranker/r/v00000001/"):
                self.raced = True
                super().put("ranker/r/v00000001/config.json", b"{}")
            return super().put(key, data)

    store = RacingStore(tmp_path)
    mine = publish(store, "r", fitted)
    assert mine.version == 2 and versions(store, "r") == [2]
    assert load_version(store, "r").version == 2


@pytest.mark.parametrize(
    "column, mu, sd",
    [
        ([0.0, 2.0, 4.0], 2.0, 1.632993),  # the population std
        ([3.0, 3.0, 3.0], 3.0, 1.0),  # constant in training: scale kept (an unseen n-gram)
        ([1.0, 1.001, 1.002], 1.001, 1e-2),  # nearly constant: scale at least 1e-2
        ([0.0, 0.0, 1e-7], 3.3e-8, 1.0),  # below 1e-6: treated as constant
    ],
)
def test_standardisation(column: list[float], mu: float, sd: float) -> None:
    got_mu, got_sd = standardisation(np.array(column, dtype=np.float32)[:, None])
    assert got_mu.tolist() == pytest.approx([mu], rel=1e-3, abs=1e-9)
    assert got_sd.dtype == np.float32 and got_sd.tolist() == pytest.approx([sd], rel=1e-5)
