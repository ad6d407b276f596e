"""What a run's dispatcher has already published: read back at start, so that a restart resumes.

A dispatcher keeps nothing on disk: the prompt topics are its log. Each task it publishes
carries its run (``PromptTask.run``), its trainer step and that step's ``step_groups`` and
``min_version``. A dispatcher that starts (a fresh one, or one restarted after a SIGKILL)
first reads every prompt topic back and keeps, for its run (:class:`Published`):

* which tasks went out, by ``(prompt_id, sample_indices)``: planning the same source again
  gives the same keys (prompt ids carry the pass, ``.e{N}``), so what is published is not
  published again;
* the stamp of the step each prompt went out in, so a window the previous dispatcher died in
  the middle of is completed *in the same step* (its ``step_groups`` counted every prompt of
  the window, and the trainer's step waits for all of them);
* the steps published, so a new window gets the lowest step after the newest one the trainer
  announced that no surviving window holds: after all of them, or into a gap the broker
  left (a SIGKILLed embedded broker can forget a whole window's tasks while the next
  window's, on other partitions, survive; numbered after the newest, that window's step
  stayed empty and the trainer waited out its step timeout, 90 s in ``srl chaos``), never
  into a step that already has its groups;
* which tasks were *generated*, read from the trajectories topic since the newest task found
  (less ``SLACK_MS`` for clocks apart): a broker that is SIGKILLed forgets the records it
  acknowledged in its last ~0.5 s (docs/broker.md), so the newest tasks may be gone from the
  prompt topics although workers read and generated them before the crash. Task ids are
  deterministic (``producers.dispatcher.task_id_for``) and a chunk carries its task id (and,
  at seq 0, its step's stamp), so a task whose every sample is complete on the topic counts
  as published, in the step its chunks say. Sending it again would generate and train its
  samples twice (measured by ``srl chaos``'s ``broker-restart``: four groups trained twice,
  once in their step and again, under new random task ids, in a step numbered after the
  newest surviving one). A forgotten task that was started but not finished goes out again
  under the same task and trajectory ids: it is generated again from seq 0 (``srl.lineage``
  decides which copy's chunks count, a newer pool epoch's first), and the trainer, which
  dedupes by trajectory id (``consumers.outcomes.Ledger``), trains one copy.

What must hold: no prompt is lost (a window published in part is completed) and none is
dispatched twice (nor sent again once generated, above), or twice into a step, as long as
the restarted dispatcher plans the same source with the same settings
(``groups_per_step``, ``tasks_per_group``, ``epochs``). Two dispatchers of one run running
*at the same time* are not fenced: run one.

Called by ``producers.dispatcher.run_dispatcher``; :meth:`Published.rest` and
:meth:`Published.generated` are pure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from producers.recovery import trajectory_id_for
from schemas.records import PromptTask, SchemaError, TrajectoryChunk, decode_as
from srl.config import TopicsConfig
from srl.kafka import read_range
from srl.topics import Layout

log = logging.getLogger("srl.dispatch")

TaskKey = tuple[str, tuple[int, ...] | None]  # (prompt_id, sample_indices)
SLACK_MS = 30_000  # trajectories are read back from the newest task found, less this


@dataclass(frozen=True)
class Stamp:
    """What every task of one released step carries."""

    step: int
    step_groups: int
    min_version: int | None


@dataclass
class Published:
    """The tasks one run's dispatchers have published (read back from the prompt topics)."""

    keys: set[TaskKey] = field(default_factory=set)
    step_of: dict[str, Stamp] = field(default_factory=dict)  # prompt id -> its step's stamp
    last_step: int = 0  # the newest step of its tasks (logged)
    newest_ms: int | None = None  # creation time of the newest task found
    complete: set[str] = field(default_factory=set)  # trajectory ids complete on the topic
    chunk_stamp: dict[str, Stamp] = field(default_factory=dict)  # task id -> from its seq 0

    def add(self, task: PromptTask) -> None:
        self.keys.add((task.prompt_id, task.sample_indices))
        self.newest_ms = max(self.newest_ms or task.created_ms, task.created_ms)
        if task.step is not None and task.step_groups is not None:
            self.step_of[task.prompt_id] = Stamp(task.step, task.step_groups, task.min_version)
            self.last_step = max(self.last_step, task.step)

    def chunk(self, c: TrajectoryChunk) -> None:
        """A chunk read back from the trajectories topic: its trajectory is complete once its
        last chunk is there (an idempotent producer leaves no gap before it); seq 0 carries
        its task's step (its ``min_version``: the chunk's own version is no older)."""
        if c.is_last:
            self.complete.add(c.trajectory_id)
        if c.seq == 0 and c.step is not None and c.step_groups is not None:
            old = self.chunk_stamp.get(c.task_id)
            version = min(c.policy_version, old.min_version or 0) if old else c.policy_version
            self.chunk_stamp[c.task_id] = Stamp(c.step, c.step_groups, version)

    def generated(self, task: PromptTask) -> bool:
        """Whether every sample of ``task`` (as planned now) is complete on the topic."""
        return all(trajectory_id_for(task.task_id, i) in self.complete for i in task.samples())

    def held(self) -> set[int]:
        """The steps that surviving windows hold: by their tasks, or by their tasks' chunks
        (read since the newest task less ``SLACK_MS``; a chunk carries no run, so another
        run's on a shared topic may hold a step here, which then stays empty as before)."""
        return {s.step for s in (*self.step_of.values(), *self.chunk_stamp.values())}

    def rest(self, tasks: Iterable[PromptTask]) -> tuple[list[PromptTask], Stamp | None]:
        """The tasks of a planned window not published yet (nor generated), and the stamp of
        the step that its published or started part went out in (None when none of it went
        out)."""
        todo, stamp = [], None
        for t in tasks:
            if (t.prompt_id, t.sample_indices) in self.keys:
                stamp = stamp or self.step_of.get(t.prompt_id)
                continue
            # generated, or started: its chunks say its step (a started one goes out again)
            stamp = stamp or self.chunk_stamp.get(t.task_id)
            if not self.generated(t):
                todo.append(t)
        return todo, stamp


def read_published(
    cfg: TopicsConfig, layout: Layout, run: str, timeout_s: float = 60.0
) -> Published:
    """Every task of ``run`` on the prompt topics (every bucket), up to their ends now."""
    out = Published()
    for bucket in layout.buckets:
        for msg in read_range(cfg, layout.prompts(bucket), timeout_s=timeout_s, role="dispatch"):
            with contextlib.suppress(SchemaError):  # the generators dead-letter bad tasks
                task = decode_as(msg.value() or b"", PromptTask)
                if task.run == run:
                    out.add(task)
    if out.newest_ms is not None:  # what workers generated of tasks the broker may have lost
        since = out.newest_ms - SLACK_MS
        chunks = read_range(cfg, layout.trajectories, since_ms=since, timeout_s=timeout_s)
        for msg in chunks:
            with contextlib.suppress(SchemaError):  # the trainer dead-letters bad chunks
                out.chunk(decode_as(msg.value() or b"", TrajectoryChunk))
    if out.keys:
        log.info(
            "run %s: %d tasks already published (newest step %d): resuming after them",
            run,
            len(out.keys),
            out.last_step,
        )
    return out
