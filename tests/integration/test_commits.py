"""Synchronous commits on the real broker: a partition the broker refuses is not taken for
committed, by the trainer (``consumers.trainer.commit``, whose committed offsets also decide
what the dedupe ledger forgets) nor by a generator (``producers.intake.Intake.commit``).

The refused partition here is one that does not exist; librdkafka 2.16 fails the whole call
for it. An answer that reports a refusal only on the partition (the call succeeding) is
``srl.kafka.Consumer.commit_sync``'s to catch: ``tests/unit/test_commit_sync.py``."""

from __future__ import annotations

import time
from typing import Any

from consumers.offsets import OffsetTracker
from consumers.trainer import commit
from producers.config import GenerateConfig
from producers.intake import Intake
from srl.kafka import committed_offsets, create_topics, make_consumer
from srl.topics import Layout


def test_the_trainer_does_not_count_a_refused_partition_as_committed(make_cfg: Any) -> None:
    cfg = make_cfg()
    topic = Layout.from_config(cfg).trajectories
    create_topics(cfg)
    group = f"trainer-commit-{time.monotonic_ns()}"
    tracker = OffsetTracker()
    tracker.seen(topic, 0, 4, None)
    tracker.seen(topic, 999, 7, None)  # no such partition: the broker refuses it
    with make_consumer(cfg, group) as consumer:
        commit(consumer, tracker)
    assert tracker.committed == {}, "a refused commit must not prune the ledger"
    assert tracker.committable() == {(topic, 0): 5, (topic, 999): 8}  # tried again next time


def test_a_generator_reports_a_refused_partition_as_a_failed_commit(make_cfg: Any) -> None:
    cfg = make_cfg(GenerateConfig, engine="sim")
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    prompts = layout.prompts(layout.buckets[0])
    intake = Intake(cfg, [prompts], lambda _tps, _states: True, lambda _states: None)
    good, missing = (prompts, 0), (prompts, 999)
    for tp in (good, missing):
        intake.tracker.add(tp, 3)
        intake.tracker.finish(tp, 3)
    intake.tracker.committable()
    group = f"gen-commit-{time.monotonic_ns()}"
    with make_consumer(cfg, group) as consumer:
        intake._consumer = consumer  # a member that never subscribed: commits as itself
        assert intake.commit(force=True) is False
        intake.tracker.forget([missing])
        assert intake.commit(force=True) is True
    assert committed_offsets(cfg, group, [good]) == {good: 4}
