"""The generator's pure decisions and its intake, without Kafka or an engine.

Tables of inputs and exact outputs for planning (``producers.planning``: targets, sample
plans, requests), recovery (what ``recovered`` makes of each state ``Found`` reports), the
pause decision (``producers.intake.pause_mode``, ``held``) and the backlog rule
(``producers.backlog``); then ``producers.intake.Intake`` against a hand-written fake
consumer: claiming records, commits in offset order, assignment and revocation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from producers.backlog import TrainerBacklog, backlog_exceeded
from producers.chunker import Chunker, TrajectoryStart
from producers.config import GenerateConfig
from producers.engines.base import Request
from producers.intake import Intake, held, pause_mode
from producers.planning import (
    BadTask,
    Recovered,
    check_versions,
    prefix_query,
    recovered,
    request_for,
    sample_plans,
    task_state,
    task_target,
    trajectory_start,
)
from producers.pool import Release, Take
from producers.recovery import Found, trajectory_id_for
from producers.tasks import SamplePlan, TaskState
from schemas.records import (
    MIGRATED,
    PromptTask,
    ResumePrefix,
    TrajectoryChunk,
    now_ms,
    pack_tokens,
)
from srl.kafka import KafkaError, KafkaException, TopicPartition


def task(**kw: Any) -> PromptTask:
    base: dict[str, Any] = dict(
        task_id="k",
        prompt_id="p",
        prompt="hi",
        group_size=3,
        max_new_tokens=8,
        bucket="le256",
        created_ms=10_000,
    )
    return PromptTask(**{**base, **kw})


def tid(s: int) -> str:
    return trajectory_id_for("k", s)


# -- planning -----------------------------------------------------------------------------------
TARGETS: list[tuple[dict[str, Any], int | None | str]] = [
    ({}, None),
    ({"metadata": '{"sim_length": 42}'}, 42),
    ({"metadata": '{"sim_length": 41.9}'}, 41),
    ({"metadata": '{"sim_length": "42"}'}, None),
    ({"metadata": '{"other": 1}'}, None),
    ({"metadata": ""}, None),
    ({"sample_indices": (2,)}, None),
    ({"metadata": "[1, 2]"}, "task k: metadata is not a JSON object"),
    ({"metadata": "{not json"}, "task k: metadata is not a JSON object"),
    ({"metadata": "null"}, "task k: metadata is not a JSON object"),
    ({"group_size": 0}, "task k: group of 0 (1..1024)"),
    ({"group_size": 2**31 - 1}, "task k: group of 2147483647 (1..1024)"),  # not 2G samples
    ({"sample_indices": (1, 3)}, "task k: sample indices (1, 3) outside group of 3"),
    ({"sample_indices": (-1,)}, "task k: sample indices (-1,) outside group of 3"),
    (
        {"resume": ResumePrefix("t", 5, 2, pack_tokens([1]), 0, "migrated")},
        "task k: sample indices (5,) outside group of 3",
    ),
    (
        {"resume": ResumePrefix("t", 1, -2, pack_tokens([1]), 0, "migrated")},
        "task k: resume at seq -2, policy version 0",
    ),
    (
        {"resume": ResumePrefix("t", 1, 2, pack_tokens([1]), -1, "migrated")},
        "task k: resume at seq 2, policy version -1",
    ),
    ({"min_version": -1}, "task k: min_version -1"),
]


@pytest.mark.parametrize(("fields", "expected"), TARGETS)
def test_task_target_reads_sim_length_and_refuses_bad_tasks(
    fields: dict[str, Any], expected: int | None | str
) -> None:
    if isinstance(expected, str):
        with pytest.raises(BadTask) as e:
            task_target(task(**fields))
        assert str(e.value) == expected
    else:
        assert task_target(task(**fields)) == expected


def test_a_task_stamped_with_a_version_never_published_is_refused() -> None:
    published = {0, 1, 2, 3}
    seen: list[tuple[int, int | None]] = []

    def exists(v: int, produced_ms: int | None) -> bool:
        seen.append((v, produced_ms))
        return v in published

    prefix = ResumePrefix("t", 1, 2, pack_tokens([1]), 3, "migrated")
    check_versions(task(min_version=3, resume=prefix), exists, 1)
    check_versions(task(), exists, 1)  # unstamped: nothing to check
    for bad in (task(min_version=9), task(min_version=2, resume=replace(prefix, min_version=7))):
        with pytest.raises(BadTask, match="policy version [97] was never published"):
            check_versions(bad, exists, bad.created_ms + 60_000)
        # judged by when it was released (produced), not planned: the store is listed again
        # unless the last listing is newer than that
        assert seen[-1][1] == bad.created_ms + 60_000


def test_a_task_planned_before_its_version_existed_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """srl chaos generator-partition (stop 26): a paced dispatcher planned step 7's task at
    22:04:18 and released it at 22:04:54 stamped v5, announced that second. The worker had
    listed the store at 22:04:50 (newest v4) and, judging by the task's ``created_ms``, did not
    list again: "policy version 5 was never published", 8 samples lost. Judged by when the
    record was produced, it lists again and finds v5."""
    from srl import weights

    store_newest = [4]
    versions = weights.KnownVersions(store=None)  # type: ignore[arg-type]
    listings = []

    def newest(_store: object) -> int:
        listings.append(store_newest[0])
        return store_newest[0]

    monkeypatch.setattr(weights, "newest_version", newest)
    assert versions.exists(4, now_ms())  # listed now: v4
    store_newest[0] = 5  # v5 written and announced; the task released for it
    planned = task(min_version=5, created_ms=now_ms() - 36_000)
    check_versions(planned, versions.exists, now_ms())
    assert listings == [4, 5]


PLANS: list[tuple[dict[str, Any], list[SamplePlan]]] = [
    ({}, [SamplePlan(tid(0), 0), SamplePlan(tid(1), 1), SamplePlan(tid(2), 2)]),
    ({"sample_indices": (1, 2)}, [SamplePlan(tid(1), 1), SamplePlan(tid(2), 2)]),
    ({"group_size": 1}, [SamplePlan(tid(0), 0)]),
    (
        {"resume": ResumePrefix("t", 2, 4, pack_tokens([7, 8, 9]), 1, "migrated")},
        [SamplePlan("t", 2, [7, 8, 9], 4)],
    ),
]


@pytest.mark.parametrize(("fields", "expected"), PLANS)
def test_sample_plans(fields: dict[str, Any], expected: list[SamplePlan]) -> None:
    assert sample_plans(task(**fields)) == expected


def test_task_state_counts_every_planned_trajectory_as_generating() -> None:
    st = task_state(task(sample_indices=(0, 2)), ("t.prompts.le256", 1), 7, [5, 6], 42)
    assert (st.tp, st.offset, st.prompt_ids, st.target_length) == (
        ("t.prompts.le256", 1),
        7,
        [5, 6],
        42,
    )
    assert st.todo == [SamplePlan(tid(0), 0), SamplePlan(tid(2), 2)]
    assert st.generating == {tid(0), tid(2)} and not st.finished


def test_a_plan_becomes_a_request_and_a_trajectory_start() -> None:
    t = task(
        temperature=0.5,
        top_p=0.9,
        predicted_length=30,
        metadata='{"a": 1}',
        step=4,
        step_groups=8,
    )
    st = TaskState(t, ("t.prompts.le256", 0), 3, [5, 6], 12)
    fresh, resumed = SamplePlan("a", 1), SamplePlan("b", 2, [9, 9], 2, started_ms=777)
    assert request_for(st, resumed) == Request("b", [5, 6], 8, 0.5, 0.9, [9, 9], 30.0, 12)
    assert trajectory_start(st, fresh, 555) == TrajectoryStart(
        "a", "p", "k", 1, 3, "le256", 30, 0, 0, pack_tokens([5, 6]), '{"a": 1}', 555, 4, 8
    )
    start = trajectory_start(st, resumed, 555)
    assert (start.next_seq, start.token_offset, start.started_ms) == (2, 2, 777)
    assert (start.pool, start.pool_epoch) == (None, None)  # outside pool epochs: unfenced
    st.writer = ("t.gen.regular", 5)  # taken in epoch 5: every chunk says so (srl.lineage)
    chunker = Chunker(1, "w")
    chunker.open(trajectory_start(st, resumed))
    chunks = chunker.add("b", [1, 2], [-0.1, -0.2], 0, "stop")
    assert [(c.pool, c.pool_epoch) for c in chunks] == [("t.gen.regular", 5)] * 2


# -- recovery -----------------------------------------------------------------------------------
def published(
    trajectory_id: str, runs: list[list[int]], end: str | None = None, first_seq: int = 0
) -> dict[int, TrajectoryChunk]:
    """What a previous owner published: one chunk per run of tokens from ``first_seq``; the
    last one ends the trajectory (``end="stop"``) or hands it off (``end=MIGRATED``)."""
    c = Chunker(100, "old")
    c.open(
        TrajectoryStart(trajectory_id, "p", "k", 0, 3, "le256", None, first_seq, 0, None, None, 500)
    )
    out: list[TrajectoryChunk] = []
    for i, run in enumerate(runs):
        last = i == len(runs) - 1
        if last and end == "stop":
            out += c.add(trajectory_id, run, [0.0] * len(run), 0, "stop")
        elif last and end == MIGRATED:
            c.add(trajectory_id, run, [0.0] * len(run), 0)
            out.append(c.hand_off(trajectory_id, 0))
        else:
            c.add(trajectory_id, run, [0.0] * len(run), 0)
            flushed = c.flush(trajectory_id)
            assert flushed is not None
            out.append(flushed)
    return {ch.seq: ch for ch in out}


def gap(trajectory_id: str) -> dict[int, TrajectoryChunk]:
    chunks = published(trajectory_id, [[1], [2], [3]])
    return {0: chunks[0], 2: chunks[2]}


ABC = [SamplePlan("a", 0), SamplePlan("b", 1), SamplePlan("c", 2)]
Todo = list[tuple[str, list[int], int, int | None]]  # trajectory id, prefix, next seq, started

RECOVERIES: list[
    tuple[str, list[SamplePlan], dict[str, dict[int, Any]], Todo, list[str], int, str | None]
] = [
    # case, plans, found chunks per trajectory, todo, skipped, resumed, gap
    (
        "nothing published",
        ABC,
        {},
        [("a", [], 0, None), ("b", [], 0, None), ("c", [], 0, None)],
        [],
        0,
        None,
    ),
    (
        "complete, prefix, none",
        ABC,
        {"a": published("a", [[1, 2], [3]], "stop"), "b": published("b", [[4, 5], [6]])},
        [("b", [4, 5, 6], 2, 500), ("c", [], 0, None)],
        ["a"],
        1,
        None,
    ),
    (
        "migrated: the long-tail pool continues it",
        ABC,
        {"a": published("a", [[1], [2]], MIGRATED), "c": published("c", [[7]], "stop")},
        [("b", [], 0, None)],
        ["a", "c"],
        0,
        None,
    ),
    (
        "a gap kills the task; what came before it stays counted",
        ABC,
        {"a": published("a", [[1]], "stop"), "b": gap("b"), "c": published("c", [[1]])},
        [],
        ["a"],
        0,
        "b",
    ),
    ("a prefix before a gap", ABC, {"a": published("a", [[1]]), "b": gap("b")}, [], [], 1, "b"),
    (
        "a resume plan continues after its own prefix",
        [SamplePlan("r", 1, [9, 9], 2, 100)],
        {"r": published("r", [[5], [6, 7]], first_seq=2)},
        [("r", [9, 9, 5, 6, 7], 4, 500)],
        [],
        1,
        None,
    ),
    (
        "a resume plan that another worker already finished",
        [SamplePlan("r", 1, [9, 9], 2, 100)],
        {"r": published("r", [[5]], "stop", first_seq=2)},
        [],
        ["r"],
        0,
        None,
    ),
]


@pytest.mark.parametrize(
    ("case", "plans", "chunks", "todo", "skipped", "resumed", "gap_at"),
    RECOVERIES,
    ids=[r[0] for r in RECOVERIES],
)
def test_recovery_decides_per_sample(
    case: str,
    plans: list[SamplePlan],
    chunks: dict[str, dict[int, TrajectoryChunk]],
    todo: Todo,
    skipped: list[str],
    resumed: int,
    gap_at: str | None,
) -> None:
    found = {p.trajectory_id: Found(dict(chunks.get(p.trajectory_id, {}))) for p in plans}
    before = [(p.trajectory_id, list(p.prefix), p.next_seq) for p in plans]
    r = recovered(plans, found)
    assert [(p.trajectory_id, p.prefix, p.next_seq, p.started_ms) for p in r.todo] == todo
    assert (r.skipped, r.resumed, r.gap) == (skipped, resumed, gap_at)
    assert [(p.trajectory_id, p.prefix, p.next_seq) for p in plans] == before  # not mutated


def test_recovered_of_no_plans_is_empty() -> None:
    assert recovered([], {}) == Recovered()


def test_prefix_query_reads_every_plan_from_the_oldest_task_minus_the_slack() -> None:
    a = TaskState(
        task(created_ms=9_000), ("t", 0), 1, todo=[SamplePlan("a", 0), SamplePlan("b", 1)]
    )
    r = TaskState(
        task(bucket="gt4096", created_ms=8_000), ("t", 1), 2, todo=[SamplePlan("r", 0, [1], 3)]
    )
    partition = {"le256": 0, "gt4096": 6}
    wanted, since = prefix_query([a, r], lambda b, _t: partition[b], 2.5)
    assert wanted == {"a": (0, 0), "b": (0, 0), "r": (6, 3)}
    assert since == 8_000 - 2_500


# -- the pause decision and the backlog rule ------------------------------------------------------
PAUSES = [
    # stopping, samples waiting, max_batch, backlog exceeded -> mode
    (False, 0, 4, False, "none"),
    (False, 3, 4, False, "none"),
    (False, 3, 4, True, "fresh"),
    (False, 0, 4, True, "fresh"),
    (False, 4, 4, False, "all"),
    (False, 5, 4, True, "all"),
    (True, 0, 4, False, "all"),
    (True, 0, 4, True, "all"),
]


@pytest.mark.parametrize(("stopping", "waiting", "max_batch", "exceeded", "mode"), PAUSES)
def test_pause_mode(
    stopping: bool, waiting: int, max_batch: int, exceeded: bool, mode: str
) -> None:
    assert pause_mode(stopping, waiting, max_batch, exceeded) == mode


HELD = [
    ("t.prompts.le256", "none", False),
    ("t.resume.le256", "none", False),
    ("t.prompts.le256", "fresh", True),
    ("t.resume.le256", "fresh", False),
    ("t.prompts.le256", "all", True),
    ("t.resume.le256", "all", True),
]


@pytest.mark.parametrize(("topic", "mode", "paused"), HELD)
def test_held(topic: str, mode: Any, paused: bool) -> None:
    assert held(topic, mode, "t.resume.") is paused


EXCEEDED = [
    # backlog, bound, trainer not moved for (s), stall_s -> over the bound
    (500, None, 0.0, 20.0, False),
    (None, 100, 0.0, 20.0, False),
    (100, 100, 0.0, 20.0, False),
    (101, 100, 0.0, 20.0, True),
    (101, 100, 19.9, 20.0, True),
    (101, 100, 20.0, 20.0, False),
    (5000, 100, 60.0, 20.0, False),
]


@pytest.mark.parametrize(("backlog", "bound", "stalled_s", "stall_s", "over"), EXCEEDED)
def test_backlog_exceeded(
    backlog: int | None, bound: int | None, stalled_s: float, stall_s: float, over: bool
) -> None:
    assert backlog_exceeded(backlog, bound, stalled_s, stall_s) is over


class FakeLag:
    """Readings of (lag, committed); ``gate``: each call waits until it is set."""

    def __init__(self, readings: list[Any], gate: threading.Event | None = None) -> None:
        self.readings, self.committed, self.calls = readings, 0, 0
        self.gate, self.inside, self.closed = gate, threading.Event(), False

    def lag(self) -> int:
        self.inside.set()
        if self.gate is not None:
            self.gate.wait()
        reading = self.readings[min(self.calls, len(self.readings) - 1)]
        self.calls += 1
        if isinstance(reading, BaseException):
            raise reading
        value, self.committed = reading
        return int(value)

    def close(self) -> None:
        self.closed = True


def test_trainer_backlog_keeps_the_last_measurement_and_times_the_trainers_stall() -> None:
    lag: Any = FakeLag([(150, 10), KafkaException(KafkaError(KafkaError._TRANSPORT)), (90, 10)])
    b = TrainerBacklog(100, stall_s=60.0)
    assert not b.exceeded() and b.value is None
    b.measure(lag)
    assert (b.value, b.exceeded()) == (150, True)
    b.measure(lag)  # the broker did not answer: the last number stands
    assert (b.value, b.measurements, b.exceeded()) == (150, 1, True)
    b.measure(lag)
    assert (b.value, b.exceeded()) == (90, False)
    stalled = TrainerBacklog(100, stall_s=0.0)
    stalled.measure(FakeLag([(150, 10)]))  # over the bound, but the trainer has not moved
    assert (stalled.value, stalled.exceeded()) == (150, False)
    unbounded = TrainerBacklog(None, stall_s=60.0)
    unbounded.measure(FakeLag([(150, 10)]))  # for the stats only
    assert (unbounded.value, unbounded.exceeded()) == (150, False)


def test_the_worker_never_waits_for_a_measurement_in_flight() -> None:
    """Issue 18: the lag of the trainer's groups is measured in the backlog's own thread; the
    worker's loop reads the last number even while a measurement hangs on the broker."""
    gate = threading.Event()
    lag = FakeLag([(150, 10), (40, 11)], gate)
    b = TrainerBacklog(100, stall_s=60.0, interval_s=0.01).start(lag)
    try:
        assert lag.inside.wait(10), "no measurement started"
        reader = threading.Thread(target=lambda: [b.exceeded() for _ in range(1000)])
        reader.start()
        reader.join(10)  # the loop's reads, while the measurement hangs
        assert not reader.is_alive() and b.value is None
        gate.set()
        deadline = time.monotonic() + 10
        while b.measurements < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.value == 40 and not b.exceeded()
        b.check()
    finally:
        gate.set()
        b.stop()
    assert lag.closed


def test_an_unexpected_failure_of_the_measuring_thread_reaches_the_worker() -> None:
    b = TrainerBacklog(100, stall_s=60.0, interval_s=0.01).start(FakeLag([ValueError("bug")]))
    b.stop()
    with pytest.raises(ValueError, match="bug"):
        b.check()


# -- the intake against a fake consumer -----------------------------------------------------------
P0, P1, R0 = ("t.prompts.le256", 0), ("t.prompts.le256", 1), ("t.resume.le256", 0)


class Msg:
    def __init__(self, tp: tuple[str, int], offset: int, code: int | None = None) -> None:
        self.tp, self._offset, self.code = tp, offset, code

    def error(self) -> KafkaError | None:
        return KafkaError(self.code) if self.code is not None else None

    def topic(self) -> str:
        return self.tp[0]

    def partition(self) -> int:
        return self.tp[1]

    def offset(self) -> int:
        return self._offset


class FakeConsumer:
    """Records what the intake asks of its consumer; serves ``batches`` and watermarks."""

    def __init__(self, high: int = 10) -> None:
        self.batches: list[list[Msg]] = []
        self.parts: list[TopicPartition] = []
        self.calls: list[tuple[str, Any]] = []
        self.high, self.fail_sync, self.polled = high, False, 0

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.topics, self.cb = topics, callbacks

    def assign_now(self, tps: list[tuple[str, int]]) -> None:
        self.parts = [TopicPartition(t, p) for t, p in tps]
        self.cb["on_assign"](self, list(self.parts))

    def assignment(self) -> list[TopicPartition]:
        return list(self.parts)

    def pause(self, parts: list[TopicPartition]) -> None:
        self.calls.append(("pause", sorted((tp.topic, tp.partition) for tp in parts)))

    def resume(self, parts: list[TopicPartition]) -> None:
        self.calls.append(("resume", sorted((tp.topic, tp.partition) for tp in parts)))

    def consume(self, num_messages: int, timeout: float) -> list[Msg]:
        self.calls.append(("consume", num_messages))
        return self.batches.pop(0) if self.batches else []

    def get_watermark_offsets(self, tp: TopicPartition, **_: Any) -> tuple[int, int]:
        return 0, self.high

    def commit_sync(self, offsets: list[TopicPartition]) -> None:
        if self.fail_sync:
            raise KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))
        self.calls.append(("sync", [(tp.topic, tp.partition, tp.offset) for tp in offsets]))

    def commit_async(self, offsets: list[TopicPartition]) -> None:
        self.calls.append(("async", [(tp.topic, tp.partition, tp.offset) for tp in offsets]))

    def poll(self, timeout: float) -> None:
        self.polled += 1

    def commits(self) -> list[tuple[str, Any]]:
        return [c for c in self.calls if c[0] in ("sync", "async")]


def make_intake(
    hand_off_ok: bool = True, **cfg: Any
) -> tuple[Intake, FakeConsumer, list[tuple[set[Any], list[int]]]]:
    handed: list[tuple[set[Any], list[int]]] = []

    def hand_off(tps: set[Any], states: list[TaskState]) -> bool:
        handed.append((tps, sorted(st.offset for st in states)))
        return hand_off_ok

    fake = FakeConsumer()
    config = GenerateConfig(
        engine="sim", topic_prefix="t", max_batch=4, **{"pool_liveness": False, **cfg}
    )
    intake = Intake(config, [P0[0], R0[0]], hand_off, lambda states: None)
    intake.join(fake)  # type: ignore[arg-type]
    return intake, fake, handed


def held_tasks(intake: Intake, tp: tuple[str, int], offsets: list[int]) -> list[TaskState]:
    states = [TaskState(task(), tp, off, generating={"x"}) for off in offsets]
    for st in states:
        intake.tracker.add(tp, st.offset)
        intake.hold(st)
    return states


def test_take_claims_new_records_only_and_asks_for_one_while_paused() -> None:
    intake, fake, _ = make_intake()
    assert fake.topics == ["t.prompts.le256", "t.resume.le256"]
    fake.batches = [
        [Msg(P0, 5), Msg(P0, 6), Msg(P0, 0, KafkaError._PARTITION_EOF), Msg(R0, 2)],
        [Msg(P0, 6), Msg(P0, 7)],  # the client rewound: 6 is already held here
    ]
    assert [(tp, off) for tp, off, _ in intake.take(0.0)] == [(P0, 5), (P0, 6), (R0, 2)]
    intake.pause("all")
    assert [(tp, off) for tp, off, _ in intake.take(0.0)] == [(P0, 7)]
    assert [c for c in fake.calls if c[0] == "consume"] == [("consume", 4), ("consume", 1)]


def test_commits_follow_finished_tasks_in_offset_order() -> None:
    intake, fake, _ = make_intake(commit_interval_s=1e-9)
    s5, s6, s7 = held_tasks(intake, P0, [5, 6, 7])
    for st in (s5, s6, s7):
        st.generating.clear()
    assert intake.finished(s6) and not intake.finished(s6)  # true once
    assert intake.commit() and intake.commit(force=True) and fake.commits() == []
    assert intake.finished(s5) and sorted(k[1] for k in intake.live) == [7]
    assert intake.commit(force=True)
    intake.dropped(P0, 7)  # dead-lettered: committable as well
    assert intake.commit() and not intake.live
    assert fake.commits() == [("sync", [(*P0, 7)]), ("async", [(*P0, 8)])]
    fake.fail_sync = True
    assert not intake.commit(force=True)
    assert not intake.commit_final(tries=2) and fake.polled == 2


def test_assignment_notes_high_watermarks_and_applies_the_pause_mode() -> None:
    intake, fake, _ = make_intake()
    intake.pause("fresh")  # nothing assigned yet: no calls
    fake.assign_now([P0, R0])
    assert intake.assigned_high == {P0: 10, R0: 10}
    assert fake.calls == [("pause", [P0])]
    started, new = TaskState(task(), P0, 9), TaskState(task(), P0, 10)
    assert intake.maybe_started(started) and not intake.maybe_started(new)
    assert not intake.maybe_started(TaskState(task(), P1, 0))
    intake.pause("fresh")
    intake.pause("all")
    intake.pause("none")
    assert fake.calls[1:] == [("pause", [P0, R0]), ("resume", [P0, R0])]


@pytest.mark.parametrize(
    ("callback", "hand_off_ok", "committed"),
    [("on_revoke", True, True), ("on_revoke", False, False), ("on_lost", True, False)],
)
def test_revocation_hands_off_then_commits_unless_lost(
    callback: str, hand_off_ok: bool, committed: bool
) -> None:
    intake, fake, handed = make_intake(hand_off_ok, commit_interval_s=1e-9)
    intake.guard.unsure_s = 0.0  # a finished task is committable at once (producers.ackguard)
    fake.assign_now([P0, P1])
    s3, _s4 = held_tasks(intake, P0, [3, 4])
    (t1,) = held_tasks(intake, P1, [1])
    s3.generating.clear()
    intake.finished(s3)
    intake.commit()  # sent, but possibly lost in the rebalance that follows
    fake.calls.clear()
    fake.cb[callback](fake, [TopicPartition(*P0)])
    assert handed == [({P0}, [4])]
    assert list(intake.live) == [(P1, 1)] and intake.assigned_high == {P1: 10}
    assert fake.commits() == ([("sync", [(*P0, 4)])] if committed else [])
    fake.assign_now([P0, P1])  # P0 comes back: a position not yet committed is kept for it
    t1.generating.clear()
    intake.finished(t1)
    fake.calls.clear()
    intake.commit(force=True)
    kept = [] if committed else [(*P0, 4)]
    assert fake.commits() == [("sync", [*kept, (*P1, 2)])]


# -- the intake following its pool's epochs (producers.pool) ------------------------------------
class FakePool:
    """Hands out ``orders`` one per tick; records what the intake reported back."""

    def __init__(self, orders: list[Release | Take | None]) -> None:
        self.orders, self.reports = orders, list[tuple[str, int]]()
        self.lease = True

    def tick(self) -> Release | Take | None:
        return self.orders.pop(0) if self.orders else None

    def holds(self) -> bool:
        return self.lease

    def released(self, order: Release) -> None:
        self.reports.append(("released", order.epoch))

    def taken(self, order: Take) -> None:
        self.reports.append(("taken", order.epoch))

    def close(self) -> None:
        self.reports.append(("closed", 0))


class AssignableConsumer(FakeConsumer):
    def assign(self, parts: list[TopicPartition]) -> None:
        self.parts = list(parts)
        self.calls.append(("assign", sorted((tp.topic, tp.partition) for tp in parts)))

    def unassign(self) -> None:
        self.parts = []
        self.calls.append(("unassign", None))

    def close(self) -> None:
        self.calls.append(("close", None))


def pool_intake(
    orders: list[Release | Take | None],
) -> tuple[Intake, AssignableConsumer, FakePool, list[Any]]:
    log: list[Any] = []

    def hand_off(tps: set[Any], states: list[TaskState]) -> bool:
        log.append(("handed", sorted(tps), sorted(st.offset for st in states)))
        return True

    def drop(states: list[TaskState]) -> None:
        log.append(("dropped", sorted(st.offset for st in states)))

    fake, pool = AssignableConsumer(), FakePool(orders)
    config = GenerateConfig(engine="sim", topic_prefix="t", max_batch=4, commit_interval_s=1e-9)
    intake = Intake(config, [P0[0], R0[0]], hand_off, drop).join(fake, pool)  # type: ignore[arg-type]
    return intake, fake, pool, log


def test_the_pool_assigns_and_nobody_subscribes() -> None:
    intake, fake, pool, _ = pool_intake([None, Take(1, (P0, R0))])
    assert not hasattr(fake, "topics")  # never a member of the broker's group
    intake.follow_pool()
    assert fake.calls == [] and pool.reports == []
    intake.pause("fresh")
    intake.follow_pool()
    assert fake.calls == [
        ("assign", [P0, R0]),
        ("resume", [P0, R0]),
        ("pause", [P0]),  # the pause mode holds for new partitions too
    ]
    assert intake.assigned_high == {P0: 10, R0: 10} and pool.reports == [("taken", 1)]
    intake.close()
    assert pool.reports[-1] == ("closed", 0)


def test_a_release_hands_off_and_commits_like_a_revocation() -> None:
    intake, fake, pool, log = pool_intake([Take(1, (P0,)), Release(2, fenced=False)])
    intake.follow_pool()
    s3, s4 = held_tasks(intake, P0, [3, 4])
    s3.generating.clear()
    intake.finished(s3)
    fake.calls.clear()
    intake.follow_pool()
    assert log == [("handed", [P0], [4])]
    assert fake.calls == [("sync", [(*P0, 4)]), ("unassign", None)]
    assert not intake.live and pool.reports == [("taken", 1), ("released", 2)]


def test_a_fenced_worker_drops_its_work_and_commits_nothing() -> None:
    intake, fake, pool, log = pool_intake([Take(1, (P0,)), Release(2, fenced=True)])
    intake.follow_pool()
    s3, _ = held_tasks(intake, P0, [3, 4])
    s3.generating.clear()
    intake.finished(s3)  # finished, not committed yet: the new owner redoes it (skips it)
    fake.calls.clear()
    intake.follow_pool()
    assert log == [("dropped", [4])]
    assert fake.calls == [("unassign", None)]  # no hand-off, no commit
    assert not intake.live and intake.tracker.positions() == {} and not intake.assigned_high
    assert pool.reports == [("taken", 1), ("released", 2)]


def test_no_commit_once_the_lease_ran_out_and_chunks_carry_the_epoch() -> None:
    intake, fake, pool, _ = pool_intake([Take(3, (P0,))])
    intake.follow_pool()
    (s5,) = held_tasks(intake, P0, [5])
    assert s5.writer == ("t.gen.regular", 3) and intake.writer == ("t.gen.regular", 3)
    s5.generating.clear()
    intake.finished(s5)
    pool.lease = False  # stopped past the session timeout: the pool may have gone on
    fake.calls.clear()
    assert not intake.commit(force=True) and fake.commits() == []
    pool.lease = True
    assert intake.commit(force=True) and fake.commits() == [("sync", [(*P0, 6)])]
