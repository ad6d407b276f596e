"""The pipeline benchmark's time model and bound (srl/bench/pipemodel.py), by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ranker.schedule import PtlModel
from srl.bench import pipemodel as p

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


def test_colocated_uses_every_device_for_each_phase_in_turn() -> None:
    w = workload(devices=4)
    lengths = np.array([100.0, 300.0])
    split = p.best_split(w, "colocated", [lengths])
    assert (split["instances"], split["trainer_devices"]) == (4, 4)
    m = p.model_iteration(w, "colocated", lengths, 4, 4)
    assert m["gen_s"] == pytest.approx(300 * PTL(1) / 1000)  # one sample per instance
    assert m["iteration_s"] == pytest.approx(m["gen_s"] + 400 * w.train_s_per_token / 4)


def test_stream_trains_groups_as_they_complete_longest_first() -> None:
    w = workload(b_max=1)
    lengths = np.array([100.0, 300.0])
    m = p.model_iteration(w, "stream", lengths, instances=1, devices=1)
    # LPT on one slot: 300 first (done at 300·PTL(1)), then 100; each trains when complete
    t_long, t_short = 300 * PTL(1) / 1000, 400 * PTL(1) / 1000
    s = w.train_s_per_token
    expected = max(t_long + 300 * s, t_short) + 100 * s
    assert m["iteration_s"] == pytest.approx(expected)
    assert m["iteration_s"] < p.model_iteration(w, "sync", lengths, 1, 1)["iteration_s"]


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
    for mode in ("sync", "stream", "async", "async+skew"):
        split = p.best_split(w, mode, batches)
        means = {n: np.mean([p.model_iteration(w, mode, g, n, 4 - n)["iteration_s"] for g in batches])
                 for n in range(1, 4)}  # fmt: skip
        assert means[split["instances"]] == pytest.approx(min(means.values()))  # ties: either
        assert split["instances"] + split["trainer_devices"] == 4
        assert split["model_iteration_s"] == pytest.approx(min(means.values()), abs=0.01)


def steps() -> list[p.StepWork]:
    return [p.StepWork(1, [100, 50], 150), p.StepWork(2, [400, 100], 500),
            p.StepWork(3, [200, 200], 400), p.StepWork(4, [300], 300)]  # fmt: skip


def test_span_bound_of_the_barrier_modes_is_per_step_and_skips_the_first() -> None:
    w = workload(b_max=2)
    split = {"instances": 2, "trainer_devices": 1}
    s = w.train_s_per_token
    gen = {2: max(500 * PTL(2) / 4, 400 * PTL(1)), 3: max(400 * PTL(2) / 4, 200 * PTL(1)),
           4: max(300 * PTL(2) / 4, 300 * PTL(1))}  # fmt: skip
    train = {2: 500 * s, 3: 400 * s, 4: 300 * s}
    b = p.span_bound(w, "stream", split, steps())
    assert b["bound_s"] == pytest.approx(sum(max(gen[i] / 1000, train[i]) for i in (2, 3, 4)))
    b = p.span_bound(w, "colocated", {"instances": 3, "trainer_devices": 3}, steps())
    gen3 = {2: max(500 * PTL(2) / 6, 400 * PTL(1)), 3: max(400 * PTL(2) / 6, 200 * PTL(1)),
            4: max(300 * PTL(2) / 6, 300 * PTL(1))}  # fmt: skip
    assert b["bound_s"] == pytest.approx(sum(gen3[i] / 1000 + train[i] / 3 for i in (2, 3, 4)))


def test_span_bound_of_async_counts_decoded_tokens_and_the_longest_over_k_plus_1() -> None:
    w = workload(b_max=2, max_staleness=1)
    split = {"instances": 2, "trainer_devices": 1}
    s = w.train_s_per_token
    b = p.span_bound(w, "async", split, steps(), span_tokens=1000.0)
    assert b["train_s"] == pytest.approx(1200 * s)
    assert b["gen_s"] == pytest.approx(1000 * PTL(2) / 4 / 1000)
    # steps k+2.. = 3 and 4 were released inside the span: their longest over k + 1
    assert b["longest_s"] == pytest.approx((200 + 300) * PTL(1) / 1000 / 2)
    assert b["bound_s"] == pytest.approx(max(b["train_s"], b["gen_s"], b["longest_s"]))
    unpaced = p.span_bound(w, "async", split, steps(), span_tokens=1000.0, paced=False)
    assert unpaced["longest_s"] == 0.0
