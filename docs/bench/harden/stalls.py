"""What a generator's decode thread waits for, across an emulated long link (issue 18).

The broker runs in its own network namespace behind the delay line of ``tests/netns.py``
(``--delay-ms`` one way); this script re-runs itself in the generators' namespace and times,
with the real embedded broker and the real clients:

* **lag**: one measurement of the trainer's backlog (``GroupLag.lag``), which the worker's
  loop called on the decode thread before issue 18 (``TrainerBacklog.check(lag)``), against
  the loop's reads today (``TrainerBacklog.check()`` + ``exceeded()``, the measurement in its
  own thread), over the same seconds;
* **migration**: the decode-thread time of one straggler's hand-off by the old
  ``Outlet._migrate`` (``--old-outlet FILE``: ``git show 0342704:producers/outlet.py``; two
  producer flushes) and by today's ``Outlet.migrate`` (delivery reports), each over real
  producers and a stand-in engine.

Root only (namespaces): ``python docs/bench/harden/stalls.py --delay-ms 50 --old-outlet F``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from producers.backlog import GroupLag, TrainerBacklog  # noqa: E402
from producers.config import GenerateConfig  # noqa: E402
from producers.engines.base import Emitted  # noqa: E402
from producers.outlet import Outlet  # noqa: E402
from producers.tasks import SamplePlan, TaskState  # noqa: E402
from schemas.records import PromptTask, pack_tokens  # noqa: E402
from srl.config import load_config  # noqa: E402
from srl.kafka import Producer, create_topics, position_group  # noqa: E402
from srl.metrics import Metrics  # noqa: E402
from srl.topics import Layout  # noqa: E402


def lag_stalls(cfg: GenerateConfig, seconds: float) -> dict[str, Any]:
    layout = Layout.from_config(cfg)
    groups = [cfg.trainer_group, position_group(cfg.trainer_group)]
    lag = GroupLag(cfg, groups, [layout.trajectories])
    calls = []
    for _ in range(10):
        t0 = time.perf_counter()
        lag.lag()
        calls.append(time.perf_counter() - t0)
    backlog = TrainerBacklog(1000, 20.0).start(GroupLag(cfg, groups, [layout.trajectories]))
    reads = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        backlog.check()
        backlog.exceeded()
        reads.append(time.perf_counter() - t0)
        time.sleep(0.001)  # a decode step
    backlog.stop()
    lag.close()
    return {
        "before_ms_per_measurement": round(statistics.median(calls) * 1000, 1),
        "before_ms_max": round(max(calls) * 1000, 1),
        "after_loop_reads": len(reads),
        "after_measurements_meanwhile": backlog.measurements,
        "after_ms_max_read": round(max(reads) * 1000, 3),
    }


class Engine:
    version, name = 0, "stand-in"

    def add(self, request: Any) -> None:
        pass

    def abort(self, key: str) -> None:
        pass


class Counts:
    worker_id, tokens, trajectories, chunks, handed_off, migrated = "w", 0, 0, 0, 0, 0


def one_migration(
    outlet_cls: type, cfg: GenerateConfig, producer: Producer, i: int
) -> tuple[float, float]:
    """Decode-thread seconds spent in ``migrate()`` (and ``poll(0)``) until one straggler has
    moved, in all and in the longest single call."""
    layout, counts = Layout.from_config(cfg), Counts()
    outlet = outlet_cls(cfg, layout, Engine(), counts, lambda st: None)
    outlet.open(producer, Metrics(producer, layout, cfg.run, "w"))
    task = PromptTask(
        task_id=f"t{i}",
        prompt_id=f"p{i}",
        prompt="",
        prompt_tokens=pack_tokens([1, 2]),
        group_size=1,
        max_new_tokens=500,
        bucket=layout.buckets[0],
        predicted_length=4,
        created_ms=0,
    )
    tid = f"{os.getpid()}-{i}"
    st = TaskState(task, ("p", 0), 0, [1, 2], None, [], {tid})
    outlet.start(st, SamplePlan(tid, 0))
    for _ in range(70):
        outlet.publish([Emitted(tid, [7], [-0.5])])
    producer.flush()  # the prefix is out before we time the hand-off
    spent, longest = 0.0, 0.0
    while counts.migrated == 0:
        t0 = time.perf_counter()
        outlet.migrate()
        producer.poll(0)
        dt = time.perf_counter() - t0
        spent, longest = spent + dt, max(longest, dt)
        time.sleep(0.001)  # a decode step
    return spent, longest


def migration_stalls(cfg: GenerateConfig, old_outlet: Path, n: int) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("old_outlet", old_outlet)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cfg = cfg.model_copy(
        update={"migrate_to": Layout.from_config(cfg).buckets[-1], "migrate_min_tokens": 8}
    )
    out: dict[str, Any] = {}
    with Producer(cfg, "bench") as producer:
        for name, cls in (("before", old.Outlet), ("after", Outlet)):
            times = [one_migration(cls, cfg, producer, i) for i in range(n)]
            out[f"{name}_ms_per_migration"] = round(statistics.median(t for t, _ in times) * 1e3, 2)
            out[f"{name}_ms_longest_call"] = round(statistics.median(c for _, c in times) * 1e3, 2)
    return out


def inner(args: argparse.Namespace) -> None:
    cfg = load_config(GenerateConfig, cli={"engine": "sim"})  # SRL_* from the harness
    create_topics(cfg)
    result = {
        "delay_ms_one_way": args.delay_ms,
        "lag": lag_stalls(cfg, 10.0),
        "migration": migration_stalls(cfg, Path(args.old_outlet), 10),
    }
    print(orjson.dumps(result).decode())


def outer(args: argparse.Namespace) -> None:
    from tests.crossdc import start_services
    from tests.netns import Topology

    with (
        tempfile.TemporaryDirectory(prefix="srl-stalls-") as tmp,
        Topology(args.delay_ms, 1000) as t,
    ):
        env = start_services(t, Path(tmp))
        argv = [sys.executable, __file__, "--inner", "--delay-ms", str(args.delay_ms)]
        out = t.run("gen", [*argv, "--old-outlet", str(Path(args.old_outlet).resolve())], env=env)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        print(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--old-outlet", required=True)
    ap.add_argument("--inner", action="store_true")
    args = ap.parse_args()
    (inner if args.inner else outer)(args)


if __name__ == "__main__":
    main()
