"""``srl bench …``: the click commands; each builds a config and calls one benchmark.

Heavy modules (torch, the benchmarks themselves) are imported inside the commands so that
``srl --help`` stays fast. Registered on the ``srl`` group by ``srl.cli``.
"""

from __future__ import annotations

import os
from typing import Any

import click

from srl.cli_common import common_options, config_from, echo_json


def _external(kw: dict[str, Any]) -> bool:
    return kw.get("bootstrap") is not None or "SRL_BOOTSTRAP_SERVERS" in os.environ


@click.group()
def bench() -> None:
    """Benchmarks (docs/benchmarks.md): data plane, weights, pipeline modes."""


@bench.command("dataplane")
@common_options
@click.option(
    "--trajectories",
    type=click.IntRange(1, 1_000_000),
    default=2000,
    show_default=True,
    help="Trajectories per phase.",
)
@click.option(
    "--mean-tokens",
    type=click.IntRange(1, 100_000),
    default=600,
    show_default=True,
    help="Mean completion length (log-normal).",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(1, 65_536),
    default=32,
    show_default=True,
    help="Tokens per chunk (the generator's chunk_tokens).",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=64,
    show_default=True,
    help="Trajectories in flight at once (their chunks interleave).",
)
@click.option(
    "--pace",
    type=click.FloatRange(0.01, 1.0),
    default=0.5,
    show_default=True,
    help="Latency phase rate, as a fraction of the measured peak.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 20),
    default=1,
    show_default=True,
    help="Raw and codec phases alternate this many times; the best of each counts.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")  # fmt: skip
def dataplane(trajectories: int, mean_tokens: int, chunk_tokens: int, batch: int, pace: float,
              repeats: int, as_json: bool, **kw: Any) -> None:  # fmt: skip
    """Tokens/s through broker + codec + assembler, against the raw byte path; ready latency.

    Starts an embedded broker on a free port unless --bootstrap is given.
    """
    from srl.bench.dataplane import run
    from srl.config import CommonConfig

    cfg = config_from(CommonConfig, kw)
    r = run(cfg, _external(kw), trajectories, mean_tokens, chunk_tokens, batch, pace, repeats)
    if as_json:
        echo_json(r)
        return
    click.echo(
        f"codec+assembly: {r['tokens_per_s']:,} tokens/s, {r['trajectories_per_s']} trajectories/s\n"
        f"raw bytes:      {r['raw_tokens_per_s']:,} tokens/s (overhead {r['overhead']:.1%})\n"
        f"last chunk -> ready at {r['paced_fraction']:.0%} of peak: p50 "
        f"{r['ready_latency_ms_p50']} ms, p99 {r['ready_latency_ms_p99']} ms"
    )


@bench.command("weights")
@click.option(
    "--sizes",
    default="10M,100M,500M",
    show_default=True,
    help="Comma-separated model sizes: 1M, 10M, 100M, 500M.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 20),
    default=2,
    show_default=True,
    help="Publications per size; the fastest counts.",
)
@click.option(
    "--swaps",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="Weight swaps between decode steps for swap_pause_ms (median).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")  # fmt: skip
def weights(sizes: str, repeats: int, swaps: int, as_json: bool) -> None:
    """Publish + fetch + verify + load against a plain file copy; a generator's swap pause."""
    from srl.bench import weights as w
    from srl.errors import ConfigError

    names = [s.strip() for s in sizes.split(",") if s.strip()]
    bad = [n for n in names if n not in w.SIZES]
    if bad or not names:
        raise ConfigError(
            f"--sizes: unknown {', '.join(bad) or 'empty'}; choose from {', '.join(w.SIZES)}"
        )
    r = w.run(names, repeats, swaps)
    if as_json:
        echo_json(r)
        return
    for s in r["sizes"]:
        click.echo(
            f"{s['name']:>5} {s['params'] / 1e6:7.1f}M params {s['bytes'] / 1e6:8.1f} MB: "
            f"publish+fetch+verify+load {s['publish_load_s']:.3f}s, plain copy {s['plain_copy_s']:.3f}s "
            f"(ratio {s['ratio']})"
        )
    click.echo(
        f"swap pause (demo model shape): median {r['swap_pause_ms']} ms, max {r['swap_pause_ms_max']} ms"
    )
