"""Evaluation glue: ranker quality on held-out prompts, pair files, and the simulated benchmark.

Owns what ``srl ranker train --demo``, ``srl ranker eval`` and ``srl ranker simulate``
compute:

* demo pairs: prompts of the demo task (``srl.task``) with their true lengths; ``train
  --demo`` fits on the train split, ``eval`` scores a published version on the held-out eval
  split (disjoint from train by construction);

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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ranker.model import RankerError
from ranker.schedule import PtlModel
from ranker.simulate import SimSettings, compare
from ranker.workload import LengthHistogram, quantile_map

if TYPE_CHECKING:
    from ranker.config import RankerConfig
    from ranker.model import LengthRanker


def demo_pairs(n: int, split: Literal["train", "eval"], seed: int) -> tuple[list[str], np.ndarray]:
    """``n`` demo-task prompts of ``split`` and their true output lengths in tokens.

    The true length is the reference answer's (``srl.task.reference_length``; one token per
    character with the byte-level tokenizer) plus the end-of-sequence token the policy emits.
    """
    try:
        from srl.task import demo_prompts, reference_length
    except ImportError:
        raise RankerError("the demo task (srl/task.py) is not in this build") from None

    prompts = demo_prompts(n, split, seed)
    return [p.text for p in prompts], np.array(
        [reference_length(p.text) + 1 for p in prompts], dtype=np.float64
    )


def train_on_demo(cfg: RankerConfig, n: int, seed: int) -> LengthRanker:
    """Bootstrap: fit on ``n`` training prompts of the demo task and publish the version."""
    from ranker.dispatch import length_quantiles
    from ranker.model import LengthRanker
    from ranker.publish import publish
    from srl.store import open_store

    texts, lengths = demo_pairs(n, "train", seed)
    from ranker.features import FeatureSpec

    ranker = LengthRanker.fit(texts, lengths, spec=FeatureSpec(cfg.buckets), hidden=cfg.hidden,
                              epochs=cfg.epochs, seed=seed)  # fmt: skip
    ranker.info["length_quantiles"] = length_quantiles(lengths)
    ranker.info["source"] = f"demo task, {n} train prompts, seed {seed}"
    return publish(open_store(cfg.store), cfg.run, ranker)


def evaluate_on_demo(
    cfg: RankerConfig, version: int | None, n: int, seed: int
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(report, true, predicted) of a published version on ``n`` held-out demo prompts."""
    from ranker.metrics import ranking_report
    from ranker.publish import load_version
    from srl.store import open_store

    ranker = load_version(open_store(cfg.store), cfg.run, version)
    texts, true = demo_pairs(n, "eval", seed)
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
    lengths: Path, scale: float, pairs: Path | None, instances: int, b_max: int, batch: int,
    alpha: float, iterations: int, seed: int, ptl: PtlModel | None = None,
    allow_shared: bool = True, migrate_factor: float | None = 2.0,
) -> dict[str, Any]:  # fmt: skip
    """The SIMULATED comparison, with the workload and ranker provenance recorded."""
    hist = LengthHistogram.from_file(lengths, scale)
    settings = SimSettings(instances, b_max, batch, alpha, iterations, seed, ptl or PtlModel(),
                           migrate_factor, allow_shared)  # fmt: skip
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
        from ranker.metrics import ranking_report

        report["ranker_quality"] = ranking_report(true, pred)
    return report
