"""Scored trajectories → complete groups (all n samples of one prompt).

Owns the wait for whole groups that GRPO-style advantages need. What must hold:

* a group is the ``group_size`` samples of one ``prompt_id``, one per ``sample_index``;
  a prompt asked again later (a new epoch) opens a new group once the first has that slot;
* a slot is filled by a scored sample, a sample whose reward failed, or a trajectory that
  expired; the group is complete when every slot is filled, and is returned exactly once;
* a group that gets nothing new for ``expire_s`` is returned by ``expire`` (its samples are
  reported as expired, never trained), unless one of its trajectories is still streaming in
  (``alive``: a long tail of a 7B run generates for many minutes; it has its own expiry, the
  assembler's, after which its slot is filled and the group completes).

Pure logic; the trainer's hot loop calls ``add`` after scoring each trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from consumers.assembler import Trajectory


@dataclass
class Sample:
    """A trajectory with its reward, or the reason it has none (``error``)."""

    traj: Trajectory
    reward: float | None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.reward is None


@dataclass
class Group:
    prompt_id: str
    group_size: int
    samples: dict[int, Sample] = field(default_factory=dict)  # sample_index -> sample
    missing: dict[int, str] = field(default_factory=dict)  # sample_index -> expired trajectory id
    last_arrival: float = 0.0
    step: int | None = None  # the trainer step it was released for (None: unscheduled)
    step_groups: int | None = None  # groups released for that step
    served_missing: bool = False  # a slot was filled by a served trajectory without feedback

    @property
    def filled(self) -> int:
        return len(self.samples) + len(self.missing)

    @property
    def complete(self) -> bool:
        return self.filled >= self.group_size

    @property
    def served(self) -> bool:
        """Served traffic (``srl serve``'s requests), not dispatched work."""
        return self.served_missing or any(s.traj.served for s in self.samples.values())

    def scored(self) -> list[Sample]:
        """Samples with a reward, by sample index (deterministic order)."""
        return [s for _, s in sorted(self.samples.items()) if not s.failed]

    def failed(self) -> list[Sample]:
        return [s for _, s in sorted(self.samples.items()) if s.failed]


class GroupBuffer:
    """Open groups by prompt id; ``add`` returns a group the moment it is complete."""

    def __init__(self, expire_s: float = 300.0) -> None:
        self.expire_s = expire_s
        self.open: dict[str, list[Group]] = {}

    def _slot(self, prompt_id: str, index: int, group_size: int, now: float) -> Group:
        groups = self.open.setdefault(prompt_id, [])
        for g in groups:
            if index not in g.samples and index not in g.missing:
                g.last_arrival = now
                return g
        g = Group(prompt_id, group_size, last_arrival=now)
        groups.append(g)
        return g

    def _close_if_complete(self, g: Group) -> Group | None:
        if not g.complete:
            return None
        groups = self.open[g.prompt_id]
        groups.remove(g)
        if not groups:
            del self.open[g.prompt_id]
        return g

    def add(self, sample: Sample, now: float | None = None) -> Group | None:
        now = time.monotonic() if now is None else now
        t = sample.traj
        g = self._slot(t.prompt_id, t.sample_index, t.group_size, now)
        g.samples[t.sample_index] = sample
        if g.step is None:
            g.step, g.step_groups = t.step, t.step_groups
        return self._close_if_complete(g)

    def add_missing(
        self,
        prompt_id: str,
        sample_index: int,
        group_size: int,
        trajectory_id: str,
        now: float | None = None,
        step: tuple[int | None, int | None] = (None, None),
        served: bool = False,
    ) -> Group | None:
        """An expired trajectory fills its slot, so the rest of its group is not held forever;
        ``served``: a served trajectory (decided without its feedback)."""
        now = time.monotonic() if now is None else now
        g = self._slot(prompt_id, sample_index, group_size, now)
        g.missing[sample_index] = trajectory_id
        g.served_missing |= served
        if g.step is None:
            g.step, g.step_groups = step
        return self._close_if_complete(g)

    def expire(self, now: float | None = None, alive: Collection[str] = ()) -> list[Group]:
        """Remove and return the groups idle for ``expire_s``, but those of prompts in
        ``alive`` (a trajectory of theirs is still receiving chunks)."""
        now = time.monotonic() if now is None else now
        dead = [
            g
            for gs in self.open.values()
            for g in gs
            if now - g.last_arrival >= self.expire_s and g.prompt_id not in alive
        ]
        for g in dead:
            self.open[g.prompt_id].remove(g)
            if not self.open[g.prompt_id]:
                del self.open[g.prompt_id]
        return dead

    def waiting(self) -> int:
        return sum(len(gs) for gs in self.open.values())
