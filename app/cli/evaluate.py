"""``srl eval``: a policy's greedy pass@1 and sampled pass@k on a prompt dataset
(``app.evalrun``; docs/rewards.md, "Evaluating a policy")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from app.cli.common import echo_json
from app.cli.options import ConfigCommand, with_config

if TYPE_CHECKING:
    from app.evalconfig import EvalConfig


@click.command("eval", cls=ConfigCommand)
@with_config("app.evalconfig:EvalConfig")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also write the JSON report to FILE.",
)
@click.option(
    "--per-prompt",
    is_flag=True,
    help="Add each prompt's completions, rewards and passes to the report.",
)
def evaluate(cfg: EvalConfig, as_json: bool, out: str | None, per_prompt: bool) -> None:
    """Greedy pass@1 and sampled pass@k of a policy on a prompt dataset with a reward.

    The policy is --model DIR, or --run NAME's newest weights in the store (verified against
    their manifest; with --model too, loaded into that model as a generator loads them); the
    engine is the generators' (hf, or vllm where installed); the reward the trainer's
    (--reward module:function, in reward processes with a timeout). A sample passes when its
    reward is at least --pass-threshold; pass@k is the unbiased estimator 1 - C(n-c,k)/C(n,k)
    over --samples n. Progress on stderr; --json or --out FILE for the report.
    """
    from app.evalrun import run_evaluation, summary, write_report

    rep = run_evaluation(cfg, per_prompt=per_prompt)
    write_report(rep, out)
    if as_json:
        echo_json(rep)
    else:
        click.echo(summary(rep))
