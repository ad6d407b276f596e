"""The weight follower holds at most one fetched version besides what the engine holds
(issue 40: it held the untaken version, the one it was fetching and the one being loaded).

The follower's thread is driven by hand here (``_on_message`` for each announcement,
``_fetch_newest`` for each pass), on a local store with real published versions; every
fetched version is tracked by a weak reference to one of its tensors, so "held" is what
Python still keeps alive, not what the follower says it keeps."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import producers.follower as follower_module
from producers.follower import WeightFollower
from schemas.records import encode
from srl.config import CommonConfig
from srl.errors import WeightsError
from srl.store import LocalStore
from srl.topics import Layout
from srl.weights import publish


class NoKafka:
    """What the follower asks of its two readers, when nothing is read from Kafka."""

    def close(self) -> None:
        return None


class Announced:
    """A weights-topic record as ``_on_message`` reads it."""

    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset = value, offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b"r"

    def topic(self) -> str:
        return "t.weights"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None


class Copying:
    """An engine that keeps its own copy of what it loads (as hf and vllm do); ``during``
    runs inside ``load_weights`` (the follower's thread going on meanwhile)."""

    def __init__(self, during: Any = None, refuse: int | None = None) -> None:
        self.version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.during, self.refuse = during, refuse

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        if self.during is not None:
            self.during()
        if version == self.refuse:
            raise WeightsError(f"v{version} does not fit the model")
        self.weights = {k: v.clone() for k, v in tensors.items()}
        self.version = version


@dataclass
class Watched:
    """A follower on a local store whose every fetched version is watched."""

    follower: WeightFollower
    store: LocalStore
    fetched: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    held_at_fetch: list[int] = field(default_factory=list)  # alive() as each fetch began

    def alive(self) -> int:
        """Fetched versions still in memory (the engine's own copies are not counted)."""
        gc.collect()
        return sum(r() is not None for r in self.fetched)

    def announce(self, version: int) -> None:
        """Publish ``version`` to the store and hand its announcement to the follower."""
        pub = publish(
            self.store,
            "r",
            version,
            {"w": torch.full((256,), float(version))},
            trainer_step=version,
            parent_version=version - 1,
        )
        self.follower._on_message(Announced(encode(pub.announcement()), version - 1))


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Watched:
    monkeypatch.setattr(follower_module, "reader", lambda *_a, **_k: NoKafka())
    store = LocalStore(tmp_path / "store")
    cfg = CommonConfig(run="r", topic_prefix="t", store=store.url)
    w = Watched(WeightFollower(cfg, Layout.from_config(cfg), store), store)
    real = follower_module.fetch_tensors

    def tracked(*args: Any, **kw: Any) -> dict[str, torch.Tensor]:
        w.held_at_fetch.append(w.alive())
        out = real(*args, **kw)
        w.fetched.append(weakref.ref(out["w"]))
        return out

    monkeypatch.setattr(follower_module, "fetch_tensors", tracked)
    return w


def test_an_untaken_version_is_dropped_before_a_newer_one_is_fetched(setup: Watched) -> None:
    p = setup
    follower = p.follower
    p.announce(1)
    follower._fetch_newest()
    assert p.alive() == 1 and follower.held == 1
    p.announce(2)  # the worker has not taken v1 yet
    follower._fetch_newest()
    assert p.held_at_fetch == [0, 0]  # v1 was let go before v2 was fetched, not kept beside it
    assert p.alive() == 1 and follower.held == 1
    ready = follower.take()
    assert ready is not None and ready.version == 2


def test_nothing_is_fetched_while_the_worker_loads_and_the_copy_is_let_go_after(
    setup: Watched,
) -> None:
    p = setup
    follower = p.follower
    p.announce(1)
    follower._fetch_newest()

    def meanwhile() -> None:  # v2 announced while v1 is being loaded: not fetched beside it
        p.announce(2)
        follower._fetch_newest()
        assert p.alive() == 1 and follower.held == 1

    engine = Copying(during=meanwhile)
    swap = follower.swap_into(engine, lambda: None)
    assert swap is not None and swap.version == 1 and engine.version == 1
    assert p.alive() == 0 and follower.held == 0  # only the engine's own copy is left
    follower._fetch_newest()  # now v2
    assert p.held_at_fetch == [0, 0] and p.alive() == 1
    assert follower.swap_into(Copying(), lambda: None) is not None


def test_a_refused_version_is_let_go_and_the_next_is_fetched(setup: Watched) -> None:
    p = setup
    follower = p.follower
    p.announce(1)
    follower._fetch_newest()
    engine = Copying(refuse=1)
    assert follower.swap_into(engine, lambda: None) is None
    assert follower.refused.keys() == {1} and follower.held == 0 and p.alive() == 0
    p.announce(2)
    follower._fetch_newest()
    assert p.alive() == 1 and follower.held == 1
    swap = follower.swap_into(engine, lambda: None)
    assert swap is not None and swap.version == 2


def test_a_version_not_newer_than_the_engines_is_let_go(setup: Watched) -> None:
    p = setup
    follower = p.follower
    p.announce(1)
    follower._fetch_newest()
    engine = Copying()
    engine.version = 5  # loaded by other means (a restart on a newer model, say)
    assert follower.swap_into(engine, lambda: None) is None
    assert follower.held == 0 and p.alive() == 0
