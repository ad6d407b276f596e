"""How well a ranker finds the long tail: recall of the truly longest q and Spearman's rho.

``recall_at(true, pred, q)`` is the fraction of the truly longest ``k = ceil(q·n)`` samples
that the ranker puts in its own top ``k`` (StreamRL's metric: 0.87 / 0.82 / 0.76 at
20 % / 10 % / 5 % for its 7B ranker). Ties: a tied block of predictions straddling the cut
counts only the share of it that fits (so a constant predictor scores about ``q``, not 1);
samples whose *true* length equals the k-th longest are interchangeable, so the true top set
is completed with whichever of them the ranker chose (so a perfect ranker scores 1 even when
many samples share the cut length). ``spearman`` is Pearson's correlation of mid-ranks.

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
    """Share of the truly longest ``q`` fraction that the predicted top ``q`` fraction holds.

    Ties, which integer lengths have plenty of, are settled as the module doc says: in the
    prediction against the ranker (a tied block at the cut contributes pro rata), in the truth
    for it (any of the equally long samples at the true cut may complete the true top set).
    So a perfect ranker scores 1 and a constant one about ``q``.
    """
    true = np.asarray(true, dtype=np.float64)
    pred = np.asarray(pred, dtype=np.float64)
    n = len(true)
    if n == 0 or len(pred) != n:
        raise ValueError("recall_at needs two equally long, non-empty arrays")
    k = top_k(n, q)
    t_cut = np.sort(true)[::-1][k - 1]
    t_above, t_at = true > t_cut, true == t_cut
    need_at = k - int(t_above.sum())  # tied samples the true top set still takes
    # expected membership of each sample in the predicted top k (pro rata at the cut)
    p_cut = np.sort(pred)[::-1][k - 1]
    member = (pred > p_cut).astype(np.float64)
    p_at = pred == p_cut
    member[p_at] = (k - float(member.sum())) / float(p_at.sum())
    hits = float(member[t_above].sum()) + min(float(member[t_at].sum()), float(need_at))
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
