"""The simulated continuous-batching makespan model and the policy comparison (SIMULATED)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ranker.schedule import PoolPlan
from ranker.simulate import (
    SimSettings,
    compare,
    plan_counts,
    random_fifo,
    run_iteration,
    skew_aware,
)
from srl.workload import LengthHistogram, PtlModel, instance_makespan

PTL = PtlModel()
HIST = Path(__file__).parent / "data" / "streamrl_output_length_hist.csv"


def test_longest_first_beats_longest_last() -> None:
    lengths = np.array([1, 1, 1, 1, 1, 1, 10])
    fifo = instance_makespan(lengths, 2, PTL)
    lpt = instance_makespan(lengths[::-1].copy(), 2, PTL)
    assert lpt < fifo


def test_every_sample_runs_exactly_once_in_skew_aware() -> None:
    rng = np.random.default_rng(0)
    true = rng.integers(1, 100, 300)
    # makespan of a plan with everything on one instance equals that instance's makespan
    one = skew_aware(true, true.astype(float), true, 1, 8, PTL, plan=PoolPlan(0, 0, 1, 8, 0, 0))
    assert one.makespan_s == pytest.approx(instance_makespan(np.sort(true)[::-1], 8, PTL))
    fifo = random_fifo(true, 1, 8, PTL, rng).makespan_s
    # total decode work is conserved: no schedule beats tokens·PTL(cap)/cap on one instance
    assert min(one.makespan_s, fifo) >= true.sum() * PTL(8) / 8 / 1000 - 1e-9


def test_compare_in_the_multi_round_regime() -> None:
    h = LengthHistogram.from_file(HIST)
    rng = np.random.default_rng(2)
    true = h.sample(4000, rng)
    s = SimSettings(instances=4, b_max=16, batch=512, iterations=3, seed=1)
    assert s.rounds() == 8
    oracle = compare(true, true, s)
    reversed_pred = compare(true, -true.astype(float), s)
    assert oracle["simulated"] is True
    r_orac = oracle["ratio_vs_random_fifo"]["oracle_lpt"]["mean"]  # type: ignore[index]
    r_bad = reversed_pred["ratio_vs_random_fifo"]["ranker_lpt"]["mean"]  # type: ignore[index]
    lb = oracle["ratio_vs_random_fifo"]["lower_bound"]["mean"]  # type: ignore[index]
    assert lb <= r_orac < 0.9  # longest-first with true lengths clearly beats random + FIFO
    assert r_bad > 1.0  # a ranker that gets the order backwards is worse than random


def test_migration_off_reproduces_the_per_instance_model() -> None:
    from ranker.migrate import MigrationPolicy
    from ranker.simmigrate import skew_aware_migrating

    rng = np.random.default_rng(4)
    true = LengthHistogram.from_file(HIST).sample(400, rng)
    pred = true * np.exp(rng.normal(0, 0.4, 400))
    plan = PoolPlan(2, 16, 4, 32, 0, 0)
    ref = skew_aware(true, pred, true, 6, 32, PTL, plan=plan).makespan_s
    got, moved = skew_aware_migrating(true, pred, plan, 0.2, PTL, MigrationPolicy(enabled=False))
    assert moved == 0 and got == pytest.approx(ref, rel=1e-12)


def test_a_mispredicted_straggler_migrates_and_the_makespan_shrinks() -> None:
    from ranker.migrate import MigrationPolicy
    from ranker.simmigrate import skew_aware_migrating

    # one long sample predicted short shares the regular instance with 400 short ones; two
    # long-tail samples have an instance to themselves. A steep PTL makes batch size matter.
    ptl = PtlModel(1.0, 1.0)
    true = np.array([8000] + [100] * 400 + [1500] * 2)
    pred = np.array([100.0] + [100.0] * 400 + [1500.0] * 2)
    plan = PoolPlan(1, 8, 1, 8, 0, 0)
    alpha = 2 / 403
    off, n0 = skew_aware_migrating(true, pred, plan, alpha, ptl, MigrationPolicy(enabled=False))
    on, n1 = skew_aware_migrating(true, pred, plan, alpha, ptl, MigrationPolicy(factor=2.0))
    assert (n0, n1) == (0, 1)
    # the straggler left after 201 tokens at PTL(8) and finished on the long-tail instance
    assert on < 0.9 * off


@pytest.mark.parametrize(
    "plans, want",
    [
        ([], {}),
        ([PoolPlan(0, 0, 16, 32, 0, 1)], {"0x0+16x32": 1}),
        (
            [
                PoolPlan(4, 8, 12, 32, 1, 1),
                PoolPlan(0, 0, 16, 32, 0, 1),
                PoolPlan(4, 8, 12, 32, 2, 2),
            ],
            {"4x8+12x32": 2, "0x0+16x32": 1},
        ),
    ],
)
def test_plan_counts(plans: list[PoolPlan], want: dict[str, int]) -> None:
    got = plan_counts(list(plans))
    assert got == want and list(got) == list(want)  # first chosen first


def test_an_iteration_without_predictions_is_the_oracles() -> None:
    true = LengthHistogram.from_file(HIST).sample(256, np.random.default_rng(2))
    s = SimSettings(instances=4, b_max=8, batch=256)
    it = run_iteration(true, None, true, s, np.random.default_rng(0))
    assert it.ranker is it.oracle and it.migrate is None
    assert it.bound_s <= it.oracle.makespan_s <= it.fifo_s * 1.5
    with_pred = run_iteration(true, true.astype(float), true, s, np.random.default_rng(0))
    assert with_pred.fifo_s == it.fifo_s and with_pred.ranker.makespan_s == it.oracle.makespan_s
    assert with_pred.migrate is not None
