"""Output-length workloads and the per-token latency model of the simulated engine.

Owns two pieces of ``WORKLOAD.md``:

* :class:`LengthHistogram` reads a histogram file of ``lo,hi,probability`` rows (``#`` lines
  are comments; probabilities are renormalised) and draws lengths from it: a bin by its
  probability, then a uniform length inside the bin, times a scale factor (0.25 and 0.5 give
  the 5K and 10K settings of the 20K histogram).
* :func:`ptl_ms` is the per-token latency with continuous batching, ``8.1 + 0.056·BS`` ms
  (7B on one H800, StreamRL Fig. 6).

Pure functions; used by the sim engine, the ``sim`` prompt source and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from srl.errors import ConfigError

PTL_BASE_MS = 8.1
PTL_PER_SEQ_MS = 0.056


def ptl_ms(batch_size: int) -> float:
    """Modelled decode-step time in ms for ``batch_size`` running sequences."""
    return PTL_BASE_MS + PTL_PER_SEQ_MS * batch_size


@dataclass(frozen=True)
class LengthHistogram:
    lo: np.ndarray
    hi: np.ndarray
    p: np.ndarray
    scale: float = 1.0
    source: str = "<table>"

    @classmethod
    def load(cls, path: str | Path, scale: float = 1.0) -> LengthHistogram:
        if scale <= 0:
            raise ConfigError(f"length scale must be > 0, got {scale}")
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"lengths file {path}: {e.strerror or e}") from None
        rows = []
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                lo, hi, p = (float(x) for x in line.split(","))
            except ValueError:
                raise ConfigError(
                    f"lengths file {path}:{n}: expected lo,hi,probability, got {line!r}"
                ) from None
            if not (0 <= lo <= hi) or p < 0:
                raise ConfigError(f"lengths file {path}:{n}: need 0 <= lo <= hi and p >= 0")
            rows.append((lo, hi, p))
        arr = np.array(rows, dtype=float).reshape(-1, 3)
        if not len(arr) or arr[:, 2].sum() <= 0:
            raise ConfigError(f"lengths file {path}: no bins with positive probability")
        return cls(arr[:, 0], arr[:, 1], arr[:, 2] / arr[:, 2].sum(), scale, str(path))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths in tokens (int64, at least 1)."""
        bins = rng.choice(len(self.p), size=n, p=self.p)
        raw = rng.uniform(self.lo[bins], self.hi[bins])
        return np.maximum(1, np.rint(raw * self.scale)).astype(np.int64)

    @property
    def mean(self) -> float:
        return float(((self.lo + self.hi) / 2 * self.p).sum() * self.scale)
