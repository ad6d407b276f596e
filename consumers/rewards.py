"""Reward functions: the plugin contract, its loader, and generic built-ins.

A reward is any importable callable ``fn(prompt: str, completion: str, metadata: dict) -> float``
named ``module:function`` (``--reward``). ``prompt`` and ``completion`` are the decoded texts
(special tokens skipped), ``metadata`` the task's metadata JSON object (``{}`` when none).
What must hold: a reward that raises, or returns something that is not a finite number,
marks the sample *failed* (outcome ``failed_reward``, counter ``reward_failures``); it is
never turned into a silent zero. See docs/rewards.md.

Built-ins (generic, for tasks whose metadata carries ``answer``):

* ``exact_match``: 1.0 when the completion, stripped, equals ``metadata["answer"]``;
* ``contains_answer``: 1.0 when ``metadata["answer"]`` occurs in the completion;
* ``first_line_match``: exact match on the completion's first line (answers ended by a newline);
* ``math_answer``: the completion's final answer (``\\boxed{}``, GSM8K's ``####``, else the last
  number) equivalent to the reference (``consumers.mathreward``);
* ``code_tests``: the fraction of ``metadata["tests"]`` the completion's program passes, run in
  a sandbox (``consumers.coderewards``, ``consumers.sandbox``).

Called by the trainer for every assembled trajectory on rank 0: in reward processes
(``consumers.rewardpool``, ``consumers.rewardworker``, through ``call_reward``) or, with
``--reward-workers 0``, in its own (``Scorer``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from consumers.coderewards import code_tests
from consumers.mathreward import math_answer
from srl.errors import ConfigError

if TYPE_CHECKING:
    from consumers.assembler import Trajectory

RewardFn = Callable[[str, str, dict[str, Any]], float]
__all__ = [
    "code_tests",
    "contains_answer",
    "exact_match",
    "first_line_match",
    "load_reward",
    "math_answer",
]


def _answer(metadata: dict[str, Any]) -> str:
    if "answer" not in metadata:
        raise KeyError("metadata has no 'answer'")
    return str(metadata["answer"]).strip()


def exact_match(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 if ``completion.strip() == str(metadata["answer"]).strip()``, else 0.0."""
    return float(completion.strip() == _answer(metadata))


def contains_answer(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 if ``str(metadata["answer"])`` occurs anywhere in the completion, else 0.0."""
    return float(_answer(metadata) in completion)


def first_line_match(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 if the completion's first line, stripped, equals the answer, else 0.0."""
    return float(completion.strip().split("\n", 1)[0].strip() == _answer(metadata))


def load_reward(spec: str) -> RewardFn:
    """Import ``module:function``; ConfigError with one line if it cannot be used."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward: expected module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward: cannot import {module_name!r} ({e})") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"reward: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward: {spec} is not callable")
    return fn


@dataclass(frozen=True)
class Scored:
    """A reward, or the reason it could not be computed."""

    reward: float | None
    error: str | None = None


class Scorer:
    """Decodes a trajectory and calls the reward; failures become ``Scored(None, reason)``."""

    def __init__(self, fn: RewardFn, tokenizer: Any) -> None:
        self.fn = fn
        self.tokenizer = tokenizer

    def texts(self, traj: Trajectory) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (
            decode(traj.prompt_tokens.tolist(), skip_special_tokens=True),
            decode(traj.tokens.tolist(), skip_special_tokens=True),
        )

    def score(self, traj: Trajectory) -> Scored:
        prompt, completion = self.texts(traj)
        return call_reward(self.fn, prompt, completion, dict(traj.metadata))


def call_reward(fn: RewardFn, prompt: str, completion: str, metadata: dict[str, Any]) -> Scored:
    """``fn``'s reward, or why there is none (it raised, or returned no finite number)."""
    try:
        value = fn(prompt, completion, metadata)
    except Exception as e:  # a plugin's bug must not stop training: count it
        return Scored(None, f"{type(e).__name__}: {e}"[:300])
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return Scored(None, f"reward returned {type(value).__name__}, not a number")
    if not math.isfinite(reward):
        return Scored(None, f"reward returned {reward}")
    return Scored(reward)
