"""``srl demo``: a real RL run on one machine, every role its own process, joined only by Kafka
and the object store.

Owns the orchestration a new user meets first. In order:

1. the policy: ``--model DIR`` or the cached warm-started tiny model (``srl init-model``);
2. held-out accuracy before training (greedy, ``app.warmstart.evaluate``);
3. the broker: the embedded one on a free loopback port with its data in ``OUT/broker``, or
   ``--bootstrap`` (then the demo's topics are left in place; a fresh topic prefix is drawn
   unless ``--topic-prefix`` is given, so runs never read each other's records);
4. one config file ``OUT/srl.toml`` that every role reads (``[dispatch]``, ``[generate]``,
   ``[train]`` tables; docs/configuration.md), then the processes: trainer, a regular and a
   long-tail generator pool, the dispatcher, each logging to ``OUT/logs/{role}.log``;
5. live progress from the metrics topic (step, reward, tokens/s, policy version, staleness,
   trainer lag) until the trainer has done ``--steps`` steps;
6. SIGTERM to everything it started (then SIGKILL after a grace period), the broker last;
7. the audit and report (``app.report``): ``OUT/report.json`` and ``OUT/report.png``.

Modes (``--mode``) map onto the roles' own switches:

* ``sync``: the dispatcher releases step t's prompts once step t-1 is announced (k = 0) and
  the trainer runs ``--sync-barrier`` (the whole batch before the backward pass): the baseline;
* ``stream``: the same barrier, but the trainer runs micro-batches as they fill (StreamRL);
* ``async``: step t's prompts are released once step t-1-k is announced (k =
  ``--max-staleness``), so generation runs up to k steps ahead of training; step t still
  trains exactly its own prompts, so nothing is dropped as stale.

Ctrl-C stops every process and still writes the report of what was done. Called by
``srl demo`` (``app.cli.main``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from app import report as rep
from app import task, warmstart
from app.demoplan import (
    DemoConfig,
    DemoError,
    Fleet,
    Plan,
    Role,
    kafka_secrets,
    require_engine,
)
from app.task import demo_pairs
from ranker.config import RankerConfig
from ranker.evaluate import train_on_pairs
from schemas.records import MetricEvent, SchemaError, decode_as
from srl.broker import EmbeddedBroker
from srl.config import CommonConfig, load_config
from srl.kafka import (
    OFFSET_BEGINNING,
    Lag,
    TopicPartition,
    create_topics,
    reader,
    wait_for_broker,
)
from srl.topics import Layout, trainer_group

log = logging.getLogger("app.demo")


# -- live progress ---------------------------------------------------------------------------
class Watcher(threading.Thread):
    """Reads the run's metric events as they arrive; the report reads them again at the end."""

    def __init__(self, cfg: CommonConfig, run: str, trainer_group: str) -> None:
        super().__init__(name="demo-watcher", daemon=True)
        self.cfg, self.run_name, self.trainer_group = cfg, run, trainer_group
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.steps: dict[int, dict[str, float]] = {}
        self.gen_tps: dict[str, float] = {}
        self.version = 0
        self.lag: int | None = None
        self.error: str | None = None

    def run(self) -> None:  # noqa: D102 (thread body)
        layout = Layout.from_config(self.cfg)
        c = reader(self.cfg, f"demo-watch-{uuid.uuid4().hex[:8]}")
        measure = Lag(self.cfg, timeout_s=3)
        try:
            c.assign([TopicPartition(layout.metrics, 0, OFFSET_BEGINNING)])
            next_lag = 0.0
            while not self.halt.is_set():
                msg = c.poll(0.5)
                if msg is not None and not msg.error():
                    with contextlib.suppress(SchemaError):
                        self._take(decode_as(msg.value() or b"", MetricEvent))
                if time.monotonic() >= next_lag:
                    next_lag = time.monotonic() + 3.0
                    with contextlib.suppress(Exception):
                        lag = measure.total([self.trainer_group], [layout.trajectories])
                        with self.lock:
                            self.lag = lag
        except Exception as e:  # the demo goes on without live numbers; the report re-reads
            self.error = str(e)
        finally:
            c.close()
            measure.close()

    def _take(self, e: Any) -> None:
        if e.run != self.run_name:
            return
        with self.lock:
            if e.kind == "train_step" and e.step is not None:
                self.steps[int(e.step)] = dict(e.values)
                self.version = max(self.version, int(e.values.get("policy_version", 0)))
            elif e.kind == "gen_stats":
                self.gen_tps[e.labels.get("worker_id", e.source)] = float(
                    e.values.get("tokens_per_s", 0.0)
                )

    def line(self) -> str:
        with self.lock:
            last = self.steps[max(self.steps)] if self.steps else {}
            gen = sum(self.gen_tps.values())
            lag = "?" if self.lag is None else str(self.lag)
            return (
                f"reward {last.get('reward_mean', float('nan')):.2f}  "
                f"gen {gen:,.0f} tok/s  train {last.get('tokens_per_s', 0.0):,.0f} tok/s  "
                f"v{self.version}  staleness {last.get('staleness_mean', 0.0):.2f}  lag {lag}"
            )

    def done_steps(self) -> int:
        with self.lock:
            return len(self.steps)


# -- the run ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _broker(cfg: DemoConfig, out: Path) -> Iterator[str]:
    if not cfg.embedded:
        yield cfg.bootstrap_servers
        return

    data = out / "broker"
    shutil.rmtree(data, ignore_errors=True)
    with EmbeddedBroker(data_dir=data) as b:
        log.info("embedded broker on %s (data in %s)", b.bootstrap, data)
        yield b.bootstrap


def _fresh(out: Path) -> None:
    """Remove what a previous demo left in OUT (only the demo's own subdirectories)."""
    for sub in ("store", "logs", "broker", "final-model"):
        shutil.rmtree(out / sub, ignore_errors=True)
    for f in ("report.json", "report.png", "srl.toml"):
        (out / f).unlink(missing_ok=True)


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict[str, Any]:
    """Run the demo end to end; returns the report (also written to OUT/report.json)."""

    t_total = time.monotonic()
    require_engine(cfg)  # before anything is built or removed
    warmstart.quiet_transformers()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _fresh(out)

    model_dir = _policy_v0(cfg)
    eval_set = task.demo_prompts(cfg.eval_prompts, "eval", seed=rep.EVAL_SEED)
    click_echo(f"policy v0: {model_dir}")
    before = warmstart.evaluate(model_dir, eval_set)
    click_echo(
        f"held-out accuracy before training: {before.accuracy:.3f} ({len(eval_set)} prompts)"
    )

    prefix = demo_prefix(cfg)
    run = f"demo-{cfg.mode}-s{cfg.seed}"
    with _broker(cfg, out) as bootstrap:
        plan = Plan(cfg, out, model_dir, bootstrap, prefix, run, f"file://{out / 'store'}")
        report = _run_roles(plan, before, eval_set, progress)
    report["total_wall_s"] = round(time.monotonic() - t_total, 1)
    report["out"] = str(out)
    rep.write(report, out)
    if report["status"] != "ok":
        raise DemoError(f"{report['status']}; partial report in {out / 'report.json'}")
    return report


def _policy_v0(cfg: DemoConfig) -> Path:
    """``--model`` or the cached warm start (seed 0, shared by every run seed: runs differ
    only in RL)."""
    model_dir = (Path(cfg.model) if cfg.model else warmstart.ensure_model(seed=0)).resolve()
    if not (model_dir / "config.json").exists():
        raise DemoError(f"--model {model_dir}: not a Hugging Face model directory (no config.json)")
    return model_dir


def demo_prefix(cfg: DemoConfig) -> str:
    """The topic prefix: on an external broker a fresh one unless one was given, so runs
    never read each other's records."""
    if not cfg.embedded and cfg.topic_prefix == "srl":
        return f"srl-demo-{uuid.uuid4().hex[:6]}"
    return cfg.topic_prefix


def role_env(
    environ: Mapping[str, str], secrets: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The roles' environment: no SRL_* variable but SRL_VERBOSE (they read OUT/srl.toml only,
    and SRL_* would override it) and the Kafka secrets (``secrets``: ``SRL_KAFKA_<NAME>``, kept
    out of OUT/srl.toml), one thread per math library, trainer ranks on loopback."""
    env = {k: v for k, v in environ.items() if not k.startswith("SRL_") or k == "SRL_VERBOSE"}
    env |= dict(secrets or {})
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env | one | {"GLOO_SOCKET_IFNAME": "lo"}


def _run_roles(plan: Plan, before: Any, eval_set: list[Any], progress: bool) -> dict[str, Any]:
    """On a running broker: topics, ranker v1, every role until the trainer is done (or one
    fails, or Ctrl-C), then the stop and the report (its ``status`` says which)."""
    cfg, run = plan.cfg, plan.run
    conf = plan.write()
    live = plan.common()
    wait_for_broker(live)
    create_topics(live)
    _bootstrap_ranker(plan)
    fleet = Fleet(env=role_env(os.environ, kafka_secrets(live)), cwd=plan.out)
    watcher = Watcher(live, run, trainer_group(live.topic_prefix, run))
    watcher.start()
    t_run = time.monotonic()
    status = "ok"
    try:
        roles = plan.roles(conf)
        for r in roles:
            fleet.start(r)
        status = _supervise(cfg, fleet, roles[0], watcher, progress)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        click_echo("stopping the generators, the dispatcher and the trainer …")
        fleet.stop()
        watcher.halt.set()
        watcher.join(10)
    wall_run = time.monotonic() - t_run
    click_echo("auditing the topics and evaluating the final policy …")
    return rep.build(live, plan, fleet, before, eval_set, wall_run, status)


def _bootstrap_ranker(plan: Plan) -> None:
    """Publish ranker v1 for the run, fitted on training prompts of the demo task, so the
    dispatcher sends the predicted-longest 20 % of each window to the long-tail pool."""

    rcfg = load_config(RankerConfig, cli={"store": plan.store_url, "run": plan.run}, env={})
    t0 = time.monotonic()
    texts, lengths = demo_pairs(2000, "train", plan.cfg.seed)
    source = f"demo task, 2000 train prompts, seed {plan.cfg.seed}"
    r = train_on_pairs(rcfg, texts, lengths, plan.cfg.seed, source)
    click_echo(
        f"length ranker v{r.version} fitted on 2000 training prompts ({time.monotonic() - t0:.1f} "
        f"s)"
    )


def click_echo(msg: str) -> None:
    import click

    click.echo(msg, err=True)


def _supervise(
    cfg: DemoConfig, fleet: Fleet, trainer: Role, watcher: Watcher, progress: bool
) -> str:
    """Wait for the trainer to finish its steps; fail fast when any role dies."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + cfg.timeout_s
    interactive = progress and sys.stderr.isatty()
    columns = (
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[line]}"),
    )
    with Progress(*columns, disable=not interactive, transient=False) as bar:
        tid = bar.add_task("steps", total=cfg.steps, line="starting …")
        last_logged = -1
        while True:
            done = watcher.done_steps()
            bar.update(tid, completed=min(done, cfg.steps), line=watcher.line())
            if progress and not interactive and done != last_logged:
                last_logged = done
                click_echo(f"step {done}/{cfg.steps}  {watcher.line()}")
            assert trainer.proc is not None
            rc = trainer.proc.poll()
            if rc is not None:
                if rc != 0:
                    return f"trainer exited with {rc}:\n{trainer.tail()}"
                bar.update(tid, completed=cfg.steps, line=watcher.line())
                return "ok"
            for r in fleet.roles:
                if r is trainer or r.proc is None:
                    continue
                rc = r.proc.poll()
                if rc not in (None, 0):
                    return f"{r.name} exited with {rc}:\n{r.tail()}"
            if time.monotonic() > deadline:
                return f"timed out after {cfg.timeout_s:.0f} s at step {done}/{cfg.steps}"
            time.sleep(1.0)


def summary(report: dict[str, Any]) -> str:
    """The few lines a user reads at the end of a demo."""
    r = report
    return "\n".join(
        [
            f"mode {r['mode']}, engine {r.get('engine', 'hf')}, seed {r['seed']}: "
            f"{r['steps']} steps in {r['wall_s']:.0f} s "
            f"({r['total_wall_s']:.0f} s in all), policy v{r['policy_versions']}",
            f"held-out accuracy {r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} "
            f"(greedy, {r['eval_prompts']} prompts); reward {r['reward_first']} -> "
            f"{r['reward_last']}",
            f"trajectories: {r['trajectories_generated']} generated, {r['trajectories_trained']} "
            f"trained, "
            f"{r['dropped_stale']} dropped stale, {r['failed']} failed, {r['pending_at_stop']} "
            f"pending at stop, "
            f"lost {r['lost']}; duplicates seen {r['duplicates_seen']}",
            f"generation {r['tokens_per_s']} tokens/s; chunk-to-trainer latency p50 "
            f"{r['ready_latency_ms_p50']} ms",
            f"report: {Path(r['out']) / 'report.json'} and report.png",
        ]
    )
