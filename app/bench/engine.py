"""``srl-producer bench``: generation speed of an engine, and what publishing chunks costs.

Owns the generator figures of docs/benchmarks.md. For one model it runs, side by side in one
process, the same fixed-length requests (``max_new_tokens`` each; the end-of-sequence token
is masked out so every sequence runs to its length and the work is identical):

* ``batch1``: one sequence at a time;
* ``batchN``: ``max_batch`` sequences decoded together (continuous batching);
* ``batchN+publish``: the same, with every emitted token going through the chunker and the
  disciplined producer to the trajectories topic of a real broker, flushed at the end.

``publish_overhead`` is ``1 - tokens_per_s(batchN+publish) / tokens_per_s(batchN)``;
``publish_overhead_cpu`` is the same with tokens per CPU second of this process (all its
threads, librdkafka's included; the broker's CPU is not counted), which other jobs on a shared
machine disturb far less than wall time. Each case runs ``repeats`` times, alternating, and
the best run counts.
Called by ``app.cli.producer``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.configs import EngineBenchConfig
from producers.chunker import Chunker, TrajectoryStart
from producers.engines import make_engine
from producers.engines.base import Engine, Request, generate
from schemas.records import encode
from srl.kafka import Producer, create_topics
from srl.topics import Layout


@dataclass
class Case:
    name: str
    batch: int
    publish: bool


def _requests(engine: Engine, n: int, max_new_tokens: int, seed: int) -> list[Request]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"bench {i} " + "".join(rng.choice("abcdefghij") for _ in range(12)) + "="
        out.append(
            Request(uuid.uuid4().hex, engine.tokenize(text), max_new_tokens, temperature=1.0)
        )
    return out


def _run(
    engine: Engine, requests: list[Request], sink: Callable[[Any], None] | None
) -> tuple[int, float, float]:
    """Tokens, wall seconds and CPU seconds of this process (all its threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for e in generate(engine, requests):
        tokens += len(e.tokens)
        if sink is not None:
            sink(e)
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def run_bench(
    cfg: EngineBenchConfig, requests_n: int = 32, max_new_tokens: int = 64, repeats: int = 2
) -> dict[str, Any]:
    """Tokens/s of ``cfg``'s engine at batch 1, at ``cfg.max_batch``, and publishing at it."""

    layout = Layout.from_config(cfg)
    create_topics(cfg)
    results: dict[str, dict[str, float]] = {}
    cases = bench_cases(cfg.max_batch)
    engines = {c.batch: make_engine(cfg.model_copy(update={"max_batch": c.batch})) for c in cases}
    for e in engines.values():
        _no_eos(e)
    with Producer(cfg, "bench") as producer:
        for rep in range(repeats):
            for c in cases:
                engine = engines[c.batch]
                n = max(2, requests_n // 8) if c.batch == 1 else requests_n
                reqs = _requests(engine, n, max_new_tokens, seed=rep)
                sink = _publisher(cfg, layout, producer, reqs) if c.publish else None
                tokens, secs, cpu = _run(engine, reqs, sink)
                if c.publish:
                    t0, c0 = time.perf_counter(), time.process_time()
                    producer.flush()
                    secs += time.perf_counter() - t0
                    cpu += time.process_time() - c0
                keep_best(results.setdefault(c.name, dict(EMPTY_CASE)), tokens, secs, cpu)
    return {
        "engine": cfg.engine,
        "model": cfg.model,
        "device": cfg.device,
        "max_new_tokens": max_new_tokens,
        "chunk_tokens": cfg.chunk_tokens,
        "repeats": repeats,
        "cases": results,
        **speedups(results, cases),
        "simulated": bool(engines[1].simulated),
    }


def bench_cases(max_batch: int) -> list[Case]:
    """Batch 1, batch ``max_batch``, and batch ``max_batch`` publishing every token."""
    return [
        Case("batch1", 1, False),
        Case(f"batch{max_batch}", max_batch, False),
        Case(f"batch{max_batch}+publish", max_batch, True),
    ]


def _publisher(
    cfg: Any, layout: Layout, producer: Producer, reqs: list[Request]
) -> Callable[[Any], None]:
    """A sink that turns each emitted token batch into chunks (the generator's Chunker) and
    produces them to the first bucket's partitions of the trajectories topic."""
    bucket = layout.buckets[0]
    chunker = Chunker(cfg.chunk_tokens, "bench")
    for r in reqs:
        chunker.open(TrajectoryStart(r.key, "bench", "bench", 0, 1, bucket))

    def sink(e: Any) -> None:
        for ch in chunker.add(e.key, e.tokens, e.logprobs, 0, e.finish_reason):
            producer.produce(
                layout.trajectories,
                encode(ch),
                key=ch.trajectory_id,
                partition=layout.partition_for(bucket, ch.trajectory_id),
            )

    return sink


EMPTY_CASE = {
    "tokens": 0,
    "seconds": 0.0,
    "tokens_per_s": 0.0,
    "cpu_seconds": 0.0,
    "tokens_per_cpu_s": 0.0,
}


def keep_best(best: dict[str, float], tokens: int, secs: float, cpu: float) -> None:
    """Keep the best wall-clock rate and, separately, the best CPU rate of a case's repeats."""
    if tokens / secs > best["tokens_per_s"]:
        best.update(tokens=tokens, seconds=round(secs, 3), tokens_per_s=round(tokens / secs, 1))
    if tokens / cpu > best["tokens_per_cpu_s"]:
        best.update(cpu_seconds=round(cpu, 3), tokens_per_cpu_s=round(tokens / cpu, 1))


def speedups(results: dict[str, dict[str, float]], cases: list[Case]) -> dict[str, float]:
    """Batching speedup over batch 1 and the share of the rate that publishing costs, by
    wall clock and by CPU time."""
    plain, pub = results[cases[1].name]["tokens_per_s"], results[cases[2].name]["tokens_per_s"]
    plain_cpu = results[cases[1].name]["tokens_per_cpu_s"]
    pub_cpu = results[cases[2].name]["tokens_per_cpu_s"]
    return {
        "batch_speedup": round(plain / results["batch1"]["tokens_per_s"], 2),
        "publish_overhead": round(1 - pub / plain, 4),
        "batch_speedup_cpu": round(plain_cpu / results["batch1"]["tokens_per_cpu_s"], 2),
        "publish_overhead_cpu": round(1 - pub_cpu / plain_cpu, 4),
    }


def _no_eos(engine: Engine) -> None:
    """Fixed-length sequences: an hf engine never samples end-of-sequence in the benchmark."""
    model = getattr(engine, "model", None)
    eos = getattr(getattr(engine, "tokenizer", None), "eos_token_id", None)
    if model is None or eos is None:
        return
    with __import__("torch").no_grad():
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            head.bias[eos] = -1e4
        else:  # bias-free head: a hook on the logits
            head.register_forward_hook(
                lambda _m, _i, out: out.index_fill_(-1, _eos_index(out, eos), -1e4)
            )


def _eos_index(out: Any, eos: int) -> Any:
    import torch

    return torch.tensor([eos], device=out.device)
