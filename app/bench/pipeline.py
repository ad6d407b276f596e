"""``srl bench pipeline``: the pipeline modes side by side, SIMULATED engine and trainer.

Owns the pipeline figures of docs/benchmarks.md. What is real and what is simulated:

* real: the broker (each ``--broker``: ``app.bench.brokers``), the codec, the dispatcher
  (``producers.dispatcher``: release by trainer step, ordering), generator workers
  (``producers.worker``: intake, admission, chunking, weights following and swapping), the
  trainer loop (``consumers.trainer``: assembly, groups, steps, staleness gate, dynamic
  batches, weights publication through the object store and the weights topic, checkpoints,
  metric events);
* simulated: the generation engine (``producers.engines.sim``: each decode step sleeps
  ``PTL(BS) = 8.1 + 0.056·BS`` ms, WORKLOAD.md) and the trainer's compute (:class:`SimTrainEngine`
  sleeps ``F·P / (peak·MFU)`` seconds per completion token per device), both divided by the
  time-compression factor. Every figure is labelled simulated.

The modes and their splits are ``app.bench.pipemodel``'s; each runs on its own topics in one
run. ``design`` says how the async modes keep their staleness bound (:data:`DESIGNS`; the
default ``paced`` is what the roles do by default; the others are kept to measure against).
Called by ``app.bench.cli``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from app.bench.pipegather import gather_records
from app.bench.pipemodel import (
    BARRIER,
    DESIGNS,
    LPT_MODES,
    MODES,
    RANDOM_DISPATCH,
    StepWork,
    Workload,
    best_split,
    run_bound,
)
from app.bench.timeline import STEP_SEGMENTS, timeline
from app.report import metric_events
from app.sources import load_source
from consumers.config import TrainConfig
from consumers.train_engine import MicroBatch, StepStats
from consumers.trainer import Trainer
from producers import follower
from producers.config import DispatchConfig, GenerateConfig
from producers.dispatcher import run_dispatcher
from producers.engines.sim import SimEngine
from producers.pool_member import current_assignment
from producers.sources import make_predictor
from producers.worker import run_generator
from srl.errors import SrlError
from srl.kafka import create_topics
from srl.store import LocalStore
from srl.stores import store_from_config
from srl.tinymodel import TinyModelSpec, build_tiny_model
from srl.weights import MANIFEST
from srl.workload import LengthHistogram

log = logging.getLogger("app.bench")
MODEL_BATCHES = 32  # sampled steps the split model averages over


# -- the simulated parts ----------------------------------------------------------------------
class SimTrainEngine:
    """A ``consumers.train_engine.TrainEngine``: the modelled compute as a device queue; tiny
    real tensors.

    A micro-batch's compute is queued on a simulated device (``busy_until``) as CUDA kernels
    are: the trainer's Python goes on while the device works, and waits only when it queues a
    second micro-batch behind a running one, and at the step's end. ``stream``: each
    micro-batch is queued when it arrives (``backward``); otherwise all of a step's compute is
    queued in ``step`` (the synchronous trainer that waits for the batch).
    """

    def __init__(self, s_per_token_wall: float, stream: bool) -> None:
        import torch

        self.s_per_token = s_per_token_wall
        self.stream = stream
        self.busy_s = 0.0
        self.busy_until = 0.0
        self._pending = 0
        self._tensors = {"sim.weight": torch.zeros(1024)}  # published as a real version
        self.max_length = 1 << 30

    def _queue(self, tokens: int) -> None:
        seconds = tokens * self.s_per_token
        self.busy_s += seconds
        now = time.monotonic()
        if self.busy_until > now:  # one micro-batch in flight at most: wait for it
            time.sleep(self.busy_until - now)
            now = self.busy_until
        self.busy_until = now + seconds

    def _sync(self) -> None:
        now = time.monotonic()
        if self.busy_until > now:
            time.sleep(self.busy_until - now)

    def backward(self, mb: MicroBatch) -> None:
        tokens = int((mb.weight > 0).sum())
        if self.stream:
            self._queue(tokens)
        else:
            self._pending += tokens

    def step(self, normalizer: float) -> StepStats:

        t0 = time.monotonic()
        self._queue(self._pending)
        self._sync()
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

    sharded = False
    lockstep = False

    def export(self, dtype: Any = None) -> dict[str, Any]:
        return self._tensors

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {"layout": {}, "steps": {}, "param_groups": []}

    def load_checkpoint_state(self, shards: Any) -> None:
        return None


class LoggedSimEngine(SimEngine):
    """The sim engine, noting when its first decode step started: a run's time for the bound
    is measured from the first decode step of any engine (nothing is generated before). A
    swap sleeps ``load_wall_s``: a real-size version's load, decoding stopped."""

    first_decode: float | None = None
    load_wall_s: float = 0.0

    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        if self.load_wall_s > 0:
            time.sleep(self.load_wall_s)
        super().load_weights(tensors, version)

    def step(self) -> list[Any]:
        t0 = time.time()
        out = super().step()
        if out and self.first_decode is None:
            self.first_decode = t0
        return out


def sim_reward(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """The benchmark's reward: cheap, and varied inside a group (parity of the text length)."""
    return float(len(completion) % 2)


# -- one mode, for real ---------------------------------------------------------------------------
def mode_configs(
    w: Workload, mode: str, split: dict[str, Any], top: dict[str, Any], model_dir: Path
) -> tuple[Any, list[Any], Any]:
    """The dispatcher's, the generators' and the trainer's configs of one mode."""
    d_over, t_over = ({}, {}) if mode in BARRIER else DESIGNS[w.design]
    return (
        dispatch_config(w, mode, top, d_over),
        [generate_config(w, mode, top, i) for i in range(split["instances"])],
        train_config(w, mode, top, model_dir, t_over),
    )


def dispatch_config(
    w: Workload, mode: str, top: dict[str, Any], over: dict[str, Any]
) -> DispatchConfig:
    """The dispatcher of one mode: a window of one step's groups, released by trainer step,
    oracle lengths for the longest-first modes; ``over``: the design's own settings."""
    hist = LengthHistogram.from_file(w.lengths, w.scale)
    max_len = int(math.ceil(float(np.max(hist.hi)))) + 1
    B = w.groups_per_step
    dispatch = {
        "max_staleness": w.k(mode),
        "groups_per_step": B,
        "window": B,
        "max_pending": 2 * B,
        "partitioning": "key" if mode in RANDOM_DISPATCH else "balanced",
        "tasks_per_group": w.tasks_per_group,
    } | over
    return DispatchConfig(
        **top,
        task="sim",
        lengths=w.lengths,
        length_scale=w.scale,
        num_prompts=B * (w.iterations + w.max_staleness + 2),
        epochs=1000,
        group_size=w.group_size,
        max_new_tokens=max_len,
        seed=w.seed,
        predictor="oracle" if mode in LPT_MODES else "baseline",
        pools=("gen",),
        **dispatch,
    )


def generate_config(w: Workload, mode: str, top: dict[str, Any], i: int) -> GenerateConfig:
    """Generator instance ``i`` of one mode, on the simulated engine."""
    return GenerateConfig(
        **top,
        pool="gen",
        worker_id=f"gen-{i}",
        engine="sim",
        max_batch=w.b_max,
        chunk_tokens=w.chunk_tokens,
        max_staleness=w.k(mode),
        time_scale=1.0 / w.compression,
        sim_tokens_per_step=w.tokens_per_step,
        seed=w.seed + i,
        stats_interval_s=2.0,
        commit_interval_s=0.5,
        drain_timeout_s=0.0,
    )


def train_config(
    w: Workload, mode: str, top: dict[str, Any], model_dir: Path, over: dict[str, Any]
) -> TrainConfig:
    """The trainer of one mode (a barrier for ``colocated`` and ``sync``); ``over``: the
    design's own settings."""
    return TrainConfig(
        **top,
        model=str(model_dir),
        reward="app.bench.pipeline:sim_reward",
        groups_per_step=w.groups_per_step,
        max_staleness=w.k(mode),
        sync_barrier=mode in ("colocated", "sync"),
        max_steps=w.iterations,
        checkpoint_every=1000,
        micro_batch_tokens=65_536,
        expire_s=600.0,
        idle_exit_s=120.0,
        **over,
    )


def mode_settings(mode: str, split: dict[str, Any], bootstrap: str, work: Path) -> dict[str, Any]:
    """The settings every role of one mode shares: its own topics, run and store."""
    tag = uuid.uuid4().hex[:6]
    return {
        "bootstrap_servers": bootstrap,
        "topic_prefix": f"bench.{mode.replace('+', '-')}.{tag}",
        "run": f"pipe-{tag}",
        "store": f"file://{work / ('store-' + tag)}",
        "prompt_partitions": split["instances"],
        "linger_ms": 2.0,
    }


class RoleThreads:
    """The dispatcher and the generators of one mode, each on a daemon thread; the first
    error stops them all and is kept for after the run."""

    def __init__(
        self, dcfg: DispatchConfig, gcfgs: list[GenerateConfig], load_wall_s: float = 0.0
    ) -> None:
        prompts = load_source(dcfg)
        predictor = make_predictor(dcfg, prompts)
        self.stop = threading.Event()
        self.gcfgs = gcfgs
        self.errors: list[BaseException] = []
        self.engines = [
            LoggedSimEngine(c.max_batch, None, c.time_scale, c.seed, c.sim_tokens_per_step)
            for c in gcfgs
        ]
        for e in self.engines:
            e.load_wall_s = load_wall_s
        self.threads = [
            threading.Thread(
                target=self._guarded, args=(run_generator, c, self.stop, e), daemon=True
            )
            for c, e in zip(gcfgs, self.engines, strict=True)
        ]
        self.threads.append(
            threading.Thread(
                target=self._guarded,
                args=(run_dispatcher, dcfg, prompts, predictor, self.stop),
                daemon=True,
            )
        )

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # reported after the run
            self.errors.append(e)
            self.stop.set()

    def start(self, settle_timeout_s: float = 60.0) -> None:
        """The generators, then, once their pool has opened an epoch with every one of them
        (``producers.pool_member``: they start together, so the first epochs hold only some),
        the dispatcher: the run starts with every instance in, as a deployment's first step
        does when its workers are up before its dispatcher."""
        *gens, dispatcher = self.threads
        for th in gens:
            th.start()
        cfg, deadline = self.gcfgs[0], time.monotonic() + settle_timeout_s
        while cfg.pool_liveness and not self._all_joined(cfg, len(gens)):
            if self.errors or time.monotonic() > deadline:
                self.stop.set()
                raise SrlError(f"bench pipeline: {len(gens)} generators never joined one epoch")
            time.sleep(0.1)
        dispatcher.start()

    @staticmethod
    def _all_joined(cfg: GenerateConfig, members: int) -> bool:
        """Whether the pool's last opened epoch assigns every generator."""
        return len(current_assignment(cfg, cfg.consumer_group, 1.0)) >= members

    def join(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(timeout=60)

    def first_decode(self) -> float | None:
        """When the first decode step of any engine started (None: none ran)."""
        return min(
            (e.first_decode for e in self.engines if e.first_decode is not None), default=None
        )

    def gen_busy_sim_s(self) -> float:
        return sum(e.simulated_ms for e in self.engines) / 1000.0


class ChargedStore(LocalStore):
    """The trainer's store, whose manifest put (a version's last write) comes
    ``publish_wall_s`` after its start: a real-size version's upload, in the publisher's
    background thread."""

    def __init__(self, root: str | Path, publish_wall_s: float) -> None:
        super().__init__(root)
        self.publish_wall_s = publish_wall_s

    def put(self, key: str, data: bytes | memoryview) -> str:
        if key.endswith("/" + MANIFEST) and self.publish_wall_s > 0:
            time.sleep(self.publish_wall_s)
        return super().put(key, data)


@contextlib.contextmanager
def charged_fetch(wall_s: float) -> Iterator[None]:
    """Every follower's fetch (``producers.follower.fetch_tensors``: files read and sha256
    checked, in its own thread) takes at least ``wall_s`` while this is open."""
    real = follower.fetch_tensors
    if wall_s <= 0:
        yield
        return

    def fetch(store: Any, manifest: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        out = real(store, manifest, *args, **kw)
        time.sleep(max(0.0, wall_s - (time.monotonic() - t0)))
        return out

    follower.fetch_tensors = fetch
    try:
        yield
    finally:
        follower.fetch_tensors = real


def trainer_store(tcfg: TrainConfig, publish_wall_s: float) -> Any:
    """The trainer's store: charged for a real-size upload when there is one."""
    if publish_wall_s <= 0 or not tcfg.store.startswith("file://"):
        return store_from_config(tcfg)
    return ChargedStore(tcfg.store[len("file://") :], publish_wall_s)


def run_roles(
    w: Workload, mode: str, split: dict[str, Any], cfgs: tuple[Any, list[Any], Any]
) -> tuple[RoleThreads, SimTrainEngine, float]:
    """The roles of one mode until the trainer's last step, charged a real-size version's
    sync (``Workload.sync``, wall = simulated / compression): the roles, the trainer's
    compute engine, wall seconds."""
    dcfg, gcfgs, tcfg = cfgs
    wall = {p: v / w.compression for p, v in w.sync(mode).items()}
    roles = RoleThreads(dcfg, gcfgs, wall["load"])
    stream = mode not in ("colocated", "sync")
    sim_train = SimTrainEngine(
        w.train_s_per_token / split["trainer_devices"] / w.compression, stream
    )
    t0 = time.monotonic()
    with charged_fetch(wall["fetch"] + wall["verify"]):
        try:
            roles.start()
            store = trainer_store(tcfg, wall["publish"])
            Trainer(tcfg, sim_train, store, None, None).run()
        finally:
            elapsed = time.monotonic() - t0
            roles.join()
    if roles.errors:
        e = roles.errors[0]
        raise SrlError(f"bench pipeline {mode}: {type(e).__name__}: {e}")
    return roles, sim_train, elapsed


def run_mode(
    w: Workload, mode: str, split: dict[str, Any], bootstrap: str, model_dir: Path, work: Path
) -> dict[str, Any]:
    """One mode for real on its own topics: the roles on threads, the trainer in this one,
    then its figures from the trainer's metric events and its hand-off timeline."""
    top = mode_settings(mode, split, bootstrap, work)
    cfgs = mode_configs(w, mode, split, top, model_dir)
    dcfg, _gcfgs, tcfg = cfgs
    create_topics(dcfg)
    roles, sim_train, wall = run_roles(w, mode, split, cfgs)
    events = metric_events(tcfg, tcfg.run)
    out = summarize(
        w,
        mode,
        split,
        events,
        wall,
        roles.first_decode(),
        roles.gen_busy_sim_s(),
        sim_train.busy_s * w.compression,
    )
    out["design"] = "barrier" if mode in BARRIER else w.design
    out["sync_charged_s"] = {p: round(v, 3) for p, v in w.sync(mode).items()}
    out["timeline"] = timeline(gather_records(tcfg, tcfg.run, events), w.k(mode), w.compression)
    return out


Sample = tuple[str, int, int, int, str]  # (outcome, tokens, step, staleness, prompt_id)


def sample_outcomes(events: list[Any]) -> dict[str, Sample]:
    """Each trajectory's last ``sample`` event as (outcome, tokens, step, staleness,
    prompt_id: its group)."""
    samples: dict[str, Sample] = {}
    for e in events:
        if e.kind == "sample":
            samples[e.labels["trajectory_id"]] = (
                e.labels.get("outcome", ""),
                int(e.values.get("tokens", 0)),
                int(e.step or 0),
                int(e.values.get("staleness", 0)),
                str(e.labels.get("prompt_id", "")),
            )
    return samples


def step_work(order: list[int], samples: dict[str, Sample]) -> list[StepWork]:
    """Per step: the lengths of every sample finalized in it, the tokens it trained, and per
    group its longest sample and trained tokens."""
    groups: dict[tuple[int, str], list[int]] = {}
    for x in samples.values():
        g = groups.setdefault((x[2], x[4]), [0, 0])
        g[0] = max(g[0], x[1])
        g[1] += x[1] if x[0] == "trained" else 0
    return [
        StepWork(
            s,
            [x[1] for x in samples.values() if x[2] == s],
            sum(x[1] for x in samples.values() if x[0] == "trained" and x[2] == s),
            [(n, t) for (step, _), (n, t) in groups.items() if step == s],
        )
        for s in order
    ]


def summarize(
    w: Workload,
    mode: str,
    split: dict[str, Any],
    events: list[Any],
    wall: float,
    first_decode: float | None,
    gen_busy_sim_s: float,
    train_busy_sim_s: float,
) -> dict[str, Any]:
    """One mode's figures from the trainer's metric events (see docs/benchmarks.md)."""
    steps = {int(e.step): e for e in events if e.kind == "train_step" and e.step is not None}
    if len(steps) < w.iterations:
        raise SrlError(
            f"bench pipeline {mode}: {len(steps)} of {w.iterations} optimizer steps finished"
        )
    order = sorted(steps)
    first, last = steps[order[0]].ts_ms / 1000.0, steps[order[-1]].ts_ms / 1000.0
    span_sim = (last - first) * w.compression
    samples = sample_outcomes(events)
    paced = mode in BARRIER or DESIGNS[w.design][0].get("max_staleness", 0) is not None
    bound = run_bound(w, mode, split, step_work(order, samples), paced)
    # the whole run, from the first decode step (nothing can be generated before it)
    run_s = (last - (first if first_decode is None else first_decode)) * w.compression
    run_sim = wall * w.compression
    out = {
        **sample_figures(samples, order, span_sim, bound["bound_s"], run_s),
        "gen_idle": round(max(0.0, 1 - gen_busy_sim_s / (split["instances"] * run_sim)), 3),
        "train_idle": round(max(0.0, 1 - train_busy_sim_s / run_sim), 3),
        "span_s": round(span_sim, 2),
        "run_s": round(run_s, 2),
        "bound_s": round(bound["bound_s"], 2),
        "bound_steps_s": bound["steps_s"],
        "measured_tokens": sum(x[1] for x in samples.values() if _measured(x, order)),
        "steps": len(order),
        "measured_steps": len(order) - 1,
        "wall_s": round(wall, 1),
        "split": split,
    }
    # the trained tokens/s this mode would reach at the bound (for the plot)
    out["bound_tokens_per_s"] = (
        round(out["trained_tokens_per_s"] / out["fraction_of_bound"], 1)
        if out["fraction_of_bound"]
        else None
    )
    return out


def _measured(x: Sample, order: list[int]) -> bool:
    """A sample trained after the first (warm-up) step."""
    return x[0] == "trained" and x[2] in order[1:]


def sample_figures(
    samples: dict[str, Sample], order: list[int], span_sim: float, bound_s: float, run_s: float
) -> dict[str, Any]:
    """Rates over the measured span (steps after the first), the run against its bound, and
    what was generated, trained and dropped."""
    trained = [x for x in samples.values() if x[0] == "trained"]
    dropped = [x for x in samples.values() if x[0] == "dropped_stale"]
    measured = [x for x in trained if x[2] in order[1:]]
    measured_tokens = sum(x[1] for x in measured)
    gen_tokens = sum(x[1] for x in samples.values())
    stale = [x[3] for x in trained]
    rate = len(measured) / span_sim if span_sim > 0 else 0.0
    return {
        "samples_per_s": round(rate, 3),
        "trained_tokens_per_s": round(measured_tokens / span_sim, 1) if span_sim > 0 else 0.0,
        "fraction_of_bound": round(bound_s / run_s, 3) if run_s > 0 else 0.0,
        "generated_tokens": gen_tokens,
        "trained_tokens": sum(x[1] for x in trained),
        "dropped_tokens": sum(x[1] for x in dropped),
        "dropped_token_fraction": round(sum(x[1] for x in dropped) / max(1, gen_tokens), 4),
        "mean_generated_tokens": round(gen_tokens / len(samples), 1) if samples else 0.0,
        "mean_trained_tokens": round(sum(x[1] for x in trained) / len(trained), 1)
        if trained
        else 0.0,
        "generated": len(samples),
        "trained": len(trained),
        "dropped_stale": len(dropped),
        "staleness_mean": round(float(np.mean(stale)), 3) if stale else 0.0,
        "staleness_max": max(stale, default=0),
    }


def ratio(a: float, b: float | None) -> float | None:
    return round(a / b, 3) if b else None


def run(
    w: Workload, bootstrap: str, progress: Any = None, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """The ``modes`` on the broker at ``bootstrap``; ratios against ``colocated`` and ``sync``
    of the same run."""

    hist = LengthHistogram.from_file(w.lengths, w.scale)
    # the model's steps: per-prompt lengths as the sim task draws them (the same histogram)
    rng = np.random.default_rng(w.seed)
    batches = [hist.sample(w.groups_per_step, rng).astype(float) for _ in range(MODEL_BATCHES)]
    splits = {m: best_split(w, m, batches) for m in modes}
    out: dict[str, Any] = {"simulated": True, "time_compression": w.compression, "modes": {}}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="srl-bench-pipeline-")))
        # the trainer loads a tokenizer and HF files from a model directory; nothing is computed
        spec = TinyModelSpec(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        model_dir = build_tiny_model(work / "model", spec, seed=0)
        for mode in modes:
            if progress is not None:
                progress(mode, splits[mode])
            out["modes"][mode] = run_mode(w, mode, splits[mode], bootstrap, model_dir, work)
    base = {m: out["modes"].get(m, {}) for m in ("colocated", "sync")}
    for r in out["modes"].values():
        for m, b in base.items():
            r[f"ratio_vs_{m}"] = ratio(r["samples_per_s"], b.get("samples_per_s"))
            r[f"tokens_ratio_vs_{m}"] = ratio(
                r["trained_tokens_per_s"], b.get("trained_tokens_per_s")
            )
    out["settings"] = {k: getattr(w, k) for k in w.__dataclass_fields__} | {
        "batch": w.batch,
        "train_s_per_token_per_device": w.train_s_per_token,
    }
    return out


def plot(res: dict[str, dict[str, Any]], path: str) -> None:
    """Top: bars of trained tokens/s per mode with the bound of its split; below: each mode's
    hand-off timeline (the step chain's median segments, simulated seconds); a column per
    broker, labelled simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(res), figsize=(8 * len(res), 8.4), squeeze=False)
    top = max(
        max(m["trained_tokens_per_s"], m["bound_tokens_per_s"] or 0.0)
        for r in res.values()
        for m in r["modes"].values()
    )
    for i, (engine, r) in enumerate(res.items()):
        plot_rates(axes[0][i], engine, r, top)
        plot_timeline(axes[1][i], r)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rates(ax: Any, engine: str, r: dict[str, Any], top: float) -> None:
    """Trained tokens/s per mode against the bound of its split."""
    modes = list(r["modes"])
    rate = [r["modes"][m]["trained_tokens_per_s"] for m in modes]
    bound = [r["modes"][m]["bound_tokens_per_s"] or 0.0 for m in modes]
    x = np.arange(len(modes))
    ax.bar(x - 0.2, rate, 0.4, label="achieved")
    ax.bar(x + 0.2, bound, 0.4, label="bound of its split", alpha=0.5)
    for i, m in enumerate(modes):
        mm = r["modes"][m]
        ax.text(
            i - 0.2,
            rate[i],
            f"x{mm['tokens_ratio_vs_colocated']} coloc.\n"
            f"{mm['fraction_of_bound']:.0%} of bound\n"
            f"{mm['dropped_token_fraction']:.0%} dropped",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, modes)
    ax.set_ylim(0, top * 1.35)  # room for the labels above the bars
    ax.set_ylabel("trained tokens / s (simulated time)")
    gb = r.get("weights_sync", {}).get("model_bytes", 0) / 1e9
    ax.set_title(
        f"{engine} broker — SIMULATED engine and trainer (time /{r['time_compression']:g}, "
        f"weights {gb:.1f} GB)"
    )
    ax.legend(loc="upper left")


def plot_timeline(ax: Any, r: dict[str, Any]) -> None:
    """Each mode's step chain, trigger step's end to the step's end: median segments stacked
    (simulated seconds)."""
    modes = list(r["modes"])
    left = np.zeros(len(modes))
    for n in STEP_SEGMENTS:
        chains = [r["modes"][m]["timeline"]["step_chain"] for m in modes]
        width = np.array([c.get(n, {}).get("p50_sim_s", 0.0) for c in chains])
        ax.barh(np.arange(len(modes)), width, left=left, label=n)
        left += width
    ax.set_yticks(np.arange(len(modes)), modes)
    ax.invert_yaxis()
    ax.set_xlabel("simulated s: step t-1-k's end -> step t's end (median segments)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=7, ncol=7)
