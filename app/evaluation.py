"""The evaluation core: greedy pass@1 and sampled pass@k of a policy on prompts with a reward.

Owns what ``srl eval`` (``app.evalrun``) and the demo's held-out evaluation
(``app.warmstart.evaluate``) share: how completions are asked for, how a sample passes, and
the figures. Generation and scoring are callables handed in, so each caller keeps its own
backend (the generators' engines for ``srl eval``; the demo's batched ``generate``):

* ``complete(prompts, temperature, n, max_new_tokens)`` returns, per prompt, its ``n``
  completions (``None`` for one the engine refused, e.g. a prompt longer than the context);
* ``score(items)`` returns, per ``(prompt, completion)``, the reward or ``None`` (the reward
  failed: it raised, timed out or returned no finite number; such a sample does not pass).

A sample **passes** when its reward is at least ``pass_threshold`` (default 1.0). Greedy pass@1
is the fraction of prompts whose greedy completion passes; sampled pass@k is the mean over
prompts of the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code"), ``n`` samples of which ``c`` pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from producers.sources import PromptLike
from srl.errors import ConfigError

Complete = Callable[[list[PromptLike], float, int, int], list[list[str | None]]]
Score = Callable[[list[tuple[PromptLike, str]]], list[float | None]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class Sampling:
    """What to generate: a greedy completion per prompt and/or ``samples`` sampled ones."""

    greedy: bool = True
    samples: int = 0
    ks: tuple[int, ...] = ()  # empty: 1 and samples
    temperature: float = 1.0
    max_new_tokens: int = 512
    pass_threshold: float = 1.0

    def k_values(self) -> list[int]:
        ks = sorted(set(self.ks or (1, self.samples)))
        if self.samples and any(k < 1 or k > self.samples for k in ks):
            raise ConfigError(f"--k {','.join(map(str, ks))}: each k must be in 1..{self.samples}")
        return ks if self.samples else []

    def check(self) -> None:
        if not self.greedy and not self.samples:
            raise ConfigError("nothing to evaluate: greedy is off and samples is 0")
        self.k_values()


@dataclass
class PromptResult:
    prompt: PromptLike
    greedy: str | None = None
    greedy_reward: float | None = None
    completions: list[str | None] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)


@dataclass
class Outcome:
    """Every prompt's completions and rewards, and the figures made from them."""

    sampling: Sampling
    results: list[PromptResult]
    group_of: Callable[[PromptLike], str] | None = None

    def passed(self, reward: float | None) -> bool:
        return reward is not None and reward >= self.sampling.pass_threshold

    def greedy_pass(self, results: Sequence[PromptResult] | None = None) -> float:
        rs = self.results if results is None else results
        return sum(self.passed(r.greedy_reward) for r in rs) / len(rs) if rs else 0.0

    def pass_k(self, k: int) -> float:
        n = self.sampling.samples
        rs = self.results
        return sum(pass_at_k(n, self._correct(r), k) for r in rs) / len(rs) if rs else 0.0

    def _correct(self, r: PromptResult) -> int:
        return sum(self.passed(x) for x in r.rewards)

    def by_group(self) -> dict[str, float]:
        """Greedy pass@1 per group (``group_of``), groups sorted by name."""
        if self.group_of is None:
            return {}
        groups: dict[str, list[PromptResult]] = {}
        for r in self.results:
            groups.setdefault(self.group_of(r.prompt), []).append(r)
        return {g: round(self.greedy_pass(rs), 4) for g, rs in sorted(groups.items())}

    def figures(self) -> dict[str, Any]:
        """The report's figures: greedy and sampled pass rates with their counts."""
        s, rs = self.sampling, self.results
        out: dict[str, Any] = {"prompts": len(rs)}
        if s.greedy:
            rewards = [r.greedy_reward for r in rs]
            out["greedy"] = {
                "pass@1": round(self.greedy_pass(), 4),
                "passed": sum(self.passed(x) for x in rewards),
                "completions": len(rewards),
                **_reward_counts(rewards, [r.greedy for r in rs]),
            }
            if self.group_of is not None:
                out["greedy"]["by_group"] = self.by_group()
        if s.samples:
            rewards = [x for r in rs for x in r.rewards]
            out["sampled"] = {
                "samples": s.samples,
                "temperature": s.temperature,
                "pass@k": {str(k): round(self.pass_k(k), 4) for k in s.k_values()},
                "passed": sum(self.passed(x) for x in rewards),
                "completions": len(rewards),
                "prompts_with_a_pass": sum(self._correct(r) > 0 for r in rs),
                **_reward_counts(rewards, [c for r in rs for c in r.completions]),
            }
        return out

    def per_prompt(self) -> list[dict[str, Any]]:
        out = []
        for r in self.results:
            d: dict[str, Any] = {"prompt_id": r.prompt.prompt_id}
            if self.sampling.greedy:
                d["greedy"] = {
                    "completion": r.greedy,
                    "reward": r.greedy_reward,
                    "passed": self.passed(r.greedy_reward),
                }
            if self.sampling.samples:
                d["sampled"] = {"rewards": r.rewards, "passed": self._correct(r)}
                d["sampled"]["completions"] = r.completions
            out.append(d)
        return out


def _reward_counts(rewards: list[float | None], completions: list[str | None]) -> dict[str, Any]:
    scored = [x for x in rewards if x is not None]
    refused = sum(c is None for c in completions)
    return {
        "mean_reward": round(sum(scored) / len(scored), 4) if scored else None,
        "reward_failures": sum(x is None for x in rewards) - refused,
        "refused": refused,
    }


def run_eval(
    prompts: list[PromptLike],
    complete: Complete,
    score: Score,
    sampling: Sampling,
    group_of: Callable[[PromptLike], str] | None = None,
) -> Outcome:
    """Generate what ``sampling`` asks for, score it, and return the outcome."""
    sampling.check()
    results = [PromptResult(p) for p in prompts]
    if sampling.greedy and prompts:
        greedy = complete(prompts, 0.0, 1, sampling.max_new_tokens)
        for r, outs in zip(results, greedy, strict=True):
            r.greedy = outs[0]
    if sampling.samples and prompts:
        sampled = complete(prompts, sampling.temperature, sampling.samples, sampling.max_new_tokens)
        for r, outs in zip(results, sampled, strict=True):
            r.completions = list(outs)
    _score(results, score, sampling.greedy)
    return Outcome(sampling, results, group_of)


def _score(results: list[PromptResult], score: Score, greedy: bool) -> None:
    """Every completion's reward (``None`` for a refused one, which is never scored)."""
    slots: list[tuple[PromptResult, int]] = []  # (result, sample index; -1: the greedy one)
    for r in results:
        r.rewards = [None] * len(r.completions)
        slots += [(r, -1)] if greedy else []
        slots += [(r, j) for j in range(len(r.completions))]
    todo = [(r, j) for r, j in slots if (r.greedy if j < 0 else r.completions[j]) is not None]
    items = [(r.prompt, str(r.greedy if j < 0 else r.completions[j])) for r, j in todo]
    for (r, j), reward in zip(todo, score(items) if items else [], strict=True):
        if j < 0:
            r.greedy_reward = reward
        else:
            r.rewards[j] = reward
