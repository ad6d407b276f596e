"""``srl chaos``: runs of the real pipeline, each with its faults, and a row per fault.

Owns the suite's order. Once: the tiny model (``srl.tinymodel``, the demo's architecture),
the sim lengths file, the broker (``app.chaos.cast``: the embedded one, or one or three
Apache Kafka nodes; killable), whether this machine can make network namespaces and tmpfs
mounts, and whether the cluster faults have their three nodes. Then per run, for each fault
of the schedule alone and (``mixed``) once for several faults together:

1. every broker node up (a fault of the run before may have left one down), a fresh
   :class:`~app.chaos.stage.Stage` (topics, store, config file), the generators' namespace
   and the tmpfs store when a fault needs them, the roles (``app.chaos.cast``),
   a supervisor thread (crashed roles come back) and the topic watch (``app.chaos.watch``);
2. warm-up: ``warmup_steps`` optimizer steps;
3. the faults, each on its own thread at its seeded offset; as each is lifted, its check is
   asked until the role has recovered or ``recover_timeout_s`` has passed;
4. the rest of the run: until the trainer has done its ``steps`` (bounded: a fault that
   loses a trajectory costs the trainer's ``expire_s`` before the step moves on);
5. SIGTERM to every role, then the audit from the topics (``app.chaos.audit``) and the rows.

A fault that needs what this machine cannot give is a skipped row with the reason. Called by
the CLI (``srl chaos``) and ``app.chaos.soak``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.chaos.audit import Audit, Recorded, audit_run
from app.chaos.cast import Broker, Cast, EmbeddedBroker, KafkaBroker, Proc
from app.chaos.catalogue import CATALOGUE, mixed_faults
from app.chaos.config import FAULTS, ChaosConfig
from app.chaos.faults import Injection, Scene
from app.chaos.netns import FullDisk, GenNamespace
from app.chaos.report import Progress, Row, result
from app.chaos.stage import Stage, write_lengths
from app.chaos.storefaults import missing_letters
from app.chaos.watch import Watch
from app.demo import role_env
from app.warmstart import quiet_transformers
from srl.errors import SrlError
from srl.kafka import create_topics
from srl.tinymodel import TinyModelSpec, build_tiny_model

WARMUP_TIMEOUT_S = 300.0  # six processes starting on a busy 2-core machine
STORE_MB = 1024  # the tmpfs store of a run with store-disk-full
JOIN_WAIT_S = 30.0  # how long a generator may take to report before the next one starts
MIX_WINDOW_S = 15.0  # faults injected together start within this long of each other
DRAIN_CAP_S = 600.0  # the longest a run waits for its trainer to finish after the faults


@dataclass
class Planned:
    """A fault to inject ``offset_s`` after warm-up, and what became of it."""

    name: str
    offset_s: float
    inj: Injection
    thread: threading.Thread | None = None
    lifted: float | None = None  # monotonic time its injector returned
    recovered: float | None = None  # wall time its check passed


class Suite:
    """One ``srl chaos``: see the module docstring."""

    def __init__(self, cfg: ChaosConfig, progress: Progress) -> None:
        self.cfg, self.progress = cfg, progress
        self.out = Path(cfg.out).resolve()
        self.rng = random.Random(cfg.seed)
        self.unavailable: dict[str, str | None] = {}

    @contextlib.contextmanager
    def prepared(self) -> Iterator[Broker]:
        """The model, the lengths file and the broker; the broker stops on exit."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress.phase("setup", "tiny model, broker, namespaces")
        quiet_transformers()
        model = self.out / "model"
        if not (model / "config.json").exists():
            build_tiny_model(model, TinyModelSpec(), seed=0)
        self.model_dir, self.lengths = model, write_lengths(self.out / "lengths.csv")
        shutil.rmtree(self.out / "broker", ignore_errors=True)
        self.broker = new_broker(self.cfg, self.out / "broker")
        self.broker.start()
        three = isinstance(self.broker, KafkaBroker) and self.cfg.nodes >= 3
        self.unavailable = {
            "netns": GenNamespace.unavailable(),
            "disk": FullDisk.unavailable(self.out),
            "cluster": None if three else "needs three Apache Kafka nodes (--broker kafka)",
        }
        try:
            yield self.broker
        finally:
            self.broker.stop()

    def run(self) -> dict[str, Any]:
        rows: list[Row] = []
        load = [round(os.getloadavg()[0], 2)]
        with self.prepared():
            if self.cfg.together:
                rows += self.run_faults("together", self.offsets(self.cfg.schedule()))
            else:
                for name in self.cfg.schedule():
                    rows += self.run_faults(name, [(name, 0.0)])
            if self.cfg.mixed:
                names = mixed_faults(self.rng, self.available())
                rows += self.run_faults("mixed", self.offsets(names))
        load.append(round(os.getloadavg()[0], 2))
        meta = {"seed": self.cfg.seed, "broker": self.broker.name, "load1": load}
        return result(self.cfg.max_staleness, rows, meta)

    def offsets(self, names: Iterable[str]) -> list[tuple[str, float]]:
        """``names`` at seeded offsets within ``MIX_WINDOW_S`` of the warm-up's end."""
        plan = [(n, round(self.rng.uniform(0, MIX_WINDOW_S), 1)) for n in names]
        return sorted(plan, key=lambda p: p[1])

    def available(self) -> set[str]:
        return {n for n in FAULTS if self.why_not(n) is None}

    def why_not(self, name: str) -> str | None:
        needs = CATALOGUE[name].needs
        return None if needs is None else self.unavailable.get(needs)

    # -- one run -------------------------------------------------------------------------
    def run_faults(self, run: str, plan: list[tuple[str, float]]) -> list[Row]:
        """One run of the pipeline with ``plan``'s faults; a row per fault."""
        skipped = [(n, why) for n, _ in plan if (why := self.why_not(n)) is not None]
        if skipped and len(plan) == 1:
            self.progress.done(run, f"skipped: {skipped[0][1]}")
            return [Row(run, None, 0, 0, 0, skipped=skipped[0][1])]
        planned = [Planned(n, off, Injection(n)) for n, off in plan]
        needs = {CATALOGUE[n].needs for n, _ in plan}
        steps = max(self.cfg.steps, *(CATALOGUE[n].min_steps for n, _ in plan))
        with self.scene(run, needs, steps) as sc:
            self.warm_up(run, sc)
            self.play(run, sc, planned)
            self.drain(run, sc, steps)
            finished, crashes = sc.cast.procs["trainer"].finished, sc.cast.crashes()
        self.progress.phase(run, "auditing the topics")
        audit = audit_run(sc.stage.common(), finished)
        rows = [make_row(run, sc, p, audit, crashes, finished, steps) for p in planned]
        self.progress.done(run, "; ".join(_summary(r, self.cfg.max_staleness) for r in rows))
        return rows

    @contextlib.contextmanager
    def scene(
        self, run: str, needs: set[str | None], steps: int, retention_ms: int | None = None
    ) -> Iterator[Scene]:
        """A run's stage, namespace, store, roles, supervisor and watch; all stopped on exit.
        With ``retention_ms`` (the data topics' retention) the watch gathers the audit's
        records as they arrive (``watch.recorded``): they will not all be there at the end."""
        work = self.out / "runs" / run
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        self.broker.start()  # what a fault of the run before left down comes back first
        with contextlib.ExitStack() as stack:
            netns = disk = None
            if "netns" in needs:
                netns = GenNamespace(self.broker.ports, work / "logs" / "relay.log").up()
                stack.callback(netns.down)
            if "disk" in needs:
                disk = FullDisk(work / "store", STORE_MB).mount()
                stack.callback(disk.unmount)
            stage = Stage(
                cfg=self.cfg,
                name=run,
                work=work,
                bootstrap=self.broker.bootstrap,
                model_dir=self.model_dir,
                lengths=self.lengths,
                store_dir=work / "store",
                steps=steps,
                prefix=netns.prefix() if netns else [],
                retention_ms=retention_ms,
            )
            conf = stage.write()
            create_topics(stage.common())
            cast = Cast(role_env(os.environ), work)
            stack.callback(cast.stop)
            watch = Watch(stage.common(), Recorded() if retention_ms else None)
            watch.start()
            stack.callback(watch.stop)
            sc = Scene(self.cfg, stage, cast, watch, self.broker, netns, disk, self.rng)
            stack.callback(sc.halt.set)
            _start(sc, stage.procs(conf))
            threading.Thread(target=_supervise, args=(sc,), daemon=True).start()
            yield sc

    def warm_up(self, run: str, sc: Scene) -> None:
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while (done := sc.watch.last_step()) < self.cfg.warmup_steps:
            if time.monotonic() > deadline:
                raise ChaosError(
                    f"{run}: the pipeline did not train {self.cfg.warmup_steps} steps in "
                    f"{WARMUP_TIMEOUT_S:g} s; trainer log:\n{sc.cast.procs['trainer'].tail()}"
                )
            self.progress.phase(run, f"warming up: step {done}/{self.cfg.warmup_steps}")
            time.sleep(0.5)

    def play(self, run: str, sc: Scene, planned: list[Planned]) -> None:
        """Inject each fault at its offset; wait until each has recovered or timed out."""
        t0 = time.monotonic()
        while waiting := advance(sc, planned, t0, self.cfg.recover_timeout_s):
            now = time.monotonic()
            self.progress.phase(run, _status(waiting, now, sc.watch.last_step(), sc.stage.steps))
            time.sleep(0.25)

    def drain(self, run: str, sc: Scene, steps: int) -> None:
        """Until the trainer has done its steps and exited: while it makes progress (a step,
        including one a restarted trainer redoes after its checkpoint, or a restart), up to
        the trainer's expiry and 30 s after the last (a fixed budget counted from the steps
        the watch had seen: a trainer restarted from an older checkpoint late in the run
        redoes steps it had already reported, and ran out of it: ``srl chaos --trainer-ranks
        2`` in a clean-clone run), never past ``DRAIN_CAP_S``."""
        trainer = sc.cast.procs["trainer"]
        grace = self.cfg.expire_s + 30
        start = time.monotonic()
        deadline, seen = start + grace, (len(sc.watch.seen.steps), trainer.starts)
        while not trainer.finished and time.monotonic() < min(deadline, start + DRAIN_CAP_S):
            self.progress.phase(run, f"training on: step {sc.watch.last_step()}/{steps}")
            time.sleep(0.5)
            now_seen = (len(sc.watch.seen.steps), trainer.starts)
            if now_seen != seen:
                deadline, seen = time.monotonic() + grace, now_seen


def make_row(
    run: str,
    sc: Scene,
    p: Planned,
    audit: Audit,
    crashes: dict[str, int],
    finished: bool,
    steps: int,
) -> Row:
    """The row of fault ``p`` of ``run``: its recovery, and the run's audit."""
    name = p.name if run == p.name else f"{run}/{p.name}"
    inj = p.inj
    note = inj.note
    if p.name == "poison" and (missing := missing_letters(sc, inj)):
        note += f"; not dead-lettered: {', '.join(missing)}"
    if not finished:
        note += f"; the trainer did {audit.steps} of {steps} steps and had not exited"
        note += f" (its log's end: {sc.cast.procs['trainer'].tail(6)!r})"
    if sc.watch.error:
        note += f"; the topic watch failed: {sc.watch.error}"
    rec = None if p.recovered is None else max(0.0, p.recovered - inj.end)
    detail = audit.to_dict() | {"crashes": crashes, "injected_at": round(inj.start, 3)}
    return Row(
        name,
        rec,
        audit.lost,
        audit.trained_twice,
        audit.max_staleness,
        audit.published_twice,
        audit.dropped,
        finished,
        note.strip("; "),
        inj.skipped,
        detail,
    )


def new_broker(cfg: ChaosConfig, data_dir: Path) -> Broker:
    if cfg.broker == "kafka":
        return KafkaBroker(data_dir, cfg.nodes)
    return EmbeddedBroker(data_dir)


class ChaosError(SrlError):
    """A run could not even start (the pipeline never trained)."""


def _start(sc: Scene, procs: list[Proc]) -> None:
    """Start the roles in order; each generator once the one before it reports (two members
    joining a group at once can wedge it on the embedded broker: docs/broker.md)."""
    for proc in procs:
        sc.cast.add(proc)
        if proc.name in sc.stage.generators:
            sc.until(functools.partial(_reports, sc, proc.name.removeprefix("gen-")), JOIN_WAIT_S)


def _reports(sc: Scene, worker: str) -> bool:
    with sc.watch.lock:
        return worker in sc.watch.seen.gen_stats


def advance(sc: Scene, planned: list[Planned], t0: float, timeout_s: float) -> list[Planned]:
    """Start each fault whose offset (from ``t0``, monotonic) has come, on its own thread; ask
    the check of each lifted one until it passes or ``timeout_s`` has passed since it was
    lifted. The faults still unsettled."""
    now = time.monotonic()
    for p in planned:
        if p.thread is None and now - t0 >= p.offset_s:
            p.thread = threading.Thread(target=_inject, args=(sc, p), daemon=True)
            p.inj.start = time.time()
            p.thread.start()
        if p.thread is not None and p.lifted is None and not p.thread.is_alive():
            p.lifted = now
        if p.lifted is not None and p.recovered is None and not p.inj.skipped:
            p.recovered = CATALOGUE[p.name].check(sc, p.inj)
    return [p for p in planned if not _settled(p, now, timeout_s)]


def _inject(sc: Scene, p: Planned) -> None:
    try:
        CATALOGUE[p.name].inject(sc, p.inj)
    except Exception as e:  # the row says what went wrong; the other faults go on
        p.inj.skipped = f"the injector failed: {type(e).__name__}: {e}"


def _settled(p: Planned, now: float, timeout_s: float) -> bool:
    if p.lifted is None:
        return False
    return p.recovered is not None or bool(p.inj.skipped) or now - p.lifted > timeout_s


def _status(waiting: list[Planned], now: float, step: int, steps: int) -> str:
    parts = []
    for p in waiting:
        if p.thread is None:
            parts.append(f"{p.name} in {p.offset_s:.0f} s")
        elif p.lifted is None:
            parts.append(f"{p.name} injected")
        else:
            parts.append(f"{p.name} recovering {now - p.lifted:.0f} s")
    return f"step {step}/{steps}: " + ", ".join(parts)


def _summary(r: Row, k: int) -> str:
    if r.skipped:
        return f"{r.fault} skipped"
    rec = "not recovered" if r.recovered_s is None else f"recovered {r.recovered_s:.1f} s"
    return f"{r.fault} {rec}, lost {r.lost}, twice {r.trained_twice}: {'ok' if r.ok(k) else 'FAIL'}"


def _supervise(sc: Scene) -> None:
    """Restart crashed roles until the run stops."""
    while not sc.halt.is_set():
        sc.cast.supervise()
        sc.halt.wait(0.2)
