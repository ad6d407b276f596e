"""Long-tail migration: when a regular-pool trajectory runs far past its prediction, move it.

Owns the decision and the hand-off record, both pure:

* :class:`MigrationPolicy` says when a running trajectory in the regular pool is a straggler:
  it has generated more than ``factor × predicted`` tokens and at least ``min_tokens``
  (a missing prediction never migrates; the long-tail pool never migrates).
* :func:`migration_task` builds the ``PromptTask`` that hands it to the long-tail pool: the
  same prompt, ``resume`` set to the prefix already published (``ResumePrefix`` with the
  completion tokens so far, the next seq, the prefix's oldest policy version and
  ``reason="migrate"``), addressed to the long-tail bucket. The long-tail worker prefills
  prompt + prefix and continues the same trajectory id at ``next_seq``, so the trainer sees
  one trajectory whose chunks happen to come from two workers.

Exactly once: the regular worker (1) publishes its open chunk as a non-final chunk and waits
for the broker's acknowledgement, (2) produces the migration task and waits for its
acknowledgement, (3) only then frees the slot and counts the sample done for its own task's
offset. It never publishes a final chunk for a migrated trajectory. Called by the generator
worker (``producers``).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from schemas.records import PromptTask, ResumePrefix, now_ms, pack_tokens

REASON = "migrate"


@dataclass(frozen=True)
class MigrationPolicy:
    factor: float = 2.0  # a straggler has generated more than factor × its prediction
    min_tokens: int = 64  # … and at least this many tokens (short predictions are noisy)
    enabled: bool = True

    def threshold(self, predicted: int | None) -> int | None:
        """Tokens after which a trajectory predicted at ``predicted`` migrates; None: never."""
        if not self.enabled or predicted is None or predicted <= 0:
            return None
        return max(self.min_tokens, math.floor(self.factor * predicted) + 1)

    def should_migrate(self, generated: int, predicted: int | None, remaining: int) -> bool:
        """True when the trajectory passed its threshold and still has tokens left to make
        (``remaining`` = max_new_tokens − generated; nothing is gained by moving a finisher)."""
        t = self.threshold(predicted)
        return t is not None and generated >= t and remaining > 0


@dataclass(frozen=True)
class Running:
    """What the worker knows of one running trajectory."""

    trajectory_id: str
    generated: int  # completion tokens so far (a resume's prefix included)
    predicted: int | None  # the task's predicted_length
    max_new_tokens: int


@dataclass
class Migrator:
    """The worker's hook: which running trajectories to hand to the long-tail pool now.

    Only a worker of a regular pool migrates (``enabled``); each trajectory at most once.
    ``migrated`` counts hand-offs for the worker's metrics.
    """

    policy: MigrationPolicy
    longtail_bucket: str
    enabled: bool = True
    migrated: int = 0
    _seen: set[str] = field(default_factory=set)

    def stragglers(self, running: list[Running]) -> list[str]:
        if not self.enabled:
            return []
        out = []
        for r in running:
            if r.trajectory_id in self._seen:
                continue
            if self.policy.should_migrate(r.generated, r.predicted, r.max_new_tokens - r.generated):
                self._seen.add(r.trajectory_id)
                out.append(r.trajectory_id)
        self.migrated += len(out)
        return out


def migration_task(
    task: PromptTask,
    trajectory_id: str,
    sample_index: int,
    next_seq: int,
    completion_tokens: list[int],
    min_version: int,
    longtail_bucket: str,
    prompt_tokens: list[int] | None = None,
) -> PromptTask:
    """The task that resumes one trajectory in the long-tail pool (see the module doc)."""
    resume = ResumePrefix(
        trajectory_id=trajectory_id,
        sample_index=sample_index,
        next_seq=next_seq,
        tokens=pack_tokens(completion_tokens),
        min_version=min_version,
        reason=REASON,
    )
    return PromptTask(
        task_id=uuid.uuid4().hex,
        prompt_id=task.prompt_id,
        prompt=task.prompt,
        group_size=task.group_size,
        max_new_tokens=task.max_new_tokens,
        bucket=longtail_bucket,
        created_ms=now_ms(),
        prompt_tokens=pack_tokens(prompt_tokens)
        if prompt_tokens is not None
        else task.prompt_tokens,
        temperature=task.temperature,
        top_p=task.top_p,
        predicted_length=task.predicted_length,
        ranker_version=task.ranker_version,
        metadata=task.metadata,
        resume=resume,
    )
