"""Quantile mapping: ranker lengths carried onto a workload histogram, order kept.

Owns replacing values by a histogram's quantiles at their ranks (``srl.workload``'s
:class:`~srl.workload.LengthHistogram` reads the histogram). The map keeps the values' order,
so a ranker's recall and Spearman are unchanged, while the values take the histogram's
distribution: real ranker predictions on demo prompts become a StreamRL-shaped workload
without invented noise.

Must hold: ties share one rank; the result is monotone in the input. Called by
``ranker.evaluate`` (the ``srl ranker simulate`` command) and ``ranker.metrics`` (ranks).
"""

from __future__ import annotations

import numpy as np

from srl.workload import LengthHistogram


def ranks01(values: np.ndarray) -> np.ndarray:
    """Mid-ranks of ``values`` scaled into (0, 1): ties share one rank, order is kept."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    order = np.argsort(v, kind="stable")
    r = np.empty(n, dtype=np.float64)
    r[order] = np.arange(n, dtype=np.float64)
    # average the ranks of tied values
    _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=r)
    r = sums[inv] / counts[inv]
    return (r + 0.5) / n


def quantile_map(values: np.ndarray, hist: LengthHistogram) -> np.ndarray:
    """``values`` replaced by the histogram quantile at their rank (order-preserving)."""
    return np.maximum(1, np.rint(hist.quantile(ranks01(values)))).astype(np.int64)
