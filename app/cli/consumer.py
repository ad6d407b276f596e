"""``srl-consumer``: the consumer side's entry point (trainer).

``srl-consumer train`` turns its options into a :class:`~consumers.config.TrainConfig` and
calls :func:`consumers.trainer.run_trainer`; torch and transformers are imported there, so
``--help`` answers at once. Several ranks: ``torchrun --nproc-per-node N -m app.cli.consumer train
…``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from app.cli.common import GROUP_SETTINGS, echo_json, run_main, setup_logging
from app.cli.options import ConfigGroup, with_config

if TYPE_CHECKING:
    from consumers.config import TrainConfig


@click.group(
    cls=ConfigGroup,
    context_settings=GROUP_SETTINGS,
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """srl consumers: train on trajectories streamed from Kafka and publish weights."""
    setup_logging(verbose)


@cli.command("train")
@with_config("consumers.config:TrainConfig")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON at the end.")
def train(cfg: TrainConfig, as_json: bool) -> None:
    """Train on the trajectories topic; publish weights; checkpoint; resume after a crash.

    The options are the [train] table of the config file and the SRL_* variables; see
    docs/trainer.md. --sync-barrier is the synchronous baseline (k = 0, publish every step).
    """
    from consumers.trainer import run_trainer

    result = run_trainer(cfg)
    if result.rank > 0:
        click.echo(
            f"rank {result.rank}: {result.steps} steps, {result.micro_batches} micro-batches"
        )
    elif as_json:
        echo_json({"steps": result.steps, "version": result.version, "outcomes": result.outcomes})
    else:
        click.echo(
            f"trained {result.steps} steps; policy version {result.version}; outcomes "
            f"{result.outcomes}"
        )


main = run_main(cli, "srl-consumer")

if __name__ == "__main__":  # torchrun --nproc-per-node N -m app.cli.consumer train …
    main()
