"""``srl-consumer``: the consumer side's entry point (trainer).

``srl-consumer train`` turns its options into a :class:`~consumers.config.TrainConfig` and
calls :func:`consumers.trainer.run_trainer`; torch and transformers are imported there, so
``--help`` answers at once. Several ranks: ``torchrun --nproc-per-node N -m app.cli.consumer train
…``. ``srl-consumer plan`` prints the GPU memory per rank of training a model
(:mod:`consumers.plan`), from its config alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

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


@cli.command("plan")
@click.option(
    "--model",
    required=True,
    metavar="DIR|CONFIG.JSON",
    help="Model directory, or a config.json: built on the meta device, no weights read.",
)
@click.option("--ranks", type=int, required=True, help="Ranks (GPUs) the trainer runs on.")
@click.option(
    "--gpu-memory",
    type=float,
    required=True,
    metavar="GIB",
    help="Memory of one GPU in GiB (an 80 GB H100 has 79.6).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default=None,
    help="Compute dtype (master weights and AdamW state are fp32). [default: the trainer's, "
    "float32]",
)
@click.option(
    "--backend",
    type=click.Choice(["fsdp", "torch"]),
    default="torch",
    show_default=True,
    help="torch: the replicated engine (the one-rank default); fsdp: FSDP2, sharded per "
    "decoder layer (the multi-rank default).",
)
@click.option(
    "--activation-checkpointing",
    is_flag=True,
    help="Keep only each layer's input; recompute one layer at a time in the backward pass.",
)
@click.option(
    "--micro-batch-tokens",
    type=int,
    default=None,
    help="Tokens of one micro-batch. [default: the trainer's, 4096]",
)
@click.option(
    "--kl-coef",
    type=float,
    default=None,
    help="Above 0 the trainer holds a frozen reference model. [default: the trainer's, 0]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(
    model: str,
    ranks: int,
    gpu_memory: float,
    dtype: str | None,
    backend: Literal["fsdp", "torch"],
    activation_checkpointing: bool,
    micro_batch_tokens: int | None,
    kl_coef: float | None,
    as_json: bool,
) -> None:
    """GPU memory per rank of training MODEL, and whether it fits: parameters, gradients,
    AdamW state, reference model, activations of one micro-batch, publish bucket.

    Counts the parameters exactly on the meta device (a 7B config answers in seconds, no
    weights); the formulas are in consumers/plan.py and docs/trainer.md.
    """
    from consumers.plan import PlanOptions, format_plan, plan_model

    # not given: the trainer's defaults, which PlanOptions reads from TrainConfig
    given: dict[str, Any] = {
        "dtype": dtype,
        "micro_batch_tokens": micro_batch_tokens,
        "kl_coef": kl_coef,
    }
    options = PlanOptions(
        ranks=ranks,
        gpu_memory_gib=gpu_memory,
        backend=backend,
        activation_checkpointing=activation_checkpointing,
        **{k: v for k, v in given.items() if v is not None},
    )
    result = plan_model(model, options)
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(format_plan(result))


main = run_main(cli, "srl-consumer")

if __name__ == "__main__":  # torchrun --nproc-per-node N -m app.cli.consumer train …
    main()
