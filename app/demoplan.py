"""The demo's plan: its settings, the config file every role reads, and the role processes.

``DemoConfig`` is ``srl demo``'s config; ``Plan`` derives each role's table of the shared
``OUT/srl.toml`` from it; ``Fleet`` starts, watches and stops the role processes (real
subprocesses of the installed ``srl-producer`` / ``srl-consumer`` scripts). Used by
``app.demo`` (the run) and ``app.report`` (what the report says about the plan).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from srl.config import CommonConfig, KafkaSettings
from srl.errors import SrlError
from srl.ports import free_port
from srl.secrets import is_file_ref, is_secret, secret_environment

log = logging.getLogger("app.demo")

STOP_GRACE_S = 60.0  # SIGTERM → SIGKILL; generators drain in-flight work within this


class DemoError(SrlError):
    """The demo could not run (a role died, the run timed out …)."""


# the trainer's ranks and dtype, as srl demo and srl chaos start it
TrainerRanks = Annotated[
    int,
    Field(
        ge=1,
        le=8,
        description="Trainer ranks (CPU gloo, under torchrun); more than one: FSDP2, sharded.",
    ),
]
TrainerDtype = Annotated[
    Literal["float32", "bfloat16"],
    Field(description="The trainer's compute dtype; bfloat16 keeps fp32 master weights."),
]


class DemoConfig(KafkaSettings):
    """``srl demo``'s settings; the ``[demo]`` table of a config file or ``SRL_*`` variables.

    Of the shared settings the demo reads only the Kafka ones (which broker, the topic prefix,
    librdkafka settings): it names the run, places the store under ``out`` and fixes the
    buckets itself (``Plan.common``)."""

    section = "demo"

    steps: int = Field(60, ge=1, le=100_000, description="Optimizer steps to train.")
    out: str = Field(
        "runs/demo", description="Directory for the report, logs, store and broker data."
    )
    mode: Literal["sync", "stream", "async"] = Field("async", description="Pipeline mode.")
    serve: bool = Field(
        False,
        description=(
            "Learn from served traffic instead: srl serve and the trainer, a client sending the "
            "task's prompts with programmatic feedback, no dispatcher (docs/serving.md)."
        ),
    )
    max_staleness: int = Field(1, ge=0, le=1000, description="k for --mode async.")
    reward: str = Field("app.task:demo_reward", description="Reward module:function.")
    seed: int = Field(0, description="Seed of the prompts, sampling and training.")
    model: str | None = Field(
        None, description="HF model directory (policy v0); null: the cached `srl init-model` model."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="Generation backend of the generator pools (and of srl serve with --serve). "
        "Every role runs in the environment srl demo runs in, so vllm needs vLLM there: "
        '.venv-vllm/bin/srl demo --engine vllm (docs/generator.md, "vLLM").',
    )
    group_size: int = Field(8, ge=2, le=256, description="Samples per prompt (GRPO group).")
    groups_per_step: int = Field(8, ge=1, le=4096, description="Groups per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    trainer_ranks: TrainerRanks = 1
    dtype: TrainerDtype = "float32"
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    max_new_tokens: int = Field(72, ge=1, description="Max generated tokens per sample.")
    eval_prompts: int = Field(256, ge=1, description="Held-out prompts for eval accuracy.")
    eval_every: int = Field(
        20,
        ge=0,
        description=(
            "Also evaluate every N-th published version (accuracy over time); 0: final only."
        ),
    )
    chunk_tokens: int = Field(16, ge=1, description="Tokens per published chunk.")
    regular_max_batch: int = Field(32, ge=1, description="Regular pool's decode batch.")
    longtail_max_batch: int = Field(8, ge=1, description="Long-tail pool's decode batch.")
    migrate_factor: float | None = Field(
        2.0,
        gt=1,
        description=(
            "The regular pool hands a trajectory past this many times its predicted length (and 16 "
            "tokens) to the long-tail pool; null: never."
        ),
    )
    timeout_s: float = Field(1800.0, gt=0, description="Give up when training takes longer.")
    embedded: bool = Field(
        True,
        description=(
            "Start the embedded broker; false when bootstrap_servers is given (then a fresh topic "
            "prefix srl-demo-XXXXXX unless one is given too)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _external_broker(cls, data: Any) -> Any:
        """A given bootstrap_servers means that broker, unless ``embedded`` is set as well."""
        if isinstance(data, dict) and "bootstrap_servers" in data and "embedded" not in data:
            return {**data, "embedded": False}
        return data


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


def console_script(name: str, *args: str) -> list[str]:
    """The console script installed beside this interpreter (the same venv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise DemoError(f"{name} not found beside {sys.executable} or on PATH; run `make install`")
    return [found, *args]


def trainer_argv(ranks: int, conf: list[str]) -> list[str]:
    """``srl-consumer train``, or with several ranks the same module under torchrun (gloo on
    loopback: ``GLOO_SOCKET_IFNAME=lo`` in the environment; a free rendezvous port)."""
    if ranks == 1:
        return console_script("srl-consumer", "train", *conf)
    rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = ["--nnodes", "1", "--nproc-per-node", str(ranks), *rdzv]
    return console_script("torchrun", *nodes, "-m", "app.cli.consumer", "train", *conf)


# -- config file ---------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_key(k: str) -> str:
    """A bare key where TOML allows one; quoted otherwise (librdkafka's dotted names)."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def toml_top(c: CommonConfig) -> dict[str, Any]:
    """The top-level keys of a generated config file: what every role of one run shares."""
    return {
        "bootstrap_servers": c.bootstrap_servers,
        "topic_prefix": c.topic_prefix,
        "run": c.run,
        "store": c.store,
        "bucket_bounds": list(c.bucket_bounds),
        "linger_ms": c.linger_ms,
        "kafka_oauth_cb": c.kafka_oauth_cb,
    }


def kafka_table(c: KafkaSettings) -> dict[str, str]:
    """The ``[kafka]`` table of a generated config file: every librdkafka setting but the
    secrets (an ``@FILE`` reference stays: it is a path); those reach the roles as
    ``SRL_KAFKA_<NAME>`` variables (:func:`kafka_secrets`), never a file srl writes."""
    return {k: v for k, v in c.kafka.items() if not is_secret(k) or is_file_ref(v)}


def kafka_secrets(c: KafkaSettings) -> dict[str, str]:
    """The secrets :func:`kafka_table` leaves out, as the roles' environment variables."""
    return secret_environment({k: v for k, v in c.kafka.items() if k not in kafka_table(c)})


def toml_text(
    top: dict[str, Any], tables: dict[str, dict[str, Any]], written_by: str = "srl demo"
) -> str:
    """A config file every role of a run reads: top-level keys, then one table per role."""
    lines = [
        f"# Written by `{written_by}`: every role of this run reads it (docs/configuration.md)."
    ]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in top.items() if v is not None]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


# vllm engine: the KV cache of each generator on CPU (the demo's sequences are under 128
# positions: 2 KiB a position on the tiny model, so a batch of 32 needs ~8 MiB); fp32 as the
# trainer and the hf engine compute
VLLM_KV_CACHE_GIB = 0.25


def engine_table(c: DemoConfig) -> dict[str, Any]:
    """The engine keys of a generator's (or srl serve's) table for ``c.engine``."""
    if c.engine == "vllm":
        return {"engine": "vllm", "dtype": "float32", "kv_cache_gib": VLLM_KV_CACHE_GIB}
    return {"engine": "hf"}


def require_engine(c: DemoConfig) -> None:
    """DemoError (one line) unless the roles can run ``c.engine`` here: every role is started
    from this interpreter's environment."""
    if c.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise DemoError(
            f"--engine vllm: vLLM is not installed in this environment ({sys.prefix}), and every "
            "role of the demo runs in the environment srl demo runs in; run it from .venv-vllm: "
            "make .venv-vllm/.installed, then .venv-vllm/bin/srl demo --engine vllm "
            '(docs/generator.md, "vLLM")'
        )


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
                **engine_table(c),
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
                "dtype": c.dtype,
                "keep_versions": 0,  # the report evaluates versions along the run
            },
        }

    def common(self) -> CommonConfig:
        """This run's shared settings: the demo's own clients use them, and they are the
        top-level keys of OUT/srl.toml (with its ``[kafka]`` table) that every role reads."""
        return CommonConfig.model_validate(
            {
                "bootstrap_servers": self.bootstrap,
                "topic_prefix": self.prefix,
                "run": self.run,
                "store": self.store_url,
                "bucket_bounds": DEMO_BUCKET_BOUNDS,
                "linger_ms": 2.0,
                "kafka": self.cfg.kafka,
                "kafka_oauth_cb": self.cfg.kafka_oauth_cb,
                "connect_timeout_s": self.cfg.connect_timeout_s,
            }
        )

    def write(self) -> Path:
        c = self.common()
        top = toml_top(c)
        tables = self.role_tables()
        if kafka_table(c):  # librdkafka settings (security …) reach every role; secrets by env
            tables = {"kafka": kafka_table(c)} | tables
        path = self.out / "srl.toml"
        path.write_text(toml_text(top, tables))
        return path

    def trainer_argv(self, conf: list[str]) -> list[str]:
        return trainer_argv(self.cfg.trainer_ranks, conf)

    def roles(self, config_file: Path) -> list[Role]:
        c, logs, conf = self.cfg, self.out / "logs", ["--config", str(config_file)]
        return [
            Role("trainer", self.trainer_argv(conf), logs / "trainer.log"),
            Role(
                "gen-regular",
                console_script(
                    "srl-producer",
                    "generate",
                    *conf,
                    "--pool",
                    "regular",
                    "--buckets",
                    ",".join(REGULAR_BUCKETS),
                    "--max-batch",
                    str(c.regular_max_batch),
                    "--worker-id",
                    "regular-0",
                    *(
                        [
                            "--migrate-to",
                            LONGTAIL_BUCKETS[0],
                            "--migrate-factor",
                            str(c.migrate_factor),
                            "--migrate-min-tokens",
                            "16",
                        ]
                        if c.migrate_factor
                        else []
                    ),
                ),
                logs / "gen-regular.log",
            ),
            Role(
                "gen-longtail",
                console_script(
                    "srl-producer",
                    "generate",
                    *conf,
                    "--pool",
                    "longtail",
                    "--buckets",
                    ",".join(LONGTAIL_BUCKETS),
                    "--max-batch",
                    str(c.longtail_max_batch),
                    "--worker-id",
                    "longtail-0",
                ),
                logs / "gen-longtail.log",
            ),
            Role(
                "dispatcher",
                console_script("srl-producer", "dispatch", *conf),
                logs / "dispatcher.log",
            ),
        ]
