"""A straggler's migration (``producers.outlet.Outlet``) with a hand-written engine and a
producer whose delivery reports come only when the test says: decoding goes on while the
hand-off is under way, the order of ``ranker.migrate`` holds, and nothing waits for the broker
on the decode thread (issue 18: each migration used to flush the whole producer twice)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from producers.config import GenerateConfig
from producers.engines.base import Emitted
from producers.outlet import Outlet
from producers.tasks import SamplePlan, TaskState
from schemas.records import MIGRATED, PromptTask, TrajectoryChunk, decode, pack_tokens
from srl.errors import SrlError
from srl.metrics import Metrics
from srl.topics import Layout


class Engine:
    version, name = 3, "fake"

    def __init__(self) -> None:
        self.running: set[str] = set()

    def add(self, request: Any) -> None:
        self.running.add(request.key)

    def abort(self, key: str) -> None:
        self.running.discard(key)


class Producer:
    """Holds every record with its delivery callback until ``deliver``; ``flush`` is what the
    decode thread must not call."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.pending: list[tuple[Any, Any]] = []
        self.flushes = 0
        self.fatal = False  # librdkafka never declared this one failed for good

    def produce(self, topic: str, value: bytes, key: Any = None, **kw: Any) -> None:
        self.sent.append((topic, decode(value)))
        self.pending.append((kw.get("on_delivery"), kw))

    def deliver(self, error: Any = None) -> None:
        pending, self.pending = self.pending, []
        for cb, _ in pending:
            if cb is not None:
                cb(error, None)

    def flush(self, timeout_s: float | None = None) -> None:
        self.flushes += 1
        self.deliver()


@dataclass
class Counts:
    worker_id: str = "w"
    tokens: int = 0
    trajectories: int = 0
    chunks: int = 0
    handed_off: int = 0
    migrated: int = 0
    done: list[str] = field(default_factory=list)


def setup(*tids: str) -> tuple[Outlet, Engine, Producer, Counts, TaskState]:
    layout = Layout()
    cfg = GenerateConfig(
        engine="sim", chunk_tokens=4, migrate_to=layout.buckets[-1], migrate_min_tokens=8
    )
    engine, producer, counts = Engine(), Producer(), Counts()
    outlet = Outlet(cfg, layout, engine, counts, lambda st: counts.done.append(st.task.task_id))  # type: ignore[arg-type]
    outlet.open(producer, Metrics(producer, layout, "r", "w"))  # type: ignore[arg-type]
    task = PromptTask(
        task_id="t",
        prompt_id="p",
        prompt="",
        prompt_tokens=pack_tokens([1, 2]),
        group_size=len(tids),
        max_new_tokens=500,
        bucket=layout.buckets[0],
        predicted_length=4,
        created_ms=0,
    )
    plans = [SamplePlan(tid, i) for i, tid in enumerate(tids)]
    st = TaskState(task, ("p", 0), 0, [1, 2], None, list(plans), set(tids))
    while st.todo:
        outlet.start(st, st.todo.pop(0))
    return outlet, engine, producer, counts, st


def decode_steps(outlet: Outlet, tids: tuple[str, ...], n: int) -> None:
    for _ in range(n):
        outlet.publish([Emitted(t, [7], [-0.5]) for t in tids])


def chunks_of(producer: Producer, tid: str) -> list[TrajectoryChunk]:
    return [
        r for _, r in producer.sent if isinstance(r, TrajectoryChunk) and r.trajectory_id == tid
    ]


def test_a_migration_follows_delivery_reports_and_never_flushes() -> None:
    outlet, engine, producer, counts, st = setup("slow", "other")
    decode_steps(outlet, ("slow", "other"), 10)  # 10 tokens > 2 x 4 predicted, >= 8
    outlet.migrate()  # both are stragglers; "other" too: both start their hand-off
    assert engine.running == set() and set(outlet.moving) == {"slow", "other"}
    handoffs = [r for _, r in producer.sent if getattr(r, "finish_reason", None) == MIGRATED]
    assert len(handoffs) == 2
    assert not [r for _, r in producer.sent if isinstance(r, PromptTask)], "task before its ack"
    outlet.migrate()  # nothing acknowledged yet: nothing more is sent
    assert not [r for _, r in producer.sent if isinstance(r, PromptTask)]
    producer.deliver()  # the prefixes and hand-off chunks are on the broker
    outlet.migrate()
    tasks = [(topic, r) for topic, r in producer.sent if isinstance(r, PromptTask)]
    assert [t.resume.trajectory_id for _, t in tasks if t.resume] == ["slow", "other"]
    assert all(topic == Layout().resumes(Layout().buckets[-1]) for topic, _ in tasks)
    slow = chunks_of(producer, "slow")
    assert tasks[0][1].resume.next_seq == slow[-1].seq + 1  # type: ignore[union-attr]
    assert counts.migrated == 0 and "slow" in st.generating  # not done before the task's ack
    producer.deliver()
    outlet.migrate()
    assert counts.migrated == 2 and not st.generating and not outlet.moving
    assert st.finished and producer.flushes == 0


def test_decoding_goes_on_while_a_hand_off_waits_for_the_broker() -> None:
    outlet, _engine, producer, _counts, _st = setup("slow", "fast")
    decode_steps(outlet, ("slow",), 10)
    decode_steps(outlet, ("fast",), 2)
    outlet.migrate()  # "slow" hands off; "fast" (2 tokens) is no straggler and keeps decoding
    before = len(producer.sent)
    decode_steps(outlet, ("fast",), 8)
    outlet.publish([Emitted("fast", [7], [-0.5], "stop")])
    assert len(producer.sent) > before and producer.flushes == 0
    assert "fast" not in outlet.by_tid and "slow" in outlet.moving


def test_revocation_finishes_the_migrations_under_way_first() -> None:
    outlet, _engine, producer, counts, st = setup("slow")
    decode_steps(outlet, ("slow",), 10)
    outlet.migrate()
    outlet.hand_off([st])  # waits for the broker here: never a prefix without its task
    assert counts.migrated == 1 and not outlet.moving and counts.handed_off == 0
    kinds = [type(r).__name__ for _, r in producer.sent]
    assert kinds[-3:] == ["TrajectoryChunk", "PromptTask", "MetricEvent"]  # hand-off, task, event


def test_a_failed_hand_off_chunk_sends_no_resume_task_and_is_fatal() -> None:
    outlet, _engine, producer, counts, st = setup("slow")
    decode_steps(outlet, ("slow",), 10)
    outlet.migrate()
    producer.deliver(error=FailedDelivery())
    with pytest.raises(SrlError, match="delivery failed"):
        outlet.check()
    outlet.migrate()
    assert not [r for _, r in producer.sent if isinstance(r, PromptTask)]
    assert counts.migrated == 0 and not st.finished


class FailedDelivery:
    def str(self) -> str:
        return "broker gone"


def test_tokens_keep_the_version_that_sampled_them_when_published_after_a_swap() -> None:
    """An engine that says which version sampled its tokens (``Emitted.version``: vllm):
    tokens sampled before a swap but published after it keep that version, in a chunk of their
    own; tokens without one carry the engine's version."""
    outlet, engine, producer, _counts, _st = setup("a")
    outlet.publish([Emitted("a", [7, 7], [-0.5, -0.5], version=3)])
    engine.version = 4  # swapped (the open chunk holds the 2 tokens of version 3)
    outlet.publish([Emitted("a", [7], [-0.5], version=3)])  # sampled before the swap
    outlet.publish([Emitted("a", [7], [-0.5], "stop")])
    got = [(c.policy_version, c.n_tokens, c.is_last) for c in chunks_of(producer, "a")]
    assert got == [(3, 3, False), (4, 1, True)]
