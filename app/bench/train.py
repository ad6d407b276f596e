"""Trainer compute throughput: completion tokens per second of forward/backward + AdamW.

``python -m app.bench.train [--steps 5] [--groups 4] [--n 4] [--budget 4096] [--spec default|test]
[--packing/--no-packing]`` builds the tiny HF model locally, makes synthetic rows (prompt 32
tokens, completion lengths log-normal around 128, clipped to [16, 512]) and times
``make_micro_batch`` → ``Engine.backward`` → ``Engine.step`` for each step, after one warm-up
step; the budget counts what the engine computes, as the trainer's (``consumers.batcher``).
No Kafka: this is the compute side alone; the end-to-end rate is the ``tokens_per_s`` of
``train_step`` events. Prints one JSON object; ``padded_tokens`` are the tokens computed.
Numbers for docs/benchmarks.md ("Training").
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import click

from app.cli.common import echo_json
from consumers.batcher import Row, pack
from consumers.config import TrainConfig
from consumers.engine import Engine
from consumers.train_engine import make_micro_batch
from srl.config import load_config
from srl.tinymodel import TinyModelSpec, build_tiny_model


@click.command()
@click.option("--steps", default=5, show_default=True, help="Timed steps (after one warm-up).")
@click.option("--groups", default=4, show_default=True, help="Groups per step.")
@click.option("--n", default=4, show_default=True, help="Samples per group.")
@click.option("--budget", default=4096, show_default=True, help="Micro-batch token budget.")
@click.option(
    "--spec",
    type=click.Choice(["default", "test"]),
    default="default",
    show_default=True,
    help="default: TinyModelSpec() (~0.9M params); test: the test fixture's smaller one.",
)
@click.option("--threads", default=0, help="torch threads; 0: torch's default.")
@click.option(
    "--packing/--no-packing",
    default=None,
    help="Pack each micro-batch into one row (TrainConfig.packing). [default: the trainer's]",
)
def main(
    steps: int, groups: int, n: int, budget: int, spec: str, threads: int, packing: bool | None
) -> None:
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(tmp, model_spec(spec))
        cli = {"model": str(model_dir), "device": "cpu", "lr": 1e-5, "packing": packing}
        cfg = load_config(TrainConfig, cli={k: v for k, v in cli.items() if v is not None}, env={})
        engine = Engine(cfg)
        params = sum(p.numel() for p in engine.params)
        times, tokens, padded = time_steps(engine, rng, steps, groups * n, budget)
    echo_json(
        {
            "spec": spec,
            "params": params,
            "steps": steps,
            "rows_per_step": groups * n,
            "budget": budget,
            "packing": cfg.packing,
            "threads": torch.get_num_threads(),
            "completion_tokens": tokens,
            "padded_tokens": padded,
            "seconds": round(sum(times), 3),
            "tokens_per_s": round(tokens / sum(times), 1),
            "step_s_median": round(float(np.median(times)), 3),
        }
    )


def model_spec(name: str) -> TinyModelSpec:
    """``default``: TinyModelSpec(); ``test``: the test fixture's smaller shape."""
    if name == "default":
        return TinyModelSpec()
    return TinyModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def synthetic_rows(rng: Any, count: int) -> list[Row]:
    """``count`` rows: a 32-token prompt, a completion of log-normal length around 128
    (clipped to [16, 512]), random behaviour log-probs and advantage."""
    import numpy as np

    rows = []
    for _ in range(count):
        length = int(np.clip(rng.lognormal(np.log(128), 0.6), 16, 512))
        ids = rng.integers(4, 260, 32 + length)
        rows.append(
            Row("t", ids, 32, -rng.random(length).astype(np.float32) * 5, float(rng.normal()))
        )
    return rows


def time_steps(
    engine: Engine, rng: Any, steps: int, rows_per_step: int, budget: int
) -> tuple[list[float], int, int]:
    """Seconds of each timed step (after one warm-up), completion and padded tokens."""
    times, tokens, padded = [], 0, 0
    for step in range(steps + 1):
        rows = synthetic_rows(rng, rows_per_step)
        t0 = time.perf_counter()
        for mb in pack([r.length for r in rows], budget, engine.cfg.packing):
            engine.backward(make_micro_batch([rows[i] for i in mb], seq_mean=False))
        stats = engine.step(float(sum(r.loss_tokens for r in rows)))
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
            tokens += sum(r.loss_tokens for r in rows)
            padded += stats.padded_tokens
    return times, tokens, padded


if __name__ == "__main__":
    main()
