"""What the dispatcher asks of the ranker: predictions and long-tail buckets.

Owns the ranker side of ``srl-producer dispatch --predictor ranker``:

* :class:`RankerPredictor` implements the dispatcher's ``LengthPredictor`` protocol
  (``version``, ``predict(prompts)``) with the newest published ranker version, followed in
  the object store (``RankerFollower``); until a version exists it answers with its
  ``fallback`` predictor and ``version`` is ``None``, so tasks say no ranker predicted them.
* :func:`assign_buckets`: StreamRL's dispatch rule on one window of prompts: the top
  ``alpha`` by prediction go to the long-tail bucket (the long-tail pool's topic), the rest to
  the bucket of their prediction, never above the last regular bucket.
* :func:`length_quantiles`: the recent actual lengths a version carries
  (``info["length_quantiles"]``), Algorithm 2's history for ``srl ranker plan``.

Called by ``producers`` (the dispatcher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ranker.model import LengthRanker
from ranker.publish import RankerFollower
from ranker.schedule import split_longtail
from srl.store import ObjectStore

QUANTILES = 101  # length_quantiles: P0, P1, …, P100 of the recent actual lengths


class RankerPredictor:
    """The latest published ranker as a ``LengthPredictor`` (see the module doc)."""

    def __init__(
        self, store: ObjectStore, run: str, fallback: object, poll_s: float = 10.0
    ) -> None:
        self.follower = RankerFollower(store, run, poll_s)
        self.fallback = fallback

    @property
    def current(self) -> LengthRanker | None:
        return self.follower.poll()

    @property
    def version(self) -> int | None:
        r = self.current
        return r.version if r is not None else None

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        r = self.current
        if r is None:
            return np.asarray(self.fallback.predict(prompts))  # type: ignore[attr-defined]
        return np.rint(r.predict(prompts)).astype(np.int64)


def length_quantiles(lengths: np.ndarray) -> list[float]:
    """What a version carries of the lengths it was trained on (Algorithm 2's history)."""
    return [
        float(x)
        for x in np.quantile(np.asarray(lengths, dtype=np.float64), np.linspace(0, 1, QUANTILES))
    ]


def assign_buckets(
    predicted: Sequence[float] | np.ndarray,
    alpha: float,
    longtail_bucket: str,
    bucket_for: Callable[[int], str],
    regular_buckets: Sequence[str],
) -> list[str]:
    """Bucket of each prompt in a window: top ``alpha`` → ``longtail_bucket``; the rest by
    prediction, clamped to the last of ``regular_buckets`` (regular prompts never land on
    the long-tail pool's topic just because their prediction is large)."""
    pred = np.asarray(predicted, dtype=np.float64)
    lt = split_longtail(pred, alpha)
    allowed = set(regular_buckets)
    out = []
    for p, is_lt in zip(pred, lt, strict=True):
        if is_lt:
            out.append(longtail_bucket)
            continue
        b = bucket_for(int(p))
        out.append(b if b in allowed else regular_buckets[-1])
    return out
