"""Settings of the ranker commands (``[ranker]`` table, ``SRL_*`` variables, CLI options).

Owns the typed, validated configuration of ``srl ranker train`` (:class:`RankerConfig`: the
shared Kafka/store settings of :class:`srl.config.CommonConfig` plus the training knobs) and
of ``srl ranker eval|plan`` (:class:`RankerStoreConfig`: only where the run's versions are).
Both read the ``[ranker]`` table, so each ignores the other's keys there.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from srl.config import CommonConfig, RunStoreConfig


class RankerStoreConfig(RunStoreConfig):
    """``srl ranker eval|plan``: the run whose published versions are read, and the store."""

    section: ClassVar[str] = "ranker"


class RankerConfig(CommonConfig):
    """``srl ranker train``: fit versions (from the demo task or online) and publish them."""

    section: ClassVar[str] = "ranker"

    model_dir: str | None = Field(
        None,
        description=(
            "Policy model directory, for its tokenizer (prompt tokens → text). null: the tiny "
            "byte-level tokenizer."
        ),
    )
    ranker_group: str | None = Field(
        None,
        description="Consumer group of the online ranker trainer. null: {prefix}.ranker.{run}.",
    )
    window: int = Field(
        4000,
        ge=10,
        le=10_000_000,
        description="Most recent (prompt, length) pairs a version is trained on.",
    )
    retrain_every: int = Field(
        500, ge=1, le=10_000_000, description="New pairs between two versions."
    )
    min_pairs: int = Field(
        200, ge=2, le=10_000_000, description="Pairs needed before the first online version."
    )
    epochs: int = Field(
        60,
        ge=1,
        le=10_000,
        description="Training epochs per version (warm-started after the first).",
    )
    hidden: tuple[int, ...] = Field(
        (64, 32), description="MLP hidden layer sizes; empty for the linear model."
    )
    buckets: int = Field(
        16,
        ge=1,
        le=1 << 20,
        description="Hashed slots per n-gram family of the ranker's features (new models only).",
    )

    def group_id(self) -> str:
        return self.ranker_group or f"{self.topic_prefix}.ranker.{self.run}"
