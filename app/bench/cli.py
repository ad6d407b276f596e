"""``srl bench …``: the click commands; each builds a config and calls one benchmark.

Heavy modules (torch, the benchmarks themselves) are imported inside the commands so that
``srl --help`` stays fast. Registered on the ``srl`` group by ``app.cli.main``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from app.bench.modes import DESIGNS, MODES
from app.cli.common import LENGTHS_SHOWN, default_lengths, echo_json
from app.cli.options import ConfigGroup, with_config

if TYPE_CHECKING:
    from app.configs import ServeBenchConfig, StreamConfig


F = TypeVar("F", bound=Callable[..., Any])
ENGINES = ("embedded", "kafka")  # srl.broker.ENGINES, without importing it for --help


def broker_option() -> Callable[[F], F]:
    """``--broker``, repeatable: the fresh brokers a benchmark runs on (``app.bench.brokers``)."""
    return click.option(
        "--broker",
        "brokers",
        type=click.Choice(list(ENGINES)),
        multiple=True,
        default=ENGINES,
        show_default=True,
        help="Brokers to run on, each fresh, one after the other (repeat the option; "
        "--bootstrap instead uses that broker).",
    )


def on_brokers(*args: Any) -> dict[str, dict[str, Any]]:
    from app.bench.brokers import on_brokers as run

    return run(*args)


@click.group(cls=ConfigGroup)
def bench() -> None:
    """Benchmarks (docs/benchmarks.md): data plane, weights, pipeline modes, serving."""


@bench.command("dataplane")
@with_config("app.configs:StreamConfig")
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
    help="Raw and codec phases alternate this many times, the best of each counting; then "
    "this many latency phases, their medians counting.",
)
@click.option(
    "--paced-seconds",
    type=click.FloatRange(0.1, 3600),
    default=20.0,
    show_default=True,
    help="Measured length of the latency phase, after its warm-up.",
)
@click.option(
    "--warmup-seconds",
    type=click.FloatRange(0, 3600),
    default=5.0,
    show_default=True,
    help="Start of the latency phase left out of its latencies.",
)
@broker_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def dataplane(
    cfg: StreamConfig,
    trajectories: int,
    mean_tokens: int,
    chunk_tokens: int,
    batch: int,
    pace: float,
    repeats: int,
    paced_seconds: float,
    warmup_seconds: float,
    brokers: tuple[str, ...],
    as_json: bool,
) -> None:
    """Tokens/s through broker + codec + assembler, against the raw byte path; ready latency.

    Runs on a fresh broker of each --broker (both by default, one after the other), or on
    bootstrap_servers when given (--bootstrap, the config file or SRL_BOOTSTRAP_SERVERS).
    JSON: the figures keyed by broker.
    """
    from app.bench.dataplane import run

    def one(bootstrap: str) -> dict[str, Any]:
        c = cfg.model_copy(update={"bootstrap_servers": bootstrap})
        sizes = (trajectories, mean_tokens, chunk_tokens, batch, pace, repeats)
        return run(c, *sizes, paced_s=paced_seconds, warmup_s=warmup_seconds)

    res = on_brokers(brokers, _external(cfg), one, _starting)
    if as_json:
        echo_json(res)
        return
    for engine, r in res.items():
        click.echo(
            f"{engine:>8} codec+assembly: {r['tokens_per_s']:,} tokens/s, "
            f"{r['trajectories_per_s']} trajectories/s; raw bytes {r['raw_tokens_per_s']:,} "
            f"tokens/s (overhead {r['overhead']:.1%}); last chunk -> ready at "
            f"{r['paced_fraction']:.0%} of peak: p50 {r['ready_latency_ms_p50']} ms, p99 "
            f"{r['ready_latency_ms_p99']} ms, p99.9 {r['ready_latency_ms_p999']} ms "
            f"(medians of {len(r['phases']['paced'])}, {r['paced_measured_s']} s measured each)"
        )


def _external(cfg: Any) -> str | None:
    """The broker a config names (--bootstrap, the file, SRL_BOOTSTRAP_SERVERS), or None."""
    return cfg.bootstrap_servers if "bootstrap_servers" in cfg.model_fields_set else None


def _starting(engine: str) -> None:
    click.echo(f"[{engine}] starting a fresh broker …", err=True)


@bench.command("weights")
@click.option(
    "--sizes",
    default="10M,100M,500M",
    show_default=True,
    help="Comma-separated model sizes: 1M, 10M, 100M, 500M, 1.5B (3 GB in bf16).",
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
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Where the store and the copies are written (default: the system's temporary "
    "directory); /dev/shm takes the disk out of the figures.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def weights(sizes: str, repeats: int, swaps: int, work_dir: str | None, as_json: bool) -> None:
    """Publish + fetch + verify + load against a plain file copy; a generator's swap pause."""
    from app.bench import weights as w
    from srl.errors import ConfigError

    names = [s.strip() for s in sizes.split(",") if s.strip()]
    bad = [n for n in names if n not in w.SIZES]
    if bad or not names:
        raise ConfigError(
            f"--sizes: unknown {', '.join(bad) or 'empty'}; choose from {', '.join(w.SIZES)}"
        )
    r = w.run(names, repeats, swaps, work_dir)
    if as_json:
        echo_json(r)
        return
    for s in r["sizes"]:
        click.echo(
            f"{s['name']:>5} {s['params'] / 1e6:7.1f}M params {s['bytes'] / 1e6:8.1f} MB: "
            f"publish+fetch+verify+load {s['publish_load_s']:.3f}s, plain copy "
            f"{s['plain_copy_s']:.3f}s "
            f"(ratio {s['ratio']})"
        )
        t = s["trainer"]
        click.echo(
            f"      trainer: the step waits {t['step_wait_s']}s (snapshot), the upload "
            f"{t['upload_s']}s runs beside the next step; end to end {t['e2e_gb_per_s']} GB/s"
        )
    click.echo(
        f"swap pause (demo model shape): median {r['swap_pause_ms']} ms, max "
        f"{r['swap_pause_ms_max']} ms"
    )


@bench.command("trainer")
@click.option("--backends", default="torch,fsdp", show_default=True, help="torch, fsdp or both.")
@click.option("--ranks", default="1,2", show_default=True, help="CPU gloo rank counts to run.")
@click.option(
    "--steps", type=click.IntRange(1, 1000), default=4, show_default=True, help="Timed steps."
)
@click.option(
    "--rows", type=click.IntRange(2, 4096), default=16, show_default=True, help="Rows a step."
)
@click.option(
    "--budget", type=click.IntRange(16), default=4096, show_default=True, help="Micro-batch tokens."
)
@click.option(
    "--spec",
    type=click.Choice(["test", "default", "10M"]),
    default="10M",
    show_default=True,
    help="Model shape: the test fixture's, the demo's (0.9M) or 10M parameters.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def trainer(
    backends: str, ranks: str, steps: int, rows: int, budget: int, spec: str, as_json: bool
) -> None:
    """Trainer tokens/s on 1 and 2 CPU ranks, replicated vs sharded, peak memory vs the plan."""
    from app.bench import trainranks
    from srl.errors import ConfigError

    names = [b.strip() for b in backends.split(",") if b.strip()]
    if not names or any(b not in trainranks.BACKENDS for b in names):
        raise ConfigError(f"--backends {backends}: choose from torch, fsdp")
    try:
        counts = [int(r) for r in ranks.split(",") if r.strip()]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= n <= 8 for n in counts):
        raise ConfigError(f"--ranks {ranks}: comma-separated counts from 1 to 8")
    r = trainranks.run(names, counts, steps, rows, budget, spec)
    if as_json:
        echo_json(r)
        return
    for x in r["runs"]:
        peaks = ", ".join(f"{p:.0f}" for p in x["peak_rss_mib"])
        click.echo(
            f"{x['backend']:>5} x{x['ranks']}: {x['tokens_per_s']:8.1f} tokens/s, step "
            f"{x['step_s_median']:.3f}s; peak MiB per rank {peaks} (plan {x['plan_mib']:.0f})"
        )


@bench.command("intake")
@click.option("--trajectories", type=click.IntRange(8, 100_000), default=512, show_default=True)
@click.option("--tokens", type=click.IntRange(1, 1 << 20), default=1024, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(1, 1 << 16), default=32, show_default=True)
@click.option(
    "--reward-ms",
    type=click.FloatRange(0, 10_000),
    default=2.0,
    show_default=True,
    help="CPU a reward call burns.",
)
@click.option("--reward-workers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def intake_bench(
    trajectories: int,
    tokens: int,
    chunk_tokens: int,
    reward_ms: float,
    reward_workers: int,
    as_json: bool,
) -> None:
    """Rank 0's consume loop: records/s of the intake; its time per trajectory with the reward
    in the loop and in reward processes."""
    from app.bench import intake

    r = intake.run(trajectories, tokens, chunk_tokens, reward_ms, reward_workers)
    if as_json:
        echo_json(r)
        return
    i = r["intake"]
    click.echo(
        f"intake: {i['records_per_s']:,.0f} records/s, {i['tokens_per_s']:,.0f} tokens/s "
        f"({i['us_per_record']:.1f} us a record)"
    )
    for mode, m in r["rewards"].items():
        click.echo(
            f"{mode}: the loop {m['loop_ms_per_trajectory']:.3f} ms a trajectory, "
            f"{m['rewards_per_s']:,.0f} rewards/s"
        )


@bench.command("pipeline")
@click.option(
    "--lengths",
    type=click.Path(dir_okay=False),
    default=default_lengths,
    show_default=LENGTHS_SHOWN,
    help="Output-length histogram (lo,hi,probability rows).",
)
@click.option(
    "--scale",
    type=click.FloatRange(min=0, min_open=True),
    default=0.25,
    show_default=True,
    help="Factor on the histogram's lengths (0.25: StreamRL's 5K setting).",
)
@click.option(
    "--devices",
    "--instances",
    "devices",
    type=click.IntRange(2, 64),
    default=6,
    show_default=True,
    help="Generator instances + trainer devices, split per mode by the time model.",
)
@click.option(
    "--b-max",
    type=click.IntRange(1, 1024),
    default=16,
    show_default=True,
    help="Decode batch cap of an instance (KV memory).",
)
@click.option(
    "--groups",
    type=click.IntRange(1, 1024),
    default=12,
    show_default=True,
    help="Groups (prompts) per optimizer step.",
)
@click.option("--group-size", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option(
    "--iterations",
    type=click.IntRange(2, 100),
    default=12,
    show_default=True,
    help="Optimizer steps per mode; the first is warm-up (12: ~2 min; with 6 a mode's ratios vary "
    "~20 % run to run).",
)
@click.option(
    "--compression",
    type=click.FloatRange(1, 10_000),
    default=20.0,
    show_default=True,
    help="Simulated seconds per wall-clock second.",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(1, 100),
    default=1,
    show_default=True,
    help="k of the async modes (1: StreamRL-Async).",
)
@click.option(
    "--modes",
    default=",".join(MODES),
    show_default=True,
    help="Comma-separated modes to run (ratios need colocated / sync in the same run).",
)
@click.option(
    "--design",
    type=click.Choice(sorted(DESIGNS)),
    default="paced",
    show_default=True,
    help="How the async modes keep samples within k (docs/benchmarks.md).",
)
@click.option(
    "--model-bytes",
    type=click.FloatRange(min=0),
    default=15.2e9,
    show_default=True,
    help="Bytes of a weights version whose publish, fetch, verify and load the run is charged "
    "(the workload's 7B in bf16; 0: none).",
)
@click.option(
    "--sync-rates",
    default="measure",
    show_default=True,
    help="Rates of the charged weight sync: 'measure' (srl bench weights at 100M on this "
    "machine, once) or publish=G,fetch=G,verify=G,load=G in GB/s.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default="bench-pipeline.png",
    show_default=True,
    help="PNG written unless --json.",
)
@click.option("--bootstrap", help="Use this Kafka instead of a fresh broker per --broker.")
@broker_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def pipeline(
    modes: str,
    plot: str,
    bootstrap: str | None,
    brokers: tuple[str, ...],
    as_json: bool,
    **kw: Any,
) -> None:
    """colocated / sync / stream / async / async+skew side by side (SIMULATED engine and trainer).

    The broker, codec, dispatcher, generator workers, trainer loop, staleness gate and weights
    protocol are real; decode steps and trainer compute sleep their modelled time
    (WORKLOAD.md), divided by --compression. Every mode runs on each --broker (both by
    default, one after the other); JSON: the figures keyed by broker.
    """
    from app.bench import pipeline as p
    from srl.errors import ConfigError
    from srl.workload import LengthHistogram

    # a bad file is a one-line error before anything starts
    LengthHistogram.from_file(kw["lengths"], kw["scale"])
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or any(m not in MODES for m in chosen):
        raise ConfigError(f"--modes {modes!r}: choose from {', '.join(MODES)}")
    sync = _sync_setting(kw.pop("model_bytes"), kw.pop("sync_rates"))
    w = p.Workload(groups_per_step=kw.pop("groups"), **kw, **sync["workload"])

    def progress(mode: str, split: dict[str, Any]) -> None:
        click.echo(
            f"{mode}: {split['instances']} generator instance(s) + {split['trainer_devices']} "
            f"trainer device(s) (modelled iteration {split['model_iteration_s']} s) …",
            err=True,
        )

    res = on_brokers(brokers, bootstrap, lambda b: p.run(w, b, progress, chosen), _starting)
    for r in res.values():
        r["weights_sync"] = sync["json"]
    if as_json:
        echo_json(res)
        return
    p.plot(res, plot)
    click.echo(f"SIMULATED engine and trainer, time compressed {w.compression:g}x; plot: {plot}")
    for engine, r in res.items():
        for mode, m in r["modes"].items():
            click.echo(f"{engine:>8} " + _pipeline_line(mode, m))
            chain = m["timeline"]["step_chain"]
            parts = ", ".join(
                f"{n} {chain[n]['p50_sim_s']:.1f}"
                for n in chain
                if isinstance(chain[n], dict) and "p50_sim_s" in chain[n]
            )
            click.echo(f"{'':>8} {'':>10}  hand-off, median simulated s: {parts}")


def _sync_setting(model_bytes: float, spec: str) -> dict[str, Any]:
    """``--model-bytes`` and ``--sync-rates`` as the Workload's fields and the JSON's entry
    (rates measured here, once, unless given or nothing is charged)."""
    from app.bench import synccost

    rates = synccost.parse_rates(spec)
    if model_bytes <= 0:
        rates = synccost.SyncRates(source="none: --model-bytes 0")
    elif rates is None:
        click.echo("measuring the weight sync's rates (srl bench weights, 100M) …", err=True)
        rates = synccost.measure_rates()
    seconds = rates.seconds(model_bytes)
    fields = {f"sync_{p}_s": v for p, v in seconds.items()} | {"model_bytes": model_bytes}
    return {"workload": fields, "json": synccost.settings(model_bytes, rates)}


def _pipeline_line(mode: str, m: dict[str, Any]) -> str:
    """One mode's figures on one line."""
    return (
        f"{mode:>10}: {m['trained_tokens_per_s']:,.0f} trained tokens/s  "
        f"x{m['tokens_ratio_vs_colocated']} colocated  x{m['tokens_ratio_vs_sync']} sync  "
        f"{m['dropped_token_fraction']:.1%} of tokens dropped  mean trained "
        f"{m['mean_trained_tokens']:.0f} "
        f"(generated {m['mean_generated_tokens']:.0f})  {m['fraction_of_bound']:.0%} of bound  "
        f"gen idle {m['gen_idle']:.0%}  staleness max {m['staleness_max']}"
    )


# -- serve (app/bench/serve.py) ------------------------------------------------------------------
@bench.command("serve")
@with_config("app.configs:ServeBenchConfig")
@click.option(
    "--max-tokens",
    type=click.IntRange(1, 100_000),
    default=64,
    show_default=True,
    help="Tokens per completion.",
)
@click.option(
    "--requests",
    type=click.IntRange(1, 1_000_000),
    default=200,
    show_default=True,
    help="Requests per phase (the same prompts in every phase).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 100_000),
    help="Saturation: requests in flight. Default 2 x max_batch.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 20),
    default=3,
    show_default=True,
    help="Rounds of each mode and phase, alternating; the medians count.",
)
@click.option(
    "--control",
    is_flag=True,
    help="A/A test: both servers publish off; the overheads are the measurement's noise.",
)
@broker_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def serve_bench(
    cfg: ServeBenchConfig,
    max_tokens: int,
    requests: int,
    concurrency: int | None,
    repeats: int,
    control: bool,
    brokers: tuple[str, ...],
    as_json: bool,
) -> None:
    """srl serve with publishing to Kafka off against on: requests/s, TTFT, ITL.

    The same engine and prompts in both modes, at saturation and at half the publish-off
    saturated rate; overhead_rps and overhead_itl_p50 are the fractional losses with
    publishing on. Runs on a fresh broker of each --broker (both by default), or on
    bootstrap_servers when given; JSON: the figures keyed by broker.
    """
    from app.bench.serve import Plan, core_split, pinned, run, text_report

    plan = Plan(max_tokens, requests, concurrency, repeats, control=control)

    split = core_split()  # the servers on the upper half of the CPUs, the rest on the lower

    def one(bootstrap: str) -> dict[str, Any]:
        c = cfg.model_copy(update={"bootstrap_servers": bootstrap})
        return run(c, plan, split[0] if split else None)

    with pinned(split[1] if split else None):
        res = on_brokers(brokers, _external(cfg), one, _starting)
    if as_json:
        echo_json(res)
    else:
        click.echo("\n".join(text_report(r, engine) for engine, r in res.items()))


@bench.command("idle")
@click.option(
    "--partitions",
    type=click.IntRange(1, 64),
    default=6,
    show_default=True,
    help="Partitions of the member's topic.",
)
@click.option(
    "--records",
    type=click.IntRange(1, 1_000_000),
    default=300,
    show_default=True,
    help="Records sent, in bursts.",
)
@click.option(
    "--bursts",
    type=click.IntRange(1, 10_000),
    default=12,
    show_default=True,
    help="Bursts, evenly spread over --seconds.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(1, 3600),
    default=12.0,
    show_default=True,
    help="How long each mode runs.",
)
@broker_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def idle(
    partitions: int,
    records: int,
    bursts: int,
    seconds: float,
    brokers: tuple[str, ...],
    as_json: bool,
) -> None:
    """A group member waiting for records: quiet (srl.kafka.quiet) against fetching.

    Broker and client CPU, records read and their delay, both modes side by side on a fresh
    broker of each engine (the embedded broker answers a fetch at the end of a partition at
    once; Apache Kafka holds it for fetch.wait.max.ms).
    """
    from app.bench.idle import run

    r = run(partitions, records, bursts, seconds, brokers)  # type: ignore[arg-type]
    if as_json:
        echo_json(r)
        return
    for engine in brokers:
        for row in r[engine]["rows"]:
            click.echo(
                f"{engine:>8} {row['mode']:>8}: broker {row['broker_cores']:.3f} cores, client "
                f"{row['client_cores']:.3f} cores; {row['records_read']} records read "
                f"(each once, in order: {row['each_once_in_order']}); delay p50 "
                f"{row['delay_ms_p50']} ms, p99 {row['delay_ms_p99']} ms"
            )
        click.echo(
            f"{engine:>8} quiet / fetching CPU: broker {r[engine]['broker_cpu_ratio']}, "
            f"client {r[engine]['client_cpu_ratio']}"
        )
