"""Which running trajectories a regular-pool worker hands to the long-tail pool, and with what.

Owns the worker's side of StreamRL's long-tail migration: it follows every running
trajectory's completion tokens (a resumed prefix included) and the oldest policy version
that sampled them, asks ``ranker.migrate.Migrator`` which ones ran past
``migrate_factor × predicted length``, and builds the ``ResumePrefix`` task that continues
each in the ``migrate_to`` bucket. What must hold:

* only trajectories of tasks outside the ``migrate_to`` bucket, with a prediction, migrate,
  each at most once;
* the task resumes exactly where this worker stops: the same trajectory id, every completion
  token so far, ``next_seq`` = the hand-off chunk's seq + 1.

The Kafka half (publish the hand-off chunk, wait for its acknowledgement, publish the task,
wait again, only then free the slot) is ``Outlet.migrate`` in ``producers.outlet``, which
calls this module. Pure logic, no Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from producers.config import GenerateConfig
from ranker.api import MigrationPolicy, Migrator, Running, migration_task
from schemas.records import PromptTask


@dataclass
class _Progress:
    sample_index: int
    tokens: list[int]
    min_version: int | None
    predicted: int | None
    max_new_tokens: int
    eligible: bool  # outside the long-tail bucket, with a prediction


@dataclass
class Stragglers:
    """Per-worker tracking of running trajectories for migration (``None`` target: disabled)."""

    target: str
    migrator: Migrator
    _running: dict[str, _Progress] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: GenerateConfig) -> Stragglers | None:
        if cfg.migrate_to is None:
            return None
        policy = MigrationPolicy(factor=cfg.migrate_factor, min_tokens=cfg.migrate_min_tokens)
        return cls(cfg.migrate_to, Migrator(policy, cfg.migrate_to))

    @property
    def migrated(self) -> int:
        return self.migrator.migrated

    def start(
        self, task: PromptTask, trajectory_id: str, sample_index: int, prefix: list[int]
    ) -> None:
        resumed = task.resume.min_version if task.resume is not None else None
        eligible = task.bucket != self.target and task.predicted_length is not None
        self._running[trajectory_id] = _Progress(
            sample_index,
            list(prefix),
            resumed,
            task.predicted_length,
            task.max_new_tokens,
            eligible,
        )

    def add(self, trajectory_id: str, tokens: list[int], version: int) -> None:
        p = self._running.get(trajectory_id)
        if p is None or not tokens:
            return
        p.tokens.extend(tokens)
        p.min_version = version if p.min_version is None else min(p.min_version, version)

    def forget(self, trajectory_id: str) -> None:
        self._running.pop(trajectory_id, None)

    def due(self) -> list[str]:
        """Trajectories to hand off now (each reported once)."""
        running = [
            Running(tid, len(p.tokens), p.predicted, p.max_new_tokens)
            for tid, p in self._running.items()
            if p.eligible
        ]
        return self.migrator.stragglers(running) if running else []

    def task(
        self,
        task: PromptTask,
        trajectory_id: str,
        next_seq: int,
        prompt_ids: list[int],
        version: int,
    ) -> tuple[PromptTask, int]:
        """The long-tail task that continues ``trajectory_id``, and its generated-token count."""
        p = self._running[trajectory_id]
        min_version = version if p.min_version is None else p.min_version
        out = migration_task(
            task,
            trajectory_id,
            p.sample_index,
            next_seq,
            p.tokens,
            min_version,
            self.target,
            prompt_ids,
        )
        return out, len(p.tokens)
