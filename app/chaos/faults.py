"""The faults of the processes: how each is injected into a running pipeline, and when its
role has recovered.

Owns :class:`Scene` (what an injector may act on), :class:`Injection` (one fault as it
happened) and the injectors and checks of the generator, trainer, dispatcher, ranker and
broker faults (the data faults are ``app.chaos.storefaults``'s; ``app.chaos.catalogue`` names
them all). An injector does the fault and stamps ``start`` and ``end`` (wall clock; ``end``
is when a lasting fault is lifted); a check reads the run's topics (``app.chaos.watch``) and
returns the time the role had recovered, or None while it has not: ``recovered_s = recovered
- end``. What each waits for (docs/reliability.md):

* a generator SIGKILLed (restarted after 1 s, as a process manager would), SIGSTOPped for
  longer than its session timeout, or cut off by a partition: every trajectory it had in
  flight is finished (resumed from its published prefix by whoever owns its partition now)
  and a step released after the fault is trained;
* the trainer SIGKILLed mid-step or mid-checkpoint (restarted after 1 s): it completes a step;
* the dispatcher SIGKILLed: a step it released after its restart is trained;
* the online ranker SIGKILLed: it publishes a version again;
* the broker (every node of an Apache Kafka cluster at once) SIGKILLed and restarted on its
  ports and data: every generator reports again and a step released after the restart is
  trained.

The faults of one node of an Apache Kafka cluster are ``app.chaos.kafkafaults``'s.

Injectors never wait longer than the run allows (``Scene.halt``), and only signal processes
of the run's :class:`~app.chaos.cast.Cast` or its broker, by pid.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.chaos.cast import RESTART_DELAY_S, Broker, Cast
from app.chaos.config import ChaosConfig
from app.chaos.netns import FullDisk, GenNamespace
from app.chaos.stage import Stage
from app.chaos.watch import Watch, first_after
from consumers.checkpoint import MARKER

POLL_S = 0.0005  # how often the checkpoint and weights injectors look at the store
INFLIGHT_WAIT_S = 60.0  # a generator fault waits this long at most for work in flight


@dataclass
class Scene:
    """What an injector may act on, and what a check may read."""

    cfg: ChaosConfig
    stage: Stage
    cast: Cast
    watch: Watch
    broker: Broker
    netns: GenNamespace | None
    disk: FullDisk | None
    rng: random.Random
    halt: threading.Event = field(default_factory=threading.Event)

    def sleep(self, seconds: float) -> None:
        self.halt.wait(seconds)

    def until(self, pred: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if self.halt.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(every_s)
        return True


@dataclass
class Injection:
    """One fault as it happened."""

    fault: str
    start: float = 0.0
    end: float = 0.0
    target: str = ""
    note: str = ""
    skipped: str | None = None
    inflight: set[str] = field(default_factory=set)
    version: int = 0
    origins: dict[str, str] = field(default_factory=dict)
    crashes: int = 0  # crashes of the run's roles when it was injected


# -- generators ---------------------------------------------------------------------------
def worker_id(name: str) -> str:
    return name.removeprefix("gen-")


def begin_inflight(sc: Scene, inj: Injection, workers: list[str]) -> None:
    """Wait (bounded) until one of ``workers`` has a trajectory in flight, so that the fault
    catches work that must be resumed; note what was in flight and stamp the start."""

    def inflight() -> bool:
        with sc.watch.lock:
            inj.inflight = sc.watch.open_on(workers)
        return bool(inj.inflight)

    sc.until(inflight, INFLIGHT_WAIT_S, 0.02)
    inj.start = inj.end = time.time()


def kill_generator(sc: Scene, inj: Injection) -> None:
    inj.target = sc.rng.choice(sc.stage.generators)
    begin_inflight(sc, inj, [worker_id(inj.target)])
    sc.cast.kill(inj.target)
    sc.sleep(RESTART_DELAY_S)
    sc.cast.restart(inj.target)
    inj.note = f"{inj.target}: {len(inj.inflight)} trajectories in flight; restarted after 1 s"


def stop_generator(sc: Scene, inj: Injection) -> None:
    inj.target = sc.rng.choice(sc.stage.generators)
    begin_inflight(sc, inj, [worker_id(inj.target)])
    sc.cast.signal(inj.target, signal.SIGSTOP)
    sc.sleep(sc.cfg.stop_s)
    sc.cast.signal(inj.target, signal.SIGCONT)
    inj.end = time.time()
    inj.note = (
        f"{inj.target}: {len(inj.inflight)} trajectories in flight; SIGSTOP {sc.cfg.stop_s:g} s"
    )


def partition(sc: Scene, inj: Injection) -> None:
    if sc.netns is None:
        inj.skipped = "no network namespace for the generators"
        return
    begin_inflight(sc, inj, [worker_id(g) for g in sc.stage.generators])
    sc.netns.partition()
    try:
        sc.sleep(sc.cfg.partition_s)
    finally:
        sc.netns.heal()
    inj.end = time.time()
    inj.note = f"all generators cut off {sc.cfg.partition_s:g} s; {len(inj.inflight)} in flight"


def inflight_done(sc: Scene, inj: Injection) -> float | None:
    """The trajectories in flight on the faulted workers are finished, and a step released
    after the fault is trained (every pool works again)."""
    with sc.watch.lock:
        done = sc.watch.finished(inj.inflight)
    whole = new_step_trained(sc, inj)
    return None if done is None or whole is None else max(done, whole)


# -- trainer ----------------------------------------------------------------------------
def _checkpoints(sc: Scene) -> Path:
    return sc.stage.store_dir / "checkpoints" / sc.stage.run


def _partial(sc: Scene) -> list[str]:
    """Checkpoint directories above the newest complete one without their marker (a write
    running or interrupted; pruned ones below it are empty and do not count)."""
    root = _checkpoints(sc)
    if not root.is_dir():
        return []
    newest = max(_complete(sc), default="")
    return sorted(
        d.name
        for d in root.iterdir()
        if d.name > newest and d.is_dir() and not (d / MARKER).exists()
    )


def kill_trainer_mid_step(sc: Scene, inj: Injection) -> None:
    """SIGKILL a seeded fraction into the step after the next one starts, outside checkpoints."""
    with sc.watch.lock:
        s0, times = sc.watch.last_step(), [t for t, _ in sc.watch.seen.steps[-4:]]
    interval = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
    sc.until(lambda: sc.watch.last_step() > s0, 60)
    sc.sleep(sc.rng.uniform(0.3, 0.7) * interval)
    sc.until(lambda: not _partial(sc), 5, POLL_S)
    inj.start = inj.end = time.time()
    sc.cast.kill("trainer")
    partial = _partial(sc)
    inj.note = f"killed {interval * 1000:.0f} ms-step trainer mid-step" + (
        f"; it was writing {partial[0]}" if partial else ""
    )
    sc.sleep(RESTART_DELAY_S)
    sc.cast.restart("trainer")


def kill_trainer_mid_checkpoint(sc: Scene, inj: Injection) -> None:
    """SIGKILL the moment a checkpoint directory appears, before its marker; retried (up to 3
    checkpoints) when the marker won the race."""
    notes = []
    for attempt in range(3):
        hit = _kill_at_next_checkpoint(sc, inj)
        if hit is None:  # nothing was injected (the run had ended, or stood still)
            notes.append("no checkpoint started in 60 s")
            if attempt == 0:
                inj.skipped = "no checkpoint started in 60 s"
            break
        if hit:
            notes.append(f"killed while writing {hit} (attempt {attempt + 1})")
            break
        notes.append("the marker won the race; again")
        sc.until(lambda: trainer_stepped(sc, inj) is not None, 60)
    inj.note = "; ".join(notes)


def _kill_at_next_checkpoint(sc: Scene, inj: Injection) -> str | None:
    """Wait for the next checkpoint to start, SIGKILL the trainer, restart it; the directory
    it left without a marker ('' if the marker was already there, None if none started)."""
    before = set(_partial(sc)) | _complete(sc)
    deadline = time.monotonic() + 60
    while not (fresh := (set(_partial(sc)) | _complete(sc)) - before):
        if sc.halt.is_set() or time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    inj.start = inj.end = time.time()
    sc.cast.kill("trainer")
    left = sorted(fresh - _complete(sc))
    sc.sleep(RESTART_DELAY_S)
    sc.cast.restart("trainer")
    return left[0] if left else ""


def _complete(sc: Scene) -> set[str]:
    root = _checkpoints(sc)
    if not root.is_dir():
        return set()
    return {d.name for d in root.iterdir() if (d / MARKER).exists()}


def trainer_stepped(sc: Scene, inj: Injection) -> float | None:
    with sc.watch.lock:
        return sc.watch.first_step_after(inj.end)


# -- dispatcher, ranker, broker ---------------------------------------------------------
def kill_role(name: str) -> Callable[[Scene, Injection], None]:
    def inject(sc: Scene, inj: Injection) -> None:
        if sc.cast.procs[name].finished:
            inj.skipped = f"the {name} had already finished its work"
            return
        inj.target = name
        inj.start = inj.end = time.time()
        sc.cast.kill(name)
        sc.sleep(RESTART_DELAY_S)
        sc.cast.restart(name)
        inj.note = f"{name} restarted after 1 s"

    return inject


def new_step_trained(sc: Scene, inj: Injection) -> float | None:
    """The first step the dispatcher released after the fault has been trained: the whole
    pipeline works again (released, generated by the pools, trained, announced). When the
    dispatcher had released the run's last step before the fault ended (a long SIGSTOP while
    the pool went on), the first step trained after the fault."""
    with sc.watch.lock:
        released = sc.watch.seen.released
        fresh = [s for s, t in released.items() if t > inj.end]
        if not fresh:
            last = bool(sc.stage.steps) and max(released, default=0) >= sc.stage.steps
            return sc.watch.first_step_after(inj.end) if last else None
        first = min(fresh)
        return min((t for t, s in sc.watch.seen.steps if s == first), default=None)


def ranker_published(sc: Scene, inj: Injection) -> float | None:
    with sc.watch.lock:
        return first_after(sc.watch.seen.ranker, inj.end)


def restart_broker(sc: Scene, inj: Injection) -> None:
    inj.target = "broker"
    inj.start = time.time()
    sc.broker.kill()
    sc.sleep(RESTART_DELAY_S)
    sc.broker.start()
    sc.watch.broker_restarted(inj.start)
    inj.end = time.time()
    inj.note = (
        f"{sc.broker.name} down {inj.end - inj.start:.1f} s (SIGKILL, restart on its port and data)"
    )


def all_back(sc: Scene, inj: Injection) -> float | None:
    """Every generator reported again and a step released after the restart was trained."""
    with sc.watch.lock:
        stats = sc.watch.seen.gen_stats
        times = [stats.get(worker_id(g), 0.0) for g in sc.stage.generators]
    step = new_step_trained(sc, inj)
    if step is None or min(times) <= inj.end:
        return None
    return max(step, *times)
