"""The trainer's typed configuration (``[train]`` table, ``SRL_*`` variables, CLI options).

Owns every knob of ``srl-consumer train`` and the cross-field rules between them, checked once
at load (``TrainConfig`` is a :class:`~srl.config.CommonConfig`, so precedence and error
messages are the shared ones). Called by ``app.cli.consumer`` and by tests that build a trainer
in-process.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator, model_validator

from srl.config import NAME_PATTERN, CommonConfig, cli
from srl.errors import ConfigError
from srl.topics import trainer_group


class RewardSettings(CommonConfig):
    """The trainer's reward: which function, and the processes that run it
    (``consumers.rewardpool``)."""

    reward: str = Field(
        "app.task:demo_reward",
        description=(
            "Reward function as module:function, called as fn(prompt, completion, metadata) -> "
            "float."
        ),
    )
    reward_workers: int = Field(
        2,
        ge=0,
        le=256,
        description=(
            "Processes that run the reward beside the consume loop (a slow or stuck reward never "
            "stops the trainer reading); 0: in the trainer's process, synchronously, no timeout."
        ),
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "A reward call running longer fails its sample (failed_reward) and its process is "
            "replaced (reward_workers > 0)."
        ),
    )

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, v: str) -> str:
        if ":" not in v:
            raise ValueError(f"expected module:function, got {v!r}")
        return v


class TrainConfig(RewardSettings):
    """Settings of ``srl-consumer train``."""

    section = "train"

    model: str = Field(
        "", description="Hugging Face model directory the run starts from (policy version 0)."
    )
    group_id: str | None = Field(
        None,
        description="Consumer group on the trajectories topic; null: {prefix}.trainer.{run}.",
    )
    start_from: str = Field(
        "earliest",
        description=(
            "Where a trainer whose group has no committed offsets yet starts reading: earliest, "
            "latest, or a time (ISO 8601, or ms since the epoch). A restart resumes from its "
            "commits."
        ),
        json_schema_extra=cli("--from", metavar="earliest|latest|TIME"),
    )
    lead_run: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description=(
            "The run whose weights the generators and srl serve follow (their --follow-run); "
            "null or this run: this trainer is the lead. Another run learns off-policy from the "
            "lead's samples: no staleness bound (versions of another lineage), importance "
            "correction as always (docs/trainer.md)."
        ),
    )
    feedback_window_s: float = Field(
        60.0,
        ge=0,
        description=(
            "How long a served trajectory waits for its feedback ({prefix}.feedback), and feedback "
            "for its trajectory; 0: read no feedback, score served trajectories by --reward."
        ),
    )
    feedback_missing: Literal["dlq", "reward"] = Field(
        "dlq",
        description=(
            "A served trajectory without feedback in the window: dlq (outcome no_feedback, to the "
            "dead-letter queue) or reward (scored by --reward)."
        ),
    )
    # -- algorithm --------------------------------------------------------------------
    advantage: Literal["grpo", "rloo"] = Field(
        "grpo",
        description="Advantage estimator: grpo (group mean/std) or rloo (leave-one-out mean).",
    )
    loss: Literal["tis", "ppo", "decoupled"] = Field(
        "tis",
        description=(
            "Objective: tis (truncated importance-weighted policy gradient), ppo (clip against "
            "behaviour), decoupled (decoupled PPO)."
        ),
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio floor is 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: ratio ceiling is 1 + clip_high.")
    tis_cap: float = Field(
        2.0, gt=0, description="Truncation C of the importance weight min(pi/mu, C)."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL to a frozen copy of --model; 0: no reference."
    )
    loss_agg: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="Loss normalisation over a step: per token, or per sequence then per sample.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of the generators; log-probs are of softmax(logits / T).",
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0: none.")
    updates_per_step: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Optimizer updates per batch: 1 streams; more re-run the stored micro-batches (PPO "
            "epochs)."
        ),
    )
    seed: int = Field(0, description="Seed of torch's generators.")
    # -- staleness and batching ---------------------------------------------------------
    max_staleness: int = Field(
        1, ge=0, description="k: the update v -> v+1 may use a trajectory only if v - b <= k."
    )
    serve_max_staleness: int | None = Field(
        8,
        ge=0,
        description=(
            "The bound for served samples (srl serve's; no admission paces them): v - b <= this, "
            "with the loss's importance correction; null: max_staleness (docs/serving.md)."
        ),
    )
    sync_barrier: bool = Field(
        False,
        description=(
            "Synchronous baseline: k = 0, wait for the whole batch before any forward pass, "
            "publish every step."
        ),
    )
    stale_policy: Literal["drop", "correct"] = Field(
        "drop",
        description=(
            "drop: a group with a stale sample is dropped whole; correct: only stale samples are "
            "dropped, the rest train with importance correction."
        ),
    )
    batching: Literal["windows", "groups"] = Field(
        "windows",
        description=(
            "windows: step t trains exactly the groups the dispatcher released for step t (no "
            "sample outlives k; docs/trainer.md); groups: each step takes the first "
            "groups_per_step complete groups (a trainer not paced by the dispatcher, e.g. of "
            "another run)."
        ),
    )
    groups_per_step: int = Field(
        4,
        ge=1,
        description=(
            "Groups per optimizer step for groups the dispatcher did not schedule (batching "
            "groups, hand-made records)."
        ),
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="Token budget of a micro-batch: sum of lengths packed, rows x longest padded.",
    )
    eager_micro_batches: bool = Field(
        True,
        description=(
            "Streaming trainer: after each poll, train the rows of complete groups at once "
            "instead of waiting for a full micro-batch (the device would sit idle)."
        ),
    )
    packing: bool = Field(
        True,
        description="One row per micro-batch, attention within each sample: no padding computed.",
    )
    max_train_tokens: int = Field(
        0,
        ge=0,
        description="Longer trajectories (prompt + completion) go to the DLQ; 0: the model's.",
    )
    expire_s: float = Field(
        300.0,
        gt=0,
        description="An incomplete trajectory or group with no new data for this long is expired.",
    )
    # -- weights, checkpoints, lifetime -------------------------------------------------
    publish_every: int = Field(1, ge=1, description="Publish a new policy version every N steps.")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="Checkpoint (and commit offsets) every N steps.",
    )
    checkpoint_every_s: float = Field(
        0.0,
        ge=0,
        description=(
            "And at least this long after the last checkpoint (0: every checkpoint_every "
            "steps). A checkpoint holds fp32 weights and AdamW state, 12 bytes a parameter "
            "(91 GB at 7B): docs/trainer.md's 7B configuration takes 900."
        ),
    )
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept in the store.")
    keep_versions: int = Field(
        4,
        ge=0,
        description=(
            "Published weights versions kept in the store, the newest; older ones are deleted "
            "after each publish (0: keep every version, e.g. for evaluating them later: 15 GB "
            "a version at 7B in bf16)."
        ),
    )
    publish_background: bool = Field(
        True,
        description="Upload each version while the next step trains; off: the step waits for it.",
    )
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0: never.")
    idle_exit_s: float = Field(
        0.0,
        ge=0,
        description=(
            "Exit after this long with no new record (counted from the last record, step or "
            "checkpoint); 0: never."
        ),
    )
    # -- backend --------------------------------------------------------------------------
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:N.")
    backend: Literal["auto", "torch", "fsdp", "deepspeed"] = Field(
        "auto",
        description=(
            "auto: fsdp with several ranks, torch with one; fsdp: FSDP2, parameters, gradients "
            "and AdamW state sharded across ranks; torch: replicated on every rank; deepspeed: "
            "ZeRO 0-3 (docs/trainer.md)."
        ),
    )
    zero_stage: int = Field(
        1,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO stage 0-3 (backend deepspeed; 3 also partitions parameters).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "Compute dtype of forward and backward. bfloat16 keeps fp32 master weights, fp32 "
            "AdamW state and fp32 gradient reduction (mixed precision) unless master_dtype says "
            "otherwise."
        ),
    )
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "dtype of the weights the optimizer updates. bfloat16 (pure-bf16 storage) rounds "
            "away most updates at small learning rates; only on explicit request, with a "
            "warning."
        ),
    )
    publish_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of published weights (the generators' serving dtype); auto: dtype.",
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each decoder layer's activations in the backward pass: keeps only the "
            "layer inputs, at about a third more compute."
        ),
    )

    @field_validator("start_from")
    @classmethod
    def _start(cls, v: str) -> str:
        start_ms(v)
        return v

    # Cross-field rules raise ConfigError (not ValueError), so pydantic passes the one-line
    # message through unchanged instead of wrapping it.
    @model_validator(mode="after")
    def _cross_field(self) -> TrainConfig:
        if self.sync_barrier and self.max_staleness != 0:
            raise ConfigError("the synchronous baseline is k = 0: add --max-staleness 0")
        if self.sync_barrier and self.publish_every != 1:
            raise ConfigError("--sync-barrier publishes every step: use --publish-every 1")
        if self.batching == "windows" and self.publish_every > self.max_staleness + 1:
            # step t's prompts are released once step t-1-k is announced: announcing less
            # often than every k+1 steps would leave the next step with nothing to train
            raise ConfigError(
                f"--publish-every {self.publish_every} with --max-staleness {self.max_staleness}: "
                "windows need --publish-every <= max_staleness + 1 (or --batching groups)"
            )
        if self.backend == "deepspeed" and self.master_dtype != "float32":
            raise ConfigError("master_dtype: the deepspeed backend keeps float32 master weights")
        if self.feedback_window_s >= self.expire_s:
            raise ConfigError(
                f"--feedback-window-s {self.feedback_window_s:g} must be under --expire-s "
                f"{self.expire_s:g} (a group waits that long for its samples)"
            )
        return self

    @property
    def consumer_group(self) -> str:
        return self.group_id or trainer_group(self.topic_prefix, self.run)

    @property
    def staleness_bound(self) -> int | None:
        """k for the gate; None for a trainer that is not the lead (its samples' versions
        belong to the lead's lineage, not to its own)."""
        lead = self.lead_run is None or self.lead_run == self.run
        return self.max_staleness if lead else None

    @property
    def served_staleness_bound(self) -> int | None:
        """The gate's bound for served samples (``consumers.gate.bound``); None: k's."""
        return None if self.sync_barrier else self.serve_max_staleness

    @property
    def start_ms(self) -> int | str:
        """``start_from`` as ``"earliest"``, ``"latest"`` or ms since the epoch."""
        return start_ms(self.start_from)


def start_ms(v: str) -> int | str:
    """``earliest``/``latest`` as they are, a time as ms since the epoch; ValueError otherwise."""
    if v in ("earliest", "latest"):
        return v
    if v.isdigit():
        return int(v)
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise ValueError(
            f"expected earliest, latest, ms since the epoch or an ISO 8601 time, got {v!r}"
        ) from None
    if t.tzinfo is None:
        t = t.astimezone()  # a time without a zone is local time
    return int(t.timestamp() * 1000)
