"""Settings of ``srl eval`` (``[eval]`` table, ``SRL_*`` variables, CLI options).

The policy (``model`` and/or a ``run``'s newest weights in the store), the engine that
generates (the generators' hf or vllm engine, built by ``producers.engines.make_engine``), the
dataset and reward, and what to generate. Read by ``app.evalrun``; docs/rewards.md ("Evaluating
a policy") explains them.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from producers.config import ChatSettings, EngineSettings, SourceSettings, VLLMSettings
from srl.config import RunStoreConfig, cli
from srl.errors import ConfigError


class EvalConfig(RunStoreConfig, VLLMSettings, ChatSettings, SourceSettings):
    """``srl eval``: greedy pass@1 and sampled pass@k of a policy on a prompt dataset."""

    section: ClassVar[str] = "eval"

    prompts: str | None = Field(
        None,
        description="The dataset, read as the dispatcher reads --prompts: a JSONL, parquet or "
        "Arrow file, or a local dataset directory; columns mapped by prompt_field, id_field, "
        "answer_field, metadata_fields (metadata.answer for the built-in rewards).",
        json_schema_extra=cli(metavar="PATH"),
    )
    limit: int | None = Field(
        None, ge=1, description="Evaluate only the first N prompts; null: every prompt."
    )
    reward: str = Field(
        "app.task:demo_reward",
        description="Reward function as module:function (the trainer's --reward), called as "
        "fn(prompt, completion, metadata) -> float.",
    )
    reward_workers: int = Field(
        2,
        ge=0,
        le=256,
        description="Processes that run the reward (as the trainer's); 0: in this process, no "
        "timeout.",
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A reward call running longer fails its sample (reward_workers > 0).",
    )
    pass_threshold: float = Field(
        1.0, description="A sample passes when its reward is at least this."
    )
    greedy: bool = Field(True, description="Greedy pass@1: one greedy completion a prompt.")
    samples: int = Field(
        0, ge=0, le=4096, description="Sampled completions a prompt for pass@k; 0: greedy only."
    )
    k: tuple[int, ...] = Field(
        (), description="The k of pass@k (e.g. 1,4), each at most samples; empty: 1 and samples."
    )
    temperature: float = Field(1.0, gt=0, le=100, description="Temperature of the samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass of the samples.")
    max_new_tokens: int = Field(
        512, ge=1, le=1_000_000, description="Most tokens a completion may generate."
    )
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation backend.")
    model: str | None = Field(
        None,
        description="Hugging Face model directory: the policy (version 0), or the config and "
        "tokenizer a --run's weights load into; null: the run's newest version alone.",
    )
    device: str = Field("cpu", description="torch device of the hf engine (cpu, cuda …).")
    dtype: str | None = Field(
        None, description="Weights dtype; null: the engine's default (hf float32, vllm auto)."
    )
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch CPU threads; null: torch's default."
    )
    max_batch: int = Field(
        32, ge=1, le=65_536, description="Most sequences decoded together (continuous batching)."
    )
    seed: int | None = Field(0, description="Sampling seed; null: a random one.")

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, v: str) -> str:
        if ":" not in v:
            raise ValueError(f"expected module:function, got {v!r}")
        return v

    @model_validator(mode="after")
    def _needs(self) -> EvalConfig:
        if not self.prompts:
            raise ConfigError("srl eval needs --prompts PATH")
        if not self.model and "run" not in self.model_fields_set:
            raise ConfigError("srl eval needs --model DIR or --run NAME (its newest weights)")
        return self

    @property
    def from_run(self) -> bool:
        """Whether the policy is the run's newest published version (``--run`` given)."""
        return "run" in self.model_fields_set


class EvalEngine(EngineSettings, VLLMSettings):
    """The engine settings ``producers.engines.make_engine`` takes, made from an
    :class:`EvalConfig` and the model directory the policy is in (not a command's config)."""
