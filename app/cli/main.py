"""``srl``: the umbrella CLI (broker, topics, demo …).

Each command turns its options into a config and calls one function; heavy modules are
imported inside the command so that ``srl --help`` answers at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from app.cli.common import GROUP_SETTINGS, echo_json, run_main, setup_logging
from app.cli.options import ConfigGroup, with_config
from app.cli.topics import topics

if TYPE_CHECKING:
    from app.chaos.config import ChaosConfig
    from app.configs import StreamConfig, TopConfig
    from app.demoplan import DemoConfig
    from srl.config import StoreSettings


@click.group(
    cls=ConfigGroup,
    context_settings=GROUP_SETTINGS,
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="srl")
def cli(verbose: int) -> None:
    """srl: streaming RL post-training for LLMs.

    Generator workers and trainers are separate processes joined only by Kafka and an object
    store. Start here: `srl broker start`, then `srl demo`; see README.md.
    """
    setup_logging(verbose)


cli.add_command(topics)


# -- broker -------------------------------------------------------------------------------
@cli.group()
def broker() -> None:
    """Run a Kafka broker on 127.0.0.1: the embedded one (default, no Java) or Apache Kafka."""


def _data_dir_option(f: Any) -> Any:
    return click.option(
        "--data-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".srl/broker"),
        show_default=True,
        help="Where the broker keeps its data, logs and pid files.",
    )(f)


@broker.command("start")
@click.option(
    "--engine",
    type=click.Choice(["embedded", "kafka"]),
    default="embedded",
    show_default=True,
    help="embedded: noida-db from PyPI; kafka: Apache Kafka 4.x in KRaft mode (Java 17; the "
    "jars come from Maven Central once).",
)
@click.option(
    "--nodes",
    type=click.Choice(["1", "3"]),
    default="1",
    show_default=True,
    help="Apache Kafka nodes (each a broker and controller); 3: replication factor 3, "
    "min.insync.replicas 2.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=9092,
    show_default=True,
    envvar="SRL_BROKER_PORT",
    show_envvar=True,
    help="Port on 127.0.0.1 (Apache Kafka: node N on PORT+N-1, its controllers after them).",
)
@click.option(
    "--kafka-home",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Use this Apache Kafka install's libs/ instead of fetching the jars.",
)
@_data_dir_option
def broker_start(
    engine: str, nodes: str, port: int, kafka_home: Path | None, data_dir: Path
) -> None:
    """Start the broker in the background and wait until it answers."""
    from srl import broker as b

    st = b.start(
        port,
        data_dir,
        engine=engine,  # type: ignore[arg-type]
        nodes=int(nodes),
        kafka_home=kafka_home,
        log=lambda line: click.echo(line, err=True),
    )
    if st["engine"] == "embedded":
        click.echo(
            f"broker running: pid {st['pid']}, bootstrap {st['bootstrap']}, data {st['data_dir']}"
        )
        return
    pids = ", ".join(str(n["pid"]) for n in st["nodes"])
    click.echo(
        f"Apache Kafka running: {len(st['nodes'])} node(s), pid {pids}, bootstrap "
        f"{st['bootstrap']}, data {st['data_dir']}"
    )


@broker.command("stop")
@_data_dir_option
def broker_stop(data_dir: Path) -> None:
    """Stop the broker started from DATA_DIR, whichever engine (its data stays)."""
    from srl import broker as b

    click.echo("broker stopped" if b.stop(data_dir) else "no broker was running")


@broker.command("status")
@_data_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def broker_status(data_dir: Path, as_json: bool) -> None:
    """Say whether the broker runs, where, and whether it answers. Exit 1 if it does not run."""
    from srl import broker as b

    st = b.status(data_dir)
    if as_json:
        echo_json(st)
    elif st["running"] and st["engine"] == "embedded":
        click.echo(
            f"running: pid {st['pid']}, bootstrap {st['bootstrap']}, answering {st['answering']}"
        )
    elif st["running"]:
        for n in st["nodes"]:
            state = f"pid {n['pid']}, answering {n['answering']}" if n["running"] else "stopped"
            click.echo(f"Apache Kafka node {n['node_id']}: {n['bootstrap']}, {state}")
    else:
        click.echo(f"not running (data dir {st['data_dir']})")
    if not st["running"]:
        raise click.exceptions.Exit(1)


@broker.command("fetch")
@click.option(
    "--version",
    "version",
    default=None,
    metavar="X.Y.Z",
    help="Another Apache Kafka release than the pinned one (e.g. 3.9.2, for `-cp DIR/*`), "
    "cached beside it; the pinned one is what `start` runs.",
)
def broker_fetch(version: str | None) -> None:
    """Fetch Apache Kafka's jars from Maven Central now (once per machine and version; `start
    --engine kafka` does it on first use) and print where they are."""
    from srl.broker import apache

    apache.check_java()
    click.echo(apache.fetch(log=lambda line: click.echo(line, err=True), version=version))


@broker.command(
    "tool",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("name")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--kafka-home",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Use this Apache Kafka install's libs/ instead of the fetched jars.",
)
def broker_tool(name: str, args: tuple[str, ...], kafka_home: Path | None) -> None:
    """Run one of Apache Kafka's own admin tools from the same jars, e.g. `srl broker tool
    kafka-consumer-groups --bootstrap-server 127.0.0.1:9092 --describe --all-groups`
    (kafka-consumer-groups, kafka-topics, kafka-configs, kafka-console-consumer,
    kafka-console-producer, kafka-get-offsets, kafka-metadata-quorum, kafka-storage)."""
    import sys

    from srl.broker import apache

    out = apache.run_tool(name, args, kafka_home, timeout_s=3600)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    raise click.exceptions.Exit(out.returncode)


# -- store --------------------------------------------------------------------------------
@cli.group()
def store() -> None:
    """Prepare and inspect the object store (file://DIR or s3://bucket/prefix)."""


@store.command("init")
@with_config("srl.config:StoreSettings")
def store_init(cfg: StoreSettings) -> None:
    """Create the store (the S3 bucket, or the directory) if missing; say how writes stay
    create-only."""
    from srl.s3store import S3Store
    from srl.stores import store_from_config

    st = store_from_config(cfg)

    if isinstance(st, S3Store):
        created = st.ensure_bucket()
        click.echo(
            f"bucket {st.bucket} {'created' if created else 'exists'} at "
            f"{st.settings.endpoint_url or 'AWS'}; create-only writes: {st.create_only_mode()}"
        )
    else:
        click.echo(f"store {st.url} ready; create-only writes: hard links")


# -- top ----------------------------------------------------------------------------------
@cli.command()
@with_config("app.configs:TopConfig")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one snapshot as JSON and exit (implies --once; shape in docs/operations.md).",
)
@click.option(
    "--prometheus",
    type=click.IntRange(1, 65535),
    default=None,
    metavar="PORT",
    help="Serve /metrics on PORT (kafka_exporter names for lag, srl_* for the rest) instead of the "
    "view.",
)
@click.option(
    "--listen",
    default="127.0.0.1",
    show_default=True,
    help="Address the --prometheus endpoint binds to.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.2, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--window",
    type=click.FloatRange(1, 86_400),
    default=300.0,
    show_default=True,
    help="Seconds of metric events behind rates, staleness and drops.",
)
@click.option(
    "--stall-after",
    type=click.FloatRange(1, 86_400),
    default=60.0,
    show_default=True,
    help="Flag a partition with lag whose committed offset has not moved for this long.",
)
def top(
    cfg: TopConfig,
    once: bool,
    as_json: bool,
    prometheus: int | None,
    listen: str,
    interval: float,
    window: float,
    stall_after: float,
) -> None:
    """Live view of every srl topic and consumer group.

    Per partition the columns of kafka-consumer-groups.sh (GROUP TOPIC PARTITION CURRENT-OFFSET
    LOG-END-OFFSET LAG CONSUMER-ID HOST CLIENT-ID), backlog in records and tokens per length
    bucket, tokens/s and trajectories/s, the latest weights version and whether its manifest
    verifies, policy versions in flight, the staleness histogram, drops and dead letters, and
    stalled partitions. Reads only: joins no group, commits nothing.
    """
    from app.top import run_top

    run_top(
        cfg,
        once=once,
        as_json=as_json,
        prometheus=prometheus,
        listen=listen,
        interval_s=interval,
        window_s=window,
        stall_after_s=stall_after,
    )


# -- init-model ------------------------------------------------------------------------------
@cli.command("init-model")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Model directory. Default runs/models/strops-s{seed}.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the init and the SFT data."
)
@click.option(
    "--steps", type=click.IntRange(1, 1_000_000), help="SFT steps (changes the cache key)."
)
@click.option("--force", is_flag=True, help="Rebuild even when a matching cached model exists.")
def init_model(out: str | None, seed: int, steps: int | None, force: bool) -> None:
    """Build the demo's tiny model and warm-start it on the demo task (cached; no download).

    A small Qwen2-architecture causal LM with a locally built byte-level tokenizer, saved in
    Hugging Face format, fine-tuned on an imperfect demonstrator of the demo task
    (docs/demo-task.md). A second run with the same settings returns at once; with --out,
    the same model already built in the default folder is copied instead of built again.
    """
    import shutil

    import orjson

    from app.warmstart import MARKER, SftSettings, cache_key, cached, default_dir, ensure_model

    sft = SftSettings() if steps is None else SftSettings(steps=steps)
    key = cache_key(seed, sft)
    where = Path(out) if out else default_dir(seed)
    how = "cached" if not force and cached(where, key) else "built"
    if how == "built" and not force and cached(default_dir(seed), key):
        shutil.rmtree(where, ignore_errors=True)
        shutil.copytree(default_dir(seed), where)
        how = f"copied from {default_dir(seed)}"
    if how == "built":
        click.echo(
            f"{where}: building (SFT {sft.steps} steps, then an eval; about 3 min on 2 cores "
            "for the default 700 steps; cached afterwards)",
            err=True,
        )
    path = ensure_model(seed=seed, out=where, force=force, sft=sft)
    info = orjson.loads((path / MARKER).read_bytes())
    click.echo(
        f"{path}: {how} (SFT {info['sft']['steps']} steps in "
        f"{info['build_s']} s, greedy held-out accuracy {info['eval_greedy']['accuracy']:.3f})"
    )


# -- smoke and demo ------------------------------------------------------------------------
@cli.command()
@with_config("app.configs:StreamConfig")
@click.option(
    "--trajectories",
    type=click.IntRange(1, 100_000),
    default=200,
    show_default=True,
    help="Synthetic trajectories to stream through the broker.",
)
def smoke(cfg: StreamConfig, trajectories: int) -> None:
    """Data-plane smoke test: synthetic trajectories through the broker, codec and topics.

    Starts a broker on a free port unless bootstrap_servers is given (--bootstrap, the config
    file or SRL_BOOTSTRAP_SERVERS), streams synthetic trajectories chunk by chunk through the
    real codec and topics, consumes them in a group, reassembles them, and checks that none is
    lost or duplicated. Nothing is trained.
    """
    from app.smoke import run_smoke

    external = "bootstrap_servers" in cfg.model_fields_set
    run_smoke(cfg, trajectories, external=external)


@cli.command()
@with_config("app.demoplan:DemoConfig")
@click.option("--json", "as_json", is_flag=True, help="Print report.json at the end.")
def demo(cfg: DemoConfig, as_json: bool) -> None:
    """A real RL run on one machine: dispatcher, two generator pools and the trainer as
    separate processes joined only by Kafka and the object store.

    Warm-starts (or reuses) the tiny demo model, measures held-out accuracy, trains for
    --steps steps with live progress, stops every process it started, and writes
    OUT/report.json and OUT/report.png. With --bootstrap it uses that broker instead of the
    embedded one (its topics stay; a fresh topic prefix unless --topic-prefix is given).
    --serve learns from served traffic instead: srl serve, the trainer and a client that
    rates each answer, no dispatcher. See docs/demo.md and docs/serving.md.
    """
    if cfg.serve:
        from app.servedemo import run_serve_demo
        from app.servedemo import summary as serve_summary

        report = run_serve_demo(cfg)
        echo_json(report) if as_json else click.echo(serve_summary(report))
        return
    from app.demo import run_demo

    report = run_demo(cfg)
    if as_json:
        echo_json({k: v for k, v in report.items() if k != "series"})
    else:
        from app.demo import summary

        click.echo(summary(report))


@cli.command()
@with_config("app.chaos.config:ChaosConfig")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the rows as JSON (docs/reliability.md)."
)
@click.option(
    "--soak",
    type=click.FloatRange(60, 7 * 86_400),
    default=None,
    metavar="SECONDS",
    help="Instead: one run this long with a fault every --fault-every-s; RSS, checkpoint and "
    "broker sizes sampled, plotted and written to OUT/soak.{json,csv,png}.",
)
def chaos(cfg: ChaosConfig, as_json: bool, soak: float | None) -> None:
    """Fault injection: a real pipeline on a broker of its own, faults on a seeded schedule.

    Runs the demo's pipeline (sim engine generators in two pools, the real trainer on the tiny
    model, the dispatcher, the online ranker) once per fault, then once with several at once:
    SIGKILL, SIGSTOP and a network partition of generators, SIGKILL of the trainer mid-step and
    mid-checkpoint, of the dispatcher and of the ranker, a broker restart, weights corrupted or
    deleted after publishing, a full object store, poison records on every input topic; with
    --broker kafka --nodes 3 also the partition leader SIGKILLed, a node frozen, a rolling
    restart and the active controller SIGKILLed. Each
    run ends in an audit from the topics; one row per fault: seconds to recover, samples lost,
    trained twice, the highest staleness. Exit 1 when a row fails. See docs/reliability.md.
    """
    import signal

    from app.chaos.report import Progress, table

    signal.signal(signal.SIGTERM, _interrupted)  # stop every role and the broker, as Ctrl-C does
    progress = Progress()
    if soak is not None:
        from app.chaos.soak import run_soak

        res = run_soak(cfg, soak, progress)
    else:
        from app.chaos.run import Suite

        res = Suite(cfg, progress).run()
    if as_json:
        echo_json(res)
    else:
        click.echo(table(res))
    if not all(r["ok"] or "skipped" in r for r in res["faults"]):
        raise click.exceptions.Exit(1)


def _interrupted(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


# -- ranker (app/cli/ranker.py) ----------------------------------------------------------------
def _add_ranker() -> None:
    from app.cli.ranker import ranker

    cli.add_command(ranker)


def _add_bench() -> None:
    from app.bench.cli import bench

    cli.add_command(bench)


def _add_serve() -> None:
    from app.cli.serve import serve

    cli.add_command(serve)


def _add_eval() -> None:
    from app.cli.evaluate import evaluate

    cli.add_command(evaluate)


_add_ranker()
_add_bench()
_add_serve()
_add_eval()

main = run_main(cli, "srl")
