"""Which complete groups make up the trainer's open step, and when that step is complete.

Owns the trainer's half of the admission rule (DESIGN.md, "Staleness"). The dispatcher
numbers its tasks by trainer step: it releases step t's groups together once the trainer has
announced step t-1-k, and workers start them with weights no older than that announcement
(``PromptTask.min_version``). If step t trains exactly those groups, every sample it trains
has ``v - b <= k`` whatever the timing, so nothing is dropped as stale and a long sample is
waited for instead of thrown away. What must hold:

* a group released for step t (``Group.step``) joins step t: at once when t is the open step,
  held back while t is later (at most k steps ahead), at once when t has passed (a late group,
  e.g. after an expiry; the staleness gate still judges it);
* step t is complete when every one of its ``step_groups`` groups has arrived, whether or not
  any of its samples trains (a group whose rewards all failed still counts);
* unscheduled groups (``step`` null: hand-made records, serving traffic, a trainer with
  ``windows=False``) join the open step as they complete, and late groups too, and count
  towards it once gated (``credit``); while no group released for the open step has been
  seen, the step is complete at ``groups_per_step`` counted groups (the rule of a trainer
  that is not paced by a dispatcher);
* a served group counts only if it trains with a learning signal (some advantage is not
  zero): users send what they send, so the trainer steps at the pace of the served traffic
  that can teach it; a group of one (every client's default ``n``), one rated all alike or
  one dropped as stale neither publishes a version with nothing learnt nor makes the
  requests still being served one version older. Dispatched work counts whatever it trains:
  a dispatcher's groups are its step budget;
* a step that got no new group for ``expire_s`` (while none of its trajectories was still
  streaming in: ``alive``, a long tail generating for many minutes) is complete with what it
  has, if it has anything or later steps are waiting (a lost task must not stall the run;
  with nothing at all the trainer takes an empty step, publishing the same weights, so the
  dispatcher's barrier moves on).

Pure logic; the trainer calls ``add`` per complete (or expired) group, ``credit`` for each
group that joined once it is gated, ``complete`` after each, and ``advance`` after taking the
step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from consumers.groups import Group


@dataclass
class StepPlanner:
    groups_per_step: int
    expire_s: float = 300.0
    step: int = 1  # the open step: the trainer's step + 1
    windows: bool = True  # False: ignore step numbers (every group is unscheduled)
    held: dict[int, list[Group]] = field(default_factory=dict)  # later steps' groups
    expected: int | None = None  # step_groups of the open step, once one of its groups is seen
    arrived: int = 0  # groups released for the open step that joined it
    others: int = 0  # unscheduled or late groups that joined it and count (``credit``)
    progress_at: float = field(default_factory=time.monotonic)

    def _scheduled(self, g: Group) -> int | None:
        return g.step if self.windows else None

    def add(self, group: Group, now: float | None = None) -> list[Group]:
        """The groups that join the open step now: ``[group]``, or ``[]`` when it is held."""
        step = self._scheduled(group)
        if step is not None and step > self.step:
            self.held.setdefault(step, []).append(group)
            return []
        self._join(group, now)
        return [group]

    def _join(self, group: Group, now: float | None) -> None:
        self.progress_at = time.monotonic() if now is None else now
        if self._scheduled(group) == self.step:
            self.arrived += 1
            if group.step_groups is not None:
                self.expected = max(self.expected or 0, group.step_groups)

    def credit(self, group: Group, signal: bool) -> None:
        """A joined group, gated (``signal``: it trains with a learning signal): an unscheduled
        or late one counts now, a served one only with a signal."""
        if self._scheduled(group) != self.step and (signal or not group.served):
            self.others += 1

    @property
    def size(self) -> int:
        return self.arrived + self.others

    def complete(self, now: float | None = None) -> bool:
        """Whether the open step should be taken now (see the module docstring)."""
        if self.expected is not None:
            if self.arrived >= self.expected:
                return True
        elif self.size >= self.groups_per_step:
            return True
        now = time.monotonic() if now is None else now
        waited = now - self.progress_at >= self.expire_s
        return waited and (self.size > 0 or bool(self.held))

    @property
    def missing(self) -> int:
        """Groups released for the open step that have not arrived (counted at an expiry)."""
        return max(0, (self.expected or 0) - self.arrived)

    def alive(self, steps: set[int | None], now: float | None = None) -> None:
        """Trajectories released for ``steps`` are still receiving chunks: the open step is
        not idle while one of its own is (it is waited for, not expired)."""
        if self.step in steps:
            self.progress_at = time.monotonic() if now is None else now

    def advance(self, now: float | None = None) -> list[Group]:
        """Open the next step; the held groups that join it (call ``complete`` again after)."""
        self.step += 1
        self.expected, self.arrived, self.others = None, 0, 0
        self.progress_at = time.monotonic() if now is None else now
        joined = self.held.pop(self.step, [])
        for g in joined:
            self._join(g, now)
        return joined

    def waiting(self) -> int:
        """Groups held for later steps."""
        return sum(len(gs) for gs in self.held.values())
