"""Evaluation glue: ranker quality on held-out prompts, pair files, and the simulated benchmark.

Owns what ``srl ranker train --demo``, ``srl ranker eval`` and ``srl ranker simulate``
compute:

* pairs of prompts and true lengths (the app layer makes them from the demo task:
  ``app.task.demo_pairs``): ``train_on_pairs`` fits and publishes a version,
  ``evaluate_on_pairs`` scores a published version on held-out pairs;

* pair files: CSV ``true,predicted`` rows (a ``#`` header), written by ``eval --pairs-out``;
* :func:`simulate_report`: the SIMULATED makespan comparison of ``ranker.simulate`` on a
  length histogram. Ranker predictions for a histogram workload are made honestly: real
  ranker predictions on real held-out demo prompts (the pair file), with both the true
  lengths and the predictions **quantile-mapped** onto the histogram (each replaced by the
  histogram's quantile at its rank). The map is monotone, so the ranker's recall and
  Spearman are exactly those it achieved on the demo task; only the scale changes.
  No noise is invented.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ranker.dispatch import length_quantiles
from ranker.features import FeatureSpec
from ranker.metrics import ranking_report
from ranker.model import LengthRanker, RankerError
from ranker.publish import load_version, publish
from ranker.simulate import SimSettings, compare
from ranker.workload import quantile_map
from srl.stores import store_from_config
from srl.workload import LengthHistogram, PtlModel

if TYPE_CHECKING:
    from ranker.config import RankerConfig
    from ranker.model import LengthRanker
    from srl.config import RunStoreConfig


def train_on_pairs(
    cfg: RankerConfig, texts: list[str], lengths: np.ndarray, seed: int, source: str
) -> LengthRanker:
    """Bootstrap: fit on prompts with their true lengths and publish the version."""

    ranker = LengthRanker.fit(
        texts,
        lengths,
        spec=FeatureSpec(cfg.buckets),
        hidden=cfg.hidden,
        epochs=cfg.epochs,
        seed=seed,
    )
    ranker.info["length_quantiles"] = length_quantiles(lengths)
    ranker.info["source"] = source
    return publish(store_from_config(cfg), cfg.run, ranker)


def evaluate_on_pairs(
    cfg: RunStoreConfig, version: int | None, texts: list[str], true: np.ndarray, seed: int
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(report, true, predicted) of a published version on held-out prompts and their lengths."""

    ranker = load_version(store_from_config(cfg), cfg.run, version)
    pred = ranker.predict(texts)
    report: dict[str, Any] = dict(ranking_report(true, pred))
    report |= {"version": ranker.version, "run": cfg.run, "split": "eval", "seed": seed}
    return report, true, pred


def write_pairs(path: Path, true: np.ndarray, pred: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "\n".join(f"{int(t)},{float(p):.3f}" for t, p in zip(true, pred, strict=True))
    path.write_text("# true_length,predicted_length\n" + rows + "\n")


def read_pairs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln and not ln.startswith("#")]
        a = np.array([[float(x) for x in ln.split(",")] for ln in lines], dtype=np.float64)
    except (OSError, ValueError) as e:
        raise RankerError(f"pairs file {path}: {e}") from None
    if a.ndim != 2 or a.shape[1] != 2 or len(a) < 10:
        raise RankerError(f"pairs file {path}: need at least 10 rows of true,predicted")
    return a[:, 0], a[:, 1]


def simulate_report(
    lengths: Path,
    scale: float,
    pairs: Path | None,
    instances: int,
    b_max: int,
    batch: int,
    alpha: float,
    iterations: int,
    seed: int,
    ptl: PtlModel | None = None,
    allow_shared: bool = True,
    migrate_factor: float | None = 2.0,
) -> dict[str, Any]:
    """The SIMULATED comparison, with the workload and ranker provenance recorded."""
    hist = LengthHistogram.from_file(lengths, scale)
    settings = SimSettings(
        instances,
        b_max,
        batch,
        alpha,
        iterations,
        seed,
        ptl or PtlModel(),
        migrate_factor,
        allow_shared,
    )
    if pairs is None:
        true_pool = hist.sample(max(20_000, batch * 4), np.random.default_rng(seed + 7919))
        pred_pool = None
        source = "none (oracle only)"
    else:
        true, pred = read_pairs(pairs)
        true_pool, pred_pool = quantile_map(true, hist), quantile_map(pred, hist)
        source = f"{pairs} ({len(true)} held-out pairs, quantile-mapped onto the histogram)"
    report: dict[str, Any] = compare(true_pool, pred_pool, settings)
    report["workload"] = {"lengths": str(lengths), "scale": scale, "mean_tokens": hist.mean()}
    report["ranker_predictions"] = source
    if pairs is not None:
        report["ranker_quality"] = ranking_report(true, pred)
    return report
