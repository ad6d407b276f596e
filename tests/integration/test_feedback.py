"""The trainer's feedback join on the real broker: served trajectories take the application's
feedback as their reward, in either order; missing, late and unmatched feedback go to the DLQ
with the reason and a counter; duplicates are counted; ``--reward`` still scores served
trajectories without feedback when asked to."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from consumers.config import TrainConfig
from consumers.trainer import run_trainer
from producers.recovery import trajectory_id_for
from schemas.records import Feedback, TrajectoryChunk, encode
from srl.kafka import Producer, committed_offsets, create_topics, watermarks
from srl.topics import Layout
from tests.chunks import metric_events, produce, read_topic, text_ids, traj_chunks


def served(cid: str, n: int, texts: Sequence[str]) -> list[TrajectoryChunk]:
    """The chunks of a served completion of ``n`` choices, as srl serve publishes them."""
    meta = {"source": "serve", "completion_id": cid, "request": {"n": n}}
    out: list[TrajectoryChunk] = []
    for i, text in enumerate(texts):
        tid = trajectory_id_for(cid, i)
        out += traj_chunks(
            cid,
            i,
            n,
            text_ids("7+1="),
            text_ids(text),
            chunk_tokens=2,
            metadata=meta,
            trajectory_id=tid,
            logprobs=[-2.0] * len(text_ids(text)),
        )
    return out


def feedback(cfg: Any, *items: tuple[str, int, float]) -> None:
    """Feedback records ``(completion id, choice index, reward)``, as srl serve publishes them."""
    layout = Layout.from_config(cfg)
    with Producer(cfg, "test-feedback") as p:
        for cid, i, reward in items:
            rec = Feedback(trajectory_id_for(cid, i), cid, i, reward, "test-serve")
            p.produce(layout.feedback, encode(rec), key=rec.trajectory_id)


def cfg_for(make_cfg: Any, model: Path, **kw: Any) -> TrainConfig:
    base = {
        "model": str(model),
        "run": f"fb-{uuid.uuid4().hex[:6]}",
        # a reward function that fails on served metadata (no "answer"): a trained sample's
        # reward can only have come from its feedback
        "reward": "consumers.rewards:exact_match",
        "groups_per_step": 1,
        "lr": 1e-3,
        "micro_batch_tokens": 64,
        "idle_exit_s": 4.0,
        "max_staleness": 100,
        "device": "cpu",
        "feedback_window_s": 1.0,
        "expire_s": 60.0,
    }
    return make_cfg(TrainConfig, **{**base, **kw})


def dlq_reasons(cfg: Any) -> list[str]:
    msgs = read_topic(cfg, Layout.from_config(cfg).dlq)
    return [dict(m.headers())["srl.reason"].decode() for m in msgs]


def counters(cfg: Any) -> dict[str, float]:
    events = metric_events(cfg, "counter")
    return dict(events[-1].values) if events else {}


def rewards_by_trajectory(cfg: Any) -> dict[str, tuple[str, float | None]]:
    return {
        e.labels["trajectory_id"]: (e.labels["outcome"], e.values.get("reward"))
        for e in metric_events(cfg, "sample")
    }


def test_feedback_is_the_reward_in_either_order_and_what_is_missing_is_dead_lettered(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = cfg_for(make_cfg, tiny_model)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    a, b, c = (f"cmpl-{x * 32}" for x in "abc")
    feedback(cfg, (a, 0, 0.25))  # before its trajectory
    produce(cfg, served(a, 2, ["8\n", "9\n"]) + served(b, 2, ["8\n", "1\n"]))
    produce(cfg, served(c, 2, ["8\n", "0\n"]))
    unmatched = "cmpl-" + "d" * 32
    feedback(
        cfg, (a, 1, -1.0), (b, 0, 1.0), (c, 0, 0.5), (c, 1, 0.0), (c, 0, 7.0), (unmatched, 0, 1)
    )
    result = run_trainer(cfg)

    assert result.outcomes == {"trained": 4, "no_signal": 1, "no_feedback": 1}
    got = rewards_by_trajectory(cfg)
    expect = {
        (a, 0): ("trained", 0.25),
        (a, 1): ("trained", -1.0),
        (b, 0): ("no_signal", 1.0),  # the only rated choice of its group: advantage 0, not run
        (b, 1): ("no_feedback", None),
        (c, 0): ("trained", 0.5),  # the first feedback counts, the second is a duplicate
        (c, 1): ("trained", 0.0),
    }
    assert got == {trajectory_id_for(cid, i): v for (cid, i), v in expect.items()}
    reasons = dlq_reasons(cfg)
    assert len(reasons) == 2, reasons
    assert any(f"no feedback for served trajectory {trajectory_id_for(b, 1)}" in r for r in reasons)
    assert any(f"no served trajectory {trajectory_id_for(unmatched, 0)}" in r for r in reasons)
    n = counters(cfg)
    assert (n["samples_no_feedback"], n["feedback_unmatched"], n["feedback_duplicates"]) == (
        1,
        1,
        1,
    )
    assert n["dead_letters"] == 2 and "reward_failures" not in n
    # every feedback record was finished by a checkpoint: committed to the end
    marks = watermarks(cfg, [layout.feedback])
    assert committed_offsets(cfg, cfg.consumer_group, list(marks)) == {
        tp: hi for tp, (_, hi) in marks.items()
    }


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_late_feedback_goes_to_the_dlq(make_cfg: Any, tiny_model: Path) -> None:
    cfg = cfg_for(make_cfg, tiny_model, idle_exit_s=8.0)
    create_topics(cfg)
    cid = "cmpl-" + "e" * 32
    produce(cfg, served(cid, 1, ["8\n"]))

    def late() -> None:  # the application rates after the trainer gave up waiting
        wait_for(lambda: any("no feedback" in r for r in dlq_reasons(cfg)), "no feedback")
        feedback(cfg, (cid, 0, 1.0))

    app = threading.Thread(target=late, daemon=True)
    app.start()
    result = run_trainer(cfg)  # the main thread: the trainer installs signal handlers
    app.join(10)
    assert result.outcomes == {"no_feedback": 1}
    assert counters(cfg)["feedback_late"] == 1
    late_reasons = [r for r in dlq_reasons(cfg) if "late" in r]
    tid = trajectory_id_for(cid, 0)
    assert late_reasons == [f"late feedback: served trajectory {tid} already decided (no_feedback)"]


def reward_length(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """A ``--reward`` for served trajectories: the completion's length."""
    return float(len(completion.strip()))


def test_reward_function_scores_served_trajectories_without_feedback(
    make_cfg: Any, tiny_model: Path, prefix: str
) -> None:
    fn = "tests.integration.test_feedback:reward_length"
    for i, kw in enumerate(({"feedback_missing": "reward"}, {"feedback_window_s": 0.0})):
        cfg = cfg_for(make_cfg, tiny_model, reward=fn, topic_prefix=f"{prefix}-{i}", **kw)
        create_topics(cfg)
        cid = f"cmpl-{uuid.uuid4().hex}"
        produce(cfg, served(cid, 2, ["8\n", "123\n"]))
        if kw.get("feedback_missing"):
            feedback(cfg, (cid, 0, -3.0))  # choice 0 has feedback, choice 1 falls back
        assert run_trainer(cfg).outcomes == {"trained": 2}, kw
        got = rewards_by_trajectory(cfg)
        want0 = -3.0 if kw.get("feedback_missing") else 1.0
        assert got[trajectory_id_for(cid, 0)] == ("trained", want0), kw
        assert got[trajectory_id_for(cid, 1)] == ("trained", 3.0), kw
        assert not dlq_reasons(cfg)
