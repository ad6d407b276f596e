"""A long tail that streams for longer than ``--expire-s`` is waited for, not expired: its group
and its step hold while its chunks keep arriving (a 7B run's longest samples generate for many
minutes; ``expire_s`` is about silence, not length)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from consumers.trainer import run_trainer
from srl.kafka import create_topics
from tests.chunks import group_chunks, metric_events, produce, text_ids
from tests.integration.test_trainer import train_cfg


def test_a_trajectory_streaming_past_expire_s_trains_with_its_group(
    make_cfg: Any, tiny_model: Path
) -> None:
    cfg = train_cfg(
        make_cfg,
        tiny_model,
        max_steps=1,
        groups_per_step=1,
        expire_s=2.0,
        feedback_window_s=0,
        idle_exit_s=20.0,
        reward="consumers.rewards:first_line_match",
    )
    create_topics(cfg)
    answers = ["3\n", "4\n", "5\n", "3" + " " * 40 + "\n"]
    trajs = group_chunks(
        "p0-1+2",
        [text_ids(a) for a in answers],
        prompt=text_ids("1+2="),
        metadata={"answer": 3},
        chunk_tokens=4,
        step=1,
        step_groups=1,
    )
    short, tail = [c for t in trajs[:3] for c in t], trajs[3]
    produce(cfg, short + tail[:1])
    sent: list[float] = []

    def stream_the_tail() -> None:  # a chunk every 0.5 s: 5 s in all, over twice expire_s
        for c in tail[1:]:
            time.sleep(0.5)
            produce(cfg, [c])
            sent.append(time.monotonic())

    thread = threading.Thread(target=stream_the_tail, daemon=True)
    t0 = time.monotonic()
    thread.start()
    result = run_trainer(cfg)
    thread.join(timeout=30)
    assert len(tail) == 11 and sent[-1] - t0 > 2 * cfg.expire_s, "the tail outlasted expire_s"
    assert result.steps == 1 and result.outcomes == {"trained": 4}, result.outcomes
    [step] = metric_events(cfg, "train_step")
    assert step.values["samples"] == 4 and step.values.get("missing_groups", 0) == 0
