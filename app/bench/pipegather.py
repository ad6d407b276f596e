"""The hand-off timeline's events, read back from a pipeline mode's own topics after its run.

What ``app.bench.timeline`` accounts for, from what the roles already write: the metrics
topic's ``train_step``, ``weights_loaded`` and ``sample`` events (the bench reads them for its
figures anyway), the weights topic's announcements, the prompt topics' tasks and the
trajectories topic's chunks. Nothing is added to the roles for it but the fetch's start on
``weights_loaded``. Called by ``app.bench.pipeline.run_mode``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from app.bench.timeline import Load, Records, Traj
from app.report import read_all
from schemas.records import PromptTask, SchemaError, TrajectoryChunk, decode_as
from srl.kafka import read_range
from srl.topics import Layout
from srl.weights import read_announcements


def gather_records(cfg: Any, run: str, events: list[Any]) -> Records:
    """A mode's :class:`Records` from its metric ``events`` and its topics (wall seconds)."""
    layout = Layout.from_config(cfg)
    step_end = {int(e.step): e.ts_ms / 1000.0 for e in events if e.kind == "train_step" and e.step}
    published = {
        int(a.trainer_step): (int(a.version), a.created_ms / 1000.0)
        for a in read_announcements(cfg, layout)
        if a.run == run
    }
    loads = [
        Load(
            e.labels.get("worker_id", ""),
            int(e.values["version"]),
            e.values["fetch_started_ms"] / 1000.0,
            e.values.get("fetch_s", 0.0),
            e.values.get("pause_ms", 0.0) / 1000.0,
            e.ts_ms / 1000.0,
        )
        for e in events
        if e.kind == "weights_loaded" and e.values.get("fetch_started_ms")
    ]
    return Records(step_end, published, loads, releases(cfg, layout), trajectories(cfg, events))


def releases(cfg: Any, layout: Layout) -> dict[int, float]:
    """Each step's release: the first of its tasks' records produced (the record's timestamp,
    wall seconds; a task's ``created_ms`` is when it was planned, before the release)."""
    out: dict[int, float] = {}
    for bucket in layout.buckets:
        for msg in read_range(cfg, layout.prompts(bucket), timeout_s=10.0, role="bench-report"):
            with contextlib.suppress(SchemaError):
                task = decode_as(msg.value() or b"", PromptTask)
                if task.step is not None:
                    t = msg.timestamp()[1] / 1000.0
                    out[int(task.step)] = min(out.get(int(task.step), t), t)
    return out


def trajectories(cfg: Any, events: list[Any]) -> dict[str, Traj]:
    """Every trajectory with a first chunk: its step, worker, start version and times; its
    last chunk and, from its ``sample`` event, when the trainer had it assembled."""
    layout = Layout.from_config(cfg)
    out: dict[str, Traj] = {}
    last: dict[str, float] = {}
    for _p, _o, value in read_all(cfg, layout.trajectories):
        with contextlib.suppress(SchemaError):
            c = decode_as(value, TrajectoryChunk)
            if c.seq == 0 and c.step is not None:
                out[c.trajectory_id] = Traj(
                    int(c.step),
                    c.worker_id,
                    int(c.policy_version),
                    c.started_ms / 1000.0,
                    c.created_ms / 1000.0,
                )
            if c.is_last:
                last[c.trajectory_id] = c.created_ms / 1000.0
    for tid, t in out.items():
        t.last_chunk = last.get(tid)
    for e in events:
        if e.kind != "sample" or e.labels.get("outcome") != "trained":
            continue
        got = out.get(e.labels.get("trajectory_id", ""))
        if got is not None and got.last_chunk is not None and "ready_latency_ms" in e.values:
            got.ready = got.last_chunk + e.values["ready_latency_ms"] / 1000.0
    return out
