"""Reward processes: answers in submission order, a stuck or dying reward is a failed sample
(never a stall or a crash), a reward's prints do not corrupt the answers."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from consumers.rewardpool import RewardPool
from consumers.rewards import Scored, Scorer, load_reward
from srl.tinymodel import build_tokenizer

SPEC = "tests.rewardfns:by_metadata"


@dataclass
class Traj:
    """What a reward reads of a trajectory."""

    completion: str
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: np.ndarray = field(default_factory=lambda: np.array([], dtype=np.int64))

    @property
    def tokens(self) -> np.ndarray:
        return np.array(TOKENIZER.encode(self.completion), dtype=np.int64)


TOKENIZER = build_tokenizer()


def pool(workers: int = 2, timeout_s: float = 30.0) -> RewardPool:
    return RewardPool(SPEC, Scorer(load_reward(SPEC), TOKENIZER), workers, timeout_s)


def drain(p: RewardPool, n: int, timeout_s: float = 60.0) -> list[tuple[Any, Scored | None]]:
    out: list[tuple[Any, Scored | None]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += p.ready()
        time.sleep(0.01)
    assert len(out) == n, f"{len(out)} of {n} results"
    return out


def test_results_come_back_in_submission_order_whatever_finishes_first() -> None:
    p = pool(workers=2)
    try:
        p.submit("slow", Traj("aaaa", {"sleep": 1.0}))  # type: ignore[arg-type]
        p.submit("fast", Traj("bb"))  # type: ignore[arg-type]
        p.submit("nothing to score")  # keeps its place: a feedback sample, an invalid one
        p.submit("third", Traj("c", {"reward": 7}))  # type: ignore[arg-type]
        time.sleep(0.5)
        assert p.ready() == [] and p.pending == 4, "nothing passes the slow one"
        out = drain(p, 4)
        assert [item for item, _ in out] == ["slow", "fast", "nothing to score", "third"]
        assert [s.reward if s else None for _, s in out] == [4.0, 2.0, None, 7.0]
        assert p.pending == 0
    finally:
        p.close()


def test_a_reward_past_its_timeout_fails_its_sample_and_the_next_one_scores() -> None:
    p = pool(workers=1, timeout_s=2.0)
    try:
        t0 = time.monotonic()
        p.submit("stuck", Traj("x", {"sleep": 60}))  # type: ignore[arg-type]
        p.submit("next", Traj("yy"))  # type: ignore[arg-type]
        (_, stuck), (_, after) = drain(p, 2)
        assert stuck is not None and stuck.reward is None
        assert stuck.error is not None and "timed out after 2s" in stuck.error
        assert after == Scored(2.0)
        assert time.monotonic() - t0 < 20, "the stuck call was cut short"
        assert p.procs[0].started == 2, "the stuck process was replaced"
    finally:
        p.close()


def test_a_reward_that_kills_its_process_fails_its_sample_only() -> None:
    p = pool(workers=1)
    try:
        p.submit("dies", Traj("x", {"exit": 3}))  # type: ignore[arg-type]
        p.submit("after", Traj("abc"))  # type: ignore[arg-type]
        (_, died), (_, after) = drain(p, 2)
        assert died is not None and died.error == "reward process died (exit code 3)"
        assert after == Scored(3.0)
    finally:
        p.close()


def test_a_reward_that_prints_or_raises_does_not_corrupt_the_answers() -> None:
    p = pool(workers=1)
    try:
        p.submit("talks", Traj("ab", {"print": '{"reward": 99}'}))  # type: ignore[arg-type]
        p.submit("bad", Traj("ab", {"reward": "nan"}))  # type: ignore[arg-type]
        (_, talks), (_, bad) = drain(p, 2)
        assert talks == Scored(2.0)
        assert bad == Scored(None, "reward returned nan")
    finally:
        p.close()


def test_no_workers_scores_in_the_trainers_process_at_submit() -> None:
    p = pool(workers=0)
    p.submit("now", Traj("abc"))  # type: ignore[arg-type]
    assert p.ready() == [("now", Scored(3.0))]
    p.close()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_close_leaves_no_reward_process() -> None:
    p = pool(workers=2)
    p.submit("a", Traj("x", {"sleep": 30}))  # type: ignore[arg-type]
    p.submit("b", Traj("y"))  # type: ignore[arg-type]
    drain_until = time.monotonic() + 10
    while not all(r.proc for r in p.procs) and time.monotonic() < drain_until:
        time.sleep(0.01)
    pids = [r.proc.pid for r in p.procs if r.proc is not None]
    assert pids, "the processes started"
    p.close()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "killed and reaped"
