"""The benchmarks' pure parts: configs of a pipeline mode, figures from events and offsets,
best-of-repeats bookkeeping, synthetic workloads. No broker, no model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.bench import dataplane, engine, pipeline, train
from app.bench.pipemodel import Workload
from consumers.config import TrainConfig
from schemas.records import MetricEvent
from srl.errors import SrlError
from srl.topics import Layout

SPLIT = {"instances": 2, "trainer_devices": 4}
TOP = {
    "bootstrap_servers": "b:1",
    "topic_prefix": "bench.x",
    "run": "pipe-x",
    "store": "file:///s",
    "prompt_partitions": 2,
    "linger_ms": 2.0,
}


@pytest.fixture
def workload(tmp_path: Path) -> Workload:
    hist = tmp_path / "h.csv"
    hist.write_text("# lo,hi,probability\n20,60,0.6\n60,200,0.3\n200,400,0.1\n")
    return Workload(lengths=str(hist), scale=0.5, iterations=3, max_staleness=2)


@pytest.mark.parametrize(
    ("mode", "k", "barrier", "predictor", "partitioning"),
    [
        ("colocated", 0, True, "baseline", "balanced"),
        ("sync", 0, True, "baseline", "key"),
        ("stream", 0, False, "oracle", "balanced"),
        ("async", 2, False, "baseline", "key"),
        ("async+skew", 2, False, "oracle", "balanced"),
    ],
)
def test_mode_configs(
    workload: Workload,
    mode: str,
    k: int,
    barrier: bool,
    predictor: str,
    partitioning: str,
) -> None:
    d, gens, t = pipeline.mode_configs(workload, mode, SPLIT, TOP, Path("/model"))
    assert (d.max_staleness, d.predictor, d.partitioning) == (k, predictor, partitioning)
    assert d.max_new_tokens == 201  # the histogram's longest length, scaled, plus one
    assert d.num_prompts == workload.groups_per_step * (3 + 2 + 2)
    assert [g.worker_id for g in gens] == ["gen-0", "gen-1"]
    assert [g.seed for g in gens] == [0, 1] and all(g.max_staleness == k for g in gens)
    assert gens[0].time_scale == 1 / workload.compression
    assert (t.max_staleness, t.sync_barrier, t.max_steps, t.model) == (k, barrier, 3, "/model")
    assert t.topic_prefix == "bench.x" and d.topic_prefix == "bench.x"


def test_the_design_sets_the_async_modes_only(workload: Workload) -> None:
    w = Workload(lengths=workload.lengths, design="unpaced")
    d, _, t = pipeline.mode_configs(w, "async", SPLIT, TOP, Path("/m"))
    assert (d.max_staleness, t.batching, t.stale_policy) == (None, "groups", "drop")
    d, _, t = pipeline.mode_configs(w, "sync", SPLIT, TOP, Path("/m"))
    assert (d.max_staleness, t.stale_policy) == (0, TrainConfig().stale_policy)


def sample(
    tid: str, outcome: str, tokens: int, step: int, staleness: int = 0, prompt: str = "p"
) -> MetricEvent:
    return MetricEvent(
        kind="sample",
        source="trainer",
        run="r",
        step=step,
        labels={"trajectory_id": tid, "outcome": outcome, "prompt_id": prompt},
        values={"tokens": float(tokens), "staleness": float(staleness)},
    )


def test_samples_step_work_and_figures() -> None:
    events = [
        sample("a", "dropped_stale", 5, 1),
        sample("a", "trained", 10, 2, 1),  # the last event of a trajectory counts
        sample("b", "trained", 30, 1),  # in the warm-up step: not measured
        sample("c", "dropped_stale", 20, 2, 3, prompt="q"),
        sample("d", "trained", 40, 3, 2),
        MetricEvent(kind="train_step", source="trainer", run="r", step=1),
    ]
    samples = pipeline.sample_outcomes(events)
    assert samples == {
        "a": ("trained", 10, 2, 1, "p"),
        "b": ("trained", 30, 1, 0, "p"),
        "c": ("dropped_stale", 20, 2, 3, "q"),
        "d": ("trained", 40, 3, 2, "p"),
    }
    work = pipeline.step_work([1, 2, 3], samples)
    assert [(w.step, list(w.lengths), w.trained_tokens, sorted(w.groups)) for w in work] == [
        (1, [30], 30, [(30, 30)]),
        (2, [10, 20], 10, [(10, 10), (20, 0)]),  # per group: longest, trained tokens
        (3, [40], 40, [(40, 40)]),
    ]
    assert pipeline.sample_figures(samples, [1, 2, 3], 10.0, 4.0, 8.0) == {
        "samples_per_s": 0.2,
        "trained_tokens_per_s": 5.0,
        "fraction_of_bound": 0.5,
        "generated_tokens": 100,
        "trained_tokens": 80,
        "dropped_tokens": 20,
        "dropped_token_fraction": 0.2,
        "mean_generated_tokens": 25.0,
        "mean_trained_tokens": 26.7,
        "generated": 4,
        "trained": 3,
        "dropped_stale": 1,
        "staleness_mean": 1.0,
        "staleness_max": 2,
    }
    empty = pipeline.sample_figures({}, [1], 0.0, 1.0, 0.0)
    assert empty["samples_per_s"] == empty["fraction_of_bound"] == empty["mean_trained_tokens"]
    assert empty["staleness_max"] == 0


def test_dataplane_phase_figures() -> None:
    spec = {"mode": "codec", "n": 100, "rate": 0}
    size = {"chunks": 400, "tokens": 50_000, "bytes": 2_000_000}
    assert dataplane.phase_result(spec, size, 2.0) == {
        "mode": "codec",
        "trajectories": 100,
        "chunks": 400,
        "tokens": 50_000,
        "bytes": 2_000_000,
        "wall_s": 2.0,
        "tokens_per_s": 25_000,
        "trajectories_per_s": 50.0,
        "mb_per_s": 1.0,
        "target_tokens_per_s": None,
    }
    assert dataplane.phase_result(spec | {"rate": 9}, size, 2.0)["target_tokens_per_s"] == 9
    ready = {f"t{i}": 1_000_000 * (i + 1) for i in range(101)}  # 1 .. 101 ms after its last chunk
    last = dict.fromkeys(ready, 0)
    assert dataplane.latency_figures(ready, last) == {
        "ready_latency_ms_p50": 51.0,
        "ready_latency_ms_p99": 100.0,
        "ready_latency_ms_p999": 100.9,
        "ready_latency_ms_max": 101.0,
        "latency_samples": 101,
    }


def test_dataplane_warm_up_is_left_out_of_the_latencies() -> None:
    # the first 10 trajectories finish in the warm-up (last chunk before 5 s) and are slow
    last = {f"t{i}": int(i * 1e9) for i in range(20)}
    ready = {t: v + (int(900e6) if v < 5e9 else int(10e6)) for t, v in last.items()}
    fig = dataplane.latency_figures(ready, last, since_ns=int(5e9))
    assert fig["latency_samples"] == 15 and fig["ready_latency_ms_max"] == 10.0
    assert dataplane.latency_figures(ready, last)["ready_latency_ms_max"] == 900.0
    with pytest.raises(SrlError):
        dataplane.latency_figures(ready, last, since_ns=int(100e9))


def test_dataplane_paced_phase_is_long_enough_and_its_spread() -> None:
    spec = {"n": 100, "mean_tokens": 500, "mode": "codec", "rate": 0}
    p = dataplane.paced_spec(spec, 10_000, paced_s=20.0, warmup_s=5.0)
    # 25 s of tokens, a tenth more
    assert p["n"] == 550 and p["rate"] == 10_000 and p["warmup_s"] == 5.0
    assert dataplane.paced_spec(spec, 100, 20.0, 5.0)["n"] == 100  # never fewer than asked
    runs = [
        {"ready_latency_ms_p50": a, "ready_latency_ms_p99": b, "ready_latency_ms_p999": c}
        for a, b, c in [(5, 20, 40), (4, 30, 90), (6, 25, 50)]
    ]
    sp = dataplane.spread(runs)
    assert sp["p99"] == {"median": 25.0, "min": 20, "max": 30}
    assert sp["p999"] == {"median": 50.0, "min": 40, "max": 90}


def test_dataplane_sizes_count_the_chunks_the_child_makes() -> None:
    layout = Layout("x")
    spec = {"n": 8, "mean_tokens": 50, "chunk_tokens": 16, "seed": 3}
    trajs = dataplane.make_trajectories(8, 50, 16, layout, 3)
    size = dataplane.phase_size(spec, layout)
    assert size["chunks"] == sum(len(t) for t in trajs)
    assert size["tokens"] == sum(c.n_tokens for t in trajs for c in t)
    assert size["bytes"] > size["tokens"]
    order = list(dataplane.interleave(trajs, 3))
    assert sorted(c.trajectory_id for c in order) == sorted(
        c.trajectory_id for t in trajs for c in t
    )


def test_engine_bench_keeps_the_best_rates_of_the_repeats_separately() -> None:
    cases = engine.bench_cases(8)
    assert [(c.name, c.batch, c.publish) for c in cases] == [
        ("batch1", 1, False),
        ("batch8", 8, False),
        ("batch8+publish", 8, True),
    ]
    best: dict[str, float] = dict(engine.EMPTY_CASE)
    engine.keep_best(best, 100, 2.0, 4.0)  # 50 tok/s, 25 tok/cpu-s
    engine.keep_best(best, 100, 1.0, 5.0)  # better wall rate, worse CPU rate
    assert best == {
        "tokens": 100,
        "seconds": 1.0,
        "tokens_per_s": 100.0,
        "cpu_seconds": 4.0,
        "tokens_per_cpu_s": 25.0,
    }
    results: dict[str, dict[str, Any]] = {
        "batch1": {"tokens_per_s": 10.0, "tokens_per_cpu_s": 20.0},
        "batch8": {"tokens_per_s": 80.0, "tokens_per_cpu_s": 100.0},
        "batch8+publish": {"tokens_per_s": 76.0, "tokens_per_cpu_s": 90.0},
    }
    assert engine.speedups(results, cases) == {
        "batch_speedup": 8.0,
        "publish_overhead": 0.05,
        "batch_speedup_cpu": 5.0,
        "publish_overhead_cpu": 0.1,
    }
    assert engine.EMPTY_CASE["tokens_per_s"] == 0.0  # keep_best worked on a copy


def test_train_bench_rows_and_model_shapes() -> None:
    rows = train.synthetic_rows(np.random.default_rng(0), 50)
    assert len(rows) == 50
    assert all(r.prompt_len == 32 and 16 <= r.loss_tokens <= 512 for r in rows)
    assert all(
        len(r.behav_logp) == r.loss_tokens and r.behav_logp.dtype == np.float32 for r in rows
    )
    again = train.synthetic_rows(np.random.default_rng(0), 50)
    assert [r.length for r in again] == [r.length for r in rows]  # the same seed, the same work
    assert train.model_spec("test").hidden_size == 64
    assert train.model_spec("default") == train.TinyModelSpec()


def test_the_bench_broker_choices_are_the_broker_engines() -> None:
    from app.bench.cli import ENGINES as CHOICES
    from srl.broker import ENGINES

    assert CHOICES == ENGINES
