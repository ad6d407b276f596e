"""Migration decisions and the hand-off task (pure)."""

from __future__ import annotations

from ranker.migrate import MigrationPolicy, migration_task
from schemas.records import PromptTask, decode_as, encode, unpack_tokens


def test_policy_thresholds() -> None:
    p = MigrationPolicy(factor=2.0, min_tokens=64)
    assert p.threshold(None) is None and p.threshold(0) is None
    assert p.threshold(10) == 64  # min_tokens wins for short predictions
    assert p.threshold(100) == 201
    assert not p.should_migrate(200, 100, remaining=50)
    assert p.should_migrate(201, 100, remaining=50)
    assert not p.should_migrate(500, 100, remaining=0)  # at max_new_tokens: nothing to move
    assert not p.should_migrate(10_000, None, remaining=50)
    assert not MigrationPolicy(enabled=False).should_migrate(10_000, 1, remaining=50)


def test_migration_task_resumes_the_same_trajectory_in_the_longtail_bucket() -> None:
    task = PromptTask(
        task_id="t1",
        prompt_id="p1",
        prompt="hi",
        group_size=4,
        max_new_tokens=512,
        bucket="le256",
        predicted_length=40,
        ranker_version=3,
        metadata='{"answer": "x"}',
        sample_indices=(0, 1, 2, 3),
    )
    m = migration_task(
        task,
        "traj-9",
        2,
        next_seq=5,
        completion_tokens=[7, 8, 9],
        min_version=1,
        longtail_bucket="gt4096",
        prompt_tokens=[1, 2],
    )
    again = decode_as(encode(m), PromptTask)  # it travels through the real codec
    assert again.bucket == "gt4096" and again.task_id != "t1" and again.prompt_id == "p1"
    assert again.resume is not None and again.resume.reason == "migrate"
    assert (again.resume.trajectory_id, again.resume.sample_index, again.resume.next_seq) == (
        "traj-9",
        2,
        5,
    )
    assert list(unpack_tokens(again.resume.tokens)) == [7, 8, 9]
    assert list(unpack_tokens(again.prompt_tokens or b"")) == [1, 2]
    assert again.samples() == (2,)  # exactly one sample: the migrated one
    assert again.predicted_length == 40 and again.metadata == task.metadata


def test_migrator_picks_each_straggler_once() -> None:
    from ranker.migrate import Migrator, Running

    m = Migrator(MigrationPolicy(factor=2.0, min_tokens=10), "gt4096")
    running = [
        Running("a", 50, 20, 100),
        Running("b", 30, 20, 100),
        Running("c", 100, 20, 100),
        Running("d", 500, None, 1000),
    ]
    assert m.stragglers(running) == ["a"]  # b is on time, c is done, d has no prediction
    assert m.stragglers(running) == [] and m.migrated == 1
    off = Migrator(MigrationPolicy(), "gt4096", enabled=False)  # a long-tail pool worker
    assert off.stragglers(running) == []
