"""Algorithm 2 (pool split) and longest-first balancing: pure functions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ranker.schedule import (
    ClassLengths,
    balance,
    history_lengths,
    plan_pools,
    pool_latency,
    split_longtail,
)
from srl.workload import PtlModel

PTL = PtlModel()


def test_split_longtail_takes_top_alpha_by_prediction() -> None:
    pred = np.array([5, 1, 9, 3, 7, 2, 8, 4, 6, 0], dtype=float)
    mask = split_longtail(pred, 0.2)
    assert mask.sum() == 2
    assert set(np.flatnonzero(mask)) == {2, 6}  # predictions 9 and 8
    assert split_longtail(pred, 0.0).sum() == 0
    assert split_longtail(pred, 1.0).all()
    # ceil: 21 % of 10 is 3 prompts
    assert split_longtail(pred, 0.21).sum() == 3


def test_history_lengths_quantiles_of_each_class() -> None:
    hist = np.arange(1, 101, dtype=float)  # 1..100; top 20 % are 81..100
    cl = history_lengths(hist, 0.2, q_typical=0.5, q_tail=0.9)
    assert cl.regular_typical == pytest.approx(np.quantile(np.arange(1, 81), 0.5))
    assert cl.regular_tail == pytest.approx(np.quantile(np.arange(1, 81), 0.9))
    assert cl.longtail_typical == pytest.approx(np.quantile(np.arange(81, 101), 0.5))
    assert cl.longtail_tail == pytest.approx(np.quantile(np.arange(81, 101), 0.9))


def test_pool_latency_by_hand() -> None:
    # 10 samples on 1 instance, b_max 4: BS=4 → 3 rounds; PTL(4)·max(tail, typ·3)
    t, bs = pool_latency(10, 1, typical=100, tail=150, ptl=PTL, b_max=4)
    candidates = {b: PTL(b) * max(150, 100 * math.ceil(10 / b)) / 1000 for b in range(1, 5)}
    assert bs == min(candidates, key=lambda b: candidates[b])
    assert t == pytest.approx(candidates[bs])
    # a regular pool runs its large batch: min(B_max, M)
    t_rg, bs_rg = pool_latency(10, 1, typical=100, tail=150, ptl=PTL, b_max=4, small_batch=False)
    assert bs_rg == 4 and t_rg == pytest.approx(candidates[4])
    assert pool_latency(0, 3, 1, 1, PTL, 4) == (0.0, 0)
    assert pool_latency(5, 0, 1, 1, PTL, 4)[0] == math.inf


def test_plan_single_instance_or_one_class_is_one_pool() -> None:
    cl = ClassLengths(1000, 3000, 8000, 15000)
    for n_lt, n_rg, inst in [(20, 80, 1), (0, 100, 4), (100, 0, 4)]:
        plan = plan_pools(n_lt, n_rg, inst, cl, PTL, 32)
        assert plan.longtail_instances == 0 and plan.regular_instances == inst


def _candidates(n_lt: int, n_rg: int, inst: int, cl: ClassLengths, ptl: PtlModel, b: int):
    typ = (n_rg * cl.regular_typical + n_lt * cl.longtail_typical) / (n_lt + n_rg)
    yield 0, pool_latency(n_lt + n_rg, inst, typ, cl.longtail_tail, ptl, b, small_batch=False)[0]
    for n in range(1, inst):
        t_lt = pool_latency(n_lt, n, cl.longtail_typical, cl.longtail_tail, ptl, b)[0]
        t_rg = pool_latency(
            n_rg, inst - n, cl.regular_typical, cl.regular_tail, ptl, b, small_batch=False
        )[0]
        yield n, max(t_lt, t_rg)


def test_plan_dedicates_small_batch_instances_when_batch_size_is_costly() -> None:
    # a steep PTL (1 + 1·BS ms) makes a small-batch long-tail pool pay off
    ptl = PtlModel(1.0, 1.0)
    cl = ClassLengths(500, 1000, 9000, 16000)
    plan = plan_pools(16, 496, 8, cl, ptl, 64)
    assert 1 <= plan.longtail_instances <= 7
    assert plan.longtail_instances + plan.regular_instances == 8
    assert plan.longtail_batch < plan.regular_batch
    assert plan.model_s == pytest.approx(min(t for _, t in _candidates(16, 496, 8, cl, ptl, 64)))


def test_plan_is_the_argmin_of_the_modelled_latency() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        inst, b = int(rng.integers(2, 12)), int(rng.integers(1, 80))
        n_lt, n_rg = int(rng.integers(1, 300)), int(rng.integers(1, 1200))
        rt = float(rng.uniform(100, 3000))
        cl = ClassLengths(rt, rt * 2, rt * rng.uniform(2, 8), rt * rng.uniform(8, 12))
        ptl = PtlModel(float(rng.uniform(0.5, 10)), float(rng.uniform(0.01, 1)))
        plan = plan_pools(n_lt, n_rg, inst, cl, ptl, b)
        best = min(t for _, t in _candidates(n_lt, n_rg, inst, cl, ptl, b))
        assert plan.model_s == pytest.approx(best)


def test_plan_keeps_one_shared_pool_when_every_instance_runs_many_rounds() -> None:
    cl = ClassLengths(2000, 4000, 9000, 16000)
    plan = plan_pools(410, 1638, 16, cl, PTL, 32)  # 2048 samples, 4 rounds per instance
    assert plan.longtail_instances == 0
    forced = plan_pools(410, 1638, 16, cl, PTL, 32, allow_shared=False)
    assert forced.longtail_instances >= 1 and forced.model_s > plan.model_s


def test_balance_partitions_and_orders_longest_first() -> None:
    rng = np.random.default_rng(3)
    pred = rng.lognormal(7, 1, 200)
    bins = balance(pred, 7)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(200))
    for b in bins:
        assert list(pred[b]) == sorted(pred[b], reverse=True)
    loads = [pred[b].sum() for b in bins]
    # greedy LPT: the spread of loads is at most the largest single prediction
    assert max(loads) - min(loads) <= pred.max() + 1e-9


def test_assign_buckets_and_length_quantiles() -> None:
    from ranker.dispatch import assign_buckets, length_quantiles

    def bucket_for(n: int) -> str:
        return (
            "le256" if n <= 256 else "le1024" if n <= 1024 else "le4096" if n <= 4096 else "gt4096"
        )

    pred = np.array([100, 5000, 300, 2000, 50, 8000, 900, 700, 10, 20], dtype=float)
    got = assign_buckets(pred, 0.2, "gt4096", bucket_for, ["le256", "le1024", "le4096"])
    assert got == [
        "le256",
        "gt4096",
        "le1024",
        "le4096",
        "le256",
        "gt4096",
        "le1024",
        "le1024",
        "le256",
        "le256",
    ]
    # a large prediction outside the top alpha stays on the regular pool's last bucket
    got = assign_buckets([9000, 8000, 1], 0.3, "gt4096", bucket_for, ["le256", "le4096"])
    assert got == ["gt4096", "le4096", "le256"]
    hist = np.array(length_quantiles(np.arange(1, 10_001)))
    assert len(hist) == 101 and hist[0] == 1 and hist[-1] == 10_000
