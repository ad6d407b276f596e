"""``srl ranker``: train, evaluate and simulate the output-length ranker.

Each command turns its options into a :class:`~ranker.config.RankerConfig` and calls one
function; numpy, torch and the Kafka client are imported inside the commands so
``srl ranker --help`` answers at once. Registered on the umbrella CLI by ``srl/cli.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from srl.cli_common import config_from, echo_json

DEFAULT_LENGTHS = Path("../shared/data/streamrl_output_length_hist.csv")


@click.group()
def ranker() -> None:
    """The output-length ranker: train it, evaluate it, simulate the dispatch it drives."""


def _ranker_options(f: Any) -> Any:
    options = [
        click.option("--model-dir", default=None, metavar="DIR",
                     help="Policy model directory (its tokenizer turns prompt tokens into text)."),
        click.option("--window", type=int, default=None, help="Most recent pairs a version trains on."),
        click.option("--retrain-every", type=int, default=None, help="New pairs between versions."),
        click.option("--min-pairs", type=int, default=None, help="Pairs needed before the first version."),
        click.option("--epochs", type=int, default=None, help="Training epochs per version."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _config(kw: dict[str, Any]) -> Any:
    from ranker.config import RankerConfig

    keys = ("model_dir", "window", "retrain_every", "min_pairs", "epochs")
    return config_from(RankerConfig, kw, **{k: kw.pop(k, None) for k in keys})


@ranker.command("simulate")
@click.option(
    "--lengths",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_LENGTHS,
    show_default=True,
    help="Output-length histogram file (lo,hi,probability rows).",
)
@click.option(
    "--scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply the histogram's lengths (0.25 and 0.5 give the 5K and 10K settings).",
)
@click.option(
    "--pairs",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="CSV of (true, predicted) pairs from `srl ranker eval --pairs-out`; both are "
    "quantile-mapped onto the histogram. Without it only oracle figures are made.",
)
@click.option(
    "--instances",
    type=click.IntRange(1, 4096),
    default=16,
    show_default=True,
    help="Generator instances N.",
)
@click.option(
    "--b-max",
    type=click.IntRange(1, 65536),
    default=32,
    show_default=True,
    help="Batch cap of an instance (KV memory).",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 10_000_000),
    default=2048,
    show_default=True,
    help="Samples per iteration.",
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of prompts treated as long-tail.",
)
@click.option(
    "--iterations",
    type=click.IntRange(1, 100_000),
    default=20,
    show_default=True,
    help="Iterations (batches) to average over.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed.")
@click.option(
    "--always-split",
    is_flag=True,
    help="Algorithm 2 exactly as StreamRL states it: always dedicate long-tail instances "
    "(never one shared pool).",
)
@click.option(
    "--migrate-factor",
    type=click.FloatRange(1.0, min_open=True),
    default=2.0,
    show_default=True,
    help="Also simulate migration of regular-pool samples past this multiple of their prediction.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def simulate(lengths: Path, scale: float, pairs: Path | None, instances: int, b_max: int,
             batch: int, alpha: float, iterations: int, seed: int, always_split: bool,
             migrate_factor: float, as_json: bool) -> None:  # fmt: skip
    """SIMULATED generation makespan: random dispatch + FIFO vs ranker dispatch + LPT vs oracle.

    Time comes from the PTL(BS) = 8.1 + 0.056·BS ms model (the sim engine's), not from a
    model running; see docs/benchmarks.md, "Skewness".
    """
    from ranker.evaluate import simulate_report

    report = simulate_report(lengths, scale, pairs, instances, b_max, batch, alpha, iterations,
                             seed, allow_shared=not always_split, migrate_factor=migrate_factor)  # fmt: skip
    if as_json:
        echo_json(report)
        return
    s, r = report["settings"], report["ratio_vs_random_fifo"]
    click.echo(
        f"SIMULATED: N={s['instances']} B_max={s['b_max']} batch={s['batch']} "
        f"({s['rounds']:.1f} rounds), alpha={s['alpha']}, {s['iterations']} iterations"
    )
    ms = report["makespan_s"]
    for key, label in (("random_fifo", "random + FIFO"), ("ranker_lpt", "ranker + LPT"),
                       ("ranker_lpt_migrate", "  + migration"), ("oracle_lpt", "oracle + LPT"),
                       ("lower_bound", "lower bound")):  # fmt: skip
        if key in r or key == "random_fifo":
            secs = f"{ms[key]['mean']:9.1f} s" if key in ms else " " * 11
            ratio = "1.000" if key == "random_fifo" else f"{r[key]['mean']:.3f}"
            click.echo(f"  {label:14s} {secs}  ratio {ratio}")
    if "ranker_quality" in report:
        q = report["ranker_quality"]
        click.echo(f"  ranker: recall@20 {q['recall_at_20']:.3f}, spearman {q['spearman']:.3f} "
                   f"on {q['n']} held-out pairs; plans {report['ranker_plans']}")  # fmt: skip
