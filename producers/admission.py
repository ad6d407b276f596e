"""Which waiting samples a generator worker may start now, and in which order.

Owns the worker's half of the admission rule (DESIGN.md, "Staleness"); the dispatcher's
half is ``producers.dispatcher.release`` and the trainer's ``consumers.steps``. What must hold:

* a fresh task never starts with weights older than ``latest - k`` (the newest version the
  worker knows of, minus its ``max_staleness``);
* nor older than its ``min_version`` (the version whose announcement released its trainer
  step), unless that version is not available to this worker (refused as corrupt, say):
  such a task first *waits* (``waiting``: versions refused less than ``refused_wait_s`` ago,
  each with the trainer step it was announced after) for a newer good version, which the
  trainer publishes after training the steps released before it, so the samples are not
  generated only to be dropped as stale. It does not wait when its own step is the
  trainer's next (the refused version's step + 1): no newer version can come without it
  (the soak at 650361a: a deleted version's tasks waited the whole 60 s while the trainer
  waited for them, then 24 of the next step's samples were dropped as stale). After the
  wait ``latest`` is the floor (a bad upload must not stall generation for good: with
  k = 0 no newer version can come), and the trainer's staleness gate judges what comes of
  it;
* a resumed trajectory (migration, recovery) ignores the task's floors (its behaviour version
  is already the oldest of its prefix) but continues only with weights at least as new as that
  prefix (``resume.min_version``), or the newest this worker can load if that is older (the
  prefix's version refused here): older tokens would make its behaviour version older. A
  long-tail worker still on v0 continued v1 prefixes it had just been handed, and the sync
  demo dropped a third of step 2 as stale (CI, under load);
* order: resumed trajectories first (they are late and known long), then the earliest
  trainer step (its deadline comes first; unscheduled tasks last), then the longest
  predicted (LPT: a long sample started last finishes last).

Pure; called by ``producers.worker`` before each decode step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from schemas.records import PromptTask


def may_start(
    task: PromptTask, loaded: int, latest: int, k: int, waiting: Mapping[int, int] | None = None
) -> bool:
    """Whether a worker running weights ``loaded`` may start a sample of ``task`` now
    (``waiting``: refused versions whose tasks still wait for a newer good one, each with the
    trainer step it was announced after)."""
    if task.resume is not None:
        return loaded >= min(task.resume.min_version, latest)
    if loaded < latest - k:
        return False
    if task.min_version is None or loaded >= task.min_version:
        return True
    after = (waiting or {}).get(task.min_version)
    needed = after is None or (task.step is not None and task.step <= after + 1)
    return needed and loaded >= latest


def order_key(task: PromptTask) -> tuple[int, float, float]:
    """Sort key: resumes first, then earliest step, then longest predicted."""
    step = float(task.step) if task.step is not None else math.inf
    return (0 if task.resume is not None else 1, step, -float(task.predicted_length or 0))
