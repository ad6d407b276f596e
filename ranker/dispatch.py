"""What the dispatcher asks of the ranker: predictions, long-tail buckets and the pool plan.

Owns the ranker side of ``srl-producer dispatch --predictor ranker``:

* :class:`RankerPredictor` implements the dispatcher's ``LengthPredictor`` protocol
  (``version``, ``predict(prompts)``) with the newest published ranker version, followed in
  the object store (``RankerFollower``); until a version exists it answers with its
  ``fallback`` predictor and ``version`` is ``None``, so tasks say no ranker predicted them.
* :func:`assign_buckets`: StreamRL's dispatch rule on one window of prompts: the top
  ``alpha`` by prediction go to the long-tail bucket (the long-tail pool's topic), the rest to
  the bucket of their prediction, never above the last regular bucket.
* :func:`window_plan`: Algorithm 2's instance split and batch caps for the window, from the
  recent actual lengths the ranker trainer publishes with each version
  (``info["length_quantiles"]``). Pools are sized when workers are launched, so the dispatcher
  reports the plan (a ``dispatch_plan`` metric) rather than enforcing it.

Called by ``producers`` (the dispatcher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ranker.model import LengthRanker
from ranker.publish import RankerFollower
from ranker.schedule import PoolPlan, PtlModel, history_lengths, plan_pools, split_longtail
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

    def history(self) -> np.ndarray | None:
        """Recent actual lengths (as quantiles) published with the current version."""
        r = self.current
        q = r.info.get("length_quantiles") if r is not None else None
        return np.asarray(q, dtype=np.float64) if q else None


def length_quantiles(lengths: np.ndarray) -> list[float]:
    """What a version carries of the lengths it was trained on (for Algorithm 2's history)."""
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


def window_plan(
    predicted: Sequence[float] | np.ndarray,
    history: np.ndarray | None,
    instances: int,
    b_max: int,
    alpha: float = 0.2,
    ptl: PtlModel | None = None,
) -> PoolPlan | None:
    """Algorithm 2 for one window; None without history (no version published yet)."""
    if history is None or len(history) == 0 or len(predicted) == 0:
        return None
    lt = int(split_longtail(predicted, alpha).sum())
    lengths = history_lengths(history, alpha)
    return plan_pools(lt, len(predicted) - lt, instances, lengths, ptl or PtlModel(), b_max)
