"""The admission rule's three halves, against exact decisions: the dispatcher's release
(``producers.dispatcher.release_after``), the worker's start (``producers.admission``) and
the trainer's steps (``consumers.steps.StepPlanner``)."""

from __future__ import annotations

import pytest

from consumers.groups import Group
from consumers.steps import StepPlanner
from producers.admission import may_start, order_key
from producers.dispatcher import release_after
from schemas.records import PromptTask, ResumePrefix


@pytest.mark.parametrize(
    ("step", "k", "after"),
    [(1, 0, 0), (2, 0, 1), (1, 1, -1), (2, 1, 0), (3, 1, 1), (5, 2, 2)],
)
def test_step_t_is_released_by_the_announcement_of_step_t_minus_1_minus_k(
    step: int, k: int, after: int
) -> None:
    assert release_after(step, k) == after


def task(
    step: int | None = None,
    min_version: int | None = None,
    predicted: int | None = None,
    resume: bool = False,
) -> PromptTask:
    prefix = ResumePrefix("t", 0, 3, b"", 1, "migrate") if resume else None
    return PromptTask(
        "id",
        "p",
        "x",
        4,
        16,
        "le256",
        step=step,
        step_groups=None if step is None else 4,
        min_version=min_version,
        predicted_length=predicted,
        resume=prefix,
    )


@pytest.mark.parametrize(
    ("min_version", "loaded", "latest", "k", "ok"),
    [
        (None, 3, 3, 1, True),
        (None, 2, 3, 1, True),  # latest - k
        (None, 1, 3, 1, False),  # older than latest - k
        (3, 2, 3, 1, False),  # its step was released by v3: wait for it
        (3, 3, 3, 1, True),
        (3, 4, 4, 1, True),
        (5, 4, 4, 1, True),  # v5 is not available here (refused): latest is the floor
        (0, 0, 0, 0, True),
        (1, 0, 1, 0, False),  # k = 0: the barrier's next step needs the new weights
    ],
)
def test_a_fresh_task_starts_only_with_weights_its_step_allows(
    min_version: int | None, loaded: int, latest: int, k: int, ok: bool
) -> None:
    assert may_start(task(step=1, min_version=min_version), loaded, latest, k) is ok


def test_a_task_released_for_a_refused_version_waits_for_a_newer_one_then_takes_latest() -> None:
    released_for_v5 = task(step=6, min_version=5)  # v5 (after trainer step 4) refused here
    assert not may_start(released_for_v5, loaded=4, latest=4, k=1, waiting={5: 4})
    assert may_start(released_for_v5, loaded=4, latest=4, k=1, waiting={3: 2})  # wait is over
    assert may_start(released_for_v5, loaded=6, latest=6, k=1, waiting={5: 4})  # newer came
    assert may_start(task(step=5, min_version=4), loaded=4, latest=4, k=1, waiting={5: 4})


def test_a_task_of_the_trainers_next_step_does_not_wait_for_a_refused_version() -> None:
    """v5, announced after trainer step 4, refused: step 5's tasks released for it start on
    v4 at once (the trainer publishes nothing newer before training step 5); step 6's wait
    for the version step 5 brings. Before, step 5's waited too, the trainer waited for them,
    and after the 60 s wait the next step's samples were dropped as stale (the soak)."""
    assert may_start(task(step=5, min_version=5), loaded=4, latest=4, k=1, waiting={5: 4})
    assert not may_start(task(step=6, min_version=5), loaded=4, latest=4, k=1, waiting={5: 4})
    unscheduled = task(step=None, min_version=5)  # no step: waits, as before
    assert not may_start(unscheduled, loaded=4, latest=4, k=1, waiting={5: 4})


def test_a_resumed_trajectory_continues_with_weights_no_older_than_its_prefix() -> None:
    resumed = task(step=1, min_version=9, resume=True)  # its prefix's oldest version: 1
    assert may_start(resumed, loaded=1, latest=9, k=0)  # the task's own floors do not apply
    # a long-tail worker that has not loaded v1 yet waits: v0 tokens would make b = 0
    assert not may_start(resumed, loaded=0, latest=1, k=0)
    # unless v1 is refused here: the newest it can load is what it continues with
    assert may_start(resumed, loaded=0, latest=0, k=0)


def test_order_resumes_then_earliest_step_then_longest() -> None:
    tasks = {
        "s2-long": task(step=2, predicted=900),
        "s1-short": task(step=1, predicted=10),
        "s1-long": task(step=1, predicted=500),
        "resume": task(step=3, predicted=1, resume=True),
        "unscheduled": task(predicted=10_000),
    }
    order = sorted(tasks, key=lambda n: order_key(tasks[n]))
    assert order == ["resume", "s1-long", "s1-short", "s2-long", "unscheduled"]


def group(step: int | None, of: int | None = 3, prompt: str = "p") -> Group:
    return Group(prompt, 2, step=step, step_groups=of if step is not None else None)


def test_a_step_trains_exactly_the_groups_released_for_it() -> None:
    pl = StepPlanner(groups_per_step=2, expire_s=100, step=1)
    assert pl.add(group(2), now=0) == []  # step 2's group waits for step 2
    assert pl.add(group(1), now=1) and not pl.complete(now=1)
    assert pl.add(group(1), now=2) and not pl.complete(
        now=2
    )  # 2 of 3, although 2 = groups_per_step
    assert pl.add(group(1), now=3) and pl.complete(now=3)
    joined = pl.advance(now=4)
    assert [g.step for g in joined] == [2] and pl.step == 2 and pl.arrived == 1
    assert not pl.complete(now=4)


def test_unscheduled_groups_fill_the_open_step_at_groups_per_step() -> None:
    pl = StepPlanner(groups_per_step=2, expire_s=100)
    for _ in range(2):  # each counts once the gate credits it with a learning signal
        g = group(None)
        assert pl.add(g, now=0) and not pl.complete(now=0)
        pl.credit(g, signal=True)
    assert pl.complete(now=0)
    pl.advance(now=0)
    # once a group released for the open step is seen, the step waits for all of them
    pl.add(group(2, of=2), now=0)
    g = group(None)
    pl.add(g, now=0)
    pl.credit(g, signal=True)
    assert pl.size == 2 and not pl.complete(now=1)
    pl.add(group(2, of=2), now=1)
    assert pl.complete(now=1)


def test_a_late_group_joins_the_open_step_and_windows_off_ignores_steps() -> None:
    pl = StepPlanner(groups_per_step=3, expire_s=100, step=5)
    late = group(4)
    assert pl.add(late, now=0) and pl.others == 0
    pl.credit(late, signal=True)
    assert pl.others == 1
    off = StepPlanner(groups_per_step=1, expire_s=100, step=1, windows=False)
    g = group(7)
    assert off.add(g, now=0) and not off.complete(now=0)
    off.credit(g, signal=True)
    assert off.complete(now=0)


def test_a_step_whose_groups_stop_arriving_completes_by_expiry() -> None:
    pl = StepPlanner(groups_per_step=2, expire_s=10, step=1)
    pl.add(group(1, of=3), now=0)
    assert not pl.complete(now=9.9)
    assert pl.complete(now=10) and pl.missing == 2
    pl.advance(now=10)
    assert not pl.complete(now=100)  # nothing arrived and nothing waits: idle, not a step
    pl.advance(now=100)  # (the trainer took no step: a fresh open step for the example)
    pl.step = 2
    pl.add(group(3, of=1), now=105)  # a later step is waiting: step 2 was lost whole
    assert not pl.complete(now=109) and pl.complete(now=110) and pl.size == 0


def test_a_step_whose_long_tail_still_streams_is_waited_for() -> None:
    """A trajectory of the open step still receiving chunks (a 7B long tail generates for many
    minutes) keeps the step from expiring; one of another step does not."""
    pl = StepPlanner(groups_per_step=2, expire_s=10, step=1)
    pl.add(group(1, of=2), now=0)
    for t in range(1, 30):
        pl.alive({1, 2}, now=t)  # chunks of step 1's last group arrive every second
    assert not pl.complete(now=35)
    pl.alive({2, None}, now=36)  # only later or unscheduled ones: the step is idle again
    assert not pl.complete(now=38) and pl.complete(now=39) and pl.missing == 1


@pytest.mark.parametrize(
    ("group_size", "tasks", "parts"),
    [
        (8, 1, [None]),
        (8, 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (5, 2, [(0, 1), (2, 3, 4)]),
        (3, 9, [(0,), (1,), (2,)]),
    ],
)
def test_a_group_is_split_into_near_equal_runs_of_sample_indices(
    group_size: int, tasks: int, parts: list[tuple[int, ...] | None]
) -> None:
    from producers.dispatcher import split_group

    assert split_group(group_size, tasks) == parts
