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
the best run counts. One engine serves every case (its admission bound ``max_batch`` set per
case: every engine batches only what it admits), so a vLLM engine starts once.

``swap_pause_ms``: how long the engine stops decoding to swap weights, as a generator does it
(``WeightFollower.swap_into``: the chunker's open chunks flushed, then ``load_weights`` with
tensors already in memory), between two ``step()`` calls of a batch that is decoding; the
model directory's own tensors, perturbed, so every swap loads different weights; the median
over ``swaps``.

``run_engines`` runs several engines (``--engines hf,vllm``) one after the other on the same
model, requests and broker: the side-by-side figures of docs/benchmarks.md ("Generation").
Called by ``app.cli.producer``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def run_engines(
    cfg: EngineBenchConfig,
    requests_n: int = 32,
    max_new_tokens: int = 64,
    repeats: int = 2,
    swaps: int = 20,
) -> dict[str, Any]:
    """``run_bench`` of each of ``cfg.engines`` (else ``cfg.engine``), one after the other on
    the same model, requests and broker: ``{"engines": {name: result}}`` for several, the one
    result for one."""
    names = cfg.engines or (cfg.engine,)
    out = {
        name: run_bench(
            cfg.model_copy(update={"engine": name}), requests_n, max_new_tokens, repeats, swaps
        )
        for name in names
    }
    return out[names[0]] if len(names) == 1 else {"engines": out}


def run_bench(
    cfg: EngineBenchConfig,
    requests_n: int = 32,
    max_new_tokens: int = 64,
    repeats: int = 2,
    swaps: int = 20,
) -> dict[str, Any]:
    """Tokens/s of ``cfg``'s engine at batch 1, at ``cfg.max_batch``, and publishing at it;
    then its swap pause (``swaps`` swaps; 0: none)."""

    layout = Layout.from_config(cfg)
    create_topics(cfg)
    results: dict[str, dict[str, float]] = {}
    cases = bench_cases(cfg.max_batch)
    t0 = time.perf_counter()
    engine = make_engine(cfg)
    start_s = time.perf_counter() - t0
    try:
        _no_eos(engine)
        _run(engine, _requests(engine, 2, 8, seed=-1), None)  # warm-up: first calls' setup
        with Producer(cfg, "bench") as producer:
            for rep in range(repeats):
                for c in cases:
                    engine.max_batch = c.batch  # admission: what it decodes together
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
        engine.max_batch = cfg.max_batch
        swap = swap_pause(engine, Path(cfg.model), swaps) if swaps and cfg.model else {}
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return {
        "engine": cfg.engine,
        "model": cfg.model,
        "device": cfg.device,
        "max_batch": cfg.max_batch,
        "max_new_tokens": max_new_tokens,
        "chunk_tokens": cfg.chunk_tokens,
        "repeats": repeats,
        "engine_start_s": round(start_s, 1),
        "cases": results,
        **speedups(results, cases),
        **swap,
        "simulated": bool(engine.simulated),
    }


def swap_pause(engine: Engine, model_dir: Path, swaps: int) -> dict[str, Any]:
    """The decode stop of ``swaps`` weight swaps while ``engine.max_batch`` sequences decode
    (module docstring): the chunker flushed, then ``load_weights`` of the model directory's
    tensors, perturbed (two versions, alternating)."""
    import torch
    from safetensors.torch import load_file

    own: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        own |= load_file(str(f))
    versions = [{k: v + 0.001 * i for k, v in own.items()} for i in (1, 2)]
    chunker = Chunker(32, "bench-swap")
    warm = 3
    for i in range(engine.max_batch):
        key = f"swap-{uuid.uuid4().hex}"
        ids = engine.tokenize(f"swap {i} =")
        engine.add(Request(key, ids, swaps + warm + 8, temperature=1.0))
        chunker.open(TrajectoryStart(key, f"p{i}", "bench", 0, 1, "b0"))
    pauses: list[float] = []
    try:
        for s in range(swaps + warm):
            for e in engine.step():
                chunker.add(e.key, e.tokens, e.logprobs, engine.version, e.finish_reason)
            if s >= warm:  # the batch is decoding: swap between this step and the next
                t0 = time.perf_counter()
                chunker.flush_all()
                engine.load_weights(versions[s % 2], engine.version + 1)
                pauses.append((time.perf_counter() - t0) * 1000)
    finally:
        engine.abort_all()
    return {
        "swap_pause_ms": round(statistics.median(pauses), 3),
        "swap_pause_ms_p90": round(sorted(pauses)[int(0.9 * (len(pauses) - 1))], 3),
        "swap_pause_ms_max": round(max(pauses), 3),
        "swaps": len(pauses),
        "swap_batch": engine.max_batch,
        "swap_model_params": sum(t.numel() for t in own.values()),
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
    """Fixed-length sequences: an engine never samples end-of-sequence in the benchmark (vllm:
    its own ``ignore_eos``; hf: the end-of-sequence logit masked)."""
    if hasattr(engine, "ignore_eos"):
        engine.ignore_eos = True
        return
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
