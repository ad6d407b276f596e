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
* the newest step published, so new windows are numbered after it (and after the newest
  step the trainer announced), never into a step that already has its groups.

What must hold: no prompt is lost (a window published in part is completed) and none is
dispatched twice, or twice into a step, as long as the restarted dispatcher plans the same
source with the same settings (``groups_per_step``, ``tasks_per_group``, ``epochs``). Two
dispatchers of one run running *at the same time* are not fenced: run one.

Called by ``producers.dispatcher.run_dispatcher``; :meth:`Published.rest` is pure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.records import PromptTask, SchemaError, decode_as
from srl.config import TopicsConfig
from srl.kafka import read_range
from srl.topics import Layout

log = logging.getLogger("srl.dispatch")

TaskKey = tuple[str, tuple[int, ...] | None]  # (prompt_id, sample_indices)


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
    last_step: int = 0

    def add(self, task: PromptTask) -> None:
        self.keys.add((task.prompt_id, task.sample_indices))
        if task.step is not None and task.step_groups is not None:
            self.step_of[task.prompt_id] = Stamp(task.step, task.step_groups, task.min_version)
            self.last_step = max(self.last_step, task.step)

    def rest(self, tasks: Iterable[PromptTask]) -> tuple[list[PromptTask], Stamp | None]:
        """The tasks of a planned window not published yet, and the stamp of the step that its
        published part went out in (None when none of it went out)."""
        todo, stamp = [], None
        for t in tasks:
            if (t.prompt_id, t.sample_indices) not in self.keys:
                todo.append(t)
            elif stamp is None:
                stamp = self.step_of.get(t.prompt_id)
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
    if out.keys:
        log.info(
            "run %s: %d tasks already published (newest step %d): resuming after them",
            run,
            len(out.keys),
            out.last_step,
        )
    return out
