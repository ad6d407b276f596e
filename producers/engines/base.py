"""The engine interface every generator backend (hf, sim, vllm) implements.

Owns the contract between a generator worker and an engine:

* ``add(request)`` queues one trajectory; the engine admits queued requests into its running
  batch as slots free up (continuous batching), highest ``priority`` first, at most
  ``max_batch`` running at once.
* ``step()`` runs one decode step for every running sequence and returns what each produced
  (``Emitted``: new token ids, their behaviour log-probs, and a finish reason on the last one);
  it returns ``[]`` when nothing runs. Nothing else happens between two ``step`` calls, so the
  worker swaps weights, admits work and publishes chunks there.
* ``load_weights(tensors, version)`` replaces the policy in place between steps; running
  sequences continue under the new weights (their KV cache is kept), and tokens sampled after
  the call carry the new version.
* ``abort(key)`` drops a queued or running request without further output (hand-off).
* a request with ``top_logprobs = k > 0`` (``srl serve``'s ``logprobs``) also gets, per
  token, the ``k`` most likely tokens and their log-probs by ``log softmax(logits / T)``
  before any top-p cut, ``T = 1`` when greedy (``Emitted.top``).

Behaviour log-probs are those of the distribution sampled from: ``log softmax(logits / T)``
of the sampled token for ``T > 0``, cut to the top-p nucleus and renormalised, and 0 for greedy
decoding (``T = 0``, a point mass); trainers compute the same quantity with the same
temperature when ``top_p = 1`` (docs/serving.md, "Behaviour policy"). A resumed request
(``prefix``) is prefilled with prompt + prefix and continues; ``max_new_tokens`` bounds
prefix + new tokens together.

``generate`` / ``complete`` drive an engine without Kafka (evaluation, benchmarks, tests).
Called by ``producers.worker``, ``app.bench.engine`` and the demo's evaluation.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

FINISH_STOP = "stop"  # end-of-sequence token sampled (it is part of the completion)
FINISH_LENGTH = "length"  # max_new_tokens or the model's context reached
FINISH_ABORT = "abort"


class RequestError(ValueError):
    """A request the engine cannot run (prompt too long, empty, bad sampling parameters)."""


@dataclass
class Request:
    """One trajectory to generate."""

    key: str  # the trajectory id; every Emitted for it carries this key
    prompt_ids: Sequence[int]
    max_new_tokens: int  # bound on prefix + new tokens
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    prefix: Sequence[int] = ()  # completion tokens already generated (resume); prefilled
    priority: float = 0.0  # admission order: higher first (the predicted length)
    target_length: int | None = None  # sim engine only: the oracle completion length
    seed: int | None = None  # this request's own sampling seed (srl serve); None: the engine's
    top_logprobs: int = 0  # per token, report this many most likely alternatives (srl serve)

    def check(self) -> None:
        if not self.prompt_ids and not self.prefix:
            raise RequestError(f"request {self.key}: empty prompt")
        if self.max_new_tokens <= len(self.prefix):
            raise RequestError(
                f"request {self.key}: max_new_tokens {self.max_new_tokens} leaves nothing after "
                f"a prefix of {len(self.prefix)} tokens"
            )
        if self.top_logprobs < 0:
            raise RequestError(f"request {self.key}: top_logprobs must be >= 0")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:
            raise RequestError(
                f"request {self.key}: temperature must be >= 0 and top_p in (0, 1], "
                f"got {self.temperature}, {self.top_p}"
            )


@dataclass
class Emitted:
    """What one decode step produced for one sequence."""

    key: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # set on the sequence's last output
    # per token, the request's ``top_logprobs`` most likely ``(token id, log-prob)``, most
    # likely first; None when it asked for none
    top: list[list[tuple[int, float]]] | None = None
    # the policy version that sampled these tokens, for an engine that says so (vllm); None:
    # the engine's version when they are published (the tokens of one step() call)
    version: int | None = None


@dataclass
class Completion:
    """A finished request, for callers that want whole outputs (``complete``)."""

    key: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class Engine(ABC):
    """A continuous-batching token generator; see the module docstring for the contract."""

    name: ClassVar[str]
    simulated: ClassVar[bool] = False

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self.version = 0
        self.waiting: list[Request] = []

    # -- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; RequestError if it can never run."""
        self.validate(request)
        self.waiting.append(request)

    def validate(self, request: Request) -> None:
        """RequestError if ``request`` can never run on this engine."""
        request.check()
        self._check(request)

    def abort(self, key: str) -> bool:
        """Drop a queued or running request; True if it was there."""
        for i, r in enumerate(self.waiting):
            if r.key == key:
                del self.waiting[i]
                return True
        return self._abort_running(key)

    def abort_all(self) -> None:
        """Drop every queued and running request (a worker starting over: their tasks are
        uncommitted and come back from Kafka)."""
        self.waiting.clear()
        for key in self.running_keys():
            self._abort_running(key)

    def _next_waiting(self) -> Request:
        """Pop the queued request with the highest priority (FIFO among equals)."""
        best = max(range(len(self.waiting)), key=lambda i: (self.waiting[i].priority, -i))
        return self.waiting.pop(best)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0

    # -- backend -------------------------------------------------------------------------
    @property
    @abstractmethod
    def running(self) -> int:
        """Sequences in the running batch."""

    @abstractmethod
    def step(self) -> list[Emitted]:
        """Admit queued requests into free slots, then one decode step for every running one."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Replace the policy between steps; WeightsError if the tensors do not fit the model."""

    @abstractmethod
    def _abort_running(self, key: str) -> bool: ...

    @abstractmethod
    def running_keys(self) -> list[str]:
        """The keys of the running batch's requests."""

    def _check(self, request: Request) -> None:
        """Backend-specific validation (e.g. context length); raise RequestError."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "simulated": self.simulated, "max_batch": self.max_batch}


def generate(engine: Engine, requests: Iterable[Request]) -> Iterator[Emitted]:
    """Queue ``requests`` and yield every output until the engine has nothing left to do."""
    for r in requests:
        engine.add(r)
    while engine.has_work:
        yield from engine.step()


def complete(engine: Engine, requests: Iterable[Request]) -> dict[str, Completion]:
    """Whole completions by key (e.g. greedy evaluation: ``temperature=0``)."""
    out: dict[str, Completion] = {}
    for e in generate(engine, requests):
        c = out.setdefault(e.key, Completion(e.key))
        c.tokens.extend(e.tokens)
        c.logprobs.extend(e.logprobs)
        if e.finish_reason is not None:
            c.finish_reason = e.finish_reason
    return out
