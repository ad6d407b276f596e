"""``srl bench pipeline``: the four pipeline modes side by side, SIMULATED engine and trainer.

Owns the pipeline figures of docs/benchmarks.md. What is real and what is simulated:

* real: the embedded broker, the codec, the dispatcher (``producers.dispatcher``: barrier,
  backlog bound, ordering), generator workers (``producers.worker``: intake, admission,
  chunking, weights following and swapping), the trainer loop (``consumers.trainer``:
  assembly, groups, staleness gate, dynamic batches, weights publication through the object
  store and the weights topic, checkpoints, metric events);
* simulated: the generation engine (``producers.engines.sim``: each decode step sleeps
  ``PTL(BS) = 8.1 + 0.056·BS`` ms, WORKLOAD.md) and the trainer's compute (:class:`SimTrainEngine`
  sleeps ``F·P / (peak·MFU)`` seconds per completion token per device), both divided by the
  time-compression factor. Every figure is labelled simulated.

The modes (WORKLOAD.md, "Fair comparison"), each on its own topics in one run:

* ``sync``: dispatcher barrier (one step of prompts per policy version), random dispatch and
  FIFO admission, the trainer computes only when the step's groups are all in (no streaming);
* ``stream``: the same barrier, but micro-batches are computed as they fill (StreamRL-Sync);
* ``async``: no barrier, ``max_staleness`` k = 1 (``--max-staleness``), random dispatch, FIFO;
* ``async+skew``: ``async`` with length-aware dispatch and longest-first admission from oracle
  lengths (``--predictor oracle``; the demo task's ranker is within 0.5 % of oracle in
  docs/benchmarks.md "Skewness"). Migration is not used (one generator pool).

Resources: ``devices`` in total; each mode gets the split (generator instances, trainer
devices) that minimises its own modelled iteration time (:func:`best_split`). The bound of
a split is WORKLOAD.md's ``max(generation bound, training time)`` per iteration.
Called by ``srl.bench.cli``.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from producers.workload import LengthHistogram
from ranker.schedule import PtlModel
from ranker.simulate import lower_bound
from srl.errors import SrlError

log = logging.getLogger("srl.bench")
MODES = ("sync", "stream", "async", "async+skew")
MODEL_BATCHES = 32  # sampled steps the split model averages over


@dataclass(frozen=True)
class Workload:
    """One benchmark setting (simulated seconds unless named ``_wall``)."""

    lengths: str
    scale: float = 0.25
    devices: int = 6  # generator instances + trainer devices, the same for every mode
    b_max: int = 16  # KV-capped decode batch of an instance
    groups_per_step: int = 12
    group_size: int = 8
    iterations: int = 12  # optimizer steps per mode (the first is warm-up, not measured)
    params: float = 7e9  # the modelled policy (WORKLOAD.md: 7B)
    flops_per_token: float = 9.0  # F per parameter (GRPO)
    peak_flops: float = 989e12  # H800 bf16 dense
    mfu: float = 0.3
    compression: float = 20.0  # simulated seconds per wall second
    tokens_per_step: int = 16  # sim engine tokens per decode step
    chunk_tokens: int = 256
    max_staleness: int = 1  # k of the async modes (1: StreamRL-Async)
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def train_s_per_token(self) -> float:
        """Simulated training seconds per completion token on one device."""
        return self.flops_per_token * self.params / (self.peak_flops * self.mfu)


# -- the simulated trainer compute -----------------------------------------------------------
class SimTrainEngine:
    """Stand-in for ``consumers.engine.Engine``: sleeps the modelled compute; tiny real tensors.

    ``stream``: each micro-batch's time is spent when it arrives (``backward``); otherwise all
    of a step's time is spent in ``step`` (the synchronous trainer that waits for the batch).
    """

    def __init__(self, s_per_token_wall: float, stream: bool) -> None:
        import torch

        self.s_per_token = s_per_token_wall
        self.stream = stream
        self.busy_s = 0.0
        self._pending = 0
        self._tensors = {"sim.weight": torch.zeros(1024)}  # published as a real version
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1 << 30))

    def _spend(self, tokens: int) -> None:
        seconds = tokens * self.s_per_token
        self.busy_s += seconds
        time.sleep(seconds)

    def backward(self, mb: Any) -> None:
        tokens = int((mb.weight > 0).sum())
        if self.stream:
            self._spend(tokens)
        else:
            self._pending += tokens

    def step(self, normalizer: float) -> Any:
        from consumers.engine import StepStats

        t0 = time.monotonic()
        self._spend(self._pending)
        self._pending = 0
        return StepStats(compute_s=time.monotonic() - t0)

    def discard(self) -> None:
        self._pending = 0

    def optimizer_state(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        return None

    def tensors(self) -> dict[str, Any]:
        return self._tensors

    def load_tensors(self, tensors: dict[str, Any]) -> None:
        return None


def sim_reward(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """The benchmark's reward: cheap, and varied inside a group (parity of the text length)."""
    return float(len(completion) % 2)


# -- the time model: splits and bounds ---------------------------------------------------------
def _finish_times(lengths: np.ndarray, cap: int, ptl: PtlModel) -> np.ndarray:
    """Seconds at which each sample of one instance finishes, admitted in the given order."""
    finish = np.zeros(len(lengths))
    running: list[tuple[int, int]] = []  # (decode step at which it finishes, index)
    step, t_ms, nxt = 0, 0.0, 0
    while nxt < len(lengths) or running:
        while nxt < len(lengths) and len(running) < cap:
            heapq.heappush(running, (step + max(1, int(lengths[nxt])), nxt))
            nxt += 1
        end = running[0][0]
        t_ms += (end - step) * ptl(len(running))
        step = end
        while running and running[0][0] == step:
            finish[heapq.heappop(running)[1]] = t_ms / 1000.0
    return finish


def model_iteration(w: Workload, mode: str, group_lengths: np.ndarray, instances: int,
                    devices: int) -> dict[str, float]:  # fmt: skip
    """Modelled seconds of one iteration, as the system runs it.

    With the barrier (``sync``, ``stream``) generation is the makespan of the step's groups,
    tail included: a task (one group, every sample of a prompt the same length) goes to one
    instance, dealt by key (random), FIFO. Without it (``async``, ``async+skew``) the next
    step's groups fill the tail, so generation runs in steady state (every instance at
    ``B_max``), but no faster than the longest sample allows: it must finish within ``k + 1``
    iterations of starting or it is dropped as stale."""
    ptl = PtlModel()
    per_group = group_lengths * w.group_size * w.train_s_per_token / devices
    train_s = float(per_group.sum())
    if mode not in ("sync", "stream"):  # async: generation of step i+1 overlaps training of step i
        steady = float(group_lengths.sum()) * w.group_size * ptl(w.b_max) / (instances * w.b_max)
        window = float(group_lengths.max()) * ptl(w.b_max) / (1 + w.max_staleness)
        gen_s = max(steady, window) / 1000.0
        return {"gen_s": gen_s, "train_s": train_s, "iteration_s": max(gen_s, train_s)}
    deal = np.random.default_rng(w.seed).permutation(len(group_lengths))
    done = np.zeros(len(group_lengths))
    for i in range(instances):
        mine = deal[i::instances]
        samples = np.repeat(group_lengths[mine], w.group_size)
        done[mine] = (
            _finish_times(samples, w.b_max, ptl).reshape(len(mine), w.group_size).max(axis=1)
        )
    gen_s = float(done.max())
    if mode == "sync":
        t = gen_s + train_s
    else:  # stream: each group trains as soon as it is complete and the trainer is free
        t = 0.0
        for j in np.argsort(done, kind="stable"):
            t = max(t, done[j]) + per_group[j]
    return {"gen_s": gen_s, "train_s": train_s, "iteration_s": float(t)}


def best_split(w: Workload, mode: str, batches: list[np.ndarray]) -> dict[str, Any]:
    """The (instances, trainer devices) split minimising ``mode``'s modelled iteration time,
    averaged over ``batches`` (per-group lengths of sampled steps: one step's longest sample
    varies a lot); with WORKLOAD.md's bound of that split (per iteration, averaged the same way)."""
    ptl = PtlModel()
    best: dict[str, Any] | None = None
    for n in range(1, w.devices):
        ms = [model_iteration(w, mode, g, n, w.devices - n) for g in batches]
        mean = {k: float(np.mean([m[k] for m in ms])) for k in ("iteration_s", "gen_s", "train_s")}
        if best is None or mean["iteration_s"] < best["model_iteration_s"]:
            bound = np.mean([max(lower_bound(np.repeat(g, w.group_size), n, w.b_max, ptl), m["train_s"])
                             for g, m in zip(batches, ms, strict=True)])  # fmt: skip
            best = {"instances": n, "trainer_devices": w.devices - n,
                    "model_iteration_s": round(mean["iteration_s"], 2), "model_gen_s": round(mean["gen_s"], 2),
                    "model_train_s": round(mean["train_s"], 2), "bound_iteration_s": round(float(bound), 2)}  # fmt: skip
    assert best is not None
    return best


# -- one mode, for real ---------------------------------------------------------------------------
def run_mode(
    w: Workload, mode: str, split: dict[str, Any], bootstrap: str, model_dir: Path, work: Path
) -> dict[str, Any]:
    from consumers.config import TrainConfig
    from consumers.trainer import Trainer
    from producers.config import DispatchConfig, GenerateConfig
    from producers.dispatcher import run_dispatcher
    from producers.engines.sim import SimEngine
    from producers.sources import load_source, make_predictor
    from producers.worker import run_generator
    from srl.kafka import create_topics
    from srl.report import metric_events
    from srl.store import open_store

    tag = uuid.uuid4().hex[:6]
    barrier = mode in ("sync", "stream")
    n, g = split["instances"], split["trainer_devices"]
    top = {"bootstrap_servers": bootstrap, "topic_prefix": f"bench.{mode.replace('+', '-')}.{tag}",
           "run": f"pipe-{tag}", "store": f"file://{work / ('store-' + tag)}", "prompt_partitions": n,
           "linger_ms": 2.0}  # fmt: skip
    hist = LengthHistogram.load(w.lengths, w.scale)
    max_len = int(math.ceil(float(np.max(hist.hi)) * w.scale)) + 1
    dcfg = DispatchConfig(**top, task="sim", lengths=w.lengths, length_scale=w.scale,
                          num_prompts=w.groups_per_step * (w.iterations + 2), epochs=1000, group_size=w.group_size,
                          max_new_tokens=max_len, seed=w.seed,
                          predictor="oracle" if mode == "async+skew" else "baseline",
                          window=w.groups_per_step, sync_barrier=barrier, groups_per_step=w.groups_per_step,
                          max_pending=None if barrier else 2 * w.groups_per_step, pools=("gen",))  # fmt: skip
    gcfgs = [
        GenerateConfig(
            **top,
            pool="gen",
            worker_id=f"gen-{i}",
            engine="sim",
            max_batch=w.b_max,
            chunk_tokens=w.chunk_tokens,
            max_staleness=0 if barrier else w.max_staleness,
            time_scale=1.0 / w.compression,
            sim_tokens_per_step=w.tokens_per_step,
            seed=w.seed + i,
            stats_interval_s=2.0,
            commit_interval_s=0.5,
            drain_timeout_s=0.0,
        )  # fmt: skip
        for i in range(n)
    ]
    tcfg = TrainConfig(**top, model=str(model_dir), reward="srl.bench.pipeline:sim_reward",
                       groups_per_step=w.groups_per_step, max_staleness=0 if barrier else w.max_staleness,
                       sync_barrier=barrier, max_steps=w.iterations, checkpoint_every=1000,
                       micro_batch_tokens=65_536, expire_s=600.0, idle_exit_s=120.0)  # fmt: skip
    create_topics(dcfg)
    prompts = load_source(dcfg)
    predictor = make_predictor(dcfg, prompts)
    stop = threading.Event()
    errors: list[BaseException] = []
    engines = [
        SimEngine(c.max_batch, None, c.time_scale, c.seed, c.sim_tokens_per_step) for c in gcfgs
    ]

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # reported after the run
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(run_generator, c, stop, e), daemon=True)
               for c, e in zip(gcfgs, engines, strict=True)]  # fmt: skip
    threads.append(threading.Thread(target=guarded, args=(run_dispatcher, dcfg, prompts, predictor, stop),
                                    daemon=True))  # fmt: skip
    sim_train = SimTrainEngine(w.train_s_per_token / g / w.compression, stream=mode != "sync")
    t0 = time.monotonic()
    for th in threads:
        th.start()
    try:
        Trainer(tcfg, sim_train, open_store(tcfg.store), None, None).run()  # type: ignore[arg-type]
    finally:
        wall = time.monotonic() - t0
        stop.set()
        for th in threads:
            th.join(timeout=60)
    if errors:
        raise SrlError(f"bench pipeline {mode}: {type(errors[0]).__name__}: {errors[0]}")
    events = metric_events(tcfg, tcfg.run)
    return summarize(w, mode, split, events, wall, sum(e.simulated_ms for e in engines) / 1000.0,
                     sim_train.busy_s * w.compression)  # fmt: skip


def summarize(w: Workload, mode: str, split: dict[str, Any], events: list[Any], wall: float,
              gen_busy_sim_s: float, train_busy_sim_s: float) -> dict[str, Any]:  # fmt: skip
    steps = {int(e.step): e for e in events if e.kind == "train_step" and e.step is not None}
    if len(steps) < w.iterations:
        raise SrlError(
            f"bench pipeline {mode}: {len(steps)} of {w.iterations} optimizer steps finished"
        )
    order = sorted(steps)
    first, last = steps[order[0]], steps[order[-1]]
    measured = sum(int(steps[s].values["samples"]) for s in order[1:])
    span_sim = (last.ts_ms - first.ts_ms) / 1000.0 * w.compression
    rate = measured / span_sim if span_sim > 0 else 0.0
    trained: dict[str, tuple[int, int, int]] = {}  # trajectory id -> (staleness, tokens, step)
    dropped: dict[str, int] = {}  # trajectory id -> tokens
    for e in events:
        if e.kind != "sample":
            continue
        tokens = int(e.values.get("tokens", 0))
        if e.labels.get("outcome") == "trained":
            trained[e.labels["trajectory_id"]] = (
                int(e.values.get("staleness", 0)),
                tokens,
                int(e.step or 0),
            )
        elif e.labels.get("outcome") == "dropped_stale":
            dropped[e.labels["trajectory_id"]] = tokens
    stale = [s for s, _, _ in trained.values()]
    # tokens trained in the measured steps: a mode that drops long samples as stale trains
    # shorter ones, so its samples/s flatters it; tokens/s does not
    measured_tokens = sum(t for _, t, s in trained.values() if s in order[1:])
    all_tokens = sum(t for _, t, _ in trained.values())
    run_sim = wall * w.compression
    bound_rate = w.batch / split["bound_iteration_s"]
    return {
        "samples_per_s": round(rate, 3), "fraction_of_bound": round(rate / bound_rate, 3),
        "gen_idle": round(max(0.0, 1 - gen_busy_sim_s / (split["instances"] * run_sim)), 3),
        "train_idle": round(max(0.0, 1 - train_busy_sim_s / run_sim), 3),
        "staleness_mean": round(float(np.mean(stale)), 3) if stale else 0.0,
        "staleness_max": max(stale, default=0), "trained": len(trained), "dropped_stale": len(dropped),
        "trained_tokens_per_s": round(measured_tokens / span_sim, 1) if span_sim > 0 else 0.0,
        "mean_trained_tokens": round(all_tokens / len(trained), 1) if trained else 0.0,
        "dropped_token_fraction": round(sum(dropped.values()) / max(1, all_tokens + sum(dropped.values())), 3),
        "steps": len(order), "measured_steps": len(order) - 1, "wall_s": round(wall, 1),
        "bound_samples_per_s": round(bound_rate, 3), "split": split,
    }  # fmt: skip


def run(w: Workload, external: str | None = None, progress: Any = None) -> dict[str, Any]:
    """Every mode on one broker; ratios against ``sync`` of the same run."""
    from srl.tinymodel import TinyModelSpec, build_tiny_model

    hist = LengthHistogram.load(w.lengths, w.scale)
    # the model's steps: per-prompt lengths as the sim task draws them (the same histogram)
    rng = np.random.default_rng(w.seed)
    batches = [hist.sample(w.groups_per_step, rng).astype(float) for _ in range(MODEL_BATCHES)]
    splits = {m: best_split(w, m, batches) for m in MODES}
    out: dict[str, Any] = {"simulated": True, "time_compression": w.compression, "modes": {}}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="srl-bench-pipeline-")))
        # the trainer loads a tokenizer and HF files from a model directory; nothing is computed
        spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        model_dir = build_tiny_model(work / "model", spec, seed=0)
        if external is None:
            from srl.broker import EmbeddedBroker

            bootstrap = stack.enter_context(EmbeddedBroker()).bootstrap
        else:
            bootstrap = external
        for mode in MODES:
            if progress is not None:
                progress(mode, splits[mode])
            out["modes"][mode] = run_mode(w, mode, splits[mode], bootstrap, model_dir, work)
    base = out["modes"]["sync"]["samples_per_s"]
    base_tokens = out["modes"]["sync"]["trained_tokens_per_s"]
    for r in out["modes"].values():
        r["ratio_vs_sync"] = round(r["samples_per_s"] / base, 3) if base else None
        r["tokens_ratio_vs_sync"] = (
            round(r["trained_tokens_per_s"] / base_tokens, 3) if base_tokens else None
        )
    out["settings"] = {k: getattr(w, k) for k in w.__dataclass_fields__} | {
        "batch": w.batch,
        "train_s_per_token_per_device": w.train_s_per_token,
    }
    return out


def plot(r: dict[str, Any], path: str) -> None:
    """Bars of samples/s per mode with the bound, labelled simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(r["modes"])
    rate = [r["modes"][m]["samples_per_s"] for m in modes]
    bound = [r["modes"][m]["bound_samples_per_s"] for m in modes]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(modes))
    ax.bar(x - 0.2, rate, 0.4, label="achieved")
    ax.bar(x + 0.2, bound, 0.4, label="bound of its split", alpha=0.5)
    for i, m in enumerate(modes):
        mm = r["modes"][m]
        ax.text(i - 0.2, rate[i], f"x{mm['ratio_vs_sync']}\n(tokens x{mm['tokens_ratio_vs_sync']})",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(x, modes)
    ax.set_ylim(0, max(rate + bound) * 1.2)  # room for the labels above the bars
    ax.set_ylabel("samples / s (simulated time)")
    ax.set_title(
        f"srl bench pipeline — SIMULATED engine and trainer (time /{r['time_compression']:g})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
