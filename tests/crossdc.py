"""Run srl across three emulated datacenters (``tests/netns.py``) and report what arrived.

The broker datacenter runs the broker, bound to its datacenter address: an Apache Kafka node
(KRaft, ``srl.broker.apache`` with the namespace's address; ``broker="kafka"``, what a company
runs across datacenters) or the embedded ``noida-db`` (``broker="embedded"``), and the S3 server
(moto); generators and the trainer run in
their own datacenters with their config files from ``deploy/datacenters/``, pointed at those
servers by ``SRL_*`` variables. Every byte between roles crosses the delayed, rate-capped links.

``run_dataplane``: the data-plane roles of ``tests/crossdc_roles.py`` (synthetic chunks one
way, weights the other way through S3). ``run_pipeline``: the real roles (``srl-producer
dispatch`` / ``generate``, ``srl-consumer train``) and an audit of every sample asked for.

Used by ``tests/e2e/test_datacenters.py``; as a benchmark:
``python -m tests.crossdc --delay-ms 50 --rate-mbit 50`` (root, see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import orjson

from srl.broker import broker_binary
from srl.broker.apache import KafkaCluster
from tests.netns import ROOT, Topology
from tests.s3server import TEST_CREDENTIALS

CONFIGS = ROOT / "deploy" / "datacenters"
KAFKA_PORT, S3_PORT = 9092, 9000


def start_broker(t: Topology, workdir: Path, broker: str) -> None:
    """The broker in the broker datacenter, on its address: an Apache Kafka node, or the
    embedded broker."""
    host = t.ip("broker")
    if broker == "kafka":
        cluster = KafkaCluster(workdir / "kafka", port=KAFKA_PORT, host=host)
        cluster.prepare(cluster.nodes)  # outside the namespace: formatting needs no network
        t.start("broker", cluster.command(cluster.nodes[0]), log=workdir / "broker.log")
        return
    embedded = [str(broker_binary()), "start", "--only", "kafka", "--host", host]
    embedded += ["--kafka-port", str(KAFKA_PORT), "--data-dir", str(workdir / "broker")]
    t.start("broker", embedded, log=workdir / "broker.log")


def start_services(t: Topology, workdir: Path, broker: str = "kafka") -> dict[str, str]:
    """Broker and S3 server in the broker datacenter; the environment that points roles at them."""
    host = t.ip("broker")
    start_broker(t, workdir, broker)
    t.start(
        "broker",
        [str(Path(sys.executable).parent / "moto_server"), "-H", host, "-p", str(S3_PORT)],
        log=workdir / "s3.log",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SRL_")}
    env.update(
        {
            **TEST_CREDENTIALS,
            "PYTHONUNBUFFERED": "1",
            "SRL_BOOTSTRAP_SERVERS": f"{host}:{KAFKA_PORT}",
            "SRL_TOPIC_PREFIX": "dc",
            "SRL_RUN": "crossdc",
            "SRL_STORE": "s3://srl-crossdc/store",
            "SRL_S3_ENDPOINT_URL": f"http://{host}:{S3_PORT}",
        }
    )
    srl = str(Path(sys.executable).parent / "srl")
    deadline = time.monotonic() + 180  # a JVM's start on a loaded machine
    for argv in ([srl, "topics", "create"], [srl, "store", "init"]):  # from the generators' side
        while True:
            out = t.run("gen", argv, env=env)
            if out.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(argv[1:])} failed: {out.stderr.strip()}")
            time.sleep(1)
    return env


def run_dataplane(
    delay_ms: float, rate_mbit: float, trajectories: int, broker: str = "kafka"
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="srl-crossdc-") as tmp,
        Topology(delay_ms, rate_mbit) as t,
    ):
        work = Path(tmp)
        env = start_services(t, work, broker)
        py = [sys.executable, "-m", "tests.crossdc_roles"]
        t0 = time.monotonic()
        ready = work / "assigned"
        trainer = t.start(
            "train",
            [*py, "consume", str(trajectories), "--config", str(CONFIGS / "trainer.toml")]
            + ["--ready", str(ready)],
            env=env,
            log=work / "train.log",
        )
        deadline = time.monotonic() + 180
        while not ready.exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        gen = t.start(
            "gen",
            [*py, "produce", str(trajectories), "--config", str(CONFIGS / "generators.toml")],
            env=env,
            log=work / "gen.log",
        )
        codes = {"train": trainer.wait(600), "gen": gen.wait(600)}
        wall = time.monotonic() - t0
        logs = {k: (work / f"{k}.log").read_text() for k in ("train", "gen")}
        if any(codes.values()):
            raise RuntimeError(f"roles failed {codes}: {logs}")
        res = {k: orjson.loads(v.strip().splitlines()[-1]) for k, v in logs.items()}
    return {
        "broker": broker,
        "delay_ms": delay_ms,
        "rate_mbit": rate_mbit,
        "wall_s": wall,
        "trainer": res["train"],
        "generator": res["gen"],
        "tokens_per_s": res["train"]["tokens"] / res["train"]["stream_s"],
        # the burst, from the generator's first record to the trainer holding every trajectory
        "burst_tokens_per_s": res["train"]["tokens"]
        / (res["train"]["done_at"] - res["gen"]["begun_at"]),
    }


def run_trainer(
    delay_ms: float, rate_mbit: float, groups: int, broker: str = "kafka"
) -> dict[str, Any]:
    """The real trainer (``srl-consumer train``, tiny model) in its datacenter, fed completed
    demo-shaped trajectories from the generators' datacenter (``feed``), publishing and
    checkpointing every step to the store across the link; then the audit."""
    from srl.tinymodel import build_tiny_model

    bins = Path(sys.executable).parent
    gen_cfg, train_cfg = str(CONFIGS / "generators.toml"), str(CONFIGS / "trainer.toml")
    with (
        tempfile.TemporaryDirectory(prefix="srl-crossdc-") as tmp,
        Topology(delay_ms, rate_mbit) as t,
    ):
        work = Path(tmp)
        model = build_tiny_model(work / "model", seed=0)
        env = {**start_services(t, work, broker), "SRL_MODEL": str(model)}
        t0 = time.monotonic()
        trainer = t.start(
            "train",
            [
                str(bins / "srl-consumer"),
                "train",
                "--config",
                train_cfg,
                "--groups-per-step",
                "2",
                "--device",
                "cpu",
                "--max-steps",  # every group fed trained: done, without the idle wait
                str(groups // 2),
                "--idle-exit-s",
                "10",
                "--max-staleness",
                "1",
                "--reward",
                "consumers.rewards:first_line_match",
            ],
            env=env,
            log=work / "train.log",
        )
        feeder = t.start(
            "gen",
            [sys.executable, "-m", "tests.crossdc_roles", "feed", str(groups), "--config", gen_cfg],
            env=env,
            log=work / "gen.log",
        )
        codes = {"train": trainer.wait(1200), "gen": feeder.wait(1200)}
        wall = time.monotonic() - t0
        logs = {k: (work / f"{k}.log").read_text() for k in codes}
        if any(codes.values()):
            raise RuntimeError(f"roles failed {codes}: { {k: v[-3000:] for k, v in logs.items()} }")
        return {
            "delay_ms": delay_ms,
            "rate_mbit": rate_mbit,
            "wall_s": wall,
            "feed": orjson.loads(logs["gen"].strip().splitlines()[-1]),
            "audit": _audit(t, gen_cfg, env),
        }


def run_pipeline(
    delay_ms: float,
    rate_mbit: float,
    prompts: int,
    group_size: int = 4,
    max_new_tokens: int = 24,
    broker: str = "kafka",
) -> dict[str, Any]:
    """The real roles: dispatcher and a generator worker (hf engine, tiny model) in the
    generators' datacenter, the trainer in its own; then an audit of every sample asked for."""
    from srl.tinymodel import build_tiny_model

    bins = Path(sys.executable).parent
    gen_cfg, train_cfg = str(CONFIGS / "generators.toml"), str(CONFIGS / "trainer.toml")
    with (
        tempfile.TemporaryDirectory(prefix="srl-crossdc-") as tmp,
        Topology(delay_ms, rate_mbit) as t,
    ):
        work = Path(tmp)
        model = build_tiny_model(work / "model", seed=0)  # each datacenter has the base model
        env = {**start_services(t, work, broker), "SRL_MODEL": str(model)}
        t0 = time.monotonic()
        trainer = t.start(
            "train",
            [
                str(bins / "srl-consumer"),
                "train",
                "--config",
                train_cfg,
                "--groups-per-step",
                "2",
                "--device",
                "cpu",
                "--idle-exit-s",
                "30",
            ],
            env=env,
            log=work / "train.log",
        )
        gen = t.start(
            "gen",
            [
                str(bins / "srl-producer"),
                "generate",
                "--config",
                gen_cfg,
                "--engine",
                "hf",
                "--max-batch",
                "8",
                "--chunk-tokens",
                "8",
                "--idle-exit",
                "30",
            ],
            env=env,
            log=work / "gen.log",
        )
        dispatch = t.run(
            "gen",
            [
                str(bins / "srl-producer"),
                "dispatch",
                "--config",
                gen_cfg,
                "--task",
                "demo",
                "--num-prompts",
                str(prompts),
                "--group-size",
                str(group_size),
                "--max-new-tokens",
                str(max_new_tokens),
            ],
            env=env,
            timeout=600,
        )
        if dispatch.returncode != 0:
            raise RuntimeError(f"dispatch failed: {dispatch.stderr.strip()}")
        # every prompt released; once every sample asked for is decided (trained or dropped
        # as stale, made durable), the run is over: SIGTERM both roles rather than waiting
        # out their idle exits (the trainer's, if it comes first, ends the wait too)
        deadline = time.monotonic() + 1200
        while trainer.poll() is None and time.monotonic() < deadline:
            seen = _audit(t, gen_cfg, env)
            if seen["asked"] > 0 and seen["missing"] == 0:
                break
            time.sleep(2)
        codes = {"train": t.stop(trainer, grace_s=120), "gen": t.stop(gen, grace_s=60)}
        wall = time.monotonic() - t0
        if any(codes.values()):
            logs = {k: (work / f"{k}.log").read_text()[-3000:] for k in codes}
            raise RuntimeError(f"roles failed {codes}: {logs}")
        return {
            "delay_ms": delay_ms,
            "rate_mbit": rate_mbit,
            "wall_s": wall,
            "audit": _audit(t, gen_cfg, env),
        }


def _audit(t: Topology, gen_cfg: str, env: dict[str, str]) -> dict[str, Any]:
    """``tests.crossdc_roles audit`` in the broker's datacenter: what was asked, decided."""
    out = t.run(
        "broker",
        [sys.executable, "-m", "tests.crossdc_roles", "audit", "--config", gen_cfg],
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"audit failed: {out.stderr.strip()}")
    return dict(orjson.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=50)
    ap.add_argument("--rate-mbit", type=float, default=50)
    ap.add_argument("--trajectories", type=int, default=400, help="data plane: trajectories")
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="the real dispatcher, generator and trainer (needs srl-producer dispatch/generate)",
    )
    ap.add_argument(
        "--trainer", type=int, metavar="GROUPS", help="the real trainer on GROUPS fed groups"
    )
    ap.add_argument("--prompts", type=int, default=16, help="pipeline: prompts dispatched")
    ap.add_argument("--broker", choices=["kafka", "embedded"], default="kafka")
    args = ap.parse_args()
    if args.pipeline:
        res = run_pipeline(args.delay_ms, args.rate_mbit, args.prompts, broker=args.broker)
    elif args.trainer:
        res = run_trainer(args.delay_ms, args.rate_mbit, args.trainer, args.broker)
    else:
        res = run_dataplane(args.delay_ms, args.rate_mbit, args.trajectories, args.broker)
    print(orjson.dumps(res).decode())


if __name__ == "__main__":
    main()


class WatchLog:
    """The JSON lines ``tests.genwatch`` writes to its log, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for raw in self.path.read_text().splitlines():
            if raw.startswith("{"):
                out.append(orjson.loads(raw))
        return out

    def until(self, what: Any, timeout_s: float) -> dict[str, Any]:
        """The first line (of those written from now on) for which ``what`` holds."""
        seen = len(self.lines())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.lines()
            for line in lines[seen:]:
                if what(line):
                    return line
            seen = len(lines)
            time.sleep(0.5)
        last = self.lines()[-1:]
        raise RuntimeError(f"watcher: condition not met in {timeout_s:g}s; last {last}")


def run_partition(cut_s: float = 30.0, prompts: int = 4, length: int = 2400) -> dict[str, Any]:
    """Two ``srl-producer generate --engine sim`` workers of one pool in the generators'
    datacenter (default settings: 10 s sessions), cut off from the broker for ``cut_s`` while
    every trajectory is in flight; when (seconds after the heal) every unfinished trajectory
    had moved on again (``resumed_s``) and all were complete, and the audit of every sample
    (``tests.genwatch``)."""
    bins = Path(sys.executable).parent
    with (
        tempfile.TemporaryDirectory(prefix="srl-partition-") as tmp,
        Topology(5.0, 100.0) as t,
    ):
        work = Path(tmp)
        env = start_services(t, work, "embedded")
        ids = [  # half on each prompt partition (librdkafka hashes keys with CRC32)
            *[p for p in (f"q{i}" for i in range(50)) if zlib.crc32(p.encode()) % 2 == 0][
                : prompts // 2
            ],
            *[p for p in (f"q{i}" for i in range(50)) if zlib.crc32(p.encode()) % 2 == 1][
                : prompts // 2
            ],
        ]
        (work / "ids").write_text("\n".join(ids))
        (work / "p.jsonl").write_text(
            "".join(
                orjson.dumps(
                    {"prompt_id": p, "prompt": p, "metadata": {"sim_length": length}}
                ).decode()
                + "\n"
                for p in ids
            )
        )
        watch = WatchLog(work / "watch.log")
        argv = [sys.executable, "-m", "tests.genwatch", "--expect", str(prompts * 2)]
        argv += ["--group-size", "2", "--ids", str(work / "ids"), "--timeout", "600"]
        t.start("train", argv, env=env, log=watch.path)
        gens = {
            w: t.start(
                "gen",
                [str(bins / "srl-producer"), "-v", "generate", "--engine", "sim"]
                + ["--worker-id", w, "--max-batch", "4", "--chunk-tokens", "32"]
                + ["--buckets", "le4096"],
                env=env,
                log=work / f"{w}.log",
            )
            for w in ("wa", "wb")
        }
        watch.until(lambda line: line["owners"] == {"wa": 2, "wb": 2}, 180)
        out = t.run(
            "gen",
            [str(bins / "srl-producer"), "dispatch", "--unpaced", "--partitioning", "key"]
            + ["--prompts", str(work / "p.jsonl"), "--group-size", "2"]
            + ["--max-new-tokens", str(length + 500)],
            env=env,
        )
        if out.returncode != 0:
            raise RuntimeError(f"dispatch failed: {out.stderr.strip()}")
        watch.until(lambda line: line["started"] == prompts * 2, 120)
        t.cut("gen")
        time.sleep(cut_s)
        t.heal("gen")
        healed_ms = time.time() * 1000
        back = watch.until(  # every incomplete trajectory has moved on since the heal
            lambda line: line.get("final") or (line["stalest_ms"] or healed_ms + 1) > healed_ms,
            300,
        )
        final = watch.until(lambda line: line.get("final"), 600)
        alive = {w: p.poll() is None for w, p in gens.items()}
        codes = {w: t.stop(p, grace_s=60) for w, p in gens.items()}
        logs = {w: (work / f"{w}.log").read_text()[-3000:] for w in gens}
        complete = next(x for x in watch.lines() if x.get("complete") == prompts * 2)
        return {
            "cut_s": cut_s,
            "resumed_s": back["at"] - healed_ms / 1000,
            "complete_s": complete["at"] - healed_ms / 1000,
            "audit": final,
            "alive": alive,
            "codes": codes,
            "logs": logs,
        }
