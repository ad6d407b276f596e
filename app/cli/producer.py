"""``srl-producer``: the producer side's entry point (dispatcher, generator workers, benchmark).

Each command turns its options into a config and calls one function; heavy modules (torch,
transformers, confluent_kafka) are imported inside the commands, so ``--help`` is instant.
SIGTERM and Ctrl-C stop a command gracefully (the second Ctrl-C aborts).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

import click

from app.cli.common import GROUP_SETTINGS, echo_json, run_main, setup_logging
from app.cli.options import ConfigGroup, with_config

if TYPE_CHECKING:
    from app.configs import EngineBenchConfig
    from producers.config import DispatchConfig, GenerateConfig


@click.group(
    cls=ConfigGroup,
    context_settings=GROUP_SETTINGS,
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """srl producers: dispatch prompt tasks and generate trajectories into Kafka."""
    setup_logging(verbose)


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM/SIGINT; a second SIGINT interrupts at once."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


@cli.command()
@with_config("producers.config:DispatchConfig")
@click.option(
    "--unpaced",
    is_flag=True,
    help="Do not pace by trainer steps: windows of --window prompts under --max-pending "
    "(max_staleness null).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def dispatch(cfg: DispatchConfig, unpaced: bool, as_json: bool) -> None:
    """Publish prompt tasks to the length-bucket prompt topics, longest-predicted first.

    Each prompt becomes one task of --group-size samples on {prefix}.prompts.{bucket}, the
    bucket chosen by the length predictor. The prompts of trainer step t (--groups-per-step
    of them) are released once the trainer has announced step t-1-K, and that step trains
    exactly them (K = --max-staleness; 0 is the synchronous barrier). --unpaced publishes
    windows while at most --max-pending tasks stay unconsumed.
    """
    from app.sources import load_source
    from producers.dispatcher import run_dispatcher
    from producers.sources import make_predictor
    from srl.kafka import start_over

    if unpaced:
        cfg = cfg.model_copy(update={"max_staleness": None})
    prompts = load_source(cfg)
    if cfg.task == "sim":
        click.echo(
            f"sim workload: {len(prompts)} prompts with SIMULATED lengths from {cfg.lengths} "
            f"(x{cfg.length_scale:g})",
            err=True,
        )
    predictor, stop = make_predictor(cfg, prompts), _stop_on_signals()
    # a broker that lost tasks it acknowledged: read back what is published, publish the rest
    summary = start_over(lambda: run_dispatcher(cfg, prompts, predictor, stop), "dispatcher")
    if as_json:
        echo_json(summary.to_dict())
    else:
        buckets = ", ".join(f"{b}: {n}" for b, n in summary.by_bucket.items())
        skipped = f"; {summary.skipped} published before (skipped)" if summary.skipped else ""
        click.echo(
            f"dispatched {summary.tasks} tasks ({cfg.group_size} samples each) from "
            f"{summary.prompts} prompts; {buckets}{skipped}"
        )


@cli.command()
@with_config("producers.config:GenerateConfig")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def generate(cfg: GenerateConfig, as_json: bool) -> None:
    """Run a generator worker: consume prompt tasks, stream token chunks to the trajectories topic.

    Chunks of --chunk-tokens tokens (and the last one) go out as they are generated, keyed by
    trajectory id. A task's offset is committed once all its samples' chunks are acknowledged.
    New weights announced on {prefix}.weights are verified and loaded between decode steps.
    """
    import logging

    from producers.worker import run_generator

    stop = _stop_on_signals()
    if cfg.engine == "sim":
        click.echo(
            "engine sim: token ids, log-probs and timing are SIMULATED (PTL model); chunks are "
            "labelled simulated",
            err=True,
        )
    logging.getLogger("srl").info(
        "generator %s: engine %s, pool %s", cfg.worker_name, cfg.engine, cfg.pool
    )
    s = run_generator(cfg, stop)
    if as_json:
        echo_json(s.to_dict())
    else:
        label = " (SIMULATED engine)" if s.simulated else ""
        click.echo(
            f"generator {s.worker_id}{label}: {s.tasks} tasks, {s.trajectories} trajectories, "
            f"{s.tokens} tokens "
            f"in {s.chunks} chunks; resumed {s.resumed}, handed off {s.handed_off}, migrated "
            f"{s.migrated}, dead letters "
            f"{s.dead_letters}, weights loaded {s.weights_loaded} refused {s.weights_refused}, "
            f"policy v{s.policy_version}"
        )


@cli.command()
@with_config("app.configs:EngineBenchConfig")
@click.option(
    "--requests", "requests_n", type=int, default=32, show_default=True, help="Sequences per run."
)
@click.option(
    "--max-new-tokens", type=int, default=64, show_default=True, help="Tokens per sequence."
)
@click.option(
    "--repeats", type=int, default=2, show_default=True, help="Runs per case (best counts)."
)
@click.option(
    "--swaps",
    type=click.IntRange(0, 10_000),
    default=20,
    show_default=True,
    help="Weight swaps while a batch decodes, for the swap pause (0: none).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench(
    cfg: EngineBenchConfig,
    requests_n: int,
    max_new_tokens: int,
    repeats: int,
    swaps: int,
    as_json: bool,
) -> None:
    """Engine tokens/s at batch 1 and at --max-batch, the cost of publishing chunks, and the
    pause of a weight swap.

    Without --model the hf and vllm engines run a fresh tiny model. --engines hf,vllm measures
    several engines side by side in one run (the vllm engine needs vLLM installed:
    docs/generator.md, "vLLM"). Starts the embedded broker for the publishing case unless
    bootstrap_servers is given (--bootstrap, the config file or SRL_BOOTSTRAP_SERVERS).
    """
    import tempfile
    from pathlib import Path

    from app.bench.engine import run_engines

    with contextlib.ExitStack() as stack:
        if cfg.model is None and {"hf", "vllm"} & {*cfg.engines, cfg.engine}:
            from srl.tinymodel import build_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="srl-bench-"))
            cfg = cfg.model_copy(update={"model": str(build_tiny_model(Path(tmp) / "tiny"))})
        if "bootstrap_servers" not in cfg.model_fields_set:
            from srl.broker import EmbeddedBroker

            broker = stack.enter_context(EmbeddedBroker())
            cfg = cfg.model_copy(update={"bootstrap_servers": broker.bootstrap})
        out = run_engines(cfg, requests_n, max_new_tokens, repeats, swaps)
    if as_json:
        echo_json(out)
        return
    for name, result in out.get("engines", {cfg.engine: out}).items():
        click.echo(_bench_lines(name, result))


def _bench_lines(name: str, out: dict[str, Any]) -> str:
    lines = [f"engine {name} (started in {out['engine_start_s']} s):"]
    for case, r in out["cases"].items():
        lines.append(
            f"{case:>16}: {r['tokens_per_s']:>9,.1f} tokens/s ({r['tokens']} tokens in "
            f"{r['seconds']} s), {r['tokens_per_cpu_s']:,.1f} tokens/CPU-s"
        )
    lines.append(
        f"batching speed-up x{out['batch_speedup']}; chunk publishing overhead "
        f"{out['publish_overhead']:.1%} (wall), {out['publish_overhead_cpu']:.1%} (CPU)"
    )
    if "swap_pause_ms" in out:
        lines.append(
            f"weight swap pause: median {out['swap_pause_ms']} ms, p90 "
            f"{out['swap_pause_ms_p90']} ms over {out['swaps']} swaps at batch "
            f"{out['swap_batch']}"
        )
    return "\n".join(lines)


main = run_main(cli, "srl-producer")
