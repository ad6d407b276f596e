"""``srl demo --serve``: continuous learning from served traffic, with no dispatcher at all.

Owns the serving variant of the demo (docs/serving.md, docs/demo.md). In order:

1. policy v0 and its held-out accuracy, as ``srl demo`` (``app.demo``: the cached warm start,
   greedy evaluation on the held-out prompts of ``app.task``);
2. the broker (embedded unless ``--bootstrap``) and ``OUT/srl.toml`` with a ``[serve]`` and a
   ``[train]`` table; then two processes: ``srl-consumer train`` (the lead run, rewards from
   feedback) and ``srl serve`` (following that run's weights);
3. the application: a client (:class:`FeedbackClient`) sends the demo task's training
   prompts through the OpenAI API (``n = group_size`` choices each, ``groups_per_step``
   requests in flight), checks each choice with the task's reward (``app.task.demo_reward``:
   exact answer) and posts it to ``POST /v1/feedback``; every request it makes is timed and
   any failure counted;
4. when the trainer has done ``--steps`` steps: the client stops, the server and trainer get
   SIGTERM; the last published version (the one the server was serving) is evaluated on the
   same held-out prompts, and ``OUT/report.json`` says what happened.

Nothing but the two processes and the client touches the policy: the served model improves
because its own traffic, rated by the application, trains it. Called by ``app.demo.run_demo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app import report as rep
from app import task, warmstart
from app.demo import Watcher, _broker, _fresh, _policy_v0, click_echo, demo_prefix, role_env
from app.demoplan import (
    DEMO_BUCKET_BOUNDS,
    DemoConfig,
    DemoError,
    Fleet,
    Role,
    console_script,
    engine_table,
    kafka_secrets,
    kafka_table,
    require_engine,
    toml_text,
    toml_top,
)
from srl.broker import free_port
from srl.config import CommonConfig
from srl.kafka import create_topics, wait_for_broker
from srl.topics import trainer_group

MODEL_NAME = "strops"  # the model id the demo's server answers to


@dataclass
class ClientStats:
    requests: int = 0
    failed: int = 0
    first_error: str | None = None
    feedback: int = 0
    latencies_s: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # per choice, in the order served


@dataclass
class FeedbackClient:
    """An application of ``srl serve``: prompts in, each choice checked and rated back."""

    base: str  # http://host:port/v1
    prompts: list[task.Prompt]
    n: int
    max_tokens: int
    temperature: float
    in_flight: int
    stats: ClientStats = field(default_factory=ClientStats)
    stop: threading.Event = field(default_factory=threading.Event)

    async def run(self) -> ClientStats:
        import httpx

        todo = list(reversed(self.prompts))
        limits = httpx.Limits(max_connections=self.in_flight + 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:

            async def worker() -> None:
                while todo and not self.stop.is_set():
                    await self.one(http, todo.pop())

            await asyncio.gather(*(worker() for _ in range(self.in_flight)))
        return self.stats

    async def one(self, http: Any, p: task.Prompt) -> None:
        body = {"model": MODEL_NAME, "prompt": p.text, "n": self.n}
        body |= {"max_tokens": self.max_tokens, "temperature": self.temperature}
        t0 = time.monotonic()
        try:
            r = await http.post(f"{self.base}/completions", json=body)
            r.raise_for_status()
            out = r.json()
            for c in out["choices"]:
                reward = task.demo_reward(p.text, c["text"], p.metadata)
                fb = {"id": out["id"], "index": c["index"], "reward": reward}
                (await http.post(f"{self.base}/feedback", json=fb)).raise_for_status()
                self.stats.feedback += 1
                self.stats.rewards.append(reward)
        except Exception as e:  # the application's failures are counted, never hidden
            self.stats.failed += 1
            self.stats.first_error = self.stats.first_error or f"{type(e).__name__}: {e}"[:300]
            return
        self.stats.requests += 1
        self.stats.latencies_s.append(time.monotonic() - t0)


@dataclass
class ServePlan:
    """The two processes and their shared config file."""

    cfg: DemoConfig
    out: Path
    model_dir: Path
    bootstrap: str
    prefix: str
    run: str
    port: int

    def common(self) -> CommonConfig:
        return CommonConfig.model_validate(
            {
                "bootstrap_servers": self.bootstrap,
                "topic_prefix": self.prefix,
                "run": self.run,
                "store": f"file://{self.out / 'store'}",
                "bucket_bounds": DEMO_BUCKET_BOUNDS,
                "linger_ms": 2.0,
                "kafka": self.cfg.kafka,
                "kafka_oauth_cb": self.cfg.kafka_oauth_cb,
                "connect_timeout_s": self.cfg.connect_timeout_s,
            }
        )

    def write(self) -> Path:
        c, d = self.common(), self.cfg
        top = toml_top(c)
        train: dict[str, Any] = {"model": str(self.model_dir), "lr": d.lr}
        train |= {"groups_per_step": d.groups_per_step}
        train |= {"batching": "groups", "max_staleness": d.max_staleness, "max_steps": d.steps}
        train |= {"temperature": d.temperature, "seed": d.seed, "device": "cpu"}
        serve: dict[str, Any] = {**engine_table(d), "model": str(self.model_dir)}
        serve |= {"model_name": MODEL_NAME}
        serve |= {"port": self.port, "max_batch": d.regular_max_batch, "threads": 1}
        serve |= {"chunk_tokens": d.chunk_tokens, "seed": d.seed, "max_n": d.group_size}
        tables: dict[str, dict[str, Any]] = {"train": train, "serve": serve}
        if kafka_table(c):  # the secrets reach the roles by environment (kafka_secrets)
            tables = {"kafka": kafka_table(c)} | tables
        path = self.out / "srl.toml"
        path.write_text(toml_text(top, tables))
        return path

    def roles(self, conf: Path) -> list[Role]:
        logs, args = self.out / "logs", ["--config", str(conf)]
        return [
            Role("trainer", console_script("srl-consumer", "train", *args), logs / "trainer.log"),
            Role("serve", console_script("srl", "serve", *args), logs / "serve.log"),
        ]


def run_serve_demo(cfg: DemoConfig, progress: bool = True) -> dict[str, Any]:
    """The serving demo end to end; returns the report (also OUT/report.json)."""
    t_total = time.monotonic()
    require_engine(cfg)
    warmstart.quiet_transformers()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _fresh(out)
    model_dir = _policy_v0(cfg)
    eval_set = task.demo_prompts(cfg.eval_prompts, "eval", seed=rep.EVAL_SEED)
    click_echo(f"policy v0: {model_dir}")
    before = warmstart.evaluate(model_dir, eval_set)
    click_echo(f"held-out accuracy before: {before.accuracy:.3f} ({len(eval_set)} prompts)")
    with _broker(cfg, out) as bootstrap:
        run = f"serve-s{cfg.seed}"
        plan = ServePlan(cfg, out, model_dir, bootstrap, demo_prefix(cfg), run, free_port())
        report = _serve_and_learn(plan, before, eval_set, progress)
    report["total_wall_s"] = round(time.monotonic() - t_total, 1)
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if report["status"] != "ok":
        raise DemoError(f"{report['status']}; partial report in {out / 'report.json'}")
    return report


def _serve_and_learn(
    plan: ServePlan, before: Any, eval_set: list[Any], progress: bool
) -> dict[str, Any]:
    live = plan.common()
    wait_for_broker(live)
    create_topics(live)
    conf = plan.write()
    fleet = Fleet(env=role_env(os.environ, kafka_secrets(live)), cwd=plan.out)
    watcher = Watcher(live, plan.run, trainer_group(live.topic_prefix, plan.run))
    watcher.start()
    c = plan.cfg
    prompts = task.demo_prompts(c.steps * c.groups_per_step * 4, "train", seed=c.seed)
    base = f"http://127.0.0.1:{plan.port}/v1"
    client = FeedbackClient(
        base, prompts, c.group_size, c.max_new_tokens, c.temperature, c.groups_per_step
    )
    t_run, status, served = time.monotonic(), "ok", 0
    try:
        trainer, server = (fleet.start(r) for r in plan.roles(conf))
        _wait_healthy(plan.port, server, c.timeout_s)
        runner = threading.Thread(target=lambda: asyncio.run(client.run()), daemon=True)
        runner.start()
        status = _supervise(plan, fleet, trainer, watcher, runner, progress)
        client.stop.set()  # requests in flight finish before the server stops
        runner.join(120)
        served = _served_version(plan.port)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        client.stop.set()
        fleet.stop()
        watcher.halt.set()
        watcher.join(10)
    wall = time.monotonic() - t_run
    click_echo("evaluating the served policy …")
    return _report(plan, before, eval_set, client.stats, status, wall, served)


def _wait_healthy(port: int, server: Role, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        if not server.alive() or time.monotonic() > deadline:
            raise DemoError(f"srl serve did not start:\n{server.tail()}")
        time.sleep(0.5)


def _served_version(port: int) -> int:
    import httpx

    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return int(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["policy_version"])
    return -1


def _supervise(
    plan: ServePlan,
    fleet: Fleet,
    trainer: Role,
    watcher: Watcher,
    client: threading.Thread,
    progress: bool,
) -> str:
    """Until the trainer has done its steps; a role that dies or a client out of prompts ends
    the run early."""
    deadline, last = time.monotonic() + plan.cfg.timeout_s, -1
    while True:
        done = watcher.done_steps()
        if progress and done != last:
            last = done
            click_echo(f"step {done}/{plan.cfg.steps}  {watcher.line()}")
        if done >= plan.cfg.steps:
            time.sleep(2.0)  # the server loads the last version
            return "ok"
        for r in fleet.roles:
            rc = r.proc.poll() if r.proc is not None else None
            if rc not in (None, 0) or (r is not trainer and rc is not None):
                return f"{r.name} exited with {rc}:\n{r.tail()}"
        if not client.is_alive():
            return f"the client ran out of prompts at step {done}"
        if time.monotonic() > deadline:
            return f"timed out after {plan.cfg.timeout_s:.0f} s at step {done}"
        time.sleep(1.0)


def _tenth(xs: list[float], last: bool) -> float | None:
    k = max(1, len(xs) // 10)
    part = xs[-k:] if last else xs[:k]
    return round(statistics.fmean(part), 4) if part else None


def _report(
    plan: ServePlan,
    before: Any,
    eval_set: list[Any],
    s: ClientStats,
    status: str,
    wall: float,
    served: int,
) -> dict[str, Any]:
    live = plan.common()
    final_dir, version = rep.final_policy(live, plan.run, plan.model_dir, plan.out / "final-model")
    after = warmstart.evaluate(final_dir, eval_set)
    events = rep.metric_events(live, plan.run)
    outcomes: dict[str, int] = {}
    for e in rep.last_samples([e for e in events if e.kind == "sample"]).values():
        outcomes[e.labels["outcome"]] = outcomes.get(e.labels["outcome"], 0) + 1
    lat = sorted(x * 1000 for x in s.latencies_s)
    return {
        "status": status,
        "mode": "serve",
        "engine": plan.cfg.engine,
        "seed": plan.cfg.seed,
        "steps": len(rep.step_events(events)),
        "steps_requested": plan.cfg.steps,
        "eval_accuracy_before": round(before.accuracy, 4),
        "eval_accuracy_after": round(after.accuracy, 4),
        "eval_prompts": len(eval_set),
        "policy_version_evaluated": version,
        "policy_version_served": served,
        "requests": s.requests,
        "failed_requests": s.failed,
        "first_error": s.first_error,
        "feedback": s.feedback,
        "served_reward_first": _tenth(s.rewards, last=False),
        "served_reward_last": _tenth(s.rewards, last=True),
        "latency_ms_p50": round(rep._pct(lat, 50) or 0.0, 1),
        "latency_ms_p99": round(rep._pct(lat, 99) or 0.0, 1),
        "sample_outcomes": outcomes,
        # rated choices the trainer dropped as stale (issue 32's measure of waste); the rest
        # trained, carried no signal (no_signal) or were still undecided at the stop
        "dropped_stale_share": round(outcomes.get("dropped_stale", 0) / max(1, s.feedback), 4),
        "wall_s": round(wall, 1),
        "run": plan.run,
        "out": str(plan.out),
    }


def summary(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"serve mode, seed {r['seed']}: {r['steps']} steps in {r['wall_s']:.0f} s "
            f"({r['total_wall_s']:.0f} s in all); served v{r['policy_version_served']}",
            f"held-out accuracy {r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} "
            f"(greedy, {r['eval_prompts']} prompts); served reward {r['served_reward_first']} -> "
            f"{r['served_reward_last']}",
            f"{r['requests']} requests ({r['failed_requests']} failed), {r['feedback']} feedback; "
            f"latency p50 {r['latency_ms_p50']} ms, p99 {r['latency_ms_p99']} ms; outcomes "
            f"{r['sample_outcomes']} ({r['dropped_stale_share']:.1%} of rated dropped as stale)",
            f"report: {Path(r['out']) / 'report.json'}",
        ]
    )
