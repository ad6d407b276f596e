"""`srl ranker simulate` end to end, as a user runs it (real subprocess)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import orjson

from tests.conftest import bin_path

HIST = Path(__file__).resolve().parents[1] / "unit" / "data" / "streamrl_output_length_hist.csv"


def srl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_path("srl"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_simulate_json_with_pairs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    true = rng.lognormal(5, 1, 500)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("# true,pred\n" + "\n".join(f"{t:.0f},{t:.0f}" for t in true) + "\n")
    r = srl(
        "ranker",
        "simulate",
        "--lengths",
        str(HIST),
        "--pairs",
        str(pairs),
        "--instances",
        "4",
        "--b-max",
        "16",
        "--batch",
        "512",
        "--iterations",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    report = orjson.loads(r.stdout)
    assert report["simulated"] is True and report["settings"]["rounds"] == 8
    ratios = report["ratio_vs_random_fifo"]
    # perfect predictions: the ranker run is the oracle run
    assert ratios["ranker_lpt"]["mean"] == ratios["oracle_lpt"]["mean"] < 1
    assert report["ranker_quality"]["recall_at_20"] == 1.0


def test_simulate_text_and_bad_input(tmp_path: Path) -> None:
    r = srl(
        "ranker",
        "simulate",
        "--lengths",
        str(HIST),
        "--iterations",
        "1",
        "--batch",
        "256",
        "--instances",
        "2",
        "--b-max",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("SIMULATED") and "oracle + LPT" in r.stdout
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2\n")
    r = srl("ranker", "simulate", "--lengths", str(bad))
    assert r.returncode != 0 and "expected lo,hi,probability" in r.stderr
    assert "Traceback" not in r.stderr


def test_train_on_demo_then_eval_json(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    r = srl("ranker", "eval", "--store", store, "--run", "x", "--json")
    assert r.returncode != 0 and "no ranker published" in r.stderr and "Traceback" not in r.stderr
    r = srl("ranker", "train", "--store", store, "--run", "x", "--demo", "600", "--epochs", "30")
    assert r.returncode == 0, r.stderr
    assert "ranker v1 published" in r.stdout
    pairs = tmp_path / "pairs.csv"
    r = srl(
        "ranker",
        "eval",
        "--store",
        store,
        "--run",
        "x",
        "--demo",
        "400",
        "--json",
        "--pairs-out",
        str(pairs),
    )
    assert r.returncode == 0, r.stderr
    report = orjson.loads(r.stdout)
    for key in ("recall_at_20", "recall_at_10", "recall_at_5", "spearman"):
        assert 0.0 <= report[key] <= 1.0
    assert report["n"] == 400 and report["version"] == 1
    assert report["spearman"] > 0.5  # learned something from 600 prompts
    assert len(pairs.read_text().splitlines()) == 401
    r = srl("ranker", "train", "--store", store, "--run", "x")
    assert r.returncode == 2 and "exactly one of --demo N or --online" in r.stderr


def test_plan_from_the_published_history(tmp_path: Path) -> None:
    from ranker.dispatch import length_quantiles
    from ranker.features import FeatureSpec
    from ranker.model import LengthRanker
    from ranker.publish import publish
    from srl.store import LocalStore
    from srl.workload import LengthHistogram

    lengths = LengthHistogram.from_file(HIST).sample(400, np.random.default_rng(0))
    r = LengthRanker.fit(
        [f"p {i}" for i in range(400)], lengths, spec=FeatureSpec(4), hidden=(), epochs=2
    )
    r.info["length_quantiles"] = length_quantiles(lengths)
    publish(LocalStore(tmp_path / "store"), "x", r)
    store = f"file://{tmp_path / 'store'}"
    few = srl(
        "ranker",
        "plan",
        "--store",
        store,
        "--run",
        "x",
        "--instances",
        "8",
        "--b-max",
        "64",
        "--batch",
        "1024",
        "--json",
    )
    many = srl(
        "ranker",
        "plan",
        "--store",
        store,
        "--run",
        "x",
        "--instances",
        "16",
        "--b-max",
        "32",
        "--batch",
        "2048",
        "--json",
    )
    assert few.returncode == 0 and many.returncode == 0, few.stderr + many.stderr
    a, b = orjson.loads(few.stdout), orjson.loads(many.stdout)
    assert a["longtail_instances"] + a["regular_instances"] == 8 and a["ranker_version"] == 1
    assert b["longtail_instances"] == 0 and b["regular_batch"] == 32  # 4 rounds: one shared pool
    text = srl(
        "ranker",
        "plan",
        "--store",
        store,
        "--run",
        "x",
        "--instances",
        "16",
        "--b-max",
        "32",
        "--batch",
        "2048",
    )
    assert text.returncode == 0 and text.stdout.startswith("one shared pool: 16 instances")
