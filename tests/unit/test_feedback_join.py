"""The trainer's feedback join, pure: served trajectories and feedback meet in either order,
once; what waits is decided when its window passes (only while the trainer is caught up, and
always after ``expire_s``); the ledger tells late feedback from a duplicate."""

from __future__ import annotations

import numpy as np

from consumers.assembler import Trajectory
from consumers.feedback import FeedbackJoin, served
from consumers.outcomes import Ledger
from schemas.records import Feedback


def traj(tid: str, source: str = "serve") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        prompt_id="cmpl-1",
        task_id="cmpl-1",
        sample_index=0,
        group_size=1,
        bucket="le256",
        prompt_tokens=np.array([5], np.int32),
        tokens=np.array([6, 7], np.int32),
        logprobs=np.array([-1.0, -1.0], np.float32),
        versions=(0,),
        finish_reason="stop",
        metadata={"source": source},
        workers=("w",),
        started_ms=1,
        last_created_ms=2,
    )


def fb(tid: str, reward: float = 1.0) -> Feedback:
    return Feedback(tid, "cmpl-1", 0, reward, "w-serve")


def join(ledger: Ledger | None = None) -> FeedbackJoin:
    return FeedbackJoin(window_s=10, expire_s=100, ledger=Ledger() if ledger is None else ledger)


def test_served_is_the_seq0_source() -> None:
    assert served(traj("t")) and not served(traj("t", source="dispatch"))


def test_trajectory_first_then_its_feedback() -> None:
    j = join()
    assert j.trajectory(traj("a"), now=0) is None  # waits
    verdict, t = j.feedback(fb("a", 0.25), now=1)
    assert verdict == "joined" and t is not None and t.trajectory_id == "a"
    assert j.feedback(fb("a", 9.0), now=2) == ("duplicate", None)
    assert not j.trajectories and not j.early


def test_feedback_first_then_its_trajectory() -> None:
    j = join()
    assert j.feedback(fb("a", -0.5), now=0) == ("early", None)
    assert j.feedback(fb("a", 3.0), now=0.5) == ("duplicate", None)  # the first one counts
    assert j.trajectory(traj("a"), now=1) == -0.5
    assert j.feedback(fb("a"), now=2) == ("duplicate", None)


def test_the_window_passes_only_while_caught_up_and_always_at_expire_s() -> None:
    j = join()
    j.trajectory(traj("a"), now=0)
    j.feedback(fb("b"), now=0)
    assert j.expire(now=9, caught_up=True) == ([], [])
    assert j.expire(now=50, caught_up=False) == ([], [])  # catching up: the other may come
    trajs, fbs = j.expire(now=50, caught_up=True)
    assert [t.trajectory_id for t in trajs] == ["a"] and [f.trajectory_id for f in fbs] == ["b"]
    # feedback for a trajectory decided without it is late, not a new early record
    assert j.feedback(fb("a"), now=51) == ("late", None)
    j.trajectory(traj("c"), now=60)
    trajs, _ = j.expire(now=160, caught_up=False)
    assert [t.trajectory_id for t in trajs] == ["c"]


def test_the_ledger_tells_late_feedback_from_a_duplicate() -> None:
    ledger = Ledger({"gone": ["no_feedback", 3], "bad": ["invalid", 3], "done": ["trained", 2]})
    j = join(ledger)
    assert j.feedback(fb("gone"), now=0) == ("late", None)
    assert j.feedback(fb("bad"), now=0) == ("late", None)
    assert j.feedback(fb("done"), now=0) == ("duplicate", None)
    assert j.feedback(fb("new"), now=0) == ("early", None)


def test_joined_ids_are_forgotten_once_the_ledger_has_them() -> None:
    ledger = Ledger()
    j = join(ledger)
    j.trajectory(traj("a"), now=0)
    j.feedback(fb("a"), now=0)
    ledger.record("a", "trained", 1)
    j.expire(now=1, caught_up=True)
    assert not j.joined
    assert j.feedback(fb("a"), now=2) == ("duplicate", None)  # now from the ledger
