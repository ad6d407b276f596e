"""Simulated engine: tokens at the pace of ``PTL(BS)``, lengths from a workload. Always labelled.

Owns a stand-in for a GPU engine in benchmarks of the system's scheduling and data plane.
What is simulated and what is real:

* simulated: the token ids (random), their log-probs (``-log V``, uniform over the vocabulary)
  and the decode time (each step lasts ``PTL(BS) × time_scale`` ms, ``srl.workload.PTL``:
  ``8.1 + 0.056·BS``, ``BS`` = sequences running in that step);
* real: continuous batching (admission as sequences finish, ``max_batch``), the length of
  every trajectory, and everything downstream (chunks, Kafka, weights verification).

A request with its own ``seed`` (``srl serve``) draws its tokens from its own generator, so
they do not depend on what else runs; ``top_logprobs`` alternatives are the sampled token and
the ids after it (every token is equally likely). A trajectory's length is its request's
``target_length`` (task metadata ``sim_length``,
an oracle length), else a draw from the histogram file, else ``max_new_tokens``; it ends
with ``stop`` at that length or ``length`` at ``max_new_tokens``. ``simulated = True`` puts
``simulated=true`` on every metric and into the CLI's output.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from producers.engines.base import FINISH_LENGTH, FINISH_STOP, Emitted, Engine, Request
from srl.workload import PTL, LengthHistogram

if TYPE_CHECKING:
    import torch

SIM_VOCAB = 32_000


@dataclass
class _SimRow:
    request: Request
    target: int
    generated: int
    rng: np.random.Generator | None = None  # the request's own (a seeded request)


class SimEngine(Engine):
    name = "sim"
    simulated = True

    def __init__(
        self,
        max_batch: int = 64,
        lengths: LengthHistogram | None = None,
        time_scale: float = 1.0,
        seed: int | None = None,
        tokens_per_step: int = 1,
        vocab: int = SIM_VOCAB,
    ) -> None:
        super().__init__(max_batch)
        if vocab < 5:
            raise ValueError("vocab must be >= 5")
        self.vocab = vocab  # token ids are drawn from [4, vocab): fit a real trainer's model
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        # > 1: each step decodes this many tokens per sequence and lasts as many PTL(BS)
        # (admission every k tokens): the same modelled time with 1/k of the Python work,
        # for time-compressed benchmarks where a 1-token step would be shorter than its overhead
        self.tokens_per_step = tokens_per_step
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.lengths = lengths
        self.time_scale = time_scale
        self.rng = np.random.default_rng(seed)
        self.rows: list[_SimRow] = []
        self._next_step_at = 0.0
        self.simulated_ms = 0.0  # modelled decode time so far (before time_scale)

    @property
    def running(self) -> int:
        return len(self.rows)

    def tokenize(self, text: str) -> list[int]:
        return [b + 4 for b in text.encode()] or [1]

    def step(self) -> list[Emitted]:
        while self.waiting and len(self.rows) < self.max_batch:
            req = self._next_waiting()
            own = None if req.seed is None else np.random.default_rng(req.seed)
            target = self._target(req, own or self.rng)
            self.rows.append(_SimRow(req, target, len(req.prefix), own))
        if not self.rows:
            return []
        k = self.tokens_per_step
        step_ms = PTL(len(self.rows)) * k
        self.simulated_ms += step_ms
        self._pace(step_ms * self.time_scale / 1000)
        tokens = self.rng.integers(4, self.vocab, (len(self.rows), k)).tolist()
        logprob = -math.log(self.vocab - 4)
        out, keep = [], []
        for row, toks in zip(self.rows, tokens, strict=True):
            n = min(k, row.target - row.generated, row.request.max_new_tokens - row.generated)
            n = max(n, 1)
            row.generated += n
            finish = None
            if row.generated >= row.target:
                finish = FINISH_STOP
            if row.generated >= row.request.max_new_tokens:
                finish = FINISH_LENGTH
            if row.rng is not None:
                toks = row.rng.integers(4, self.vocab, k).tolist()
            top = self._top(row, toks[:n])
            out.append(Emitted(row.request.key, toks[:n], [logprob] * n, finish, top))
            if finish is None:
                keep.append(row)
        self.rows = keep
        return out

    def _top(self, row: _SimRow, tokens: list[int]) -> list[list[tuple[int, float]]] | None:
        k = row.request.top_logprobs
        if not k:
            return None
        lp, span = -math.log(self.vocab - 4), self.vocab - 4
        return [[(4 + (t - 4 + j) % span, lp) for j in range(min(k, span))] for t in tokens]

    def _pace(self, seconds: float) -> None:
        """Sleep until this step's modelled end. A step that follows the previous one within
        its own duration starts where the previous one ended: the worker's work between steps
        (chunks, Kafka, admission) overlaps the modelled decode, as a GPU engine's CPU-side
        work overlaps its kernels. A later step (the engine sat idle) starts now."""
        now = time.monotonic()
        start = self._next_step_at if now < self._next_step_at + seconds else now
        self._next_step_at = start + seconds
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)

    def _target(self, req: Request, rng: np.random.Generator) -> int:
        if req.target_length is not None:
            return max(1, int(req.target_length))
        if self.lengths is not None:
            return int(self.lengths.sample(1, rng)[0])
        return req.max_new_tokens

    def running_keys(self) -> list[str]:
        return [r.request.key for r in self.rows]

    def _abort_running(self, key: str) -> bool:
        n = len(self.rows)
        self.rows = [r for r in self.rows if r.request.key != key]
        return len(self.rows) < n

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Verification happened upstream (the follower); a simulated policy only changes
        version."""
        self.version = version

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"time_scale": self.time_scale}
