"""``srl eval``: a policy's greedy pass@1 and sampled pass@k on a prompt dataset, as JSON.

How each part is the system's own, not a copy:

* **the policy**: ``--model DIR`` (version 0), and/or ``--run NAME``'s newest version in the
  object store, each file checked against the version's manifest (size and sha256,
  ``srl.weights``) before it is parsed: loaded into the engine built on ``--model`` with
  ``fetch_tensors`` + ``load_weights`` as a generator follows a run, or, without ``--model``,
  materialised as a model directory (a published version holds its config and tokenizer);
* **the engine**: the generators' (``producers.engines.make_engine``: hf, or vllm where it is
  installed); prompts are tokenised by the engine as a generator tokenises a dispatched prompt;
* **the dataset**: the dispatcher's source loader (:func:`load_prompts`, the one place that
  reads it);
* **the reward**: the trainer's (``consumers.rewards.load_reward``), run in reward processes
  with the trainer's timeout (``consumers.rewardpool.RewardProcess``), or in this process with
  ``--reward-workers 0``; its prompt and completion are decoded as the trainer decodes them;
* **the figures**: ``app.evaluation`` (also the demo's held-out evaluation).

A progress bar goes to stderr (one line per tenth when stderr is not a terminal). Bad input
(no such file, a bad line, an unknown reward, a k above --samples) is one line and exit 2.
"""

from __future__ import annotations

import queue
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import orjson

from app.evalconfig import EvalConfig, EvalEngine
from app.evaluation import Outcome, Sampling, run_eval
from app.sources import load_source
from consumers.rewardpool import RewardProcess
from consumers.rewards import RewardFn, Scored, call_reward, load_reward
from producers.config import DispatchConfig
from producers.engines import Engine, Request, RequestError, generate, make_engine
from producers.sources import PromptLike
from srl.errors import ConfigError, SrlError
from srl.stores import store_from_config
from srl.weights import MANIFEST, Manifest, fetch_tensors, materialize, version_prefix


def load_prompts(cfg: EvalConfig, tokenizer: str) -> list[PromptLike]:
    """The dataset, read and (``--chat-template``) rendered by the dispatcher's source loader
    (``app.sources.load_source``: the formats, the field mapping and the template of
    ``srl-producer dispatch``), with ``tokenizer``'s template; the first ``limit`` prompts."""
    source = DispatchConfig.model_validate(
        {
            "prompts": cfg.prompts,
            "prompt_field": cfg.prompt_field,
            "id_field": cfg.id_field,
            "answer_field": cfg.answer_field,
            "metadata_fields": cfg.metadata_fields,
            "chat_template": cfg.chat_template,
            "system_prompt": cfg.system_prompt,
            "tokenizer": tokenizer,
        }
    )
    prompts = load_source(source)
    return prompts[: cfg.limit] if cfg.limit else prompts


# -- the policy ------------------------------------------------------------------------------
@dataclass
class Policy:
    model_dir: Path
    version: int
    manifest: Manifest | None  # the run's version loaded into the engine (None: model_dir's)


def newest_manifest(cfg: EvalConfig) -> Manifest | None:
    """The manifest of ``cfg.run``'s newest published version in the store (None: none)."""
    store = store_from_config(cfg)
    versions = [
        int(parts[2][1:])
        for key in store.list(f"weights/{cfg.run}/")
        if len(parts := key.split("/")) == 4 and parts[3] == MANIFEST and parts[2][1:].isdigit()
    ]
    if not versions:
        return None
    key = f"{version_prefix(cfg.run, max(versions))}/{MANIFEST}"
    return Manifest.from_json(store.get(key), store.uri(key))


def resolve_policy(cfg: EvalConfig, workdir: Path) -> Policy:
    """Where the engine loads from, and which version it evaluates."""
    manifest = newest_manifest(cfg) if cfg.from_run else None
    if manifest is None and not cfg.model:
        raise SrlError(f"run {cfg.run!r} has no published weights in {cfg.store}")
    if cfg.model:
        return Policy(Path(cfg.model), manifest.version if manifest else 0, manifest)
    assert manifest is not None
    out = materialize(store_from_config(cfg), manifest, workdir / f"v{manifest.version:08d}")
    if not (out / "config.json").is_file():
        raise SrlError(
            f"run {cfg.run!r} v{manifest.version} holds no config.json: give --model DIR for "
            "its config and tokenizer"
        )
    return Policy(out, manifest.version, None)


def build_engine(cfg: EvalConfig, policy: Policy) -> Engine:
    """The generators' engine on the policy (a run's version loaded as a generator loads it)."""
    settings = EvalEngine.model_validate(
        {
            "engine": cfg.engine,
            "model": str(policy.model_dir),
            "device": cfg.device,
            "dtype": cfg.dtype,
            "threads": cfg.threads,
            "max_batch": cfg.max_batch,
            "seed": cfg.seed,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_model_len": cfg.max_model_len,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "kv_cache_gib": cfg.kv_cache_gib,
        }
    )
    engine = make_engine(settings)
    if policy.manifest is not None:
        store = store_from_config(cfg)
        engine.load_weights(fetch_tensors(store, policy.manifest), policy.manifest.version)
    return engine


# -- progress --------------------------------------------------------------------------------
class Progress:
    """Completions and rewards done, on stderr: a bar on a terminal, else a line a tenth."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.live = enabled and sys.stderr.isatty()
        self.t0, self.shown = time.monotonic(), -1
        self.bar: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            self.bar = Bar(
                TextColumn("srl eval: {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.bar.start()
            self.task = self.bar.add_task("generating", total=self.total)

    def advance(self, what: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=what)
            return
        tenth = self.done * 10 // self.total
        if self.enabled and tenth != self.shown:
            self.shown = tenth
            click.echo(
                f"srl eval: {what} {self.done}/{self.total} ({time.monotonic() - self.t0:.0f} s)",
                err=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- generation and rewards ------------------------------------------------------------------
class EngineCompleter:
    """``app.evaluation``'s ``complete`` on an engine: every sample a request of its own."""

    def __init__(self, engine: Engine, top_p: float, progress: Progress) -> None:
        self.engine, self.top_p, self.progress = engine, top_p, progress
        self.finish: dict[str, int] = {}
        self.tokens = 0
        self.prompt_ids: dict[str, list[int]] = {}

    def ids(self, prompt: PromptLike) -> list[int]:
        """The prompt's tokens, as a generator makes them of a dispatched prompt: the rendered
        ids it carries (``--chat-template``), else the engine's tokens of its text."""
        if prompt.prompt_id not in self.prompt_ids:
            given = getattr(prompt, "prompt_tokens", None)
            ids = list(given) if given else self.engine.tokenize(prompt.text)
            self.prompt_ids[prompt.prompt_id] = ids
        return self.prompt_ids[prompt.prompt_id]

    def __call__(
        self, prompts: list[PromptLike], temperature: float, n: int, max_new_tokens: int
    ) -> list[list[str | None]]:
        top_p = self.top_p if temperature > 0 else 1.0
        requests: list[Request] = []
        out_tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            for j in range(n):
                r = Request(f"{i}/{j}", self.ids(p), max_new_tokens, temperature, top_p)
                try:
                    self.engine.validate(r)
                except RequestError:  # counted: the sample does not pass
                    self._count("refused")
                    continue
                requests.append(r)
                out_tokens[r.key] = []
        for e in generate(self.engine, requests):
            out_tokens[e.key] += e.tokens
            if e.finish_reason is not None:
                self._count(e.finish_reason)
        decode = self.engine.tokenizer.decode  # type: ignore[attr-defined]
        texts = {k: str(decode(t, skip_special_tokens=True)) for k, t in out_tokens.items()}
        self.tokens += sum(len(t) for t in out_tokens.values())
        return [[texts.get(f"{i}/{j}") for j in range(n)] for i in range(len(prompts))]

    def _count(self, reason: str) -> None:
        self.finish[reason] = self.finish.get(reason, 0) + 1
        self.progress.advance("generating")


class Rewards:
    """``app.evaluation``'s ``score``: the trainer's reward on decoded texts, in reward
    processes under the trainer's timeout (``workers`` > 0) or in this process."""

    def __init__(self, cfg: EvalConfig, decode_prompt: Any, progress: Progress) -> None:
        self.fn: RewardFn = load_reward(cfg.reward)  # an unusable reward: one line, exit 2
        self.spec, self.timeout_s, self.workers = (
            cfg.reward,
            cfg.reward_timeout_s,
            cfg.reward_workers,
        )
        self.decode_prompt, self.progress = decode_prompt, progress
        self.errors: dict[str, int] = {}

    def __call__(self, items: list[tuple[PromptLike, str]]) -> list[float | None]:
        reqs = [(self.decode_prompt(p), c, dict(p.metadata)) for p, c in items]
        if self.workers == 0:
            scored = []
            for r in reqs:
                scored.append(call_reward(self.fn, *r))
                self.progress.advance("scoring")
        else:
            scored = self._in_processes(reqs)
        for s in scored:
            if s.error is not None:
                why = "timed out" if "timed out" in s.error else s.error.split(":")[0][:60]
                self.errors[why] = self.errors.get(why, 0) + 1
        return [s.reward for s in scored]

    def _in_processes(self, reqs: list[tuple[str, str, dict[str, Any]]]) -> list[Scored]:
        jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        out: list[Scored | None] = [None] * len(reqs)
        lock = threading.Lock()

        def serve(proc: RewardProcess) -> None:
            try:
                while (i := jobs.get()) is not None:
                    p, c, m = reqs[i]
                    line = orjson.dumps({"prompt": p, "completion": c, "metadata": m}, default=str)
                    try:
                        out[i] = proc.call(line + b"\n")
                    except Exception as e:  # never lose a result: the sample fails instead
                        proc.stop()
                        out[i] = Scored(None, f"reward process: {type(e).__name__}: {e}"[:300])
                    with lock:
                        self.progress.advance("scoring")
            finally:
                proc.stop()

        procs = [
            RewardProcess(self.spec, self.timeout_s) for _ in range(min(self.workers, len(reqs)))
        ]
        threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in procs]
        for i in range(len(reqs)):
            jobs.put(i)
        for t in threads:
            jobs.put(None)
            t.start()
        for t in threads:
            t.join()
        return [s or Scored(None, "reward process: no answer") for s in out]


# -- the command -----------------------------------------------------------------------------
@contextmanager
def _workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="srl-eval-") as d:
        yield Path(d)


def sampling_of(cfg: EvalConfig) -> Sampling:
    s = Sampling(
        greedy=cfg.greedy,
        samples=cfg.samples,
        ks=cfg.k,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens,
        pass_threshold=cfg.pass_threshold,
    )
    s.check()  # before anything loads
    return s


def run_evaluation(
    cfg: EvalConfig, per_prompt: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Evaluate ``cfg``'s policy on its dataset; the report (docs/rewards.md)."""
    sampling = sampling_of(cfg)
    load_reward(cfg.reward)  # a bad reward fails before the model loads
    t0 = time.monotonic()
    with _workdir() as work:
        policy = resolve_policy(cfg, work)
        prompts = load_prompts(cfg, str(policy.model_dir))  # a bad dataset: before the engine
        engine = build_engine(cfg, policy)
        total = len(prompts) * (int(sampling.greedy) + sampling.samples)
        bar = Progress(2 * total, progress)
        try:
            completer = EngineCompleter(engine, cfg.top_p, bar)
            tok: Any = getattr(engine, "tokenizer")  # noqa: B009 (hf and vllm engines have one)
            rewards = Rewards(
                cfg, lambda p: str(tok.decode(completer.ids(p), skip_special_tokens=True)), bar
            )
            outcome = run_eval(prompts, completer, rewards, sampling)
        finally:
            bar.close()
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    return report(cfg, policy, outcome, completer, rewards, time.monotonic() - t0, per_prompt)


def report(
    cfg: EvalConfig,
    policy: Policy,
    outcome: Outcome,
    completer: EngineCompleter,
    rewards: Rewards,
    wall_s: float,
    per_prompt: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": cfg.model,
        "run": cfg.run if cfg.from_run else None,
        "version": policy.version,
        "engine": cfg.engine,
        "dataset": cfg.prompts,
        "chat_template": cfg.chat_template,
        "reward": cfg.reward,
        "pass_threshold": cfg.pass_threshold,
        "max_new_tokens": cfg.max_new_tokens,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        **outcome.figures(),
        "finish": dict(sorted(completer.finish.items())),
        "reward_errors": dict(sorted(rewards.errors.items())),
        "generated_tokens": completer.tokens,
        "wall_s": round(wall_s, 2),
    }
    if per_prompt:
        out["per_prompt"] = outcome.per_prompt()
    return out


def summary(rep: dict[str, Any]) -> str:
    """One line of the report's figures."""
    who = f"{rep['run']} v{rep['version']}" if rep["run"] else f"{rep['model']} (v{rep['version']})"
    parts = [f"srl eval: {who} on {rep['prompts']} prompts of {rep['dataset']}"]
    if "greedy" in rep:
        g = rep["greedy"]
        parts.append(f"greedy pass@1 {g['pass@1']:.4f} ({g['passed']}/{g['completions']})")
    if "sampled" in rep:
        s = rep["sampled"]
        ks = ", ".join(f"pass@{k} {v:.4f}" for k, v in s["pass@k"].items())
        parts.append(f"{ks} ({s['samples']} samples at T={s['temperature']:g})")
    return "; ".join(parts)


def write_report(rep: dict[str, Any], out: str | None) -> None:
    if out is None:
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(orjson.dumps(rep, option=orjson.OPT_INDENT_2))
    except OSError as e:
        raise ConfigError(f"--out {out}: {e.strerror or e}") from None
