"""Skewness-aware dispatch (StreamRL Algorithm 2) and longest-first balancing.

Owns the scheduling math, pure and deterministic, on the per-token latency model
:class:`srl.workload.PtlModel` (``PTL(BS) = a + b·BS`` ms, the one the sim engine paces
itself with):

* :func:`split_longtail`: the top ``alpha`` of prompts by predicted length are long-tail.
* :func:`history_lengths`: the typical lengths ``L`` of each class from recent actual lengths:
  regular = the ``q_regular`` quantile (default P50) of lengths below the history's
  ``1 − alpha`` quantile; long-tail = the ``q_longtail`` quantile (default P90) of the
  lengths above it.
* :func:`plan_pools`: split ``N`` generator instances between a long-tail pool and a regular
  pool by minimising the larger of the two pools' modelled latencies
  ``PTL(BS) × L × ceil(M / BS)`` (``M`` samples per instance, ``BS ≤ B_max`` chosen per pool,
  so the long-tail pool runs small batches at low per-token latency).
* :func:`balance`: spread a pool's prompts over its instances, longest first onto the instance
  with the least predicted work (greedy LPT), so no instance holds two tails; each
  instance's list comes out longest-predicted-first, the order it admits them in.

Must hold: every prompt lands in exactly one pool and one instance; the plan uses at least one
instance per pool that has prompts whenever ``N ≥ 2``. Called by ``ranker.dispatch``,
``ranker.simulate`` / ``ranker.simmigrate`` and ``srl ranker plan``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from srl.workload import PtlModel


def split_longtail(predicted: Sequence[float] | np.ndarray, alpha: float) -> np.ndarray:
    """Boolean mask of the top ``ceil(alpha·n)`` prompts by prediction (ties: earlier first)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    pred = np.asarray(predicted, dtype=np.float64)
    k = math.ceil(alpha * len(pred) - 1e-9)
    mask = np.zeros(len(pred), dtype=bool)
    mask[np.argsort(-pred, kind="stable")[:k]] = True
    return mask


@dataclass(frozen=True)
class ClassLengths:
    """Typical and tail lengths (tokens) of the regular and long-tail classes."""

    regular_typical: float
    regular_tail: float
    longtail_typical: float
    longtail_tail: float


def history_lengths(
    history: Sequence[float] | np.ndarray,
    alpha: float,
    q_typical: float = 0.5,
    q_tail: float = 0.9,
) -> ClassLengths:
    """Class lengths from recent actual lengths: the ``q_typical`` (P50) and ``q_tail`` (P90)
    quantiles of the lengths below and above the history's ``1 − alpha`` quantile."""
    h = np.sort(np.asarray(history, dtype=np.float64))
    if len(h) == 0:
        raise ValueError("history_lengths needs at least one past length")
    k = len(h) - math.ceil(alpha * len(h) - 1e-9)  # first long-tail index
    regular = h[:k] if k > 0 else h
    longtail = h[k:] if k < len(h) else h[-1:]
    return ClassLengths(
        float(np.quantile(regular, q_typical)),
        float(np.quantile(regular, q_tail)),
        float(np.quantile(longtail, q_typical)),
        float(np.quantile(longtail, q_tail)),
    )


def pool_latency(
    samples: int,
    instances: int,
    typical: float,
    tail: float,
    ptl: PtlModel,
    b_max: int,
    small_batch: bool = True,
) -> tuple[float, int]:
    """(modelled seconds, batch size) for ``samples`` spread over ``instances``.

    ``PTL(BS) × max(tail, typical × ceil(M / BS))``: ``ceil(M/BS)`` rounds of typical length,
    but never less than one tail sample, which longest-first ordering starts in round one
    (for a single-round pool this is StreamRL's ``PTL(BS) × L × ceil(M/BS)`` with L = tail).
    With ``small_batch`` (the long-tail pool) the best ``BS ≤ B_max`` is chosen; otherwise
    (regular and shared pools: large batch) ``BS = min(B_max, M)``.
    """
    if samples == 0:
        return 0.0, 0
    if instances <= 0:
        return math.inf, 0
    m = math.ceil(samples / instances)
    best = (math.inf, 1)
    for bs in range(1 if small_batch else min(b_max, m), min(b_max, m) + 1):
        t = ptl(bs) * max(tail, typical * math.ceil(m / bs)) / 1000.0
        if t < best[0]:
            best = (t, bs)
    return best


@dataclass(frozen=True)
class PoolPlan:
    """How many instances and what batch cap each pool gets, with the modelled latencies.

    ``longtail_instances == 0`` means no dedicated long-tail pool: every instance is regular
    and long-tail prompts are simply ordered first there.
    """

    longtail_instances: int
    longtail_batch: int
    regular_instances: int
    regular_batch: int
    longtail_model_s: float
    regular_model_s: float

    @property
    def model_s(self) -> float:
        return max(self.longtail_model_s, self.regular_model_s)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "longtail_instances": self.longtail_instances,
            "longtail_batch": self.longtail_batch,
            "regular_instances": self.regular_instances,
            "regular_batch": self.regular_batch,
            "longtail_model_s": self.longtail_model_s,
            "regular_model_s": self.regular_model_s,
        }


def plan_pools(
    n_longtail: int,
    n_regular: int,
    instances: int,
    lengths: ClassLengths,
    ptl: PtlModel,
    b_max: int,
    allow_shared: bool = True,
) -> PoolPlan:
    """StreamRL Algorithm 2: the instance split minimising the slower pool's modelled latency.

    Candidates are ``n`` long-tail instances for ``n = 1 … N−1`` and, with ``allow_shared``,
    ``n = 0`` (one shared pool, long-tail prompts first), which wins when every instance must
    run many rounds anyway. With one instance or an empty class there is nothing to split.
    """
    if instances < 1 or b_max < 1:
        raise ValueError("plan_pools needs at least one instance and b_max >= 1")
    total = n_longtail + n_regular
    candidates: list[PoolPlan] = []
    if allow_shared or instances == 1 or n_longtail == 0 or n_regular == 0:
        typical = (
            n_regular * lengths.regular_typical + n_longtail * lengths.longtail_typical
        ) / max(1, total)
        tail = lengths.longtail_tail if n_longtail else lengths.regular_tail
        t, bs = pool_latency(total, instances, typical, tail, ptl, b_max, small_batch=False)
        candidates.append(PoolPlan(0, 0, instances, bs, 0.0, t))
    if n_longtail and n_regular:
        for n_lt in range(1, instances):
            t_lt, bs_lt = pool_latency(
                n_longtail, n_lt, lengths.longtail_typical, lengths.longtail_tail, ptl, b_max
            )
            t_rg, bs_rg = pool_latency(
                n_regular,
                instances - n_lt,
                lengths.regular_typical,
                lengths.regular_tail,
                ptl,
                b_max,
                small_batch=False,
            )
            candidates.append(PoolPlan(n_lt, bs_lt, instances - n_lt, bs_rg, t_lt, t_rg))
    # strictly better only: ties keep the earlier candidate (shared pool, then fewer long-tail)
    best = candidates[0]
    for plan in candidates[1:]:
        if plan.model_s < best.model_s - 1e-9:
            best = plan
    return best


def balance(predicted: Sequence[float] | np.ndarray, bins: int) -> list[list[int]]:
    """Indices spread over ``bins`` instances, longest first onto the least-loaded one.

    Load is predicted tokens; ties go to the instance with fewer prompts, then the lower index.
    Each instance's list comes out longest-predicted-first (its LPT order).
    """
    if bins < 1:
        raise ValueError("balance needs at least one bin")
    pred = np.asarray(predicted, dtype=np.float64)
    heap = [(0.0, 0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in np.argsort(-pred, kind="stable"):
        load, count, b = heapq.heappop(heap)
        out[b].append(int(i))
        heapq.heappush(heap, (load + float(pred[i]), count + 1, b))
    return out
