"""Data-plane roles for the cross-datacenter harness, built from srl's real parts.

``produce N``  (generator datacenter): N synthetic trajectories, chunk by chunk, to the
               trajectories topic; then waits for weights v1 on the weights topic, fetches it
               from the store and verifies every file (a generator following the trainer).
``consume N``  (trainer datacenter): reads the trajectories topic in a consumer group until N
               trajectories are complete, dedupes by (trajectory_id, seq), commits, then
               publishes weights v1 (files, manifest last, announcement).
``feed G``     (generator datacenter): G prompt groups of 4 completed trajectories of the
               arithmetic demo shape (prompt "a+b=", metadata answer) for the real trainer,
               two groups per trainer step, each pair stamped with the latest announced
               version and sent at most one step ahead of the trainer (as generators under
               max_staleness 1 would); then fetches and verifies the final version G // 2.
``audit``      (any datacenter): after a run of the real pipeline, every sample the dispatcher
               asked for (prompt tasks × their samples; without prompt tasks, every complete
               trajectory on the trajectories topic) against the trainer's ``sample`` events:
               trained, dropped, missing, twice; and the trained-sample rate.

Each prints one JSON line with what it saw. Both load their datacenter's config file
(``--config deploy/datacenters/….toml``; ``SRL_*`` variables point it at the harness' broker
and store). Run as ``python -m tests.crossdc_roles ROLE N --config FILE``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import orjson

from app.smoke import synthetic_chunks
from schemas.records import TrajectoryChunk, decode_as, encode
from srl.config import CommonConfig, load_config
from srl.kafka import Producer, TopicPartition, make_consumer
from srl.stores import store_from_config
from srl.topics import Layout
from srl.weights import announce, fetch_tensors, latest_announcement, load_manifest, publish


def produce(cfg: CommonConfig, n: int, timeout_s: float) -> dict[str, Any]:
    layout = Layout.from_config(cfg)
    chunks = synthetic_chunks(n, layout, seed=1)
    t0 = time.monotonic()
    with Producer(cfg, "gen") as p:
        p.warm([layout.trajectories])  # as a generator does while its model loads
        begun = time.monotonic()  # the first record (connecting across the link is before it)
        for c in chunks:
            p.produce(
                layout.trajectories,
                encode(c),
                key=c.trajectory_id,
                partition=layout.partition_for(c.bucket, c.trajectory_id),
            )
    sent_s = time.monotonic() - t0
    deadline = time.monotonic() + timeout_s
    while (ann := latest_announcement(cfg, layout, cfg.run, 10)) is None:
        if time.monotonic() > deadline:
            raise SystemExit("no weights announcement arrived")
        time.sleep(0.5)
    store = store_from_config(cfg)
    tensors = fetch_tensors(store, load_manifest(store, ann))
    return {
        "role": "produce",
        "chunks": len(chunks),
        "tokens": sum(c.n_tokens for c in chunks),
        "send_s": sent_s,
        "begun_at": begun,  # CLOCK_MONOTONIC, shared by the namespaces of one machine
        "weights_version": ann.version,
        "tensors": len(tensors),
    }


def consume(cfg: CommonConfig, n: int, timeout_s: float, ready: str = "") -> dict[str, Any]:
    import torch

    layout = Layout.from_config(cfg)
    consumer = make_consumer(cfg, f"{cfg.topic_prefix}-crossdc", "trainer")
    seen: set[tuple[str, int]] = set()
    last_seq: dict[str, int] = {}
    done: set[str] = set()
    duplicates = tokens = 0
    ends: dict[tuple[str, int], int] = {}
    t0 = first = time.monotonic()
    try:
        # ``ready``: written once the group assigned the partitions, so the burst's clock
        # (the generator's first record) starts with a reader in place, not with its start-up
        consumer.subscribe(
            [layout.trajectories],
            on_assign=lambda _c, _p: ready and Path(ready).write_text("assigned"),
        )
        while len(done) < n and time.monotonic() - t0 < timeout_s:
            batch = [m for m in consumer.consume(500, 0.5) if not m.error()]
            for msg in batch:
                if not seen:
                    first = time.monotonic()
                c = decode_as(msg.value() or b"", TrajectoryChunk)
                if (c.trajectory_id, c.seq) in seen:
                    duplicates += 1
                else:
                    seen.add((c.trajectory_id, c.seq))
                    tokens += c.n_tokens
                if c.is_last:
                    last_seq[c.trajectory_id] = c.seq
                for tid, last in list(last_seq.items()):
                    if all((tid, s) in seen for s in range(last + 1)):
                        done.add(tid)
                        del last_seq[tid]
                ends[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
            if batch:  # as the trainer does, the read loop never waits a round trip for it
                consumer.commit_async([TopicPartition(t, p, o) for (t, p), o in ends.items()])
        done_at = time.monotonic()
        stream_s = done_at - first
        consumer.commit_sync([TopicPartition(t, p, o) for (t, p), o in ends.items()])
    finally:
        consumer.close()
    torch.manual_seed(0)
    pub = publish(
        store_from_config(cfg),
        cfg.run,
        1,
        {"w": torch.randn(256, 256)},
        trainer_step=1,
        parent_version=0,
    )
    with Producer(cfg, "trainer") as p:
        announce(p, layout, pub)
    return {
        "role": "consume",
        "trajectories": len(done),
        "duplicates": duplicates,
        "tokens": tokens,
        "stream_s": stream_s,
        "done_at": done_at,
        "published": pub.manifest.version,
    }


def feed(cfg: CommonConfig, groups: int, timeout_s: float) -> dict[str, Any]:
    import random

    from tests.chunks import produce as produce_chunks
    from tests.chunks import text_ids, traj_chunks

    rng = random.Random(5)
    layout = Layout.from_config(cfg)
    deadline = time.monotonic() + timeout_s

    def latest() -> int:
        ann = latest_announcement(cfg, layout, cfg.run, 10)
        return ann.version if ann else 0

    sent = 0
    for step in range(groups // 2):  # two groups per trainer step; one step ahead at most
        while (version := latest()) < step - 1:
            if time.monotonic() > deadline:
                raise SystemExit(f"weights v{step - 1} did not arrive")
            time.sleep(0.2)
        chunks: list[TrajectoryChunk] = []
        for g in (2 * step, 2 * step + 1):
            a, b = rng.randrange(10), rng.randrange(10)
            for i in range(4):
                answer = str(a + b) if rng.random() < 0.5 else str(rng.randrange(20))
                chunks += traj_chunks(
                    f"p{g}",
                    i,
                    4,
                    text_ids(f"{a}+{b}="),
                    text_ids(answer + "\n\n"),
                    chunk_tokens=2,
                    versions=version,
                    logprobs=[-5.5] * (len(answer) + 2),
                    metadata={"answer": a + b},
                )
        produce_chunks(cfg, chunks)
        sent += len(chunks)
    while (version := latest()) < groups // 2:
        if time.monotonic() > deadline:
            raise SystemExit(f"weights v{groups // 2} did not arrive")
        time.sleep(0.2)
    ann = latest_announcement(cfg, layout, cfg.run, 10)
    assert ann is not None
    store = store_from_config(cfg)
    tensors = fetch_tensors(store, load_manifest(store, ann))
    return {
        "role": "feed",
        "trajectories": 4 * groups,
        "chunks": sent,
        "weights_version": ann.version,
        "tensors": len(tensors),
    }


def audit(cfg: CommonConfig, n: int, timeout_s: float) -> dict[str, Any]:
    from collections import Counter

    from schemas.records import MetricEvent, PromptTask
    from tests.chunks import read_topic

    layout = Layout.from_config(cfg)
    asked: Counter[str] = Counter()
    for bucket in layout.buckets:
        for m in read_topic(cfg, layout.prompts(bucket), timeout_s):
            task = decode_as(m.value() or b"", PromptTask)
            asked[task.prompt_id] += len(task.samples())
    if not asked:  # no dispatcher: every complete trajectory on the topic was asked for
        for m in read_topic(cfg, layout.trajectories, timeout_s):
            chunk = decode_as(m.value() or b"", TrajectoryChunk)
            if chunk.is_last:
                asked[chunk.prompt_id] += 1
    events = [
        decode_as(m.value() or b"", MetricEvent) for m in read_topic(cfg, layout.metrics, timeout_s)
    ]
    samples = [e for e in events if e.kind == "sample" and e.run == cfg.run]
    seen = Counter(e.labels["trajectory_id"] for e in samples)
    outcomes = Counter(e.labels.get("outcome") for e in samples)
    per_prompt = Counter(e.labels["prompt_id"] for e in samples)
    trained = sorted(e.ts_ms for e in samples if e.labels.get("outcome") == "trained")
    tokens = sum(e.values.get("tokens", 0) for e in samples if e.labels.get("outcome") == "trained")
    span_s = (trained[-1] - trained[0]) / 1000 if len(trained) > 1 else 0.0
    return {
        "role": "audit",
        "asked": sum(asked.values()),
        "prompts": len(asked),
        "outcomes": dict(outcomes),
        "twice": sum(1 for v in seen.values() if v > 1),
        "missing": sum(max(0, k - per_prompt[p]) for p, k in asked.items()),
        "trained_samples_per_s": (len(trained) - 1) / span_s if span_s else None,
        "trained_tokens_per_s": tokens / span_s if span_s else None,
        "steps": sum(1 for e in events if e.kind == "train_step" and e.run == cfg.run),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["produce", "consume", "feed", "audit"])
    ap.add_argument("n", type=int, nargs="?", default=0)
    ap.add_argument("--config", required=True)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--ready", default="", help="consume: a file written once assigned")
    args = ap.parse_args()
    cfg = load_config(CommonConfig, file=args.config)
    if args.role == "consume":
        res = consume(cfg, args.n, args.timeout_s, args.ready)
    else:
        run = {"produce": produce, "feed": feed, "audit": audit}[args.role]
        res = run(cfg, args.n, args.timeout_s)
    print(orjson.dumps(res).decode(), flush=True)


if __name__ == "__main__":
    main()
