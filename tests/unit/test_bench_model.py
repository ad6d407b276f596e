"""The pipeline benchmark's time model (srl/bench/pipeline.py): iteration times by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ranker.schedule import PtlModel
from srl.bench import pipeline as p

PTL = PtlModel()


def workload(**kw: object) -> p.Workload:
    base = {"lengths": "unused.csv", "devices": 3, "b_max": 4, "group_size": 1}
    return p.Workload(**(base | kw))  # type: ignore[arg-type]


def test_sync_is_the_tail_included_makespan_plus_training() -> None:
    w = workload()
    lengths = np.array([100.0, 300.0])
    m = p.model_iteration(w, "sync", lengths, instances=1, devices=2)
    gen = (100 * PTL(2) + 200 * PTL(1)) / 1000  # both run together, then the long one alone
    train = 400 * w.train_s_per_token / 2
    assert m["gen_s"] == pytest.approx(gen)
    assert m["train_s"] == pytest.approx(train)
    assert m["iteration_s"] == pytest.approx(gen + train)


@pytest.mark.parametrize("mode", ["async", "async+skew"])
def test_async_generation_is_steady_state_but_no_faster_than_the_staleness_window(
    mode: str,
) -> None:
    w = workload()
    # many short groups: the steady-state throughput term binds
    short = np.full(40, 200.0)
    m = p.model_iteration(w, mode, short, instances=2, devices=1)
    steady = 40 * 200 * PTL(4) / (2 * 4) / 1000
    assert m["gen_s"] == pytest.approx(steady)
    assert m["iteration_s"] == pytest.approx(max(steady, m["train_s"]))
    # one very long group: it must finish within k + 1 = 2 iterations, so it sets the floor
    skewed = np.array([10.0, 10.0, 5000.0])
    m = p.model_iteration(w, mode, skewed, instances=2, devices=1)
    assert m["gen_s"] == pytest.approx(5000 * PTL(4) / 1000 / (1 + w.max_staleness))
    # and it is never slower than the barrier's makespan of the same step plus its training
    sync = p.model_iteration(w, "sync", skewed, instances=2, devices=1)
    assert m["iteration_s"] < sync["iteration_s"]


def test_best_split_minimises_the_mean_over_sampled_steps() -> None:
    w = workload(devices=4)
    batches = [np.array([100.0, 900.0, 50.0]), np.array([400.0, 400.0, 30.0])]
    for mode in p.MODES:
        split = p.best_split(w, mode, batches)
        means = {n: np.mean([p.model_iteration(w, mode, g, n, 4 - n)["iteration_s"] for g in batches])
                 for n in range(1, 4)}  # fmt: skip
        assert means[split["instances"]] == pytest.approx(min(means.values()))  # ties: either
        assert split["instances"] + split["trainer_devices"] == 4
        assert split["model_iteration_s"] == pytest.approx(min(means.values()), abs=0.01)
