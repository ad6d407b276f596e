"""``srl ranker``: train, evaluate and simulate the output-length ranker.

``train`` reads a :class:`~ranker.config.RankerConfig`, ``eval`` and ``plan`` only where the
run's versions are (:class:`~ranker.config.RankerStoreConfig`); each calls one function.
numpy, torch and the Kafka client are imported inside the commands, so ``srl ranker --help``
answers at once. Registered on the umbrella CLI by ``app/cli/main.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from app.cli.common import LENGTHS_SHOWN, default_lengths, echo_json
from app.cli.options import ConfigGroup, with_config

if TYPE_CHECKING:
    from ranker.config import RankerConfig, RankerStoreConfig


@click.group(cls=ConfigGroup)
def ranker() -> None:
    """The output-length ranker: train it, evaluate it, simulate the dispatch it drives."""


@ranker.command("train")
@with_config("ranker.config:RankerConfig")
@click.option(
    "--demo",
    "demo_n",
    type=click.IntRange(10, 1_000_000),
    default=None,
    help="Fit one version on N training prompts of the demo task (their true lengths) and publish "
    "it.",
)
@click.option(
    "--online",
    is_flag=True,
    help="Follow the trajectories topic and publish a version every --retrain-every pairs.",
)
@click.option(
    "--max-versions",
    type=click.IntRange(1),
    default=None,
    help="With --online: stop after publishing this many versions.",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=None,
    help="With --online: stop after this many seconds without a new pair.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for demo prompts and init."
)
def train(
    cfg: RankerConfig,
    demo_n: int | None,
    online: bool,
    max_versions: int | None,
    idle_timeout: float | None,
    seed: int,
) -> None:
    """Train the ranker and publish versions to the object store (ranker/{run}/v…/).

    With --demo N it bootstraps from the demo task; with --online it learns from the (prompt,
    actual length) pairs the generators put on the trajectories topic, warm-starting each
    version from the last, so it follows the policy as output lengths drift.
    """
    from srl.errors import ConfigError

    if (demo_n is None) == (not online):
        raise ConfigError("srl ranker train: give exactly one of --demo N or --online")
    if demo_n is not None:
        from app.task import demo_pairs
        from ranker.evaluate import train_on_pairs

        texts, lengths = demo_pairs(demo_n, "train", seed)
        source = f"demo task, {demo_n} train prompts, seed {seed}"
        r = train_on_pairs(cfg, texts, lengths, seed, source)
        click.echo(f"ranker v{r.version} published for run {cfg.run} ({demo_n} demo prompts)")
        return
    from ranker.online import run_online

    def report(r: Any, values: dict[str, float]) -> None:
        live = values.get("live_recall_at_20")
        extra = f", dispatch-time recall_at_20 {live:.3f}" if live is not None else ""
        click.echo(f"ranker v{r.version} published ({int(values['pairs'])} pairs{extra})")

    n = run_online(cfg, max_versions, idle_timeout, on_version=report)
    click.echo(f"published {n} version(s)")


@ranker.command("eval")
@with_config("ranker.config:RankerStoreConfig")
@click.option(
    "--version",
    "version",
    type=click.IntRange(1),
    default=None,
    help="Ranker version to evaluate. Default: the latest published.",
)
@click.option(
    "--demo",
    "demo_n",
    type=click.IntRange(10, 1_000_000),
    default=2000,
    show_default=True,
    help="Held-out demo-task prompts to evaluate on (never trained on).",
)
@click.option(
    "--seed", type=int, default=1, show_default=True, help="Seed of the held-out prompts."
)
@click.option(
    "--pairs-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the (true, predicted) pairs as CSV (input of `srl ranker simulate`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def eval_(
    cfg: RankerStoreConfig,
    version: int | None,
    demo_n: int,
    seed: int,
    pairs_out: Path | None,
    as_json: bool,
) -> None:
    """Recall of the truly longest 20/10/5 % and Spearman's rho on held-out prompts."""
    from app.task import demo_pairs
    from ranker.evaluate import evaluate_on_pairs, write_pairs

    texts, lengths = demo_pairs(demo_n, "eval", seed)
    report, true, pred = evaluate_on_pairs(cfg, version, texts, lengths, seed)
    if pairs_out is not None:
        write_pairs(pairs_out, true, pred)
    if as_json:
        echo_json(report)
        return
    click.echo(
        f"ranker v{report['version']} on {report['n']} held-out prompts: recall@20 "
        f"{report['recall_at_20']:.3f}, recall@10 {report['recall_at_10']:.3f}, recall@5 "
        f"{report['recall_at_5']:.3f}, spearman {report['spearman']:.3f}"
    )


@ranker.command("plan")
@with_config("ranker.config:RankerStoreConfig")
@click.option(
    "--instances", type=click.IntRange(1, 4096), required=True, help="Generator instances N."
)
@click.option(
    "--b-max", type=click.IntRange(1, 65536), required=True, help="Batch cap of an instance."
)
@click.option(
    "--batch",
    type=click.IntRange(1, 10_000_000),
    required=True,
    help="Samples per iteration (prompts x group size).",
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of prompts treated as long-tail.",
)
@click.option("--always-split", is_flag=True, help="Never keep one shared pool.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def plan(
    cfg: RankerStoreConfig,
    instances: int,
    b_max: int,
    batch: int,
    alpha: float,
    always_split: bool,
    as_json: bool,
) -> None:
    """Algorithm 2's pool split for the next launch: long-tail and regular instances and batch
    caps, from the recent actual lengths published with the latest ranker version."""
    import math

    from ranker.publish import load_version
    from ranker.schedule import history_lengths, plan_pools
    from srl.errors import ConfigError
    from srl.stores import store_from_config
    from srl.workload import PtlModel

    ranker = load_version(store_from_config(cfg), cfg.run)
    quantiles = ranker.info.get("length_quantiles")
    if not quantiles:
        raise ConfigError(f"ranker v{ranker.version} carries no length history; train a newer one")
    lengths = history_lengths(quantiles, alpha)
    n_lt = math.ceil(alpha * batch - 1e-9)
    p = plan_pools(n_lt, batch - n_lt, instances, lengths, PtlModel(), b_max, not always_split)
    out = {
        "ranker_version": ranker.version,
        "alpha": alpha,
        "batch": batch,
        **p.to_dict(),
        "class_lengths": vars(lengths),
        "ptl_ms": "8.1 + 0.056*BS",
    }
    if as_json:
        echo_json(out)
        return
    if p.longtail_instances == 0:
        click.echo(
            f"one shared pool: {p.regular_instances} instances, --max-batch {p.regular_batch} "
            f"(modelled {p.regular_model_s:.1f} s; long-tail prompts simply go first)"
        )
    else:
        click.echo(
            f"long-tail pool: {p.longtail_instances} instances, --max-batch {p.longtail_batch} "
            f"(modelled {p.longtail_model_s:.1f} s)"
        )
        click.echo(
            f"regular pool:   {p.regular_instances} instances, --max-batch {p.regular_batch} "
            f"(modelled {p.regular_model_s:.1f} s)"
        )


@ranker.command("simulate")
@click.option(
    "--lengths",
    type=click.Path(dir_okay=False, path_type=Path),
    default=default_lengths,
    show_default=LENGTHS_SHOWN,
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
def simulate(
    lengths: Path,
    scale: float,
    pairs: Path | None,
    instances: int,
    b_max: int,
    batch: int,
    alpha: float,
    iterations: int,
    seed: int,
    always_split: bool,
    migrate_factor: float,
    as_json: bool,
) -> None:
    """SIMULATED generation makespan: random dispatch + FIFO vs ranker dispatch + LPT vs oracle.

    Time comes from the PTL(BS) = 8.1 + 0.056·BS ms model (the sim engine's), not from a
    model running; see docs/benchmarks.md, "Skewness".
    """
    from ranker.evaluate import simulate_report

    report = simulate_report(
        lengths,
        scale,
        pairs,
        instances,
        b_max,
        batch,
        alpha,
        iterations,
        seed,
        allow_shared=not always_split,
        migrate_factor=migrate_factor,
    )
    if as_json:
        echo_json(report)
        return
    s, r = report["settings"], report["ratio_vs_random_fifo"]
    click.echo(
        f"SIMULATED: N={s['instances']} B_max={s['b_max']} batch={s['batch']} "
        f"({s['rounds']:.1f} rounds), alpha={s['alpha']}, {s['iterations']} iterations"
    )
    ms = report["makespan_s"]
    for key, label in (
        ("random_fifo", "random + FIFO"),
        ("ranker_lpt", "ranker + LPT"),
        ("ranker_lpt_migrate", "  + migration"),
        ("oracle_lpt", "oracle + LPT"),
        ("lower_bound", "lower bound"),
    ):
        if key in r or key == "random_fifo":
            secs = f"{ms[key]['mean']:9.1f} s" if key in ms else " " * 11
            ratio = "1.000" if key == "random_fifo" else f"{r[key]['mean']:.3f}"
            click.echo(f"  {label:14s} {secs}  ratio {ratio}")
    if "ranker_quality" in report:
        q = report["ranker_quality"]
        click.echo(
            f"  ranker: recall@20 {q['recall_at_20']:.3f}, spearman {q['spearman']:.3f} "
            f"on {q['n']} held-out pairs; plans {report['ranker_plans']}"
        )
