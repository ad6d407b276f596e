"""Output-length workloads and the per-token latency model: what every simulation runs on.

Owns the two models of ``WORKLOAD.md`` that the simulated parts share:

* :class:`LengthHistogram`: a piecewise-uniform output-length distribution, read from a file
  of ``lo,hi,probability`` rows (``#`` lines are comments; probabilities are normalised), e.g.
  ``srl.data.STREAMRL_LENGTHS`` (StreamRL Fig. 7, package data). ``scale`` multiplies every
  bound (0.25 and 0.5 give the 5K and 10K settings of the 20K histogram). A draw picks a bin by its
  probability, then a uniform length inside it; :meth:`LengthHistogram.quantile` is the
  inverse CDF (linear inside a bin).
* :class:`PtlModel`: the per-token decode latency under continuous batching,
  ``PTL(BS) = a + b·BS`` ms, by default ``8.1 + 0.056·BS`` (a 7B model on one H800, StreamRL
  Fig. 6), and what follows from it for one generator instance: :func:`finish_times` (each
  decode step advances every running sample by one token and lasts ``PTL(running)``; a
  finished sample's slot is refilled at once, up to ``cap``), :func:`instance_makespan`, and
  the two terms no schedule beats, :func:`longest_s` (the longest sample alone at ``PTL(1)``)
  and :func:`throughput_s` (every token at the best rate, ``PTL(B_max) / B_max`` each).

Must hold: every bin has ``0 <= lo <= hi``, bins are increasing and do not overlap (so the
quantile function is monotone), probabilities are ``>= 0`` with a positive sum; a bad file is
a one-line :class:`WorkloadError`. Pure (numpy only). Used by the sim engine
(``producers.engines.sim``), the ``sim`` prompt source, the ranker's scheduling and
simulation (``ranker.schedule``, ``ranker.simulate``, ``ranker.evaluate``) and the pipeline
benchmark (``app.bench``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from srl.errors import ConfigError


class WorkloadError(ConfigError):
    """A length histogram file (or table) that cannot be used."""


@dataclass(frozen=True)
class PtlModel:
    """Per-token latency of one decode step at batch size ``bs``, in milliseconds."""

    a_ms: float = 8.1
    b_ms: float = 0.056

    def __call__(self, bs: int | float) -> float:
        return self.a_ms + self.b_ms * bs

    def describe(self) -> str:
        """The formula, as reports print it (``8.1 + 0.056*BS``)."""
        return f"{self.a_ms} + {self.b_ms}*BS"


PTL = PtlModel()  # the model of WORKLOAD.md


def finish_times(lengths: np.ndarray, cap: int, ptl: PtlModel = PTL) -> np.ndarray:
    """Seconds at which each sample of one instance finishes, admitted in the given order."""
    if cap < 1:
        raise ValueError("batch cap must be >= 1")
    finish = np.zeros(len(lengths))
    running: list[tuple[int, int]] = []  # (decode step at which it finishes, index)
    step, t_ms, nxt = 0, 0.0, 0
    while nxt < len(lengths) or running:
        while nxt < len(lengths) and len(running) < cap:
            heapq.heappush(running, (step + max(1, int(lengths[nxt])), nxt))
            nxt += 1
        end = running[0][0]
        t_ms += (end - step) * ptl(len(running))
        step = end
        while running and running[0][0] == step:
            finish[heapq.heappop(running)[1]] = t_ms / 1000.0
    return finish


def instance_makespan(lengths: np.ndarray, cap: int, ptl: PtlModel = PTL) -> float:
    """Seconds for one instance to finish ``lengths`` admitted in the given order."""
    return float(finish_times(lengths, cap, ptl).max(initial=0.0))


def longest_s(lengths: Sequence[int] | np.ndarray, ptl: PtlModel = PTL) -> float:
    """Seconds the longest sample needs on its own (``PTL(1)`` per token)."""
    longest = float(np.max(lengths)) if len(lengths) else 0.0
    return longest * ptl(1) / 1000.0


def throughput_s(tokens: float, instances: int, b_max: int, ptl: PtlModel = PTL) -> float:
    """Seconds ``instances`` need for ``tokens`` at their best rate (every one at ``B_max``)."""
    return tokens * ptl(b_max) / (instances * b_max) / 1000.0


def parse_rows(text: str, where: str) -> np.ndarray:
    """``[n, 3]`` float64 rows ``lo, hi, probability`` of a histogram file's text."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(",")
        try:
            if len(parts) != 3:
                raise ValueError
            rows.append([float(p) for p in parts])
        except ValueError:
            raise WorkloadError(
                f"lengths file {where}:{n}: expected lo,hi,probability, got {line!r}"
            ) from None
    if not rows:
        raise WorkloadError(f"lengths file {where}: no bins")
    return np.array(rows, dtype=np.float64)


@dataclass(frozen=True)
class LengthHistogram:
    """Piecewise-uniform output-length distribution (tokens, bounds already scaled)."""

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
        a = parse_rows(text, str(path))
        return cls.from_bins(a[:, 0] * scale, a[:, 1] * scale, a[:, 2], source=str(path))

    @classmethod
    def from_bins(
        cls, lo: np.ndarray, hi: np.ndarray, prob: np.ndarray, source: str = ""
    ) -> LengthHistogram:
        lo, hi, prob = (np.asarray(x, dtype=np.float64) for x in (lo, hi, prob))
        where = source or "histogram"
        if np.any(hi < lo) or np.any(lo < 0):
            raise WorkloadError(f"{where}: every bin needs 0 <= lo <= hi")
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
        """``n`` lengths in tokens (int64, at least 1): a bin by its probability, then a
        uniform length inside it (the draws the sim engine and the ``sim`` source make)."""
        bins = rng.choice(len(self.prob), size=n, p=self.prob)
        raw = rng.uniform(self.lo[bins], self.hi[bins])
        return np.maximum(1, np.rint(raw)).astype(np.int64)

    def mean(self) -> float:
        """Mean length in tokens (bin midpoints weighted by probability)."""
        return float(np.sum(self.prob * (self.lo + self.hi) / 2))
