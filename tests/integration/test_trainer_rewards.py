"""Rewards off the trainer's consume loop (``consumers.rewardpool``), against the session broker:
the trainer reads on while a reward runs, and a reward past its timeout fails its sample."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from consumers.trainer import run_trainer
from schemas.records import TrajectoryChunk
from srl.kafka import committed_offsets, create_topics, position_group, watermarks
from srl.topics import Layout
from tests.chunks import group_chunks, metric_events, produce, text_ids
from tests.integration.test_trainer import make_groups, train_cfg
from tests.unit.test_sandbox import WHY

REWARD = "tests.rewardfns:by_metadata"


def with_metadata(chunks: list[TrajectoryChunk], sample: int, meta: str) -> list[TrajectoryChunk]:
    """``chunks`` with sample ``sample`` of the first group carrying ``meta``."""
    first = next(c for c in chunks if c.sample_index == sample and c.seq == 0)
    return [
        c if c is not first else c.__class__(**{**c.to_dict(), "metadata": meta}) for c in chunks
    ]


def test_the_trainer_reads_on_while_a_reward_runs(
    make_cfg: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """One sample's reward waits for a file; meanwhile the trainer's shared read position
    (its loop's ``share_positions``, once a second) reaches the end of the topic, so its
    consume loop polled on. With the reward in the loop (before) it stood still."""
    flag = tmp_path / "go"
    cfg = train_cfg(make_cfg, tiny_model, max_steps=2, reward=REWARD, idle_exit_s=30.0)
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    chunks = with_metadata(make_groups(4), 1, f'{{"wait_for": "{flag}"}}')
    produce(cfg, chunks)
    marks = watermarks(cfg, [layout.trajectories])
    parts = [tp for tp, (_, hi) in marks.items() if hi > 0]
    seen: dict[str, Any] = {}

    def release_when_read() -> None:  # the trainer runs in the main thread (signals)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            read = committed_offsets(cfg, position_group(cfg.consumer_group), parts)
            seen["read"] = read
            if all(read.get(tp, -1) == marks[tp][1] for tp in parts):
                seen["all read while the reward ran"] = True
                break
            time.sleep(0.2)
        flag.touch()

    watcher = threading.Thread(target=release_when_read, daemon=True)
    watcher.start()
    result = run_trainer(cfg)
    watcher.join(timeout=60)
    assert seen.get("all read while the reward ran"), f"read {seen.get('read')} of {marks}"
    assert (result.steps, result.version) == (2, 2)
    assert result.outcomes == {"trained": 16}


def test_a_reward_past_its_timeout_fails_its_sample_and_the_group_trains(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_steps=1,
        groups_per_step=1,
        reward=REWARD,
        reward_timeout_s=3.0,
    )
    create_topics(cfg)
    produce(cfg, with_metadata(make_groups(1), 2, '{"sleep": 120}'))
    t0 = time.monotonic()
    result = run_trainer(cfg)
    assert time.monotonic() - t0 < 60
    assert result.outcomes == {"trained": 3, "failed_reward": 1}
    failed = [e for e in metric_events(cfg, "sample") if e.labels["outcome"] == "failed_reward"]
    assert len(failed) == 1 and "timed out after 3s" in failed[0].labels["reason"]
    counters = metric_events(cfg, "counter")[-1].values
    assert counters["reward_failures"] == 1 and counters["reward_timeouts"] == 1


def with_metadatas(chunks: list[TrajectoryChunk], metas: dict[int, str]) -> list[TrajectoryChunk]:
    for sample, meta in metas.items():
        chunks = with_metadata(chunks, sample, meta)
    return chunks


def test_rewards_that_hang_raise_or_segfault_are_counted_and_the_trainer_steps_on(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = train_cfg(
        make_cfg, tiny_model, max_steps=2, groups_per_step=1, reward=REWARD, reward_timeout_s=3.0
    )
    create_topics(cfg)
    bad = {0: '{"sleep": 600}', 1: '{"reward": "x"}', 2: '{"segfault": true}'}
    produce(cfg, with_metadatas(make_groups(2), bad))
    result = run_trainer(cfg)
    assert result.steps == 2 and result.outcomes["failed_reward"] == 3, result.outcomes
    reasons = sorted(
        e.labels["reason"]
        for e in metric_events(cfg, "sample")
        if e.labels["outcome"] == "failed_reward"
    )
    assert "timed out after 3s" in reasons[2] and "ValueError" in reasons[0], reasons
    assert reasons[1] == "reward process died (exit code -11)", reasons


@pytest.mark.skipif(WHY is not None, reason=f"no sandbox here: {WHY}")
def test_the_code_reward_scores_model_programs_in_the_sandbox_and_training_goes_on(
    make_cfg: Any, tiny_model: Path
) -> None:
    """A fork bomb, an infinite loop, a right and a wrong program, one group."""
    cfg = train_cfg(
        make_cfg, tiny_model, max_steps=1, groups_per_step=1, reward="consumers.rewards:code_tests"
    )
    create_topics(cfg)
    programs = [
        "import os\nwhile True:\n    os.fork()\n",
        "while True:\n    pass\n",
        "def f(x):\n    return 2 * x\n",
        "def f(x):\n    return x\n",
    ]
    meta = {"tests": ["assert f(2) == 4", "assert f(0) == 0"], "time_limit_s": 3}
    trajs = group_chunks(
        "p0", [text_ids(p) for p in programs], prompt=text_ids("f="), metadata=meta, chunk_tokens=8
    )
    produce(cfg, [c for t in trajs for c in t])
    t0 = time.monotonic()
    result = run_trainer(cfg)
    assert time.monotonic() - t0 < 120 and result.outcomes == {"trained": 4}, result.outcomes
    rewards = sorted(e.values["reward"] for e in metric_events(cfg, "sample"))
    assert rewards == [0.0, 0.0, 0.5, 1.0], rewards  # the identity passes f(0) == 0
