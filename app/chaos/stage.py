"""One chaos run's pipeline: its topics, config file and roles, as the demo runs them.

Owns what a run is made of. Every run has its own topic prefix, run name and object store on
the suite's one embedded broker, and the demo's shape (``app.demoplan``) with the sim engine:

* the trainer (``srl-consumer train``) on the tiny model the demo is built from (a real
  ``srl.tinymodel`` model, real optimizer steps, checkpoints and published versions);
* a regular pool of ``regular_workers`` generator workers (buckets le16, le32; stragglers
  migrate to the long tail) and a long-tail pool of one (gt32), engine ``sim`` with token ids
  drawn from the model's vocabulary, lengths 8..64 from a seeded histogram;
* the dispatcher (``srl-producer dispatch``), paced by trainer step, predicting lengths with
  the ranker that the online ranker (``srl ranker train --online``) keeps publishing.

Generators may run inside a network namespace (``prefix``), the store on a size-limited
tmpfs (``store_dir``): the faults that need them set them up. Used by ``app.chaos.run``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.chaos.cast import Proc
from app.chaos.config import ChaosConfig
from app.demoplan import console_script, toml_text, toml_top, trainer_argv
from srl.config import CommonConfig

BUCKET_BOUNDS = (16, 32)
REGULAR, LONGTAIL = ("le16", "le32"), ("gt32",)
MAX_NEW_TOKENS = 64
TINY_VOCAB = 260  # srl.tinymodel's byte-level tokenizer: 4 specials + 256 bytes
KEEP_VERSIONS = 8  # weights versions the trainer keeps in the store
# lengths the sim engine generates (lo, hi, probability): most short, a long tail to 64
LENGTHS = ((8, 16, 0.45), (16, 32, 0.35), (32, 48, 0.12), (48, 64, 0.08))


def write_lengths(path: Path) -> Path:
    path.write_text(
        "# lo,hi,probability: srl chaos's sim lengths\n"
        + "".join(f"{lo},{hi},{p}\n" for lo, hi, p in LENGTHS)
    )
    return path


@dataclass
class Stage:
    """Everything one run's processes need; ``write`` puts it in ``work/srl.toml``."""

    cfg: ChaosConfig
    name: str
    work: Path
    bootstrap: str
    model_dir: Path
    lengths: Path
    store_dir: Path
    steps: int  # the trainer's max_steps; 0: until stopped (soak)
    prefix: list[str]  # the generators' command prefix (a network namespace), or []
    retention_ms: int | None = None  # of the data topics (soak); None: the broker's default

    def __post_init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.topic_prefix = f"chaos-{self.name}-{tag}"
        self.run = f"chaos-{self.name}-{tag}"
        regular = [f"gen-regular-{i}" for i in range(self.cfg.regular_workers)]
        self.generators: list[str] = [*regular, "gen-longtail-0"]

    def common(self) -> CommonConfig:
        """The run's shared settings (the chaos process's own clients use them too)."""
        return CommonConfig.model_validate(
            {
                "bootstrap_servers": self.bootstrap,
                "topic_prefix": self.topic_prefix,
                "run": self.run,
                "store": f"file://{self.store_dir}",
                "bucket_bounds": BUCKET_BOUNDS,
                "linger_ms": 2.0,
                "retention_ms": self.retention_ms,
            }
        )

    def tables(self) -> dict[str, dict[str, Any]]:
        c, k = self.cfg, self.cfg.max_staleness
        prompts = (self.steps or 100_000) * c.groups_per_step
        return {
            "dispatch": {
                "task": "sim",
                "lengths": str(self.lengths),
                "seed": c.seed,
                "num_prompts": prompts,
                "group_size": c.group_size,
                "max_new_tokens": MAX_NEW_TOKENS,
                "max_staleness": k,
                "groups_per_step": c.groups_per_step,
                "pools": ["regular", "longtail"],
                "predictor": "ranker",
                "longtail_bucket": LONGTAIL[0],
            },
            "generate": {
                "engine": "sim",
                "sim_vocab": TINY_VOCAB,
                "time_scale": c.time_scale,
                "chunk_tokens": 16,
                "max_staleness": k,
                "seed": c.seed,
                "stats_interval_s": 2.0,
                "drain_timeout_s": 5.0,
            },
            "train": {
                "model": str(self.model_dir),
                "reward": "app.bench.pipeline:sim_reward",
                "lr": 1e-4,
                "groups_per_step": c.groups_per_step,
                "max_staleness": k,
                "max_steps": self.steps,
                "expire_s": c.expire_s,
                "seed": c.seed,
                "device": "cpu",
                "dtype": self.cfg.dtype,
                "keep_versions": KEEP_VERSIONS,  # a bounded store in the soak
            },
            "ranker": {
                "model_dir": str(self.model_dir),
                # a version a step: a ranker restarted late in a run still has a step's
                # pairs ahead of it to publish from (its window starts empty)
                "retrain_every": c.groups_per_step * c.group_size,
                "min_pairs": c.groups_per_step * c.group_size,
                "window": 2000,
                "epochs": 10,
                "hidden": [16],
            },
        }

    def write(self) -> Path:
        c = self.common()
        path = self.work / "srl.toml"
        path.write_text(toml_text(toml_top(c), self.tables(), written_by="srl chaos"))
        return path

    def procs(self, conf: Path) -> list[Proc]:
        """The roles, in start order: trainer, generators, ranker, dispatcher."""
        logs, f = self.work / "logs", ["--config", str(conf)]

        def gen(name: str, pool: str, buckets: tuple[str, ...], migrate: bool) -> Proc:
            extra = ["--migrate-to", LONGTAIL[0], "--migrate-min-tokens", "16"] if migrate else []
            argv = console_script(
                "srl-producer", "generate", *f, "--pool", pool, "--buckets", ",".join(buckets)
            )
            argv += ["--worker-id", name.removeprefix("gen-"), *extra]
            return Proc(name, argv, logs / f"{name}.log", prefix=self.prefix)

        return [
            Proc("trainer", trainer_argv(self.cfg.trainer_ranks, f), logs / "trainer.log"),
            *(gen(g, "regular", REGULAR, True) for g in self.generators[:-1]),
            gen(self.generators[-1], "longtail", LONGTAIL, False),
            Proc(
                "ranker",
                console_script("srl", "ranker", "train", "--online", *f),
                logs / "ranker.log",
            ),
            Proc(
                "dispatcher",
                console_script("srl-producer", "dispatch", *f),
                logs / "dispatcher.log",
            ),
        ]
