"""How well a ranker finds the long tail: recall of the truly longest q and Spearman's rho.

``recall_at(true, pred, q)`` is the fraction of the truly longest ``ceil(q·n)`` samples that
the ranker puts in its own top ``ceil(q·n)`` (StreamRL's metric: 0.87 / 0.82 / 0.76 at
20 % / 10 % / 5 % for its 7B ranker). Ties in ``pred`` are broken against the ranker
(a tied block straddling the cut counts only the share of it that fits), so a constant
predictor scores ``q``, not 1. ``spearman`` is Pearson's correlation of mid-ranks.

Pure numpy; called by ``ranker.evaluate`` and the simulation report.
"""

from __future__ import annotations

import math

import numpy as np

from ranker.workload import ranks01


def top_k(n: int, q: float) -> int:
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    return max(1, math.ceil(q * n - 1e-9))


def recall_at(true: np.ndarray, pred: np.ndarray, q: float) -> float:
    """Share of the truly longest ``q`` fraction that the predicted top ``q`` fraction holds."""
    true = np.asarray(true, dtype=np.float64)
    pred = np.asarray(pred, dtype=np.float64)
    n = len(true)
    if n == 0 or len(pred) != n:
        raise ValueError("recall_at needs two equally long, non-empty arrays")
    k = top_k(n, q)
    true_top = np.zeros(n, dtype=bool)
    true_top[np.argsort(-true, kind="stable")[:k]] = True
    # predicted top-k with ties at the cut shared out fractionally
    cut = np.sort(pred)[::-1][k - 1]
    above = pred > cut
    at = pred == cut
    room = k - int(above.sum())
    hits = float(np.sum(above & true_top))
    if at.any():
        hits += room * float(np.sum(at & true_top)) / float(at.sum())
    return hits / k


def spearman(true: np.ndarray, pred: np.ndarray) -> float:
    """Spearman's rank correlation (mid-ranks for ties); 0.0 when either side is constant."""
    a, b = ranks01(np.asarray(true)), ranks01(np.asarray(pred))
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(np.sum(a * a) * np.sum(b * b)))
    return float(np.sum(a * b) / denom) if denom > 0 else 0.0


def ranking_report(true: np.ndarray, pred: np.ndarray) -> dict[str, float | int]:
    """The figures ``srl ranker eval --json`` prints."""
    return {
        "recall_at_20": recall_at(true, pred, 0.20),
        "recall_at_10": recall_at(true, pred, 0.10),
        "recall_at_5": recall_at(true, pred, 0.05),
        "spearman": spearman(true, pred),
        "n": len(true),
    }
