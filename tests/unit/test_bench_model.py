"""The pipeline benchmark's time model and bound (app/bench/pipemodel.py), by hand."""

from __future__ import annotations

import numpy as np
import pytest

from app.bench import pipemodel as p
from srl.workload import PtlModel

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
        means = {
            n: np.mean([p.model_iteration(w, mode, g, n, 4 - n)["iteration_s"] for g in batches])
            for n in range(1, 4)
        }
        assert means[split["instances"]] == pytest.approx(min(means.values()))  # ties: either
        assert split["instances"] + split["trainer_devices"] == 4
        assert split["model_iteration_s"] == pytest.approx(min(means.values()), abs=0.01)


def steps() -> list[p.StepWork]:
    return [
        p.StepWork(1, [100, 50], 150),
        p.StepWork(2, [400, 100], 500),
        p.StepWork(3, [200, 200], 400),
        p.StepWork(4, [300], 300),
    ]


def test_run_bound_of_the_barrier_modes_chains_each_step_after_the_previous() -> None:
    w = workload(b_max=2)
    split = {"instances": 2, "trainer_devices": 1}
    s = w.train_s_per_token

    def gen(tokens: int, longest: int, instances: int) -> float:
        return max(tokens * PTL(2) / (instances * 2), longest * PTL(1)) / 1000

    work = steps()
    g = [gen(sum(x.lengths), max(x.lengths), 2) for x in work]
    r = [x.trained_tokens * s for x in work]
    b = p.run_bound(w, "sync", split, work)
    assert b["bound_s"] == pytest.approx(sum(a + c for a, c in zip(g, r, strict=True)))
    stream = p.run_bound(w, "stream", split, work)
    assert stream["bound_s"] == pytest.approx(sum(max(a, c) for a, c in zip(g, r, strict=True)))
    colo = p.run_bound(w, "colocated", {"instances": 3, "trainer_devices": 3}, work)
    g3 = [gen(sum(x.lengths), max(x.lengths), 3) for x in work]
    assert colo["bound_s"] == pytest.approx(sum(a + c / 3 for a, c in zip(g3, r, strict=True)))


def test_run_bound_of_async_releases_step_j_at_the_end_of_step_j_minus_1_minus_k() -> None:
    w = workload(b_max=2, max_staleness=1)
    split = {"instances": 2, "trainer_devices": 1}
    s = w.train_s_per_token
    work = steps()
    G = [sum(x.lengths) * PTL(2) / 4 / 1000 for x in work]
    L = [max(x.lengths) * PTL(1) / 1000 for x in work]
    R = [x.trained_tokens * s for x in work]
    T: list[float] = []
    for j in range(4):  # by hand: T_j over the three constraints, T_i = 0 before the run
        at = [0.0, 0.0, *T]  # at[i + 2] = T_i for i = -1, 0, 1, …
        gen = max(at[m - 2 + 2 - 1] + sum(G[m - 1 : j + 1]) for m in range(1, j + 2))
        T.append(max(at[j + 1] + R[j], at[j - 1 + 1] + L[j], gen))
    b = p.run_bound(w, "async", split, work)
    assert b["steps_s"] == pytest.approx([round(t, 2) for t in T], abs=0.01)
    assert b["bound_s"] == pytest.approx(T[-1])
    # k = 1 allows more overlap than the barrier: never a higher bound than stream's
    assert b["bound_s"] <= p.run_bound(w, "stream", split, work)["bound_s"] + 1e-9
    unpaced = p.run_bound(w, "async", split, work, paced=False)
    assert unpaced["bound_s"] == pytest.approx(max(sum(R), sum(G)))


def test_run_bound_trains_a_group_only_after_its_longest_sample() -> None:
    """The streaming modes' step cannot end before its last group's longest sample is
    generated from the release and that group's tokens are then trained; the barrier modes
    already train everything after generating, so their bound does not change."""
    w = workload(b_max=2, max_staleness=1, params=7e11)  # training dominates: 100x the 7B's
    split = {"instances": 2, "trainer_devices": 2}
    s = w.train_s_per_token / 2
    # one step: two groups, the long one of 300 tokens, the short one of 100 (all trained)
    plain = [p.StepWork(1, [300, 300, 100], 700)]
    grouped = [p.StepWork(1, [300, 300, 100], 700, [(300, 600), (100, 100)])]
    for mode in ("stream", "async"):
        before = p.run_bound(w, mode, split, plain)["bound_s"]
        after = p.run_bound(w, mode, split, grouped)["bound_s"]
        assert before == pytest.approx(max(700 * s, 300 * PTL(1) / 1000, 700 * PTL(2) / 4000))
        assert after == pytest.approx(max(before, 300 * PTL(1) / 1000 + 600 * s))
        assert after > before  # the long group's 600 tokens train after its 300th token
    for mode in ("sync", "colocated"):
        assert p.run_bound(w, mode, split, grouped) == p.run_bound(w, mode, split, plain)
