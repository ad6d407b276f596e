"""Typed settings of the dispatcher (``[dispatch]``) and the generator worker (``[generate]``).

Owns every knob of the producer side, with bounds checked once at load and the cross-field
rules in one validator per class (bucket names are checked against the topic layout here, not
in the worker). Values come from defaults < config file < ``SRL_*`` < CLI options
(``srl.config.load_config``); the CLI options are generated from these fields
(``app/cli/options.py``). docs/generator.md explains them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, model_validator

from srl.config import NAME_PATTERN, CommonConfig, Settings, TopicsConfig, cli
from srl.errors import ConfigError
from srl.topics import Layout, pool_group, trainer_group


class ChatSettings(Settings):
    """The tokenizer's chat template (``srl.chat``): ``srl-producer dispatch`` and ``srl
    serve`` apply it by the same function, so a conversation gets the same token ids in
    training and in serving."""

    chat_template: bool = Field(
        False,
        description="Render prompts with the tokenizer's own chat template, with the generation "
        "prompt (dispatch: each prompt of the source, a text as one user message, with "
        "--tokenizer DIR; the tasks carry the rendered ids. srl serve: chat requests). A "
        "tokenizer without a chat template is refused. false: dispatch sends prompt text as it "
        "is; srl serve uses a template where the tokenizer has one, else a plain role: content "
        "join.",
    )
    system_prompt: str | None = Field(
        None,
        description="With chat_template: a system message put first in every conversation that "
        "does not begin with its own.",
    )

    @model_validator(mode="after")
    def _system_needs_template(self) -> ChatSettings:
        if self.system_prompt is not None and not self.chat_template:
            raise ConfigError("--system-prompt needs --chat-template")
        return self


class SourceSettings(Settings):
    """How a prompt source's columns map to prompts (``producers.sources``): the dispatcher's
    and ``srl eval``'s, which read a dataset the same way."""

    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Column of the prompt: a string, or chat messages (a list of {role, "
        "content}; needs chat_template). a.b: field b of struct column a.",
    )
    id_field: str | None = Field(
        None,
        min_length=1,
        description="Column of the prompt id (a unique string or integer); null: prompt_id "
        "where the source has it, else {file name}:{row}.",
    )
    answer_field: str | None = Field(
        None,
        min_length=1,
        description="Column of the reference answer, carried to the reward as "
        "metadata.answer (what the built-in rewards read); null: answer where the source has "
        "it, else none.",
    )
    metadata_fields: tuple[str, ...] = Field(
        (),
        description="Columns copied into each prompt's metadata under their own names (a "
        "metadata column, an object, is merged in too).",
    )


class DispatchConfig(CommonConfig, ChatSettings, SourceSettings):
    """``srl-producer dispatch``: which prompts become which tasks, in which order, how fast."""

    section = "dispatch"

    prompts: str | None = Field(
        None,
        description="Prompt source: a JSONL file, a parquet or Arrow file, or a local dataset "
        "directory (datasets save_to_disk, or parquet/arrow files); columns mapped by "
        "prompt_field, id_field, answer_field, metadata_fields. Or use task.",
        json_schema_extra=cli(metavar="PATH"),
    )
    task: Literal["demo", "sim"] | None = Field(
        None,
        description=(
            "Built-in prompt source instead of a file: demo (synthetic task) or sim (simulated "
            "workload)."
        ),
    )
    num_prompts: int = Field(
        64, ge=1, le=10_000_000, description="Prompts the built-in task generates."
    )
    split: Literal["train", "eval"] = Field("train", description="Split of the demo task.")
    lengths: str | None = Field(
        None, description="Length histogram file (lo,hi,probability) for the sim task's sim_length."
    )
    length_scale: float = Field(
        1.0,
        gt=0,
        le=100,
        description="Factor on histogram lengths (0.25 / 0.5: the 5K / 10K settings).",
        json_schema_extra=cli("--scale"),
    )
    seed: int = Field(0, description="Seed of the built-in task's prompts.")
    group_size: int = Field(4, ge=1, le=4096, description="n: samples per prompt (GRPO group).")
    max_new_tokens: int = Field(
        256, ge=1, le=1_000_000, description="Upper bound on generated tokens per sample."
    )
    temperature: float = Field(1.0, ge=0, le=100, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    predictor: Literal["baseline", "oracle", "ranker"] = Field(
        "baseline",
        description=(
            "Length predictor: baseline (one length for all), oracle (metadata.sim_length) or "
            "ranker (the run's latest published ranker version, docs/ranker.md; baseline until one "
            "exists)."
        ),
    )
    alpha: float = Field(
        0.2,
        gt=0,
        lt=1,
        description=(
            "predictor ranker: the top alpha of each window (by predicted length) goes to the "
            "long-tail bucket (StreamRL Algorithm 2)."
        ),
    )
    longtail_bucket: str | None = Field(
        None,
        description=(
            "predictor ranker: the long-tail pool's bucket; the other buckets are the regular "
            "pool's. null: the last bucket."
        ),
    )
    baseline_length: int | None = Field(
        None, ge=1, description="The baseline predictor's length; null: max_new_tokens."
    )
    max_staleness: int | None = Field(
        1,
        ge=0,
        le=1_000_000,
        description="k: release each trainer step's groups_per_step prompts once the trainer has "
        "announced step t-1-k (0: the synchronous barrier); the trainer's step t trains "
        "exactly them, so no sample is dropped as stale. null: unpaced (window and "
        "max_pending).",
    )
    groups_per_step: int = Field(
        8, ge=1, description="Prompts (groups) per trainer step: the size of each released step."
    )
    tasks_per_group: int = Field(
        1,
        ge=1,
        le=4096,
        description="Tasks each group is split into (near-equal runs of sample indices), so a long "
        "group's samples can run on several workers; the trainer still groups by prompt id.",
    )
    partitioning: Literal["balanced", "key"] = Field(
        "balanced",
        description=(
            "Prompt partition of a task: balanced (the partition with the least predicted tokens "
            "so far, so a pool's workers get even shares) or key (hash of the prompt id: random)."
        ),
    )
    window: int = Field(
        64,
        ge=1,
        description=(
            "Unpaced (max_staleness null): prompts ordered together (longest-predicted first) "
            "before publishing."
        ),
    )
    max_pending: int | None = Field(
        256,
        ge=1,
        description=(
            "Unpaced (max_staleness null): stop publishing while this many tasks are unconsumed by "
            "the pools; null: no bound."
        ),
    )
    pools: tuple[str, ...] = Field(
        ("regular",),
        description="Generator pools whose progress counts for max_pending (their groups: "
        "{prefix}.gen.{pool}).",
    )
    barrier_timeout_s: float = Field(
        3600.0,
        gt=0,
        description=(
            "Paced: give up when the trainer announces no step a release waits for within this "
            "long."
        ),
    )
    epochs: int = Field(1, ge=1, le=100_000, description="Passes over the prompt source.")
    tokenizer: str | None = Field(
        None,
        description=(
            "A model directory whose tokenizer counts each prompt's tokens before dispatch, as "
            "the generators tokenize it (rendered, with chat_template): a prompt whose tokens + "
            "max_new_tokens exceed context_tokens goes to the DLQ with the reason, never to a "
            "generator (nor into a step that would wait for it). null: no check at dispatch."
        ),
        json_schema_extra=cli(metavar="DIR"),
    )
    context_tokens: int | None = Field(
        None,
        ge=2,
        description=(
            "The generators' context (prompt + max_new_tokens), checked at dispatch with "
            "--tokenizer; null: that model's max_position_embeddings."
        ),
    )

    # Cross-field rules raise ConfigError (not ValueError), so pydantic passes the one-line
    # message through unchanged instead of wrapping it.
    @model_validator(mode="after")
    def _one_source(self) -> DispatchConfig:
        if (self.prompts is None) == (self.task is None):
            raise ConfigError("give exactly one prompt source: --prompts FILE or --task demo|sim")
        if self.task == "sim" and self.lengths is None:
            raise ConfigError("--task sim needs --lengths FILE (a lo,hi,probability histogram)")
        if self.chat_template and self.tokenizer is None:
            raise ConfigError(
                "--chat-template needs --tokenizer DIR (the generators' model: its template "
                "renders the prompts)"
            )
        return self


class EngineSettings(Settings):
    """The generation backend and how its output is chunked: ``srl-producer generate`` and
    ``srl-producer bench``."""

    engine: Literal["hf", "sim", "vllm"] = Field("hf", description="Generation backend.")
    model: str | None = Field(
        None, description="Hugging Face model directory: policy version 0 (hf, vllm)."
    )
    device: str = Field("cpu", description="torch device of the hf engine (cpu, cuda, cuda:1 …).")
    dtype: str | None = Field(
        None,
        description="Weights dtype (float32, bfloat16 …); null: float32 for hf, auto for vllm.",
    )
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch CPU threads; null: torch's default."
    )
    max_batch: int = Field(
        8, ge=1, le=65_536, description="Most sequences decoded together (continuous batching)."
    )
    chunk_tokens: int = Field(
        32,
        ge=1,
        le=65_536,
        description="Tokens per published chunk (the last chunk may be shorter).",
    )
    seed: int | None = Field(
        None, description="Sampling seed; null: a random one per worker (hf, sim, vllm)."
    )
    lengths: str | None = Field(
        None, description="sim engine: length histogram file for tasks without metadata.sim_length."
    )
    length_scale: float = Field(
        1.0,
        gt=0,
        le=100,
        description="sim engine: factor on histogram lengths.",
        json_schema_extra=cli("--scale"),
    )
    time_scale: float = Field(
        1.0,
        ge=0,
        le=1000,
        description="sim engine: factor on the modelled step time PTL(BS) (0.01 = 100x faster than "
        "modelled).",
    )
    sim_tokens_per_step: int = Field(
        1,
        ge=1,
        le=4096,
        description=(
            "sim engine: tokens per sequence per decode step (each step lasts that many PTL(BS)); "
            ">1 cuts Python work in time-compressed runs."
        ),
    )
    sim_vocab: int = Field(
        32_000,
        ge=5,
        description="sim engine: token ids are drawn from [4, sim_vocab) (set it to a real trainer "
        "model's vocabulary size).",
    )


class VLLMSettings(Settings):
    """What only the vllm engine reads (``producers.engines.vllm``; docs/generator.md, "vLLM")."""

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="vllm engine: devices one engine shards the model over (vLLM's "
        "tensor_parallel_size).",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="vllm engine: context positions (prompt + max_new_tokens); a task that does "
        "not fit goes to the DLQ with the reason. null: the model's.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vllm engine: share of GPU memory for the weights and the KV cache; null: "
        "0.85. On CPU it is that share of the machine's memory, so it is used there only when "
        "set (and kv_cache_gib is not).",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vllm engine: KV cache size in GiB, instead of sizing it by "
        "gpu_memory_utilization (on CPU: vLLM's KV cache space). null: by "
        "gpu_memory_utilization on GPU; on CPU 1 GiB unless gpu_memory_utilization is set.",
    )


class GenerateConfig(CommonConfig, EngineSettings, VLLMSettings):
    """``srl-producer generate``: one generator worker of one pool."""

    section = "generate"

    pool: str = Field(
        "regular",
        pattern=NAME_PATTERN,
        description="Generator pool; its consumer group is {prefix}.gen.{pool}.",
    )
    buckets: tuple[str, ...] = Field(
        (), description="Length buckets whose prompt topics this pool consumes; empty: all."
    )
    group_id: str | None = Field(
        None, description="Consumer group on the prompt topics; null: {prefix}.gen.{pool}."
    )
    take_over_from: str | None = Field(
        None,
        description=(
            "Before joining, copy this consumer group's committed positions to ours where ours has "
            "none (replacing a pool whose group a dead member wedges on the embedded broker)."
        ),
    )
    pool_liveness: bool = Field(
        True,
        description=(
            "Assign the pool's partitions among its workers (pool epochs, producers.pool): a "
            "worker silent for session.timeout.ms loses its share on any broker (the embedded "
            "one never evicts a group member). false: subscribe to the pool's consumer group. "
            "Every worker of a pool must agree."
        ),
    )
    worker_id: str | None = Field(
        None, description="Id on chunks and metrics; null: host-pid-pool."
    )
    follow_run: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description=(
            "The run whose weights this worker loads and whose trainer bounds its backlog (the "
            "lead, when several trainers learn from one stream); null: run."
        ),
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1_000_000,
        description=(
            "k: never start a trajectory with weights older than latest - k (0: synchronous)."
        ),
    )
    max_backlog_chunks: int | None = Field(
        None,
        ge=1,
        description=(
            "Pause intake while the trainer has more than this many chunks of the trajectories "
            "topic still to read (its shared read position, or its committed offsets if further); "
            "null: no bound."
        ),
    )
    backlog_stall_s: float = Field(
        20.0,
        gt=0,
        description=(
            "Ignore the backlog bound while the trainer's position and offsets have not moved for "
            "this long: it is waiting for groups that paused intake would never finish."
        ),
    )
    backlog_group: str | None = Field(
        None,
        description="Consumer group whose lag is the backlog; null: the followed run's trainer "
        "group, {prefix}.trainer.{run}.",
    )
    migrate_to: str | None = Field(
        None,
        description=(
            "Long-tail bucket to hand stragglers to (by prefix, same trajectory id): a trajectory "
            "of another bucket that ran past migrate_factor x its predicted length moves there; "
            "null: never migrate."
        ),
    )
    migrate_factor: float = Field(
        2.0,
        gt=1.0,
        le=1000,
        description="A straggler has generated more than this many times its predicted length.",
    )
    migrate_min_tokens: int = Field(
        64, ge=1, description="… and at least this many tokens (short predictions are noisy)."
    )
    stats_interval_s: float = Field(
        5.0, gt=0, description="How often gen_stats events are emitted."
    )
    commit_interval_s: float = Field(
        1.0, gt=0, description="How often finished tasks' offsets are committed."
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description=(
            "On SIGTERM: how long in-flight trajectories may run before they are handed off."
        ),
        json_schema_extra=cli("--drain-timeout"),
    )
    idle_exit_s: float | None = Field(
        None,
        gt=0,
        description="Exit cleanly after this long with nothing to do; null: run until stopped.",
        json_schema_extra=cli("--idle-exit"),
    )
    recovery_slack_s: float = Field(
        60.0,
        ge=0,
        description=(
            "Clock skew allowed when reading a redelivered task's chunks back by timestamp."
        ),
    )
    refused_wait_s: float = Field(
        60.0,
        ge=0,
        description=(
            "A task released for a version this worker refused (corrupt or deleted weights) "
            "waits this long for a newer good version before it starts on the older weights "
            "(whose samples the trainer may then drop as stale)."
        ),
    )

    @model_validator(mode="after")
    def _cross_field(self) -> GenerateConfig:
        if self.engine in ("hf", "vllm") and not self.model:
            raise ConfigError(f"engine {self.engine} needs --model DIR (policy version 0)")
        check_buckets(self, "buckets", self.buckets)
        if self.migrate_to is not None:
            check_buckets(self, "migrate_to", [self.migrate_to])
        return self

    @property
    def consumer_group(self) -> str:
        return self.group_id or pool_group(self.topic_prefix, self.pool)

    @property
    def weights_run(self) -> str:
        """The run whose weights are loaded (the lead's)."""
        return self.follow_run or self.run

    @property
    def trainer_group(self) -> str:
        return self.backlog_group or trainer_group(self.topic_prefix, self.weights_run)

    @property
    def worker_name(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}-{self.pool}"


def check_buckets(cfg: TopicsConfig, key: str, buckets: Iterable[str]) -> None:
    """ConfigError naming ``key`` unless every one of ``buckets`` is a bucket of the layout."""
    layout = Layout.from_config(cfg)
    for b in buckets:
        try:
            layout.bucket_index(b)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
