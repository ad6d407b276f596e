"""Poison records for every input topic of the pipeline, and where each one was written.

Owns what the ``poison`` fault writes. Input topics are the ones a role consumes: the prompt
and resume topics of every bucket (generators), the trajectories topic (trainer, online
ranker) and the weights topic (generators' followers, dispatcher). On each, one record of
every kind in :data:`KINDS`:

* ``garbage``: random bytes;
* ``unknown-fingerprint``: the single-object marker ``C3 01`` with a fingerprint no schema has;
* ``truncated``: a valid record of the topic's type cut in half;
* ``oversized``: a valid record of the topic's type about 800 KB long (a prompt, a token
  list, a manifest URI far beyond anything the roles write; under the topics' 1 MB limit);
* ``wrong-schema``: a valid record of another type (a metric event);
* ``future-version`` / ``negative-version``: a valid record whose policy version is 10^9 or
  negative (a chunk's ``policy_version``, a task's ``min_version``, an announcement's
  ``version`` for this run).

Every id starts with ``chaos-poison`` (``app.chaos.audit`` leaves them out of the counts).
Each must end in ``{prefix}.dlq`` with its origin ``topic/partition@offset`` and a reason,
and no consumer may stop: ``inject`` returns the origins, ``app.chaos.faults`` checks them.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from app.chaos.audit import POISON_PREFIX
from schemas.records import (
    MetricEvent,
    PromptTask,
    Record,
    TrajectoryChunk,
    WeightsAnnouncement,
    encode,
    pack_logprobs,
    pack_tokens,
)
from srl.config import CommonConfig
from srl.kafka import Producer
from srl.topics import Layout

KINDS = (
    "garbage",
    "unknown-fingerprint",
    "truncated",
    "oversized",
    "wrong-schema",
    "future-version",
    "negative-version",
)
BIG = 800_000  # bytes of an oversized record's payload
FUTURE = 10**9


def _task(rng: random.Random, bucket: str, kind: str) -> PromptTask:
    pid = f"{POISON_PREFIX}-{kind}-{rng.getrandbits(32):08x}"
    return PromptTask(
        task_id=pid, prompt_id=pid, prompt="poison", group_size=1, max_new_tokens=8, bucket=bucket
    )


def _chunk(rng: random.Random, bucket: str, kind: str, n: int = 8) -> TrajectoryChunk:
    tid = f"{POISON_PREFIX}-{kind}-{rng.getrandbits(32):08x}"
    return TrajectoryChunk(
        trajectory_id=tid,
        prompt_id=tid,
        task_id=tid,
        sample_index=0,
        group_size=1,
        seq=0,
        token_offset=0,
        tokens=pack_tokens([rng.randrange(4, 260) for _ in range(n)]),
        logprobs=pack_logprobs([-1.0] * n),
        policy_version=0,
        is_last=True,
        worker_id="chaos-poison",
        bucket=bucket,
        started_ms=0,
        finish_reason="stop",
        prompt_tokens=pack_tokens([10, 11, 12]),
    )


def _announcement(run: str, _kind: str) -> WeightsAnnouncement:
    return WeightsAnnouncement(
        run=run,
        version=1,
        manifest_uri=f"file:///nonexistent/{POISON_PREFIX}/manifest.json",
        manifest_sha256="0" * 64,
        trainer_step=1,
        total_bytes=1,
    )


def typed(kind: str, base: Record, rng: random.Random) -> Record:
    """The valid record of ``kind`` built from ``base`` (``base`` itself for the others)."""
    if isinstance(base, PromptTask):
        return {
            "oversized": replace(base, prompt="x" * BIG),
            "future-version": replace(base, min_version=FUTURE),
            "negative-version": replace(base, min_version=-3),
        }.get(kind, base)
    if isinstance(base, TrajectoryChunk):
        return {
            "oversized": _chunk(rng, base.bucket, kind, BIG // 8),
            "future-version": replace(base, policy_version=FUTURE),
            "negative-version": replace(base, policy_version=-1),
        }.get(kind, base)
    assert isinstance(base, WeightsAnnouncement)
    return {
        "oversized": replace(base, manifest_uri="file:///" + "x" * BIG),
        "future-version": replace(base, version=FUTURE, trainer_step=FUTURE),
        "negative-version": replace(base, version=-1, trainer_step=-1),
    }.get(kind, base)


def value(kind: str, base: Record, rng: random.Random) -> bytes:
    """The bytes of one poison record of ``kind`` for a topic whose records look like ``base``."""
    if kind == "garbage":
        return rng.randbytes(200)
    if kind == "unknown-fingerprint":
        return b"\xc3\x01" + rng.randbytes(8) + rng.randbytes(60)
    if kind == "wrong-schema":
        return encode(MetricEvent(kind="poison", source=POISON_PREFIX, run="poison"))
    data = encode(typed(kind, base, rng))
    return data[: len(data) // 2] if kind == "truncated" else data


def plan(cfg: CommonConfig, rng: random.Random) -> list[tuple[str, str, bytes]]:
    """``(topic, kind, value)`` of every poison record, every kind on every input topic."""
    layout = Layout.from_config(cfg)
    bases: list[tuple[str, Callable[[str], Record]]] = []
    for b in layout.buckets:
        task = functools.partial(_task, rng, b)
        bases += [(layout.prompts(b), task), (layout.resumes(b), task)]
    bases += [
        (layout.trajectories, functools.partial(_chunk, rng, layout.buckets[0])),
        (layout.weights, functools.partial(_announcement, cfg.run)),
    ]
    return [(topic, k, value(k, make(k), rng)) for topic, make in bases for k in KINDS]


def inject(cfg: CommonConfig, rng: random.Random) -> dict[str, str]:
    """Write every poison record; ``{origin: "topic kind"}`` of each one delivered."""
    origins: dict[str, str] = {}
    lock = threading.Lock()

    def delivered(kind: str) -> Callable[[Any, Any], None]:
        def cb(err: Any, msg: Any) -> None:
            if err is None:
                with lock:
                    origins[f"{msg.topic()}/{msg.partition()}@{msg.offset()}"] = kind

        return cb

    with Producer(cfg, "chaos-poison") as p:
        for topic, kind, data in plan(cfg, rng):
            key = f"{POISON_PREFIX}-{kind}"
            p.produce(topic, data, key=key, on_delivery=delivered(f"{topic} {kind}"))
    return origins
