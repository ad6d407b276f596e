"""Chunk factories for trainer tests: trajectories cut into ``TrajectoryChunk`` records.

``traj_chunks`` cuts one completion into chunks the way a generator worker does (seq from 0,
token offsets, prompt tokens and metadata on seq 0, ``is_last`` on the final chunk), with a
policy version per chunk; ``group_chunks`` makes the ``n`` samples of one prompt, and
``produce`` writes records to the trajectories topic partition of their bucket.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from producers.config import GenerateConfig
from schemas.records import TrajectoryChunk, encode, pack_logprobs, pack_tokens


def traj_chunks(
    prompt_id: str,
    sample_index: int,
    group_size: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    chunk_tokens: int = 4,
    versions: Sequence[int] | int = 0,
    logprobs: Sequence[float] | None = None,
    metadata: dict[str, Any] | None = None,
    trajectory_id: str | None = None,
    bucket: str = "le256",
    worker_id: str = "w0",
    step: int | None = None,
    step_groups: int | None = None,
) -> list[TrajectoryChunk]:
    tid = trajectory_id or uuid.uuid4().hex
    lp = np.full(len(completion), -1.0, np.float32) if logprobs is None else np.asarray(logprobs)
    spans = [
        (o, min(o + chunk_tokens, len(completion))) for o in range(0, len(completion), chunk_tokens)
    ]
    spans = spans or [(0, 0)]
    vers = [versions] * len(spans) if isinstance(versions, int) else list(versions)
    assert len(vers) == len(spans), f"{len(spans)} chunks need {len(spans)} versions"
    out = []
    for seq, ((a, b), v) in enumerate(zip(spans, vers, strict=True)):
        last = seq == len(spans) - 1
        out.append(
            TrajectoryChunk(
                trajectory_id=tid,
                prompt_id=prompt_id,
                task_id=f"task-{prompt_id}",
                sample_index=sample_index,
                group_size=group_size,
                seq=seq,
                token_offset=a,
                tokens=pack_tokens(completion[a:b]),
                logprobs=pack_logprobs(lp[a:b]),
                policy_version=v,
                is_last=last,
                worker_id=worker_id,
                bucket=bucket,
                started_ms=1,
                finish_reason="stop" if last else None,
                prompt_tokens=pack_tokens(prompt) if seq == 0 else None,
                metadata=orjson.dumps(metadata).decode()
                if seq == 0 and metadata is not None
                else None,
                step=step if seq == 0 else None,
                step_groups=step_groups if seq == 0 else None,
            )
        )
    return out


@functools.cache
def _tokenizer() -> Any:
    from srl.tinymodel import build_tokenizer

    return build_tokenizer()


def text_ids(text: str) -> list[int]:
    """Token ids of ``text`` under the tiny model's byte-level tokenizer."""
    return list(_tokenizer().encode(text, add_special_tokens=False))


def group_chunks(
    prompt_id: str,
    completions: Sequence[Sequence[int]],
    prompt: Sequence[int] = (5, 6, 7),
    **kw: Any,
) -> list[list[TrajectoryChunk]]:
    n = len(completions)
    return [traj_chunks(prompt_id, i, n, prompt, c, **kw) for i, c in enumerate(completions)]


def produce(
    cfg: Any,
    chunks: Sequence[TrajectoryChunk],
    extra: Sequence[bytes] = (),
    partition: int | None = None,
) -> None:
    """Write chunks, then raw ``extra`` values, to the trajectories topic, in order.

    ``partition`` overrides the layout's partition for every record (chunks and extras);
    by default chunks go to their bucket's partition and extras to partition 0.
    """
    from srl.kafka import Producer
    from srl.topics import Layout

    layout = Layout.from_config(cfg)
    with Producer(cfg, "test") as p:
        for c in chunks:
            part = (
                partition
                if partition is not None
                else layout.partition_for(c.bucket, c.trajectory_id)
            )
            p.produce(layout.trajectories, encode(c), key=c.trajectory_id, partition=part)
        for raw in extra:
            p.produce(layout.trajectories, raw, key=b"bad", partition=partition or 0)


def publish_versions(cfg: Any, upto: int, run: str = "lead") -> None:
    """Weights versions 1..``upto`` of ``run`` in the store (a tiny tensor each): chunks may
    claim those versions (a version no run has published is from the future, and poison)."""
    import torch

    from srl.stores import store_from_config
    from srl.weights import publish

    store = store_from_config(cfg)
    for v in range(1, upto + 1):
        publish(store, run, v, {"w": torch.zeros(1)}, trainer_step=v, parent_version=v - 1)


def read_topic(cfg: Any, topic: str, timeout_s: float = 20.0) -> list[Any]:
    """Every message of ``topic`` up to its current high watermarks (all partitions)."""
    from srl.kafka import read_range

    return list(read_range(cfg, topic, timeout_s=timeout_s, role=f"reader-{uuid.uuid4().hex[:6]}"))


def metric_events(cfg: Any, kind: str | None = None) -> list[Any]:
    from schemas.records import MetricEvent, decode_as
    from srl.topics import Layout

    events = [
        decode_as(m.value(), MetricEvent) for m in read_topic(cfg, Layout.from_config(cfg).metrics)
    ]
    return [e for e in events if kind is None or e.kind == kind]


def sim_generate_cfg(make_cfg: Any, **kw: Any) -> GenerateConfig:
    """A fast sim-engine generator config for in-process worker tests (``kw`` overrides)."""
    base = {
        "engine": "sim",
        "time_scale": 0.05,
        "max_batch": 4,
        "chunk_tokens": 16,
        "seed": 0,
        "stats_interval_s": 0.5,
        "commit_interval_s": 0.2,
        "drain_timeout_s": 5.0,
    }
    return make_cfg(GenerateConfig, **{**base, **kw})  # type: ignore[no-any-return]
