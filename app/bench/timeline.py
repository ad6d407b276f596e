"""``srl bench pipeline``'s hand-off timeline: where each step's time between trainer steps goes.

Pure accounting (numpy only) over the events a pipeline run already leaves on its topics,
gathered by ``app.bench.pipeline.gather_records``:

* the trainer's ``train_step`` events (a step's end), its weights announcements (a version
  published: manifest in the store, announcement made, ``created_ms``);
* each generator's ``weights_loaded`` events (``fetch_started_ms``, ``fetch_s``: fetch and
  sha256 verification in one pass; ``pause_ms``: the swap; ``ts_ms``: swapped);
* the prompt tasks (``created_ms``: the dispatcher's release of a step) and the trajectory
  chunks (``started_ms``: first token; ``created_ms`` of the first and last chunk;
  ``policy_version`` of the first chunk: the version a trajectory started at), and the
  trainer's ``sample`` events (``ready_latency_ms``: last chunk → assembled).

Two chains, each a list of events in causal order (:data:`WEIGHTS_CHAIN`,
:data:`STEP_CHAIN`). A chain's segments are the differences of consecutive events after a
running maximum (an event stamped, at millisecond resolution, before the one it follows counts
as at it), so every segment is ≥ 0 and the segments of a chain add up to its span exactly:

* the weights chain, per (version, generator): trainer step end → published → fetch started
  (the announcement's delivery and the follower's wake-up) → fetched and verified → swap begun
  (waiting for the decode loop) → swapped → first token of a trajectory started at the version;
* the step chain, per trainer step t of a mode with staleness k: step t-1-k's end (what
  releases step t) → its version published → step t released by the dispatcher → first token
  of step t (admission: a worker with the version, and room) → first chunk → last chunk →
  last trajectory ready → step t's end. Its span is ``T_t − T_{t−1−k}``: one step for the
  barrier modes (k = 0), k + 1 steps for the async ones (their hand-off overlaps generation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WEIGHTS_CHAIN = (
    "step_end",
    "published",
    "fetch_started",
    "fetched",
    "swap_begun",
    "swapped",
    "first_token",
)
WEIGHTS_SEGMENTS = ("publish", "announce", "fetch_verify", "swap_wait", "swap", "first_token")
STEP_CHAIN = (
    "trigger_step_end",
    "published",
    "released",
    "first_token",
    "first_chunk",
    "last_chunk",
    "ready",
    "step_end",
)
STEP_SEGMENTS = ("publish", "release", "admit", "first_chunk", "generate", "ready", "consume")


def segments(times: Sequence[float], names: Sequence[str]) -> dict[str, float]:
    """Consecutive differences of ``times`` after a running maximum: ``len(times) - 1``
    segments, each ≥ 0, adding up to ``max(times) - times[0]`` (the chain's span)."""
    if len(names) != len(times) - 1:
        raise ValueError(f"{len(times)} events need {len(times) - 1} segment names")
    clamped = np.maximum.accumulate(np.asarray(times, dtype=float))
    return {n: float(d) for n, d in zip(names, np.diff(clamped), strict=True)}


@dataclass
class Load:
    """One generator's swap to one version (a ``weights_loaded`` event; wall seconds)."""

    worker: str
    version: int
    fetch_started: float
    fetch_s: float
    pause_s: float
    swapped: float


@dataclass
class Traj:
    """One trajectory's times (wall seconds) from its chunks and its ``sample`` event."""

    step: int
    worker: str
    start_version: int
    first_token: float
    first_chunk: float
    last_chunk: float | None = None
    ready: float | None = None


@dataclass
class Records:
    """What a run left, in wall seconds: step ends, versions published (by the step that
    published them), swaps, each step's release and its trajectories."""

    step_end: dict[int, float]
    published: dict[int, tuple[int, float]]  # trainer step -> (version, published)
    loads: list[Load] = field(default_factory=list)
    released: dict[int, float] = field(default_factory=dict)  # step -> first task created
    trajs: dict[str, Traj] = field(default_factory=dict)


def weights_rows(r: Records) -> list[dict[str, Any]]:
    """The weights chain of every (version, generator) with all its events."""
    rows = []
    for load in r.loads:
        step = next((s for s, (v, _t) in r.published.items() if v == load.version), None)
        if step is None or step not in r.step_end:
            continue
        first = min(
            (
                t.first_token
                for t in r.trajs.values()
                if t.worker == load.worker and t.start_version >= load.version
            ),
            default=None,
        )
        if first is None:
            continue
        fetched = load.fetch_started + load.fetch_s
        times = [
            r.step_end[step],
            r.published[step][1],
            load.fetch_started,
            fetched,
            load.swapped - load.pause_s,
            load.swapped,
            first,
        ]
        seg = segments(times, WEIGHTS_SEGMENTS)
        rows.append(
            {"step": step, "version": load.version, "worker": load.worker, "segments": seg}
            | {"span_s": sum(seg.values())}
        )
    return rows


def step_rows(r: Records, k: int) -> list[dict[str, Any]]:
    """The step chain of every step t whose trigger (step t-1-k) is a step of the run."""
    rows = []
    for t in sorted(r.step_end):
        s = t - 1 - k
        mine = [x for x in r.trajs.values() if x.step == t]
        if s not in r.step_end or s not in r.published or t not in r.released or not mine:
            continue
        if any(x.last_chunk is None or x.ready is None for x in mine):
            continue
        times = [
            r.step_end[s],
            r.published[s][1],
            r.released[t],
            min(x.first_token for x in mine),
            min(x.first_chunk for x in mine),
            max(x.last_chunk for x in mine if x.last_chunk is not None),
            max(x.ready for x in mine if x.ready is not None),
            r.step_end[t],
        ]
        seg = segments(times, STEP_SEGMENTS)
        prev = r.step_end.get(t - 1)
        rows.append(
            {
                "step": t,
                "trigger_step": s,
                "segments": seg,
                "span_s": sum(seg.values()),
                "step_s": None if prev is None else r.step_end[t] - prev,
            }
        )
    return rows


def quantiles(values: Iterable[float], compression: float) -> dict[str, float]:
    """p50 and p99 in wall and simulated seconds (simulated = wall x compression)."""
    v = np.asarray(list(values), dtype=float)
    if not len(v):
        return {}
    p50, p99 = float(np.percentile(v, 50)), float(np.percentile(v, 99))
    return {
        "p50_s": round(p50, 4),
        "p99_s": round(p99, 4),
        "p50_sim_s": round(p50 * compression, 3),
        "p99_sim_s": round(p99 * compression, 3),
    }


def summarize_rows(rows: list[dict[str, Any]], names: Sequence[str], compression: float) -> dict:
    """Per segment and for the span: p50 / p99 over the rows, wall and simulated; and each
    segment's share of the summed spans (the shares add up to 1)."""
    total = sum(row["span_s"] for row in rows)
    out: dict[str, Any] = {"rows": len(rows)}
    for n in names:
        vals = [row["segments"][n] for row in rows]
        share = round(sum(vals) / total, 4) if total > 0 else 0.0
        out[n] = quantiles(vals, compression) | {"share": share}
    out["span"] = quantiles((row["span_s"] for row in rows), compression)
    return out


def timeline(r: Records, k: int, compression: float) -> dict[str, Any]:
    """A mode's timeline: both chains summarized, and the step chain per step (wall s)."""
    steps, weights = step_rows(r, k), weights_rows(r)
    per_step = [
        {
            "step": row["step"],
            "trigger_step": row["trigger_step"],
            "span_s": round(row["span_s"], 4),
            "step_s": None if row["step_s"] is None else round(row["step_s"], 4),
            **{n: round(v, 4) for n, v in row["segments"].items()},
        }
        for row in steps
    ]
    return {
        "k": k,
        "compression": compression,
        "step_chain": summarize_rows(steps, STEP_SEGMENTS, compression),
        "weights_chain": summarize_rows(weights, WEIGHTS_SEGMENTS, compression),
        "steps": per_step,
    }
