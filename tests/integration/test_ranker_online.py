"""Online ranker training against a real broker: trajectories topic in, versions in the store."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ranker import online
from ranker.config import RankerConfig
from ranker.dispatch import RankerPredictor
from ranker.metrics import spearman
from ranker.online import run_online
from ranker.publish import load_version, versions
from schemas.records import TrajectoryChunk, encode, pack_logprobs, pack_tokens
from srl.errors import ProducerFailed
from srl.kafka import Producer, committed_offsets, create_topics
from srl.stores import store_from_config
from srl.tinymodel import build_tokenizer
from srl.topics import Layout

TOKENIZER = build_tokenizer()  # what decoder_for(None) reads prompt tokens with


def _trajectory(i: int, k: int, layout: Layout) -> list[TrajectoryChunk]:
    """'count to k' answered with 2·k tokens, published as chunks of 16 (+ one bad record)."""
    prompt = f"count to {k}"
    length = 2 * k
    tid = f"traj-{i}"
    chunks, offset, seq = [], 0, 0
    while offset < length:
        n = min(16, length - offset)
        last = offset + n == length
        chunks.append(
            TrajectoryChunk(
                trajectory_id=tid,
                prompt_id=f"p{i}",
                task_id=f"t{i}",
                sample_index=0,
                group_size=1,
                seq=seq,
                token_offset=offset,
                tokens=pack_tokens([5] * n),
                logprobs=pack_logprobs([0.0] * n),
                policy_version=0,
                is_last=last,
                worker_id="w",
                bucket=layout.bucket_for(length),
                started_ms=0,
                finish_reason="stop" if last else None,
                predicted_length=None if i % 2 else 50,
                prompt_tokens=pack_tokens(TOKENIZER.encode(prompt)) if seq == 0 else None,
            )
        )
        offset, seq = offset + n, seq + 1
    return chunks


def _publish_trajectories(cfg: RankerConfig, layout: Layout, n: int) -> None:
    create_topics(cfg)
    ks = np.random.default_rng(0).integers(1, 150, n)
    with Producer(cfg, "test") as p:
        p.produce(layout.trajectories, b"not avro", key="junk", partition=0)
        for i, k in enumerate(ks):
            for c in _trajectory(i, int(k), layout):
                p.produce(
                    layout.trajectories,
                    encode(c),
                    key=c.trajectory_id,
                    partition=layout.partition_for(c.bucket, c.trajectory_id),
                )


def test_a_ranker_whose_producer_failed_for_good_starts_over_in_its_process(
    make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a SIGKILLed embedded broker forgets what it acknowledged last: the producer fails for
    # good (out-of-order sequence); the ranker used to exit (twice in the 30-minute soak)
    cfg: RankerConfig = make_cfg(
        RankerConfig, window=100, retrain_every=100, min_pairs=100, epochs=5, hidden=(8,)
    )
    _publish_trajectories(cfg, Layout.from_config(cfg), 260)
    real, failed = online._OnlineRun.take, list[int]()

    def failing(self: Any, msg: Any) -> Any:
        if self.published and not failed:
            failed.append(1)
            raise ProducerFailed("the producer to the test broker failed for good: injected")
        return real(self, msg)

    monkeypatch.setattr(online._OnlineRun, "take", failing)
    assert online.run_online(cfg, max_versions=2, idle_timeout_s=15) == 2
    assert failed and versions(store_from_config(cfg), cfg.run) == [1, 2]


def test_online_training_publishes_versions_and_commits(make_cfg: Any) -> None:
    cfg: RankerConfig = make_cfg(
        RankerConfig, window=400, retrain_every=150, min_pairs=150, epochs=60, hidden=(32,)
    )
    layout = Layout.from_config(cfg)
    _publish_trajectories(cfg, layout, 450)
    seen: list[dict[str, float]] = []
    n = run_online(cfg, max_versions=2, idle_timeout_s=15, on_version=lambda r, v: seen.append(v))
    assert n == 2 and [int(v["version"]) for v in seen] == [1, 2]
    store = store_from_config(cfg)
    assert versions(store, cfg.run) == [1, 2]
    v2 = load_version(store, cfg.run)
    assert v2.info["warm_start_from"] == 1 and len(v2.info["length_quantiles"]) == 101
    # it learned the lengths: held-out prompts rank in the right order
    test_k = np.arange(5, 150, 7)
    pred = v2.predict([f"count to {k}" for k in test_k])
    assert spearman(test_k, pred) > 0.9
    # dispatch-time predictions (constant 50 on half the trajectories) were scored
    assert seen[0]["live_n"] > 0 and seen[0]["live_spearman"] == 0.0
    # offsets of what went into the versions are committed in the ranker's group
    parts = [(layout.trajectories, p) for p in range(layout.trajectory_partition_count)]
    committed = committed_offsets(cfg, cfg.group_id(), parts)
    assert sum(o for o in committed.values() if o and o > 0) > 0
    # the dispatcher's predictor picks up the newest version
    fallback = type("F", (), {"version": None, "predict": lambda self, ps: np.full(len(ps), 7)})()
    rp = RankerPredictor(store, cfg.run, fallback)
    assert rp.version == 2 and rp.predict(["count to 3"]).dtype == np.int64
    assert RankerPredictor(store_from_config(cfg), "other-run", fallback).predict(["x"])[0] == 7


def test_a_restarted_ranker_pairs_the_trajectory_that_straddled_its_last_commit(
    make_cfg: Any,
) -> None:
    # "a" starts before the ten trajectories that make version 1 and ends after them: the
    # commit after version 1 stops at a's first chunk, so the next ranker reads it again
    cfg: RankerConfig = make_cfg(
        RankerConfig, window=100, retrain_every=10, min_pairs=10, epochs=2, hidden=(8,)
    )
    layout = Layout.from_config(cfg)
    create_topics(cfg)
    a = _trajectory(99, 20, layout)  # 40 tokens: three chunks
    records = [a[0], *(c for i in range(10) for c in _trajectory(i, 3, layout)), *a[1:]]
    with Producer(cfg, "test") as p:
        for c in records:
            p.produce(layout.trajectories, encode(c), key=c.trajectory_id, partition=0)
    seen: list[dict[str, float]] = []
    assert (
        run_online(cfg, max_versions=1, idle_timeout_s=10, on_version=lambda r, v: seen.append(v))
        == 1
    )
    committed = committed_offsets(cfg, cfg.group_id(), [(layout.trajectories, 0)])
    assert committed[(layout.trajectories, 0)] == 0  # a's first chunk, not past it
    restarted = cfg.model_copy(update={"retrain_every": 11, "min_pairs": 11})
    assert (
        run_online(
            restarted, max_versions=1, idle_timeout_s=10, on_version=lambda r, v: seen.append(v)
        )
        == 1
    )
    assert [int(v["pairs"]) for v in seen] == [10, 11]  # the ten again, and a
