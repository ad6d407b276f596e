"""Settings of the ranker roles (``[ranker]`` table, ``SRL_*`` variables, CLI options).

Owns the typed, validated configuration of ``srl ranker train|eval|simulate``; the common
Kafka/store settings come from :class:`srl.config.CommonConfig`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from srl.config import CommonConfig


class RankerConfig(CommonConfig):
    section: ClassVar[str] = "ranker"

    model_dir: str | None = Field(
        None,
        description=(
            "Policy model directory, for its tokenizer (prompt tokens → text). null: the tiny "
            "byte-level tokenizer."
        ),
    )
    ranker_group: str | None = Field(
        None, description="Consumer group of the online ranker trainer. null: srl-ranker-{run}."
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
    poll_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="How often dispatchers look for a newer ranker version, seconds.",
    )

    def group_id(self) -> str:
        return self.ranker_group or f"srl-ranker-{self.run}"
