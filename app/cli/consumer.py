"""``srl-consumer``: the consumer side's entry point (trainer).

``srl-consumer train`` turns its options into a :class:`~consumers.config.TrainConfig` and
calls :func:`consumers.trainer.run_trainer`; torch and transformers are imported there, so
``--help`` answers at once. Several ranks: ``torchrun --nproc-per-node N -m app.cli.consumer train
…``.
"""

from __future__ import annotations

from typing import Any

import click

from app.cli.common import common_options, config_from, echo_json, run_main, setup_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """srl consumers: train on trajectories streamed from Kafka and publish weights."""
    setup_logging(verbose)


def _flag(name: str) -> Any:
    return click.option(f"--{name}/--no-{name}", default=None)


@cli.command("train")
@common_options
@click.option(
    "--model", metavar="DIR", help="HF model directory: policy version 0. Env: SRL_MODEL."
)
@click.option(
    "--reward",
    metavar="MODULE:FUNCTION",
    help="Reward fn(prompt, completion, metadata) -> float (docs/rewards.md).",
)
@click.option(
    "--group-id", help="Consumer group on the trajectories topic. Default srl-trainer-{run}."
)
@click.option(
    "--advantage", type=click.Choice(["grpo", "rloo"]), help="Advantage estimator. Default grpo."
)
@click.option(
    "--loss",
    type=click.Choice(["tis", "ppo", "decoupled"]),
    help="Objective: tis, ppo (clip vs behaviour) or decoupled (decoupled PPO). Default tis.",
)
@click.option("--clip-low", type=float, help="PPO clip floor 1 - x. Default 0.2.")
@click.option("--clip-high", type=float, help="PPO clip ceiling 1 + x. Default 0.2.")
@click.option("--tis-cap", type=float, help="Truncation C of the importance weight. Default 2.")
@click.option(
    "--kl-coef", type=float, help="k3 KL to a frozen copy of --model; 0 loads none. Default 0."
)
@click.option(
    "--loss-agg", type=click.Choice(["token_mean", "seq_mean"]), help="Loss normalisation."
)
@click.option("--temperature", type=float, help="Generators' sampling temperature. Default 1.")
@click.option("--lr", type=float, help="AdamW learning rate. Default 1e-5.")
@click.option("--weight-decay", type=float, help="AdamW weight decay. Default 0.")
@click.option("--max-grad-norm", type=float, help="Gradient clipping; 0: none. Default 1.")
@click.option(
    "--updates-per-step", type=int, help="Optimizer updates per batch (PPO epochs). Default 1."
)
@click.option("--seed", type=int, help="torch seed. Default 0.")
@click.option(
    "--max-staleness",
    type=int,
    metavar="K",
    help="Train v -> v+1 only on samples with v - b <= K. Default 1.",
)
@_flag("sync-barrier")
@click.option(
    "--stale-policy",
    type=click.Choice(["drop", "correct"]),
    help="drop: drop a group with a stale sample; correct: drop only stale samples. Default drop.",
)
@click.option(
    "--batching",
    type=click.Choice(["windows", "groups"]),
    help="windows: step t trains the groups released for step t; groups: the first G complete. "
    "Default windows.",
)
@click.option(
    "--groups-per-step",
    type=int,
    metavar="G",
    help="Groups per step for groups the dispatcher did not schedule. Default 4.",
)
@click.option("--micro-batch-tokens", type=int, help="Token budget of a micro-batch. Default 4096.")
@click.option(
    "--expire-s",
    type=float,
    help="Expire incomplete trajectories/groups idle this long. Default 300.",
)
@click.option("--publish-every", type=int, help="Publish weights every N steps. Default 1.")
@click.option(
    "--checkpoint-every", type=int, help="Checkpoint and commit offsets every N steps. Default 1."
)
@click.option("--keep-checkpoints", type=int, help="Complete checkpoints kept. Default 2.")
@click.option("--max-steps", type=int, help="Stop after N optimizer steps in all; 0: never.")
@click.option("--idle-exit-s", type=float, help="Exit after this long with no record; 0: never.")
@click.option("--device", help="auto, cpu, cuda, cuda:N. Default auto.")
@click.option(
    "--backend", type=click.Choice(["torch", "deepspeed"]), help="Training backend. Default torch."
)
@click.option(
    "--zero-stage",
    type=click.IntRange(0, 3),
    help="DeepSpeed ZeRO stage 0-2 (--backend deepspeed). Default 1.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON at the end.")
def train(as_json: bool, **kw: Any) -> None:
    """Train on the trajectories topic; publish weights; checkpoint; resume after a crash.

    The flags mirror the [train] table of the config file and SRL_* variables; see
    docs/trainer.md. --sync-barrier is the synchronous baseline (k = 0, publish every step).
    """
    from consumers.config import TrainConfig
    from consumers.trainer import run_trainer

    own = {
        k: v
        for k, v in kw.items()
        if k not in ("config", "bootstrap", "topic_prefix", "run", "store", "kafka_setting")
    }
    cfg = config_from(TrainConfig, kw, **own)
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
