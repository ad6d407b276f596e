"""Checkpoint size over a long trainer run: the dedupe ledger pruned by offset (issue 18).

Runs the real trainer in-process (tiny model, CPU) on the embedded broker over STEPS steps of
one group of 2 short trajectories each, all produced up front on one partition, with a
checkpoint every step; prints the size of each kept checkpoint's ``state.json`` (ledger, window
events) at a few steps, as JSON. Run from a checkout (``PYTHONPATH=.``) against this tree or
an older one to compare: ``python docs/bench/harden/ledger.py --steps 200``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

from consumers.config import TrainConfig  # noqa: E402
from consumers.trainer import run_trainer  # noqa: E402
from srl.broker import EmbeddedBroker  # noqa: E402
from srl.config import load_config  # noqa: E402
from srl.kafka import create_topics  # noqa: E402
from srl.stores import store_from_config  # noqa: E402
from srl.tinymodel import TinyModelSpec, build_tiny_model  # noqa: E402
from tests.chunks import produce  # noqa: E402
from tests.integration.test_trainer import make_groups  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        spec = TinyModelSpec(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = build_tiny_model(Path(tmp) / "model", spec, seed=0)
        cfg = load_config(
            TrainConfig,
            cli={
                "bootstrap_servers": broker.bootstrap,
                "topic_prefix": "ledger",
                "store": f"file://{tmp}/store",
                "model": str(model),
                "groups_per_step": 1,
                "batching": "groups",
                "lr": 1e-3,
                "micro_batch_tokens": 64,
                "idle_exit_s": 5.0,
                "max_staleness": args.steps + 10,
                "device": "cpu",
                "keep_checkpoints": args.steps + 10,
            },
            env={},
        )
        create_topics(cfg)
        produce(cfg, make_groups(args.steps, n=2), partition=0)
        t0 = time.monotonic()
        result = run_trainer(cfg)
        wall = time.monotonic() - t0
        store = store_from_config(cfg)
        sizes = {}
        for key in store.list(f"checkpoints/{cfg.run}/"):
            if key.endswith("/state.json"):
                state = orjson.loads(store.get(key))
                sizes[state["step"]] = (len(store.get(key)), len(state["ledger"]))
    at = [s for s in (1, 10, 50, 100, 150, 200, 400, 800) if s in sizes] + [max(sizes)]
    print(
        orjson.dumps(
            {
                "steps": result.steps,
                "outcomes": result.outcomes,
                "wall_s": round(wall, 1),
                "state_json_bytes": {s: sizes[s][0] for s in dict.fromkeys(at)},
                "ledger_entries": {s: sizes[s][1] for s in dict.fromkeys(at)},
            },
            option=orjson.OPT_NON_STR_KEYS,
        ).decode()
    )


if __name__ == "__main__":
    main()
