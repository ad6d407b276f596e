"""The commit guard: a finished task is committed only once its chunks are surely kept.

Owns, for one worker, which finished tasks' offsets may be committed. The embedded broker
writes its state down some 0.3–0.5 s after a change, so a SIGKILLed one forgets the chunks
it acknowledged last (docs/broker.md); a task finished on those chunks whose offset is then
committed (to the restarted broker) is lost: nobody generates it again, and its step waits
for the trainer's expiry. What must hold:

* a finished task's offset becomes committable only ``UNSURE_S`` after its last chunk was
  acknowledged (the broker has written it down by then), except in a final commit;
* when the producer reports that every broker went away (``srl.kafka.Producer.outages``),
  the tasks finished within ``UNSURE_S`` before are *suspects*: their offsets (and, in offset
  order, the ones after them) are not committed until their trajectories are read back from
  the topic complete (:meth:`AckGuard.verify`); if one is not, the worker exits with them
  uncommitted, and whoever takes them next resumes them from what the broker kept
  (``producers.recovery``). On Apache Kafka acknowledged records are replicated and no
  suspect is ever incomplete: the read-back costs one bounded read per outage.

Bookkeeping, and the read-back (:func:`lost_trajectories`); called by ``producers.intake``
(cutoffs) and ``producers.worker`` (outages, verification).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from producers.planning import recovered, sample_plans
from producers.recovery import read_prefixes
from producers.tasks import TaskState
from srl.config import CommonConfig
from srl.errors import SrlError
from srl.kafka import KafkaException, describe
from srl.topics import Layout

log = logging.getLogger("srl.generate")

UNSURE_S = 2.0  # a broker keeps what it acknowledged this long ago (the embedded one: 0.5 s)

# the trajectory ids of ``states`` that the topic does not hold complete
ReadBack = Callable[[list[TaskState]], list[str]]


@dataclass
class AckGuard:
    unsure_s: float = UNSURE_S
    recent: list[tuple[float, TaskState]] = field(default_factory=list)  # (finished at, task)
    suspects: list[tuple[float, TaskState]] = field(default_factory=list)
    outages: int = 0  # the producer's count last seen
    next_check: float = 0.0

    def watch(self, outages: int, now: float) -> bool:
        """Note the producer's outage count; True when suspects are due to be read back (at
        most every ``unsure_s``: while the broker is away the read fails and is tried again)."""
        if outages > self.outages:
            self.outages = outages
            self.outage(now)
        if not self.suspects or now < self.next_check:
            return False
        self.next_check = now + self.unsure_s
        return True

    def finished(self, st: TaskState, now: float) -> None:
        self.recent = [(t, s) for t, s in self.recent if t > now - self.unsure_s]
        self.recent.append((now, st))

    def outage(self, now: float) -> None:
        """Every broker went away: the tasks finished just before are suspects."""
        fresh = [(t, s) for t, s in self.recent if t > now - self.unsure_s]
        known = {id(s) for _, s in self.suspects}
        self.suspects += [(t, s) for t, s in fresh if id(s) not in known]

    def forget(self, tps: set[tuple[str, int]] | None = None) -> None:
        """Partitions given up (all: None): their tasks are the next owner's to read back."""
        keep = (lambda s: False) if tps is None else (lambda s: s.tp not in tps)
        self.recent = [(t, s) for t, s in self.recent if keep(s)]
        self.suspects = [(t, s) for t, s in self.suspects if keep(s)]

    def cutoff(self, now: float, final: bool = False) -> float:
        """Commit only tasks finished before this time (``time.monotonic()``)."""
        if self.suspects:
            return min(t for t, _ in self.suspects) - 1e-6
        return math.inf if final else now - self.unsure_s

    def verify(self, read: ReadBack) -> list[str]:
        """Read the suspects back: [] and they are cleared (committable again), or the ids of
        the trajectories the broker lost. A read that fails (the broker is not back yet)
        leaves them suspects."""
        if not self.suspects:
            return []
        try:
            missing = read([s for _, s in self.suspects])
        except (KafkaException, SrlError) as e:
            log.info("reading back tasks finished before the outage: %s", describe(e))
            return []
        if not missing:
            log.info("the %d tasks finished before the outage are all kept", len(self.suspects))
            self.suspects = []
        return missing


def lost_trajectories(
    cfg: CommonConfig, layout: Layout, states: list[TaskState], slack_s: float
) -> list[str]:
    """The trajectories of finished ``states`` that the topic does not hold complete (or
    handed to the long-tail pool)."""
    plans = {id(st): sample_plans(st.task) for st in states}
    wanted = {
        p.trajectory_id: (layout.partition_for(st.task.bucket, p.trajectory_id), p.next_seq)
        for st in states
        for p in plans[id(st)]
    }
    since = min(st.task.created_ms for st in states) - int(slack_s * 1000)
    found = read_prefixes(cfg, layout, wanted, since, timeout_s=10.0)
    lost: list[str] = []
    for st in states:
        r = recovered(plans[id(st)], found, st.writer)
        lost += [r.gap] if r.gap is not None else [p.trajectory_id for p in r.todo]
    return lost
