"""``srl-consumer``: the consumer side's entry point (trainer)."""

from __future__ import annotations

import click

from srl.cli_common import run_main, setup_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """srl consumers: train on trajectories streamed from Kafka and publish weights."""
    setup_logging(verbose)


main = run_main(cli, "srl-consumer")
