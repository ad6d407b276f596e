"""Every fault the suite knows: its injector, its recovery check, its role, what it needs.

Owns :data:`CATALOGUE` (one :class:`Fault` per name of ``app.chaos.config.FAULTS``, checked at
import) and :func:`mixed_faults`, the seeded choice of faults injected together in the mixed
run (at most one per role, so that two faults never fight over one process). The injectors
and checks are ``app.chaos.faults``'s, ``app.chaos.storefaults``'s and (the cluster's)
``app.chaos.kafkafaults``'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from app.chaos import faults as f
from app.chaos import kafkafaults as k
from app.chaos import storefaults as s
from app.chaos.config import FAULTS

MIXED_ROLES = 4  # faults injected together in the mixed run


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[f.Scene, f.Injection], None]
    check: Callable[[f.Scene, f.Injection], float | None]
    role: str  # the part of the system it hits; the mixed run takes at most one per role
    # "netns" (the generators' namespace), "disk" (a tmpfs store) or "cluster" (three Apache
    # Kafka nodes)
    needs: str | None = None
    # steps a run with this fault trains at least: the pipeline must still be working when a
    # long fault (a rolling restart of three nodes) ends, or its recovery cannot be seen
    min_steps: int = 0


CATALOGUE: dict[str, Fault] = {
    x.name: x
    for x in (
        Fault("generator-kill", f.kill_generator, f.inflight_done, "generator"),
        Fault("generator-stop", f.stop_generator, f.inflight_done, "generator"),
        Fault("generator-partition", f.partition, f.inflight_done, "generator", "netns"),
        Fault("trainer-kill-step", f.kill_trainer_mid_step, f.trainer_stepped, "trainer"),
        Fault(
            "trainer-kill-checkpoint", f.kill_trainer_mid_checkpoint, f.trainer_stepped, "trainer"
        ),
        Fault("dispatcher-kill", f.kill_role("dispatcher"), f.new_step_trained, "dispatcher"),
        # killed up to MIX_WINDOW_S after the warm-up, the ranker needs steps after that
        Fault("ranker-kill", f.kill_role("ranker"), f.ranker_published, "ranker", None, 16),
        Fault("broker-restart", f.restart_broker, f.all_back, "broker"),
        Fault("weights-corrupt", s.spoil_weights(False), s.refused_then_newer, "store"),
        Fault("weights-delete", s.spoil_weights(True), s.refused_then_newer, "store"),
        Fault("store-disk-full", s.fill_store, s.published_again, "store", "disk"),
        Fault("poison", s.write_poison, s.poison_handled, "topics"),
        Fault("kafka-leader-kill", k.kill_leader, f.inflight_done, "broker", "cluster", 16),
        Fault("kafka-node-freeze", k.freeze_node, f.inflight_done, "broker", "cluster", 16),
        Fault("kafka-rolling-restart", k.rolling_restart, f.inflight_done, "broker", "cluster", 40),
        Fault("kafka-controller-kill", k.kill_controller, f.inflight_done, "broker", "cluster", 16),
    )
}
assert tuple(CATALOGUE) == FAULTS, "app.chaos.config.FAULTS and the catalogue disagree"


def mixed_faults(rng: random.Random, available: set[str]) -> list[str]:
    """``MIXED_ROLES`` faults of different roles, drawn from ``available``."""
    by_role: dict[str, list[str]] = {}
    for name in FAULTS:
        if name in available:
            by_role.setdefault(CATALOGUE[name].role, []).append(name)
    roles = rng.sample(sorted(by_role), min(MIXED_ROLES, len(by_role)))
    return [rng.choice(by_role[r]) for r in roles]
