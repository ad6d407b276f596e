"""Learning from served traffic with little waste (issue 32, item 4): served samples have their
own staleness bound (``consumers.gate``), and an unscheduled group counts towards a step only
when it trains with a learning signal (``consumers.steps.StepPlanner.credit``)."""

from __future__ import annotations

import pytest

from consumers.assembler import Assembler, Trajectory
from consumers.config import TrainConfig
from consumers.gate import gate_group
from consumers.groups import Group, GroupBuffer, Sample
from consumers.steps import StepPlanner
from tests.chunks import traj_chunks


def traj(prompt_id: str, index: int, n: int, version: int, served: bool) -> Trajectory:
    meta = {"source": "serve"} if served else None
    chunks = traj_chunks(prompt_id, index, n, [1, 2], [3, 4], versions=version, metadata=meta)
    out = [Assembler(set()).add(c) for c in chunks][-1]
    assert out is not None
    return out


def group(rewards: list[float], version: int = 0, served: bool = True, prompt: str = "p") -> Group:
    buf, out = GroupBuffer(), None
    for i, r in enumerate(rewards):
        out = buf.add(Sample(traj(prompt, i, len(rewards), version, served), r))
    assert out is not None
    return out


def test_a_served_sample_is_judged_by_the_served_bound_dispatched_work_by_k() -> None:
    # at v = 10 a served group of v6 is four updates behind: over k = 1, within the served 8
    served = gate_group(group([1.0, 0.0], version=6), v=10, k=1, served_k=8)
    assert len(served.train) == 2 and served.stale == []
    dispatched = gate_group(group([1.0, 0.0], version=6, served=False), v=10, k=1, served_k=8)
    assert dispatched.train == [] and len(dispatched.stale) == 2
    # the served bound is a bound: nine behind is stale
    assert len(gate_group(group([1.0, 0.0], version=1), v=10, k=1, served_k=8).stale) == 2
    # without a served bound (None) served samples take k, as before
    assert len(gate_group(group([1.0, 0.0], version=6), v=10, k=1).stale) == 2
    # another lineage (k None): no bound for anything
    assert len(gate_group(group([1.0, 0.0], version=0), v=10, k=None, served_k=8).train) == 2


def test_the_served_bound_is_a_config_field_and_the_barrier_keeps_k() -> None:
    assert TrainConfig().served_staleness_bound == 8
    assert TrainConfig(serve_max_staleness=None).served_staleness_bound is None
    assert TrainConfig(sync_barrier=True, max_staleness=0).served_staleness_bound is None


@pytest.mark.parametrize(
    ("rewards", "signal"),
    [
        ([1.0], False),
        ([0.0, 0.0, 0.0], False),
        ([1.0, 1.0], False),
        ([0.1, 0.1, 0.1], False),  # the mean is not exactly 0.1: rounding is no signal
        ([1.0, 0.0], True),
    ],
)
def test_a_group_has_a_learning_signal_when_an_advantage_is_not_zero(
    rewards: list[float], signal: bool
) -> None:
    adm = gate_group(group(rewards), v=0, k=1)
    assert adm.trains and adm.signal is signal


def test_only_served_groups_that_train_with_a_signal_count_towards_a_step() -> None:
    pl = StepPlanner(groups_per_step=2, expire_s=100)
    for g, v in [
        (group([1.0]), 0),  # n = 1: zero advantage
        (group([0.0, 0.0], prompt="q"), 0),  # all rated alike
        (group([1.0, 0.0], version=0, prompt="r"), 5),  # dropped as stale
        (group([1.0, 0.0], prompt="s"), 0),  # a signal
    ]:
        assert pl.add(g, now=0) == [g]
        pl.credit(g, gate_group(g, v=v, k=1).signal)
    assert pl.size == 1 and not pl.complete(now=1)  # the old rule counted 4 and stepped
    g = group([0.0, 1.0], prompt="t")
    pl.add(g, now=2)
    pl.credit(g, gate_group(g, v=0, k=1).signal)
    assert pl.complete(now=2)


def test_dispatched_unscheduled_groups_count_whatever_they_train() -> None:
    pl = StepPlanner(groups_per_step=2, expire_s=100)
    for prompt in ("a", "b"):
        g = group([1.0, 1.0], served=False, prompt=prompt)
        pl.add(g, now=0)
        pl.credit(g, gate_group(g, v=0, k=1).signal)
    assert pl.complete(now=0)


def test_a_group_released_for_the_open_step_counts_whatever_it_trains() -> None:
    pl = StepPlanner(groups_per_step=8, expire_s=100, step=1)
    g = Group("p", 2, step=1, step_groups=1)
    pl.add(g, now=0)
    pl.credit(g, False)  # the dispatcher's window: its groups count by arrival, not credit
    assert pl.complete(now=0) and pl.others == 0


def test_a_served_group_without_signal_is_not_run_and_is_decided_no_signal() -> None:
    from consumers.outcomes import Ledger, Outcomes

    flat = gate_group(group([1.0, 1.0]), v=0, k=1, skip_flat=True)
    assert flat.train == [] and len(flat.flat) == 2 and not flat.trains and not flat.signal
    events = Outcomes(Ledger(), 100).gated(flat, step=1, version=0)
    assert [e["labels"]["outcome"] for e in events] == ["no_signal", "no_signal"]
    # dispatched work, a group with a signal, or a loss with a KL term: run as before
    assert len(gate_group(group([1.0, 1.0], served=False), v=0, k=1, skip_flat=True).train) == 2
    assert len(gate_group(group([1.0, 0.0]), v=0, k=1, skip_flat=True).train) == 2
    assert len(gate_group(group([1.0, 1.0]), v=0, k=1).train) == 2


def test_a_served_request_nobody_rated_does_not_count_towards_a_step() -> None:
    # an n = 1 request without feedback: its only slot is filled by the feedback join
    unrated = GroupBuffer().add_missing("p", 0, 1, "t", served=True)
    assert unrated is not None and unrated.served and unrated.scored() == []
    pl = StepPlanner(groups_per_step=1, expire_s=100)
    pl.add(unrated, now=0)
    pl.credit(unrated, gate_group(unrated, v=0, k=1).signal)
    assert not pl.complete(now=0)
    lost = GroupBuffer().add_missing("d", 0, 1, "t")  # dispatched work: counts as before
    assert lost is not None and not lost.served
    pl.add(lost, now=0)
    pl.credit(lost, False)
    assert pl.complete(now=0)
