"""Output-length workloads: histogram files of the form ``lo,hi,probability`` and quantile maps.

Owns reading a length histogram (``/work/shared/data/streamrl_output_length_hist.csv`` or any
file of that form: ``#`` comment lines, then one ``lo,hi,probability`` bin per line), its
inverse CDF (uniform inside a bin), sampling from it, and **quantile mapping**: replacing
values by the histogram's quantiles at their ranks, which keeps their order (so recall and
Spearman of a ranker are unchanged) while giving them the histogram's distribution.

Must hold: bins are non-overlapping and increasing, probabilities are non-negative and sum to
a positive number (they are normalised); a bad file is a one-line ``WorkloadError``.
Called by ``ranker.simulate`` and the ``srl ranker simulate`` command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from srl.errors import SrlError


class WorkloadError(SrlError):
    """A length histogram file that cannot be used."""


@dataclass(frozen=True)
class LengthHistogram:
    """Piecewise-uniform output-length distribution (tokens)."""

    lo: np.ndarray
    hi: np.ndarray
    prob: np.ndarray  # normalised, sums to 1
    source: str = ""

    @classmethod
    def from_file(cls, path: str | Path, scale: float = 1.0) -> LengthHistogram:
        """Read ``lo,hi,probability`` rows (``#`` comments allowed); multiply bounds by
        ``scale``."""
        if not scale > 0:
            raise WorkloadError(f"length scale must be positive, got {scale}")
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise WorkloadError(f"lengths file {path}: {e.strerror or e}") from None
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(",")
            try:
                if len(parts) != 3:
                    raise ValueError
                rows.append(tuple(float(p) for p in parts))
            except ValueError:
                raise WorkloadError(
                    f"lengths file {path}, line {n}: expected lo,hi,probability, got {line!r}"
                ) from None
        if not rows:
            raise WorkloadError(f"lengths file {path}: no bins")
        a = np.array(rows, dtype=np.float64)
        return cls.from_bins(a[:, 0] * scale, a[:, 1] * scale, a[:, 2], source=str(path))

    @classmethod
    def from_bins(
        cls, lo: np.ndarray, hi: np.ndarray, prob: np.ndarray, source: str = ""
    ) -> LengthHistogram:
        lo, hi, prob = (np.asarray(x, dtype=np.float64) for x in (lo, hi, prob))
        where = source or "histogram"
        if np.any(hi <= lo) or np.any(lo < 0):
            raise WorkloadError(f"{where}: every bin needs 0 <= lo < hi")
        if np.any(lo[1:] < hi[:-1]):
            raise WorkloadError(f"{where}: bins must be increasing and must not overlap")
        if np.any(prob < 0) or not prob.sum() > 0:
            raise WorkloadError(f"{where}: probabilities must be >= 0 with a positive sum")
        return cls(lo, hi, prob / prob.sum(), source)

    def quantile(self, u: np.ndarray | float) -> np.ndarray:
        """Inverse CDF at ``u`` in [0, 1] (linear inside a bin)."""
        u = np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)
        cdf = np.concatenate([[0.0], np.cumsum(self.prob)])
        cdf[-1] = 1.0
        i = np.clip(np.searchsorted(cdf, u, side="right") - 1, 0, len(self.prob) - 1)
        # empty bins have zero width in u; searchsorted(side=right) skips them
        p = np.where(self.prob[i] > 0, self.prob[i], 1.0)
        frac = np.clip((u - cdf[i]) / p, 0.0, 1.0)
        return self.lo[i] + frac * (self.hi[i] - self.lo[i])

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` integer lengths (at least 1 token) drawn from the histogram."""
        return np.maximum(1, np.rint(self.quantile(rng.random(n)))).astype(np.int64)

    def mean(self) -> float:
        return float(np.sum(self.prob * (self.lo + self.hi) / 2))


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
