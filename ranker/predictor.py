"""The length-predictor interface the dispatcher calls, and two predictors that need no training.

Owns the contract between the dispatcher (``producers.dispatcher``) and any output-length
model: ``predict(prompts)`` returns one predicted output length in tokens per prompt text, as
a numpy array in the same order, and ``version`` names the model that made the prediction
(``None``: not a trained ranker). The dispatcher buckets each prompt by its prediction and
orders a bucket longest-predicted first; the prediction and version travel with the task
(``PromptTask.predicted_length`` / ``ranker_version``) and back on the chunks, so the ranker
learns from (prompt, actual length) pairs. The learned ranker implements the same protocol.

* :class:`BaselinePredictor` predicts the same length for every prompt (no information: every
  prompt lands in one bucket, in dataset order). It is the control a ranker is compared with.
* :class:`OraclePredictor` looks lengths up by prompt text: for simulated workloads whose
  prompts carry their true length, i.e. the "oracle lengths" upper bound of StreamRL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LengthPredictor(Protocol):
    @property
    def version(self) -> int | None:
        """Version of the model behind the predictions (None: not a versioned model)."""
        ...

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        """Predicted output tokens per prompt, shape ``[len(prompts)]``."""
        ...


class BaselinePredictor:
    """The same prediction for every prompt (default: the task's ``max_new_tokens``)."""

    version: int | None = None

    def __init__(self, length: int) -> None:
        if length < 1:
            raise ValueError("baseline length must be >= 1")
        self.length = length

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        return np.full(len(prompts), self.length, dtype=np.int64)


class OraclePredictor:
    """Known lengths by prompt text; ``default`` for texts it does not know."""

    version: int | None = None

    def __init__(self, lengths: Mapping[str, int], default: int) -> None:
        self.lengths = dict(lengths)
        self.default = default

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        return np.array([self.lengths.get(p, self.default) for p in prompts], dtype=np.int64)
