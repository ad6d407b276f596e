"""``srl bench dataplane``: chunks through the real broker into the trainer's assembler.

Owns the data-plane figures of docs/benchmarks.md. Three phases run in one invocation
against the same broker, each on its own fresh topics and consumer group:

* ``raw``: the encoded chunk records are made before the clock starts and sent as opaque
  bytes; the consumer only counts messages (no codec, no assembly): the byte path's limit;
* ``codec``: the same trajectories, encoded inside the timed loop by the disciplined
  ``Producer``'s caller, decoded by the consumer and stitched by ``consumers.assembler``;
* ``paced``: the codec phase again at ``pace`` (0.5) of the codec phase's measured token
  rate, for the last-chunk-produced → trajectory-ready latency; long enough to leave the start
  behind (``warmup_s``, 5 s, left out of the latencies, then ``paced_s``, 20 s, measured),
  ``repeats`` times (p50, p99, p99.9: their median over the repeats, and their spread).

Chunks come from the generator's own ``producers.chunker.Chunker`` (random token ids and
log-probs); ``batch`` trajectories are in flight at once and emit their chunks interleaved,
as a continuous-batching generator does. The producing side runs in a child process (as a
generator does); the consuming side in this one. Throughput is tokens over the time from
the first produce to the last message consumed (raw) or trajectory assembled (codec).
Latency pairs the child's wall-clock time just before it encodes a trajectory's last chunk
with this process's wall-clock time when ``Assembler.add`` returns the trajectory.
Called by ``app.bench.cli``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.configs import StreamConfig
from consumers.assembler import Assembler
from producers.chunker import Chunker, TrajectoryStart
from schemas.records import TrajectoryChunk, decode_as, encode, pack_tokens
from srl.errors import SrlError
from srl.kafka import Consumer, Producer, create_topics, make_consumer
from srl.topics import Layout, TopicSpec

TIMEOUT_S = 300.0


def make_trajectories(
    n: int, mean_tokens: int, chunk_tokens: int, layout: Layout, seed: int = 0
) -> list[list[TrajectoryChunk]]:
    """``n`` trajectories (log-normal lengths around ``mean_tokens``), chunked by the real
    Chunker."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu = np.log(mean_tokens) - sigma**2 / 2
    lengths = np.clip(rng.lognormal(mu, sigma, n).astype(int), 1, 16 * mean_tokens)
    chunker = Chunker(chunk_tokens, "bench-dataplane")
    out = []
    for i, length in enumerate(lengths):
        tid = uuid.uuid4().hex
        chunker.open(
            TrajectoryStart(
                trajectory_id=tid,
                prompt_id=f"p{i // 4}",
                task_id="bench",
                sample_index=i % 4,
                group_size=4,
                bucket=layout.bucket_for(int(length)),
                prompt_tokens=pack_tokens(rng.integers(0, 150_000, 64)),
            )
        )
        tokens = rng.integers(0, 150_000, int(length)).tolist()
        logprobs = (-rng.random(int(length)) * 5).tolist()
        out.append(chunker.add(tid, tokens, logprobs, version=0, finish_reason="length"))
    return out


def interleave(trajs: list[list[TrajectoryChunk]], batch: int) -> Iterator[TrajectoryChunk]:
    """Chunks in the order a generator with ``batch`` trajectories in flight emits them."""
    pending = iter(trajs)
    active: list[Iterator[TrajectoryChunk]] = []
    for _ in range(batch):
        t = next(pending, None)
        if t is not None:
            active.append(iter(t))
    while active:
        still = []
        for it in active:
            c = next(it, None)
            if c is None:
                t = next(pending, None)
                if t is not None:
                    still.append(iter(t))
                continue
            yield c
            still.append(it)
        active = still


def _produce(
    cfg: StreamConfig, spec: dict[str, Any], go: Any, ready: Any, start_ns: Any, out: Any
) -> None:
    """Child: make the chunks, wait for ``go``, produce them; send back last-chunk times."""
    layout = Layout.from_config(cfg)
    trajs = make_trajectories(
        spec["n"], spec["mean_tokens"], spec["chunk_tokens"], layout, spec["seed"]
    )
    chunks = list(interleave(trajs, spec["batch"]))
    raw = spec["mode"] == "raw"
    payloads = [encode(c) for c in chunks] if raw else None
    tokens_per_ns = spec["rate"] / 1e9 if spec["rate"] else 0.0
    last_ns: dict[str, int] = {}
    with Producer(cfg, "bench-dataplane") as producer:
        # the clock starts on a started producer: topic metadata fetched, and the idempotent
        # producer id acquired (librdkafka holds the first records ~0.5 s until it has one)
        producer.warm([layout.trajectories])
        producer.produce(warmup_topic(cfg), b"warm-up")
        producer.flush(60)
        ready.set()
        go.wait()
        t0 = time.time_ns()
        start_ns.value = t0
        sent = 0
        for i, c in enumerate(chunks):
            if tokens_per_ns:
                due = t0 + int(sent / tokens_per_ns)
                while (now := time.time_ns()) < due:
                    time.sleep(min(0.002, (due - now) / 1e9))
            if c.is_last:
                last_ns[c.trajectory_id] = time.time_ns()
            value = payloads[i] if payloads is not None else encode(c)
            producer.produce(
                layout.trajectories,
                value,
                key=c.trajectory_id,
                partition=layout.partition_for(c.bucket, c.trajectory_id),
            )
            sent += c.n_tokens
        producer.flush(60)
    out.put(last_ns)


def warmup_topic(cfg: StreamConfig) -> str:
    return f"{cfg.topic_prefix}.bench-warmup"


def run_phase(cfg: StreamConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """One phase (``spec['mode']`` raw or codec, ``spec['rate']`` tokens/s or 0 for flat out)."""
    cfg = cfg.model_copy(update={"topic_prefix": f"{cfg.topic_prefix}.bench{uuid.uuid4().hex[:6]}"})
    layout = Layout.from_config(cfg)
    create_topics(cfg, [*layout.specs(), TopicSpec(warmup_topic(cfg), 1, {})])
    size = phase_size(spec, layout)
    consumer = make_consumer(
        cfg, f"{cfg.topic_prefix}.bench-{uuid.uuid4().hex[:8]}", "bench-dataplane"
    )
    ctx = mp.get_context("spawn")
    go, ready, start_ns, q = ctx.Event(), ctx.Event(), ctx.Value("q", 0), ctx.Queue()
    child = ctx.Process(target=_produce, args=(cfg, spec, go, ready, start_ns, q), daemon=True)
    try:
        _join(consumer, layout.trajectories)
        child.start()
        if not ready.wait(TIMEOUT_S):
            raise SrlError("bench producer did not start")
        go.set()
        got = _consume(consumer, child, spec["mode"], size["chunks"])
        last_ns = q.get(timeout=60)
        child.join(30)
    finally:
        consumer.close()
        if child.is_alive():
            child.kill()
            child.join()
    res = phase_result(spec, size, (got.end_ns - start_ns.value) / 1e9)
    if spec["mode"] == "codec":
        if len(got.ready_ns) != spec["n"] or got.duplicates:
            raise SrlError(
                f"assembled {len(got.ready_ns)}/{spec['n']}, duplicates {got.duplicates}"
            )
        since = start_ns.value + int(spec.get("warmup_s", 0.0) * 1e9)
        res |= latency_figures(got.ready_ns, last_ns, since)
        res["warmup_s"] = spec.get("warmup_s", 0.0)
        res["measured_s"] = round(max(0.0, res["wall_s"] - res["warmup_s"]), 3)
    return res


def phase_size(spec: dict[str, Any], layout: Layout) -> dict[str, int]:
    """Chunks, tokens and encoded bytes of a phase's trajectories (made again, as the child
    makes them)."""
    probe = make_trajectories(
        spec["n"], spec["mean_tokens"], spec["chunk_tokens"], layout, spec["seed"]
    )
    return {
        "chunks": sum(len(t) for t in probe),
        "tokens": sum(c.n_tokens for t in probe for c in t),
        "bytes": sum(len(encode(c)) for t in probe for c in t),
    }


def _join(consumer: Consumer, topic: str) -> None:
    """Subscribe and wait for an assignment: the group is joined before the clock starts."""
    consumer.subscribe([topic])
    deadline = time.monotonic() + 30
    while not consumer.assignment():
        consumer.poll(0.1)
        if time.monotonic() > deadline:
            raise SrlError("bench consumer got no partitions within 30 s")


@dataclass
class Consumed:
    end_ns: int  # wall clock after the last message
    ready_ns: dict[str, int]  # trajectory id -> wall clock when the assembler returned it
    duplicates: int


def _consume(consumer: Consumer, child: Any, mode: str, n_chunks: int) -> Consumed:
    """Read ``n_chunks`` messages; in the codec mode decode and assemble each."""
    assembler = Assembler(set())
    ready_ns: dict[str, int] = {}
    got = 0
    end_ns = 0
    deadline = time.monotonic() + TIMEOUT_S
    codec = mode == "codec"
    while got < n_chunks:
        if time.monotonic() > deadline or not child.is_alive() and child.exitcode:
            raise SrlError(f"bench {mode}: {got}/{n_chunks} chunks consumed")
        for msg in consumer.next_batch(1000, 0.05):
            if msg.error():
                continue
            got += 1
            if codec:
                traj = assembler.add(decode_as(msg.value() or b"", TrajectoryChunk))
                if traj is not None:
                    ready_ns[traj.trajectory_id] = time.time_ns()
        end_ns = time.time_ns()
    return Consumed(end_ns, ready_ns, assembler.duplicates)


def phase_result(spec: dict[str, Any], size: dict[str, int], wall: float) -> dict[str, Any]:
    """A phase's rates over ``wall`` seconds (first produce to last message consumed)."""
    return {
        "mode": spec["mode"],
        "trajectories": spec["n"],
        "chunks": size["chunks"],
        "tokens": size["tokens"],
        "bytes": size["bytes"],
        "wall_s": round(wall, 4),
        "tokens_per_s": round(size["tokens"] / wall),
        "trajectories_per_s": round(spec["n"] / wall, 1),
        "mb_per_s": round(size["bytes"] / wall / 1e6, 2),
        "target_tokens_per_s": spec["rate"] or None,
    }


def latency_figures(
    ready_ns: dict[str, int], last_ns: dict[str, int], since_ns: int = 0
) -> dict[str, float]:
    """Last chunk produced -> trajectory ready, in ms, of the trajectories whose last chunk
    was produced at ``since_ns`` or later (the warm-up left out): p50, p99, p99.9, max."""
    lat = np.array([(ready_ns[t] - last_ns[t]) / 1e6 for t in ready_ns if last_ns[t] >= since_ns])
    if not len(lat):
        raise SrlError("no trajectory finished after the warm-up: a longer phase is needed")
    return {
        "ready_latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
        "ready_latency_ms_p99": round(float(np.percentile(lat, 99)), 2),
        "ready_latency_ms_p999": round(float(np.percentile(lat, 99.9)), 2),
        "ready_latency_ms_max": round(float(lat.max()), 2),
        "latency_samples": int(len(lat)),
    }


QUANTILES = ("p50", "p99", "p999")


def paced_spec(spec: dict[str, Any], rate: int, paced_s: float, warmup_s: float) -> dict[str, Any]:
    """The paced phase at ``rate`` tokens/s: enough trajectories (of ``spec``'s mean length,
    a tenth more) for ``warmup_s`` left out plus ``paced_s`` measured, and never fewer than
    ``spec``'s."""
    # a tenth more: the clipped log-normal's mean is a little below ``mean_tokens`` (583 at
    # 600), and the phase must not end before ``paced_s`` is measured
    n = math.ceil(1.1 * rate * (paced_s + warmup_s) / spec["mean_tokens"])
    return spec | {"mode": "codec", "rate": rate, "n": max(spec["n"], n), "warmup_s": warmup_s}


def spread(paced: list[dict[str, Any]]) -> dict[str, Any]:
    """The paced repeats' ready latencies: each quantile's median, min and max over them."""
    out: dict[str, Any] = {}
    for q in QUANTILES:
        v = [p[f"ready_latency_ms_{q}"] for p in paced]
        out[q] = {"median": round(float(np.median(v)), 2), "min": min(v), "max": max(v)}
    return out


def run(
    cfg: StreamConfig,
    trajectories: int = 2000,
    mean_tokens: int = 600,
    chunk_tokens: int = 32,
    batch: int = 64,
    pace: float = 0.5,
    repeats: int = 1,
    seed: int = 0,
    paced_s: float = 20.0,
    warmup_s: float = 5.0,
) -> dict[str, Any]:
    """All three phases on ``cfg``'s broker; the best of ``repeats`` raw and codec runs
    (alternating) counts; then ``repeats`` paced phases of ``warmup_s`` + ``paced_s`` at
    ``pace`` of the best codec rate, whose latencies' medians count (with their spread)."""
    spec = {
        "n": trajectories,
        "mean_tokens": mean_tokens,
        "chunk_tokens": chunk_tokens,
        "batch": batch,
        "seed": seed,
        "rate": 0,
    }
    raws, codecs = [], []
    for _ in range(repeats):
        raws.append(run_phase(cfg, spec | {"mode": "raw"}))
        codecs.append(run_phase(cfg, spec | {"mode": "codec"}))
    raw = max(raws, key=lambda r: r["tokens_per_s"])
    codec = max(codecs, key=lambda r: r["tokens_per_s"])
    pspec = paced_spec(spec, int(codec["tokens_per_s"] * pace), paced_s, warmup_s)
    paced = [run_phase(cfg, pspec) for _ in range(repeats)]
    sp = spread(paced)
    return {
        "tokens_per_s": codec["tokens_per_s"],
        "trajectories_per_s": codec["trajectories_per_s"],
        "raw_tokens_per_s": raw["tokens_per_s"],
        "overhead": round(raw["tokens_per_s"] / codec["tokens_per_s"] - 1, 4),
        **{f"ready_latency_ms_{q}": sp[q]["median"] for q in QUANTILES},
        "ready_latency_spread_ms": sp,
        "paced_fraction": pace,
        "paced_measured_s": min(p["measured_s"] for p in paced),
        "peak_ready_latency_ms_p50": codec["ready_latency_ms_p50"],
        "peak_ready_latency_ms_p99": codec["ready_latency_ms_p99"],
        "settings": {
            "trajectories": trajectories,
            "mean_tokens": mean_tokens,
            "chunk_tokens": chunk_tokens,
            "batch": batch,
            "repeats": repeats,
            "paced_s": paced_s,
            "warmup_s": warmup_s,
            "compression": cfg.compression,
            "linger_ms": cfg.linger_ms,
        },
        "phases": {"raw": raws, "codec": codecs, "paced": paced},
    }
