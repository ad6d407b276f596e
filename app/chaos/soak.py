"""``srl chaos --soak SECONDS``: one long run with a fault every ``fault_every_s``, and what it
costs over time.

Owns the soak. The pipeline is ``app.chaos.run``'s (same stage, roles and faults) run for
``SECONDS`` with no step limit; a fault is injected every ``fault_every_s``, the faults taken
in a seeded order, round after round, each checked for recovery as in the suite. Every
``SAMPLE_S`` it samples:

* the resident set size (``VmRSS`` of ``/proc/PID/status``) of every role and the broker;
* the size of the newest complete checkpoint (what a restart loads: model, optimizer, ledger);
* the size of the broker's data directory and of the object store (published versions);
* the trainer's step and the machine's 1-minute load average.

At the end: the series as ``OUT/soak.json`` and ``OUT/soak.csv``, the plot ``OUT/soak.png``,
and the rows of every fault injected (the audit of the whole run; a trainer that never stops
leaves its last samples pending). ``store-disk-full`` is left out: its store is a tmpfs, and
every published version stays in the store, so a long run would hold them all in memory.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

from app.chaos.audit import audit_run
from app.chaos.catalogue import CATALOGUE
from app.chaos.config import FAULTS, ChaosConfig
from app.chaos.faults import Injection, Scene
from app.chaos.report import Progress, result
from app.chaos.run import Planned, Suite, advance, make_row
from app.chaos.soakplot import write_series

SAMPLE_S = 5.0
MB = 1024 * 1024
LEFT_OUT = ("store-disk-full",)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def tree_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total / MB


def newest_checkpoint_mb(sc: Scene) -> float | None:
    root = sc.stage.store_dir / "checkpoints" / sc.stage.run
    done = sorted(d for d in root.glob("c*") if (d / "CHECKPOINT.json").exists())
    return tree_mb(done[-1]) if done else None


def sample(sc: Scene, t0: float) -> dict[str, Any]:
    with sc.cast.lock:
        rss = {name: rss_mb(p.pid if p.alive() else None) for name, p in sc.cast.procs.items()}
    rss["broker"] = sum(rss_mb(p) or 0.0 for p in sc.broker.pids()) or None
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "step": sc.watch.last_step(),
        "rss_mb": {k: round(v, 1) for k, v in rss.items() if v is not None},
        "checkpoint_mb": _round(newest_checkpoint_mb(sc)),
        "broker_data_mb": _round(sum(tree_mb(d) for d in sc.broker.data_dirs())),
        "store_mb": _round(tree_mb(sc.stage.store_dir)),
        "load1": round(os.getloadavg()[0], 2),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def run_soak(cfg: ChaosConfig, seconds: float, progress: Progress) -> dict[str, Any]:
    suite = Suite(cfg, progress)
    with suite.prepared():
        names = [n for n in FAULTS if n in suite.available() and n not in LEFT_OUT]
        random.Random(cfg.seed).shuffle(names)
        count = math.ceil(seconds / cfg.fault_every_s) - 1  # the last one before the end
        order = [names[i % len(names)] for i in range(count)]
        planned = [
            Planned(n, (i + 1) * cfg.fault_every_s, Injection(n)) for i, n in enumerate(order)
        ]
        needs = {CATALOGUE[p.name].needs for p in planned}
        retention_ms = int(cfg.soak_retention_s * 1000) or None
        with suite.scene("soak", needs, 0, retention_ms) as sc:
            suite.warm_up("soak", sc)
            series = _soak_loop(sc, planned, seconds, cfg, progress)
            crashes = sc.cast.crashes()
            progress.phase("soak", "stopping the roles; auditing the topics")
            sc.halt.set()
            sc.cast.stop()
            if sc.watch.recorded is not None and not sc.watch.catch_up():
                progress.phase("soak", "the topic watch did not catch up: the audit is short")
            audit = audit_run(sc.stage.common(), finished=False, recorded=sc.watch.recorded)
    rows = [make_row("soak", sc, p, audit, crashes, True, 0) for p in planned]
    summary = write_series(Path(cfg.out).resolve(), series, planned, cfg, seconds)
    progress.done("soak", f"{len(planned)} faults in {seconds:g} s; series in {cfg.out}")
    return result(cfg.max_staleness, rows, {"seed": cfg.seed, "soak": summary})


def _soak_loop(
    sc: Scene, planned: list[Planned], seconds: float, cfg: ChaosConfig, progress: Progress
) -> list[dict[str, Any]]:
    """Faults at their offsets and a sample every ``SAMPLE_S`` for ``seconds``; then, with no
    new fault, until the injected ones have recovered (or timed out)."""
    t0 = time.monotonic()
    series: list[dict[str, Any]] = []
    next_sample = t0
    while True:
        now = time.monotonic()
        running = now - t0 < seconds
        started = planned if running else [p for p in planned if p.thread is not None]
        if not advance(sc, started, t0, cfg.recover_timeout_s) and not running:
            return series
        if now >= next_sample:
            next_sample += SAMPLE_S
            series.append(s := sample(sc, t0))
            progress.phase(
                "soak",
                f"{s['t_s']:.0f}/{seconds:g} s, step {s['step']}, "
                f"{sum(p.thread is not None for p in planned)}/{len(planned)} faults, "
                f"checkpoint {s['checkpoint_mb']} MB, broker {s['broker_data_mb']} MB",
            )
        time.sleep(0.25)
