"""``srl demo``: a real RL run on one machine, every role its own process, joined only by Kafka
and the object store.

Owns the orchestration a new user meets first. In order:

1. the policy: ``--model DIR`` or the cached warm-started tiny model (``srl init-model``);
2. held-out accuracy before training (greedy, ``srl.warmstart.evaluate``);
3. the broker: the embedded one on a free loopback port with its data in ``OUT/broker``, or
   ``--bootstrap`` (then the demo's topics are left in place; a fresh topic prefix is drawn
   unless ``--topic-prefix`` is given, so runs never read each other's records);
4. one config file ``OUT/srl.toml`` that every role reads (``[dispatch]``, ``[generate]``,
   ``[train]`` tables; docs/configuration.md), then the processes: trainer, a regular and a
   long-tail generator pool, the dispatcher, each logging to ``OUT/logs/{role}.log``;
5. live progress from the metrics topic (step, reward, tokens/s, policy version, staleness,
   trainer lag) until the trainer has done ``--steps`` steps;
6. SIGTERM to everything it started (then SIGKILL after a grace period), the broker last;
7. the audit and report (``srl.report``): ``OUT/report.json`` and ``OUT/report.png``.

Modes (``--mode``) map onto the roles' own switches:

* ``sync``: the dispatcher releases step t's prompts once step t-1 is announced (k = 0) and
  the trainer runs ``--sync-barrier`` (the whole batch before the backward pass): the baseline;
* ``stream``: the same barrier, but the trainer runs micro-batches as they fill (StreamRL);
* ``async``: step t's prompts are released once step t-1-k is announced (k =
  ``--max-staleness``), so generation runs up to k steps ahead of training; step t still
  trains exactly its own prompts, so nothing is dropped as stale.

Ctrl-C stops every process and still writes the report of what was done. Called by
``srl demo`` (``srl.cli``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from srl.config import CommonConfig
from srl.errors import SrlError

log = logging.getLogger("srl.demo")

STOP_GRACE_S = 60.0  # SIGTERM → SIGKILL; generators drain in-flight work within this


class DemoError(SrlError):
    """The demo could not run (a role died, the run timed out …)."""


class DemoConfig(CommonConfig):
    """``srl demo``'s settings; the ``[demo]`` table of a config file or ``SRL_*`` variables."""

    section = "demo"

    steps: int = Field(60, ge=1, le=100_000, description="Optimizer steps to train.")
    out: str = Field(
        "runs/demo", description="Directory for the report, logs, store and broker data."
    )
    mode: Literal["sync", "stream", "async"] = Field("async", description="Pipeline mode.")
    max_staleness: int = Field(1, ge=0, le=1000, description="k for --mode async.")
    reward: str = Field("srl.task:demo_reward", description="Reward module:function.")
    seed: int = Field(0, description="Seed of the prompts, sampling and training.")
    model: str | None = Field(
        None, description="HF model directory (policy v0); null: the cached `srl init-model` model."
    )
    group_size: int = Field(8, ge=2, le=256, description="Samples per prompt (GRPO group).")
    groups_per_step: int = Field(8, ge=1, le=4096, description="Groups per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    max_new_tokens: int = Field(72, ge=1, description="Max generated tokens per sample.")
    eval_prompts: int = Field(256, ge=1, description="Held-out prompts for eval accuracy.")
    eval_every: int = Field(
        20,
        ge=0,
        description="Also evaluate every N-th published version (accuracy over time); 0: final only.",
    )
    chunk_tokens: int = Field(16, ge=1, description="Tokens per published chunk.")
    regular_max_batch: int = Field(32, ge=1, description="Regular pool's decode batch.")
    longtail_max_batch: int = Field(8, ge=1, description="Long-tail pool's decode batch.")
    migrate_factor: float | None = Field(
        2.0,
        gt=1,
        description="The regular pool hands a trajectory past this many times its predicted length (and 16 tokens) to the long-tail pool; null: never.",
    )
    timeout_s: float = Field(1800.0, gt=0, description="Give up when training takes longer.")
    embedded: bool = Field(True, description="Start the embedded broker (false with --bootstrap).")


# -- processes ---------------------------------------------------------------------------
@dataclass
class Role:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@dataclass
class Fleet:
    """The processes the demo started; every one is stopped, whatever happens."""

    env: dict[str, str]
    cwd: Path
    roles: list[Role] = field(default_factory=list)

    def start(self, role: Role) -> Role:
        role.log_path.parent.mkdir(parents=True, exist_ok=True)
        with role.log_path.open("ab") as out:
            role.proc = subprocess.Popen(
                role.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # our Ctrl-C is not theirs: we stop them in order
            )
        role.started = time.monotonic()
        self.roles.append(role)
        log.info("started %s (pid %d): %s", role.name, role.proc.pid, " ".join(role.argv))
        return role

    def stop(self, roles: list[Role] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the process group."""
        todo = [r for r in (roles or self.roles) if r.alive()]
        for r in todo:
            assert r.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            for r in todo:
                assert r.proc is not None
                try:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", r.name, grace_s)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(r.proc.pid, signal.SIGKILL)
                    r.proc.wait(10)
        except KeyboardInterrupt:  # a second Ctrl-C: no more grace
            log.warning("interrupted again: killing every role")
        for r in self.roles:  # anything a role left in its process group
            if r.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(10)


def _script(name: str, *args: str) -> list[str]:
    """The console script installed beside this interpreter (the same venv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise DemoError(f"{name} not found beside {sys.executable} or on PATH; run `make install`")
    return [found, *args]


# -- config file ---------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml(top: dict[str, Any], tables: dict[str, dict[str, Any]]) -> str:
    lines = ["# Written by `srl demo`: every role of this run reads it (docs/configuration.md)."]
    lines += [f"{k} = {_toml_value(v)}" for k, v in top.items() if v is not None]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


# Demo answers are at most 64 tokens (+ EOS): buckets le16, le32 (regular pool), gt32 (long tail).
DEMO_BUCKET_BOUNDS = (16, 32)
REGULAR_BUCKETS = ("le16", "le32")
LONGTAIL_BUCKETS = ("gt32",)


@dataclass
class Plan:
    """Everything the processes need, derived from the config: written to OUT/srl.toml."""

    cfg: DemoConfig
    out: Path
    model_dir: Path
    bootstrap: str
    prefix: str
    run: str
    store_url: str

    def role_tables(self) -> dict[str, dict[str, Any]]:
        c = self.cfg
        k = 0 if c.mode in ("sync", "stream") else c.max_staleness
        return {
            "dispatch": {
                "task": "demo",
                "seed": c.seed,
                # step t's prompts are released once step t-1-k is announced and step t trains
                # exactly them: one step of prompts per step, nothing dropped as stale
                "num_prompts": c.steps * c.groups_per_step,
                "group_size": c.group_size,
                "max_new_tokens": c.max_new_tokens,
                "temperature": c.temperature,
                "max_staleness": k,
                "groups_per_step": c.groups_per_step,
                "pools": ["regular", "longtail"],
                "predictor": "ranker",
                "longtail_bucket": LONGTAIL_BUCKETS[0],
            },
            "generate": {
                "engine": "hf",
                "model": str(self.model_dir),
                "chunk_tokens": c.chunk_tokens,
                "max_staleness": k,
                "threads": 1,
                "seed": c.seed,
                "stats_interval_s": 2.0,
                "drain_timeout_s": 20.0,
            },
            "train": {
                "model": str(self.model_dir),
                "reward": c.reward,
                "lr": c.lr,
                "groups_per_step": c.groups_per_step,
                "max_staleness": k,
                "sync_barrier": c.mode == "sync",
                "max_steps": c.steps,
                "temperature": c.temperature,
                "seed": c.seed,
                "device": "cpu",
            },
        }

    def write(self) -> Path:
        top = {
            "bootstrap_servers": self.bootstrap,
            "topic_prefix": self.prefix,
            "run": self.run,
            "store": self.store_url,
            "bucket_bounds": list(DEMO_BUCKET_BOUNDS),
            "linger_ms": 2.0,
        }
        tables = self.role_tables()
        if self.cfg.kafka:  # librdkafka settings (security …) reach every role
            tables = {"kafka": dict(self.cfg.kafka)} | tables
        path = self.out / "srl.toml"
        path.write_text(_toml(top, tables))
        return path

    def roles(self, config_file: Path) -> list[Role]:
        c, logs, conf = self.cfg, self.out / "logs", ["--config", str(config_file)]
        return [
            Role("trainer", _script("srl-consumer", "train", *conf), logs / "trainer.log"),
            Role(
                "gen-regular",
                _script(
                    "srl-producer", "generate", *conf, "--pool", "regular",
                    "--buckets", ",".join(REGULAR_BUCKETS),
                    "--max-batch", str(c.regular_max_batch), "--worker-id", "regular-0",
                    *(["--migrate-to", LONGTAIL_BUCKETS[0], "--migrate-factor", str(c.migrate_factor),
                       "--migrate-min-tokens", "16"] if c.migrate_factor else []),
                ),
                logs / "gen-regular.log",
            ),
            Role(
                "gen-longtail",
                _script(
                    "srl-producer", "generate", *conf, "--pool", "longtail",
                    "--buckets", ",".join(LONGTAIL_BUCKETS),
                    "--max-batch", str(c.longtail_max_batch), "--worker-id", "longtail-0",
                ),
                logs / "gen-longtail.log",
            ),
            Role("dispatcher", _script("srl-producer", "dispatch", *conf), logs / "dispatcher.log"),
        ]  # fmt: skip


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
        from confluent_kafka import Consumer, TopicPartition

        from schemas.records import MetricEvent, SchemaError, decode_as
        from srl.kafka import base_settings, committed_offsets, watermarks
        from srl.topics import Layout

        layout = Layout.from_config(self.cfg)
        c = Consumer(
            base_settings(self.cfg, "demo-watch")
            | {"group.id": f"srl-demo-watch-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}
            | self.cfg.kafka
        )
        try:
            c.assign([TopicPartition(layout.metrics, 0, -2)])  # OFFSET_BEGINNING
            next_lag = 0.0
            while not self.halt.is_set():
                msg = c.poll(0.5)
                if msg is not None and not msg.error():
                    with contextlib.suppress(SchemaError):
                        self._take(decode_as(msg.value() or b"", MetricEvent))
                if time.monotonic() >= next_lag:
                    next_lag = time.monotonic() + 3.0
                    with contextlib.suppress(Exception):
                        hw = watermarks(self.cfg, [layout.trajectories], timeout_s=3)
                        done = committed_offsets(self.cfg, self.trainer_group, list(hw), 3)
                        lag = sum(hi - (done.get(tp) or lo) for tp, (lo, hi) in hw.items())
                        with self.lock:
                            self.lag = lag
        except Exception as e:  # the demo goes on without live numbers; the report re-reads
            self.error = str(e)
        finally:
            c.close()

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
    from srl.broker import EmbeddedBroker

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
    from srl import report as rep
    from srl import task, warmstart

    t_total = time.monotonic()
    warmstart.quiet_transformers()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _fresh(out)

    # the warm start is shared by every run seed (seed 0): runs differ only in RL
    model_dir = (Path(cfg.model) if cfg.model else warmstart.ensure_model(seed=0)).resolve()
    if not (model_dir / "config.json").exists():
        raise DemoError(f"--model {model_dir}: not a Hugging Face model directory (no config.json)")
    eval_set = task.demo_prompts(cfg.eval_prompts, "eval", seed=rep.EVAL_SEED)
    click_echo(f"policy v0: {model_dir}")
    before = warmstart.evaluate(model_dir, eval_set)
    click_echo(
        f"held-out accuracy before training: {before.accuracy:.3f} ({len(eval_set)} prompts)"
    )

    prefix = cfg.topic_prefix
    if not cfg.embedded and prefix == "srl":
        prefix = f"srl-demo-{uuid.uuid4().hex[:6]}"
    run = f"demo-{cfg.mode}-s{cfg.seed}"
    with _broker(cfg, out) as bootstrap:
        plan = Plan(cfg, out, model_dir, bootstrap, prefix, run, f"file://{out / 'store'}")
        conf = plan.write()
        live = cfg.model_copy(
            update={
                "bootstrap_servers": bootstrap,
                "topic_prefix": prefix,
                "run": run,
                "store": plan.store_url,
                "bucket_bounds": DEMO_BUCKET_BOUNDS,
            }
        )
        from srl.kafka import create_topics, wait_for_broker

        wait_for_broker(live)
        create_topics(live)
        _bootstrap_ranker(plan)
        # the roles read OUT/srl.toml only: SRL_* variables would override it
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("SRL_") or k == "SRL_VERBOSE"
        }
        env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        fleet = Fleet(env=env, cwd=out)
        watcher = Watcher(live, run, f"srl-trainer-{run}")
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
        report = rep.build(live, plan, fleet, before, eval_set, wall_run, status)
    report["total_wall_s"] = round(time.monotonic() - t_total, 1)
    report["out"] = str(out)
    rep.write(report, out)
    if status != "ok":
        raise DemoError(f"{status}; partial report in {out / 'report.json'}")
    return report


def _bootstrap_ranker(plan: Plan) -> None:
    """Publish ranker v1 for the run, fitted on training prompts of the demo task, so the
    dispatcher sends the predicted-longest 20 % of each window to the long-tail pool."""
    from ranker.config import RankerConfig
    from ranker.evaluate import train_on_demo
    from srl.config import load_config

    rcfg = load_config(RankerConfig, cli={"store": plan.store_url, "run": plan.run}, env={})
    t0 = time.monotonic()
    r = train_on_demo(rcfg, 2000, plan.cfg.seed)
    click_echo(
        f"length ranker v{r.version} fitted on 2000 training prompts ({time.monotonic() - t0:.1f} s)"
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
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[line]}"),
    )  # fmt: skip
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
    return "\n".join([
        f"mode {r['mode']}, seed {r['seed']}: {r['steps']} steps in {r['wall_s']:.0f} s "
        f"({r['total_wall_s']:.0f} s in all), policy v{r['policy_versions']}",
        f"held-out accuracy {r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} "
        f"(greedy, {r['eval_prompts']} prompts); reward {r['reward_first']} -> {r['reward_last']}",
        f"trajectories: {r['trajectories_generated']} generated, {r['trajectories_trained']} trained, "
        f"{r['dropped_stale']} dropped stale, {r['failed']} failed, {r['pending_at_stop']} pending at stop, "
        f"lost {r['lost']}; duplicates seen {r['duplicates_seen']}",
        f"generation {r['tokens_per_s']} tokens/s; chunk-to-trainer latency p50 {r['ready_latency_ms_p50']} ms",
        f"report: {Path(r['out']) / 'report.json'} and report.png",
    ])  # fmt: skip
