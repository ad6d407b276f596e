"""The demo's audit and report: what was generated, trained, dropped, pending or lost, and plots.

Owns ``OUT/report.json`` and ``OUT/report.png``. Everything is read back from where the roles
left it, never from the roles' own summaries:

* the trajectories topic, scanned to its high watermark: a trajectory is *generated* when its
  chunks ``0..last`` are all there (``is_last`` seen); a chunk seen twice at the same
  ``(trajectory_id, seq)`` is a duplicate;
* the metrics topic: ``sample`` events (docs/metrics.md) give each trajectory's outcome,
  deduplicated by ``(trajectory_id, step)`` because a restarted trainer re-sends them;
  ``train_step`` events give the per-step series;
* the trainer group's committed offsets: a generated trajectory with no outcome whose first
  chunk lies at or after its partition's committed offset is *pending* — the run ended
  before the trainer read it; it is still in Kafka and a continued run trains it. One with no
  outcome below the committed offset is *lost*: the trainer moved past it without deciding it;
* the object store: the last published version is materialised into ``OUT/final-model`` and
  evaluated greedily on the held-out prompts.

Called by ``app.demo``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from app import warmstart
from schemas.records import MetricEvent, SchemaError, TrajectoryChunk, decode_as
from srl.errors import SrlError
from srl.kafka import committed_offsets, read_range, watermarks
from srl.lineage import Lineage
from srl.stores import store_from_config
from srl.topics import Layout, trainer_group
from srl.weights import load_manifest, materialize, read_announcements

if TYPE_CHECKING:
    from app.demoplan import Fleet, Plan
    from srl.config import CommonConfig

log = logging.getLogger("app.report")

EVAL_SEED = 20261122  # the held-out evaluation prompts are the same for every run and seed
SAMPLE_OUTCOMES = ("trained", "dropped_stale", "failed_reward", "expired", "invalid")


# -- reading topics ----------------------------------------------------------------------------
def read_all(
    cfg: CommonConfig, topic: str, timeout_s: float = 30.0
) -> Iterator[tuple[int, int, bytes]]:
    """Every record of ``topic`` up to the high watermarks at call time: (partition, offset,
    value). A read that times out is logged and ends there (the report says what it saw)."""
    try:
        for msg in read_range(cfg, topic, timeout_s=timeout_s, role="demo-report"):
            yield msg.partition() or 0, msg.offset() or 0, msg.value() or b""
    except SrlError as e:
        log.warning("%s", e)


def passed_commit(firsts: dict[int, int], committed: dict[int, int | None]) -> bool:
    """Some record of a trajectory (``firsts``: its first offset on each partition it spans; a
    migrated one's chunks lie in two buckets' partitions) lies below the committed offset of
    its partition: a restarted trainer would not read it again, so undecided it is lost, not
    pending (the commit rule never allows that: ``consumers.offsets``)."""
    return any((committed.get(p) or 0) > first for p, first in firsts.items())


@dataclass
class TrajSeen:
    firsts: dict[int, int]  # partition -> the trajectory's first offset there
    lineage: Lineage = field(default_factory=Lineage)  # the chunks that count, as trained
    first_ms: int = 0
    last_ms: int = 0
    versions: set[int] = field(default_factory=set)
    workers: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.lineage.complete()

    @property
    def tokens(self) -> int:
        return sum(c.n_tokens for c in self.lineage.chunks.values())


@dataclass
class Audit:
    trajectories: dict[str, TrajSeen]
    duplicate_chunks: int
    undecodable: int
    outcomes: dict[str, str]
    decided_twice: int
    committed: dict[int, int | None]

    @property
    def generated(self) -> set[str]:
        return {t for t, s in self.trajectories.items() if s.complete}

    def pending(self) -> set[str]:
        return {
            t
            for t in self.generated - set(self.outcomes)
            if not passed_commit(self.trajectories[t].firsts, self.committed)
        }

    def lost(self) -> set[str]:
        return self.generated - set(self.outcomes) - self.pending()


def audit_trajectories(cfg: CommonConfig, group: str, samples: list[Any]) -> Audit:

    layout = Layout.from_config(cfg)
    seen: dict[str, TrajSeen] = {}
    dup = bad = 0
    for p, o, value in read_all(cfg, layout.trajectories):
        try:
            ch = decode_as(value, TrajectoryChunk)
        except SchemaError:
            bad += 1
            continue
        s = seen.get(ch.trajectory_id)
        if s is None:
            s = seen[ch.trajectory_id] = TrajSeen({p: o}, first_ms=ch.created_ms)
        if s.lineage.add(ch) != "kept":  # a copy, or a fenced (zombie) writer's chunk
            dup += 1
            continue
        s.firsts[p] = min(s.firsts.get(p, o), o)
        s.first_ms = min(s.first_ms, ch.created_ms)
        s.last_ms = max(s.last_ms, ch.created_ms)
        s.versions.add(ch.policy_version)
        s.workers.add(ch.worker_id)
    decided: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for e in samples:
        decided[e.labels.get("trajectory_id", "")].add(
            (e.labels.get("outcome", ""), int(e.step or 0))
        )
    outcomes = {t: max(d, key=lambda x: x[1])[0] for t, d in decided.items() if t}
    hw = watermarks(cfg, [layout.trajectories])
    done = committed_offsets(cfg, group, list(hw))
    return Audit(
        trajectories=seen,
        duplicate_chunks=dup,
        undecodable=bad,
        outcomes=outcomes,
        decided_twice=sum(1 for d in decided.values() if len(d) > 1),
        committed={p: v for (_t, p), v in done.items()},
    )


def metric_events(cfg: CommonConfig, run: str) -> list[Any]:

    out = []
    for _p, _o, value in read_all(cfg, Layout.from_config(cfg).metrics):
        with contextlib.suppress(SchemaError):
            e = decode_as(value, MetricEvent)
            if e.run == run:
                out.append(e)
    return out


# -- the final policy ------------------------------------------------------------------------
def final_policy(
    cfg: CommonConfig, run: str, model_dir: Path, out_dir: Path, version: int | None = None
) -> tuple[Path, int]:
    """A published version (default: the last) as a HF model directory (v0: ``model_dir``)."""

    anns = [a for a in read_announcements(cfg, Layout.from_config(cfg)) if a.run == run]
    if version is not None:
        anns = [a for a in anns if a.version == version]
    if not anns:
        return model_dir, 0
    ann = max(anns, key=lambda a: a.version)
    store = store_from_config(cfg)
    manifest = load_manifest(store, ann)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for f in model_dir.iterdir():  # config and tokenizer; the weights come from the store
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".index.json")):
            shutil.copy2(f, out_dir / f.name)
    materialize(store, manifest, out_dir)
    return out_dir, ann.version


# -- the report ------------------------------------------------------------------------------
def _mean(xs: list[float | None]) -> float | None:
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(finite) / len(finite) if finite else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def build(
    cfg: CommonConfig,
    plan: Plan,
    fleet: Fleet,
    before: Any,
    eval_set: list[Any],
    wall_run: float,
    status: str,
) -> dict[str, Any]:
    """The report of one demo run (``OUT/report.json``), read back from the topics and the
    store; ``before`` is the held-out evaluation of policy v0."""
    events = metric_events(cfg, plan.run)
    samples = [e for e in events if e.kind == "sample"]
    steps = step_events(events)
    audit = audit_trajectories(cfg, trainer_group(cfg.topic_prefix, plan.run), samples)

    final_dir, version = final_policy(cfg, plan.run, plan.model_dir, plan.out / "final-model")
    after = warmstart.evaluate(final_dir, eval_set)

    t0 = min((e.ts_ms for e in events), default=0)
    curve = eval_curve(cfg, plan, eval_set, events, t0, before.accuracy, (version, after.accuracy))
    last = list(last_samples(samples).values())
    latency = [e.values["ready_latency_ms"] for e in last if "ready_latency_ms" in e.values]
    gen_tokens = sum(audit.trajectories[t].tokens for t in audit.generated)
    c = plan.cfg
    report: dict[str, Any] = {
        "status": status,
        "mode": c.mode,
        "engine": c.engine,
        "seed": c.seed,
        "max_staleness": 0 if c.mode != "async" else c.max_staleness,
        "steps": len(steps),
        "steps_requested": c.steps,
        **reward_ends([steps[s].values.get("reward_mean") for s in sorted(steps)]),
        "eval_accuracy_before": _r(before.accuracy),
        "eval_accuracy_after": _r(after.accuracy),
        "eval_prompts": len(eval_set),
        "eval_by_op_before": getattr(before, "by_op", None),
        "eval_by_op_after": getattr(after, "by_op", None),
        **audit_fields(audit, events),
        **throughput_fields(wall_run, gen_tokens, version, last, latency),
        "eval_curve": curve,
        "model": str(plan.model_dir),
        "final_model": str(final_dir),
        "run": plan.run,
        "topic_prefix": plan.prefix,
        "bootstrap": plan.bootstrap,
        "series": series(steps, t0, [e for e in events if e.kind == "gen_stats"], latency),
        "roles": {r.name: (r.proc.returncode if r.proc else None) for r in fleet.roles},
    }
    if audit.lost():
        report["lost_examples"] = sorted(audit.lost())[:5]
    return report


def eval_curve(
    cfg: CommonConfig,
    plan: Plan,
    eval_set: list[Any],
    events: list[Any],
    t0: int,
    before: float,
    final: tuple[int, float],
) -> list[dict[str, Any]]:
    """Held-out accuracy over wall-clock: v0, every ``eval_every``-th published version
    (materialised and evaluated now), and the final version (``(version, accuracy)``)."""
    published = published_times(events)
    version, after = final
    curve = [{"version": 0, "t_s": 0.0, "accuracy": before}]
    for v in curve_versions(published, plan.cfg.eval_every, version):
        d, _ = final_policy(cfg, plan.run, plan.model_dir, plan.out / "eval-model", v)
        acc = warmstart.evaluate(d, eval_set).accuracy
        curve.append({"version": v, "t_s": round((published[v] - t0) / 1000, 2), "accuracy": acc})
    if version:
        t_final = round((published.get(version, t0) - t0) / 1000, 2)
        curve.append({"version": version, "t_s": t_final, "accuracy": after})
    shutil.rmtree(plan.out / "eval-model", ignore_errors=True)
    return curve


def step_events(events: list[Any]) -> dict[int, Any]:
    """The ``train_step`` event of each step; a step redone after a restart: the last one."""
    return {int(e.step): e for e in events if e.kind == "train_step" and e.step is not None}


def published_times(events: list[Any]) -> dict[int, int]:
    """``{version: ts_ms}`` of the ``weights_published`` events."""
    return {int(e.values["version"]): e.ts_ms for e in events if e.kind == "weights_published"}


def curve_versions(published: dict[int, int], every: int, final: int) -> list[int]:
    """The published versions the curve evaluates besides the final one: every ``every``-th
    (none when ``every`` is 0)."""
    return [v for v in sorted(published) if every and v % every == 0 and v != final]


def last_samples(samples: list[Any]) -> dict[str, Any]:
    """Each trajectory's ``sample`` event of the highest step (the last decision counts)."""
    last: dict[str, Any] = {}
    for e in samples:
        t = e.labels.get("trajectory_id", "")
        if t not in last or (e.step or 0) >= (last[t].step or 0):
            last[t] = e
    return last


def reward_ends(rewards: list[float | None]) -> dict[str, float | None]:
    """Mean reward over the first and over the last tenth of the steps (at least one)."""
    tenth = max(1, math.ceil(len(rewards) / 10))
    return {
        "reward_first": _r(_mean(rewards[:tenth])),
        "reward_last": _r(_mean(rewards[-tenth:])),
    }


def audit_fields(audit: Audit, events: list[Any]) -> dict[str, Any]:
    """What happened to the trajectories: generated, decided, pending, lost, duplicates."""
    counts = {o: sum(1 for v in audit.outcomes.values() if v == o) for o in SAMPLE_OUTCOMES}
    counters: dict[str, float] = {}
    for e in events:
        if e.kind == "counter" and e.source.startswith("trainer"):
            counters.update(e.values)
    return {
        "trajectories_generated": len(audit.generated),
        "trajectories_trained": counts["trained"],
        "dropped_stale": counts["dropped_stale"],
        "failed": counts["failed_reward"] + counts["expired"] + counts["invalid"],
        "duplicates_seen": audit.duplicate_chunks + int(counters.get("duplicates", 0)),
        "duplicate_chunks_in_topic": audit.duplicate_chunks,
        "decided_twice": audit.decided_twice,
        "pending_at_stop": len(audit.pending()),
        "migrated": sum(1 for e in events if e.kind == "migrated"),
        "incomplete_at_stop": len(audit.trajectories) - len(audit.generated),
        "lost": len(audit.lost()),
    }


def throughput_fields(
    wall_run: float, gen_tokens: int, version: int, last: list[Any], latency: list[float]
) -> dict[str, Any]:
    """Generation rate, versions, staleness of the trained samples (``last``: each
    trajectory's last decision) and chunk-to-trainer latency percentiles."""
    staleness = [
        int(e.values.get("staleness", 0)) for e in last if e.labels.get("outcome") == "trained"
    ]
    return {
        "wall_s": round(wall_run, 1),
        "tokens_per_s": _r(gen_tokens / wall_run if wall_run > 0 else None, 1),
        "tokens_generated": gen_tokens,
        "policy_versions": version,
        "staleness_hist": {str(k): staleness.count(k) for k in sorted(set(staleness))},
        "ready_latency_ms_p50": _r(_pct(latency, 50), 1),
        "ready_latency_ms_p99": _r(_pct(latency, 99), 1),
    }


def series(
    steps: dict[int, Any], t0: int, gen_stats: list[Any], latency: list[float]
) -> dict[str, Any]:
    """The plotted series: per step (seconds since ``t0``, reward, tokens/s, staleness), the
    generators' rates over time, and the sorted latencies."""
    order = sorted(steps)
    return {
        "step": order,
        "t_s": [round((steps[s].ts_ms - t0) / 1000, 2) for s in order],
        "reward_mean": [steps[s].values.get("reward_mean") for s in order],
        "train_tokens_per_s": [steps[s].values.get("tokens_per_s") for s in order],
        "staleness_mean": [steps[s].values.get("staleness_mean") for s in order],
        "gen": [
            [
                round((e.ts_ms - t0) / 1000, 2),
                e.labels.get("worker_id", e.source),
                e.values.get("tokens_per_s"),
            ]
            for e in gen_stats
        ],
        "ready_latency_ms": sorted(latency),
    }


def write(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    try:
        plot(report, out / "report.png")
    except Exception as e:  # a plot must not cost the user the numbers
        log.warning("report.png not written: %s", e)


def _rolling(xs: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = [x for x in xs[max(0, i - n + 1) : i + 1] if math.isfinite(x)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["series"]
    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))
    title = (
        f"srl demo — mode {report['mode']}, seed {report['seed']}: held-out accuracy "
        f"{report['eval_accuracy_before']:.2f} → {report['eval_accuracy_after']:.2f}, "
        f"{report['steps']} steps in {report['wall_s']:.0f} s, lost {report['lost']}"
    )
    fig.suptitle(title, fontsize=12)
    smooth = _rolling([x if x is not None else float("nan") for x in s["reward_mean"]], 5)
    ax[0, 0].plot(s["step"], s["reward_mean"], ".", alpha=0.4, label="per step")
    ax[0, 0].plot(s["step"], smooth, "-", color="C0", label="mean of 5 steps")
    ax[0, 0].set(title="reward vs step", xlabel="optimizer step", ylabel="mean reward")
    ax[0, 0].legend(fontsize=8)
    ax[0, 1].plot(s["t_s"], s["reward_mean"], ".", alpha=0.4, color="C1")
    ax[0, 1].plot(s["t_s"], smooth, "-", color="C1")
    ax[0, 1].set(title="reward vs wall-clock", xlabel="seconds since start", ylabel="mean reward")
    by_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, w, tps in s["gen"]:
        by_worker[w].append((t, tps or 0.0))
    for w, pts in sorted(by_worker.items()):
        ax[0, 2].plot([p[0] for p in pts], [p[1] for p in pts], label=f"generator {w}")
    ax[0, 2].plot(s["t_s"], s["train_tokens_per_s"], "k.-", label="trainer")
    ax[0, 2].set(title="throughput", xlabel="seconds since start", ylabel="tokens/s")
    ax[0, 2].legend(fontsize=8)
    hist = report["staleness_hist"]
    ax[1, 0].bar([int(k) for k in hist], list(hist.values()))
    ax[1, 0].set(title="staleness of trained samples (v − b)", xlabel="versions", ylabel="samples")
    ax[1, 0].set_xticks([int(k) for k in hist] or [0])
    lat = s["ready_latency_ms"]
    if lat:
        ax[1, 1].hist(lat, bins=30)
    ax[1, 1].set(
        title="chunk-to-trainer latency (last chunk → assembled)",
        xlabel="ms",
        ylabel="trajectories",
    )
    curve = report.get("eval_curve") or [{"t_s": 0.0, "accuracy": report["eval_accuracy_before"]}]
    ax[1, 2].plot([c["t_s"] for c in curve], [c["accuracy"] for c in curve], "o-", color="C2")
    ax[1, 2].set(
        title=f"held-out accuracy (greedy, {report['eval_prompts']} prompts)",
        xlabel="seconds since start (version published)",
        ylabel="accuracy",
        ylim=(0, 1),
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
