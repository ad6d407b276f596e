"""A data-plane smoke run: synthetic trajectories through the real broker, codec and topics.

It checks the path every role stands on: chunks produced to the bucket's partitions,
consumed in a group, committed, and every trajectory reassembled exactly once. Token ids are
random; nothing is trained. Called by ``srl smoke`` (``app.cli.main``); the tests reuse
``synthetic_chunks``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from typing import Any

import click
import numpy as np

from app.configs import StreamConfig
from schemas.records import TrajectoryChunk, decode_as, encode, now_ms, pack_logprobs, pack_tokens
from srl.broker import EmbeddedBroker
from srl.errors import SrlError
from srl.kafka import Producer, TopicPartition, create_topics, make_consumer
from srl.topics import Layout


def synthetic_chunks(
    n: int, layout: Layout, chunk_tokens: int = 16, seed: int = 0
) -> list[TrajectoryChunk]:
    rng = np.random.default_rng(seed)
    chunks = []
    for i in range(n):
        length = int(min(8000, rng.lognormal(5.0, 1.0))) + 1
        bucket = layout.bucket_for(length)
        tid, started = uuid.uuid4().hex, now_ms()
        for seq, off in enumerate(range(0, length, chunk_tokens)):
            k = min(chunk_tokens, length - off)
            chunks.append(
                TrajectoryChunk(
                    trajectory_id=tid,
                    prompt_id=f"p{i}",
                    task_id=f"t{i}",
                    sample_index=0,
                    group_size=1,
                    seq=seq,
                    token_offset=off,
                    tokens=pack_tokens(rng.integers(0, 32000, k)),
                    logprobs=pack_logprobs(-rng.random(k)),
                    policy_version=0,
                    is_last=off + k >= length,
                    worker_id="smoke",
                    bucket=bucket,
                    started_ms=started,
                    finish_reason="length" if off + k >= length else None,
                )
            )
    return chunks


def run_smoke(cfg: StreamConfig, n: int, external: bool = False) -> dict[str, Any]:
    """Produce ``n`` synthetic trajectories, consume them in a fresh group, commit, and check
    that every one was reassembled; SrlError if any was lost. Returns the figures."""
    with contextlib.ExitStack() as stack:
        if not external:
            click.echo("starting the embedded broker …")
            b = stack.enter_context(EmbeddedBroker())
            cfg = cfg.model_copy(update={"bootstrap_servers": b.bootstrap})
        layout = Layout.from_config(cfg)
        create_topics(cfg)
        chunks = synthetic_chunks(n, layout)
        expected = {c.trajectory_id: c.seq + 1 for c in chunks if c.is_last}
        t0 = time.perf_counter()
        _produce(cfg, layout, chunks)
        produce_s = time.perf_counter() - t0
        done, duplicates = _consume(cfg, layout, expected)
        wall = time.perf_counter() - t0
        result = smoke_result(chunks, len(expected), done, duplicates, produce_s, wall)
        click.echo(
            f"{result['assembled']}/{result['trajectories']} trajectories ({len(chunks)} chunks, "
            f"{result['tokens']} tokens) "
            f"reassembled in {wall:.2f}s ({result['tokens_per_s']} tokens/s); lost "
            f"{result['lost']}, "
            f"duplicates {duplicates}"
        )
        if result["lost"]:
            raise SrlError(f"smoke run lost {result['lost']} trajectories")
        return result


def _produce(cfg: StreamConfig, layout: Layout, chunks: list[TrajectoryChunk]) -> None:
    """Every chunk to its bucket's partitions, keyed by trajectory, with a progress bar."""
    from rich.progress import Progress

    with Progress(transient=True) as progress, Producer(cfg, "smoke") as producer:
        task = progress.add_task("producing chunks", total=len(chunks))
        for c in chunks:
            producer.produce(
                layout.trajectories,
                encode(c),
                key=c.trajectory_id,
                partition=layout.partition_for(c.bucket, c.trajectory_id),
            )
            progress.advance(task)


def _consume(cfg: StreamConfig, layout: Layout, expected: dict[str, int]) -> tuple[int, int]:
    """Read the trajectories topic in a fresh group until every expected trajectory has all
    its chunks (at most 60 s), then commit: (trajectories complete, duplicate chunks)."""
    consumer = make_consumer(cfg, f"{cfg.topic_prefix}.smoke-{uuid.uuid4().hex[:8]}", "smoke")
    seen: dict[str, set[int]] = defaultdict(set)
    done: set[str] = set()
    duplicates = 0
    ends: dict[tuple[str, int], int] = {}
    try:
        consumer.subscribe([layout.trajectories])
        deadline = time.monotonic() + 60
        while len(done) < len(expected) and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if msg.error():
                    continue
                c = decode_as(msg.value() or b"", TrajectoryChunk)
                if c.seq in seen[c.trajectory_id]:
                    duplicates += 1
                seen[c.trajectory_id].add(c.seq)
                if len(seen[c.trajectory_id]) == expected.get(c.trajectory_id, -1):
                    done.add(c.trajectory_id)
                ends[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
        consumer.commit_sync([TopicPartition(t, p, o) for (t, p), o in ends.items()])
    finally:
        consumer.close()
    return len(done), duplicates


def smoke_result(
    chunks: list[TrajectoryChunk],
    trajectories: int,
    assembled: int,
    duplicates: int,
    produce_s: float,
    wall: float,
) -> dict[str, Any]:
    """The smoke run's figures; ``lost``: trajectories not reassembled."""
    tokens = sum(c.n_tokens for c in chunks)
    return {
        "trajectories": trajectories,
        "chunks": len(chunks),
        "tokens": tokens,
        "assembled": assembled,
        "duplicates": duplicates,
        "lost": trajectories - assembled,
        "produce_s": round(produce_s, 3),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall),
    }
