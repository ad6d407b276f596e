"""``srl-producer``: the producer side's entry point (dispatcher, generator workers, benchmark).

Each command turns its options into a config and calls one function; heavy modules (torch,
transformers, confluent_kafka) are imported inside the commands, so ``--help`` is instant.
SIGTERM and Ctrl-C stop a command gracefully (the second Ctrl-C aborts).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import click

from app.cli.common import common_options, config_from, echo_json, run_main, setup_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


@contextlib.contextmanager
def _kafka_errors() -> Iterator[None]:
    """A Kafka client error (e.g. a bad -X setting) as one line, not a traceback."""
    from srl.errors import SrlError
    from srl.kafka import KafkaException

    try:
        yield
    except KafkaException as e:
        err = e.args[0] if e.args else e
        raise SrlError(f"kafka: {err.str() if hasattr(err, 'str') else err}") from None


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


@cli.command()
@common_options
@click.option(
    "--prompts",
    type=click.Path(dir_okay=False),
    help="JSONL file: {prompt_id, prompt, metadata} per line.",
)
@click.option(
    "--task",
    type=click.Choice(["demo", "sim"]),
    help="Built-in source: demo (synthetic task) or sim (simulated workload).",
)
@click.option("--num-prompts", type=int, help="Prompts the built-in task generates. Default 64.")
@click.option(
    "--split", type=click.Choice(["train", "eval"]), help="Split of the demo task. Default train."
)
@click.option(
    "--lengths",
    type=click.Path(dir_okay=False),
    help="sim task: length histogram file (lo,hi,probability).",
)
@click.option(
    "--scale", "length_scale", type=float, help="sim task: factor on histogram lengths. Default 1."
)
@click.option("--seed", type=int, help="Seed of the built-in task. Default 0.")
@click.option("--group-size", type=int, help="Samples per prompt (n). Default 4.")
@click.option("--max-new-tokens", type=int, help="Max generated tokens per sample. Default 256.")
@click.option("--temperature", type=float, help="Sampling temperature (0 = greedy). Default 1.")
@click.option("--top-p", type=float, help="Nucleus sampling mass. Default 1.")
@click.option(
    "--predictor",
    type=click.Choice(["baseline", "oracle", "ranker"]),
    help="Length predictor. Default baseline.",
)
@click.option(
    "--max-staleness",
    type=int,
    metavar="K",
    help="Release trainer step t's prompts once step t-1-K is announced (0: synchronous). Default "
    "1.",
)
@click.option(
    "--unpaced",
    is_flag=True,
    help="Do not pace by trainer steps: windows of --window prompts under --max-pending.",
)
@click.option("--groups-per-step", type=int, help="Prompts per trainer step. Default 8.")
@click.option(
    "--tasks-per-group",
    type=int,
    help="Split each group into this many tasks (sample runs) that may go to different workers. "
    "Default 1.",
)
@click.option(
    "--partitioning",
    type=click.Choice(["balanced", "key"]),
    help="Prompt partition: least predicted work so far (balanced) or key hash. Default balanced.",
)
@click.option("--window", type=int, help="Unpaced: prompts ordered together. Default 64.")
@click.option(
    "--max-pending",
    type=int,
    help="Unpaced: most unconsumed tasks on the prompt topics. Default 256.",
)
@click.option(
    "--pools",
    help=(
        "Comma-separated generator pools whose progress counts for --max-pending. Default regular."
    ),
)
@click.option("--epochs", type=int, help="Passes over the prompts. Default 1.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def dispatch(as_json: bool, pools: str | None, unpaced: bool, **kw: Any) -> None:
    """Publish prompt tasks to the length-bucket prompt topics, longest-predicted first.

    Each prompt becomes one task of --group-size samples on {prefix}.prompts.{bucket}, the
    bucket chosen by the length predictor. The prompts of trainer step t (--groups-per-step
    of them) are released once the trainer has announced step t-1-K, and that step trains
    exactly them (K = --max-staleness; 0 is the synchronous barrier). --unpaced publishes
    windows while at most --max-pending tasks stay unconsumed.
    """
    from app.sources import load_source
    from producers.config import DispatchConfig
    from producers.dispatcher import run_dispatcher
    from producers.sources import make_predictor

    own = {
        k: kw.pop(k)
        for k in list(kw)
        if k not in ("config", "bootstrap", "topic_prefix", "run", "store", "kafka_setting")
    }
    cfg = config_from(DispatchConfig, kw, **own, pools=_csv(pools))
    if unpaced:
        cfg = cfg.model_copy(update={"max_staleness": None})
    prompts = load_source(cfg)
    if cfg.task == "sim":
        click.echo(
            f"sim workload: {len(prompts)} prompts with SIMULATED lengths from {cfg.lengths} "
            f"(x{cfg.length_scale:g})",
            err=True,
        )
    with _kafka_errors():
        summary = run_dispatcher(cfg, prompts, make_predictor(cfg, prompts), _stop_on_signals())
    if as_json:
        echo_json(summary.to_dict())
    else:
        buckets = ", ".join(f"{b}: {n}" for b, n in summary.by_bucket.items())
        click.echo(
            f"dispatched {summary.tasks} tasks ({cfg.group_size} samples each) from "
            f"{summary.prompts} prompts; {buckets}"
        )


@cli.command()
@common_options
@click.option(
    "--pool", help="Generator pool (consumer group {prefix}.gen.{pool}). Default regular."
)
@click.option(
    "--buckets", help="Comma-separated length buckets to consume, e.g. le256,le1024. Default: all."
)
@click.option("--group-id", help="Consumer group override.")
@click.option(
    "--take-over-from",
    metavar="GROUP",
    help="Start where GROUP committed (where ours has nothing): replace a wedged pool's group.",
)
@click.option("--worker-id", help="Worker id on chunks and metrics. Default host-pid-pool.")
@click.option(
    "--engine", type=click.Choice(["hf", "sim", "vllm"]), help="Generation backend. Default hf."
)
@click.option(
    "--model",
    type=click.Path(file_okay=False),
    help="Hugging Face model directory (policy version 0).",
)
@click.option("--device", help="torch device for hf (cpu, cuda …). Default cpu.")
@click.option("--dtype", help="Weights dtype (float32, bfloat16 …).")
@click.option("--threads", type=int, help="torch CPU threads.")
@click.option("--max-batch", type=int, help="Most sequences decoded together. Default 8.")
@click.option("--chunk-tokens", type=int, help="Tokens per published chunk. Default 32.")
@click.option(
    "--max-staleness",
    type=int,
    help="k: never start with weights older than latest - k. Default 1.",
)
@click.option(
    "--max-backlog-chunks", type=int, help="Pause while the trainer lags by more chunks than this."
)
@click.option(
    "--migrate-to",
    metavar="BUCKET",
    help="Hand stragglers (past --migrate-factor x their predicted length) to this long-tail "
    "bucket.",
)
@click.option(
    "--migrate-factor", type=float, help="Straggler: generated > factor x predicted. Default 2."
)
@click.option(
    "--migrate-min-tokens", type=int, help="Straggler: at least this many tokens. Default 64."
)
@click.option("--seed", type=int, help="Sampling seed.")
@click.option(
    "--lengths",
    type=click.Path(dir_okay=False),
    help="sim: length histogram file for tasks without sim_length.",
)
@click.option("--scale", "length_scale", type=float, help="sim: factor on histogram lengths.")
@click.option(
    "--time-scale", type=float, help="sim: factor on the modelled step time PTL(BS). Default 1."
)
@click.option("--sim-vocab", type=int, help="sim: token ids drawn from [4, N). Default 32000.")
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    type=float,
    help="On SIGTERM: seconds to finish running sequences. Default 30.",
)
@click.option(
    "--idle-exit",
    "idle_exit_s",
    type=float,
    help="Exit after this many seconds with nothing to do.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def generate(as_json: bool, buckets: str | None, **kw: Any) -> None:
    """Run a generator worker: consume prompt tasks, stream token chunks to the trajectories topic.

    Chunks of --chunk-tokens tokens (and the last one) go out as they are generated, keyed by
    trajectory id. A task's offset is committed once all its samples' chunks are acknowledged.
    New weights announced on {prefix}.weights are verified and loaded between decode steps.
    """
    import logging

    from producers.config import GenerateConfig
    from producers.worker import run_generator

    own = {
        k: kw.pop(k)
        for k in list(kw)
        if k not in ("config", "bootstrap", "topic_prefix", "run", "store", "kafka_setting")
    }
    cfg = config_from(GenerateConfig, kw, **own, buckets=_csv(buckets))
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
    with _kafka_errors():
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
@common_options
@click.option(
    "--engine", type=click.Choice(["hf", "sim", "vllm"]), help="Generation backend. Default hf."
)
@click.option(
    "--model",
    type=click.Path(file_okay=False),
    help="HF model directory. Default: a fresh tiny model.",
)
@click.option("--device", help="torch device (cpu, cuda …). Default cpu.")
@click.option("--threads", type=int, help="torch CPU threads.")
@click.option("--max-batch", type=int, default=16, show_default=True, help="The large batch.")
@click.option("--chunk-tokens", type=int, help="Tokens per published chunk. Default 32.")
@click.option(
    "--requests", "requests_n", type=int, default=32, show_default=True, help="Sequences per run."
)
@click.option(
    "--max-new-tokens", type=int, default=64, show_default=True, help="Tokens per sequence."
)
@click.option(
    "--repeats", type=int, default=2, show_default=True, help="Runs per case (best counts)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench(as_json: bool, requests_n: int, max_new_tokens: int, repeats: int, **kw: Any) -> None:
    """Engine tokens/s at batch 1 and at --max-batch, and the cost of publishing chunks.

    Starts the embedded broker for the publishing case unless --bootstrap is given.
    """
    import tempfile
    from pathlib import Path

    from app.bench.engine import run_bench
    from producers.config import GenerateConfig

    own = {
        k: kw.pop(k)
        for k in list(kw)
        if k not in ("config", "bootstrap", "topic_prefix", "run", "store", "kafka_setting")
    }
    with contextlib.ExitStack() as stack:
        if own.get("model") is None and own.get("engine") in (None, "hf"):
            from srl.tinymodel import build_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="srl-bench-"))
            own["model"] = str(build_tiny_model(Path(tmp) / "tiny"))
        if kw.get("bootstrap") is None:
            from srl.broker import EmbeddedBroker

            kw["bootstrap"] = stack.enter_context(EmbeddedBroker()).bootstrap
        cfg = config_from(GenerateConfig, kw, **own)
        with _kafka_errors():
            out = run_bench(cfg, requests_n, max_new_tokens, repeats)
    if as_json:
        echo_json(out)
        return
    for name, r in out["cases"].items():
        click.echo(
            f"{name:>16}: {r['tokens_per_s']:>9,.1f} tokens/s ({r['tokens']} tokens in "
            f"{r['seconds']} s), "
            f"{r['tokens_per_cpu_s']:,.1f} tokens/CPU-s"
        )
    click.echo(
        f"batching speed-up x{out['batch_speedup']}; chunk publishing overhead "
        f"{out['publish_overhead']:.1%} "
        f"(wall), {out['publish_overhead_cpu']:.1%} (CPU)"
    )


main = run_main(cli, "srl-producer")
