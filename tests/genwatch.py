"""Watch a generator pool from inside a datacenter of the netns harness (``tests/netns.py``).

``python -m tests.genwatch --expect N --group-size G --ids FILE --timeout S`` reads the
trajectories topic as the trainer counts it (``srl.lineage``, via the tests' ``Trajectories``)
and the pool's assignment (``tests.genpool.owners``), and prints one JSON line a second:
``{"at": wall time, "started": trajectories with a chunk, "complete": n, "fenced": n,
"stalest_ms": creation time of the newest chunk of the incomplete trajectory that has gone
longest without one (null: none incomplete), "owners": {worker: partitions}, "epoch": newest
opened epoch}``; once ``N`` trajectories are complete (or at
the timeout) a last line with ``"final": true`` and the audit: every sample of the prompt
ids in ``FILE`` complete exactly once (``exactly_once``), no trajectory mixing two writers'
chains (``unmixed``), chunks dropped as duplicates or fenced. The roles' environment (``SRL_*``)
points it at the harness' broker. Used by ``tests/e2e/test_datacenters.py``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import orjson

from producers.pool import PoolView
from srl.config import CommonConfig, load_config
from srl.kafka import read_range
from srl.topics import Layout
from tests.genpool import owners
from tests.integration.test_generation import Trajectories


def newest_epoch(cfg: CommonConfig, pool: str) -> int:
    view, opened = PoolView(pool, 0.0), 0
    for msg in read_range(cfg, Layout.from_config(cfg).pool_epochs, timeout_s=10):
        if view.on_epoch(orjson.loads(msg.value() or b"{}")) and view.current.opened:
            opened = view.current.epoch
    return opened


def audit(t: Trajectories, ids: list[str], group_size: int) -> dict[str, Any]:
    by_sample: dict[tuple[str, int], int] = {}
    unmixed = True
    for cs in t.complete().values():
        key = (cs[0].prompt_id, cs[0].sample_index)
        by_sample[key] = by_sample.get(key, 0) + 1
        writers = [(c.pool_epoch or 0, c.worker_id) for c in cs]
        runs = [w for i, w in enumerate(writers) if i == 0 or w != writers[i - 1]]
        unmixed = unmixed and runs == sorted(set(runs))
    expected = {(p, s) for p in ids for s in range(group_size)}
    return {
        "final": True,
        "complete": len(t.complete()),
        "exactly_once": set(by_sample) == expected and set(by_sample.values()) == {1},
        "missing": len(expected - set(by_sample)),
        "twice": sum(v > 1 for v in by_sample.values()),
        "unmixed": unmixed,
        "duplicates": t.duplicates,
        "fenced": t.fenced,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--ids", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    cfg = load_config(CommonConfig)
    pool = f"{cfg.topic_prefix}.gen.regular"
    t = Trajectories(cfg)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        t.poll()
        complete = t.complete()
        stalest = [
            max(c.created_ms for c in t.ordered(tid)) for tid in t.chunks if tid not in complete
        ]
        line = {
            "at": time.time(),
            "started": len(t.chunks),
            "complete": len(complete),
            "fenced": t.fenced,
            "stalest_ms": min(stalest, default=None),
            "owners": {w: len(p) for w, p in owners(cfg).items()},
            "epoch": newest_epoch(cfg, pool),
        }
        print(orjson.dumps(line).decode(), flush=True)
        if line["complete"] >= args.expect:
            break
        time.sleep(0.5)
    t.poll()
    ids = args.ids.read_text().split()
    print(orjson.dumps(audit(t, ids, args.group_size)).decode(), flush=True)


if __name__ == "__main__":
    main()
