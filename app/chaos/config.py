"""``srl chaos``'s settings: which faults, how big each run is, how long each fault lasts.

Owns :class:`ChaosConfig` (the ``[chaos]`` table of a config file, ``SRL_*`` variables, the
command's options) and :data:`FAULTS`, the names of the faults the suite knows, in the order
the full schedule injects them. The suite always starts its own broker (it kills and restarts
it): the embedded one, or Apache Kafka nodes (``broker``, ``nodes``), so it reads no Kafka
settings. Used by ``app.chaos.run`` and the CLI.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from app.demoplan import TrainerDtype, TrainerRanks
from srl.config import Settings
from srl.errors import ConfigError

# the full schedule, each alone, in this order (docs/reliability.md says what each one means)
FAULTS: tuple[str, ...] = (
    "generator-kill",
    "generator-stop",
    "generator-partition",
    "trainer-kill-step",
    "trainer-kill-checkpoint",
    "dispatcher-kill",
    "ranker-kill",
    "broker-restart",
    "weights-corrupt",
    "weights-delete",
    "store-disk-full",
    "poison",
    "kafka-leader-kill",
    "kafka-node-freeze",
    "kafka-rolling-restart",
    "kafka-controller-kill",
)


class ChaosConfig(Settings):
    """``srl chaos``: a real pipeline on a broker of its own, faults injected on a seeded
    schedule, an audit from the topics after each run."""

    section: ClassVar[str] = "chaos"

    broker: Literal["embedded", "kafka"] = Field(
        "embedded",
        description=(
            "The broker the suite starts: the embedded one, or Apache Kafka nodes (KRaft, "
            "srl broker start --engine kafka)."
        ),
    )
    nodes: int = Field(
        3,
        ge=1,
        le=3,
        description=(
            "With --broker kafka: how many nodes; the kafka-* faults need 3 (one may be down)."
        ),
    )

    out: str = Field("runs/chaos", description="Directory for logs, stores, results and plots.")
    seed: int = Field(0, description="Seed of the schedule: fault times, targets, mixes.")
    faults: tuple[str, ...] = Field(
        (), description="Faults to inject, each in its own run; empty: all of them."
    )
    mixed: bool = Field(
        True, description="After the single faults, one run with several of them at once."
    )
    together: bool = Field(
        False,
        description="Inject the faults together in one run (seeded offsets), not one run each.",
    )
    regular_workers: int = Field(
        2, ge=1, le=8, description="Generator workers in the regular pool (the long tail has one)."
    )
    trainer_ranks: TrainerRanks = 1
    dtype: TrainerDtype = "float32"
    max_staleness: int = Field(1, ge=0, le=100, description="k of every role.")
    steps: int = Field(12, ge=4, le=100_000, description="Optimizer steps of each run.")
    warmup_steps: int = Field(
        3, ge=1, le=1000, description="Steps trained before the first fault of a run."
    )
    groups_per_step: int = Field(4, ge=1, le=256, description="Groups per optimizer step.")
    group_size: int = Field(8, ge=2, le=64, description="Samples per prompt (GRPO group).")
    time_scale: float = Field(
        4.0,
        gt=0,
        le=100,
        description=(
            "Pace of the sim engine: factor on PTL(BS) per token (4: a 64-token answer takes "
            "about 2 s, so generator faults meet trajectories in flight)."
        ),
    )
    recover_timeout_s: float = Field(
        90.0, gt=0, description="Give up waiting for a role's recovery after this long."
    )
    partition_s: float = Field(30.0, gt=0, description="Length of the network partition.")
    stop_s: float = Field(
        20.0,
        gt=0,
        description="How long a generator stays SIGSTOPped (longer than its session timeout).",
    )
    disk_full_s: float = Field(10.0, gt=0, description="How long the object store stays full.")
    expire_s: float = Field(
        90.0,
        gt=0,
        description="The trainer's expiry: a trajectory unfinished this long is given up (lost).",
    )
    fault_every_s: float = Field(60.0, gt=0, description="With --soak: seconds between faults.")
    soak_retention_s: float = Field(
        300.0,
        ge=0,
        description=(
            "With --soak: retention of the run's data topics (trajectories, metrics, dead "
            "letters), so that the broker's data stays flat; the audit is gathered as the "
            "records arrive. 0: the broker's default, the audit reads them back at the end."
        ),
    )

    @model_validator(mode="after")
    def _known(self) -> ChaosConfig:
        if self.nodes == 2:
            raise ConfigError("chaos: nodes is 1 or 3 (a KRaft quorum of two has no majority)")
        if 0 < self.soak_retention_s < 10:
            raise ConfigError("chaos: soak_retention_s must be 0 (none) or at least 10")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ConfigError(f"chaos: unknown fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
        if self.warmup_steps >= self.steps:
            raise ConfigError(
                f"chaos: warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})"
            )
        return self

    def schedule(self) -> tuple[str, ...]:
        """The faults that run alone, in schedule order."""
        return tuple(f for f in FAULTS if f in self.faults) if self.faults else FAULTS
