"""The built-in math reward (``consumers.rewards:math_answer``): a completion's final answer
against the task's reference answer, by mathematical equivalence.

Owns the extraction rules and the comparison. What must hold:

* **one answer per completion**, taken by the first rule that finds one (``extract_answer``):
  1. the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced: MATH's and most chat
     models' convention;
  2. else what follows the last ``####`` on its line: GSM8K's convention;
  3. else the last number in the text (``-1,234.5``, ``3/4``, a ``\\frac{a}{b}``), so an answer
     given in words ("so the total is 72 dollars") still counts; a completion without any is
     wrong (0.0), never an error;
* the reference (``metadata["answer"]``, a string or a number) is read by the same rules when it
  is a solution text (a GSM8K answer field ``"… #### 72"``, a MATH solution with its box), else
  taken whole;
* **equivalence, not string equality**: both sides are parsed as LaTeX or plain expressions by
  HF's ``math-verify`` and compared symbolically and numerically (``1/2``, ``0.5`` and
  ``\\frac{1}{2}``; ``x^2+2x+1`` and ``(x+1)^2``; ``1,000`` and ``1000``; ``\\$5`` and ``5``;
  ``10 \\text{ cm}`` and ``10``), with its own 5 s limits in the reward process's main thread;
  a close number is not equal (``12.5`` against ``12``, ``0.333`` against ``\\frac{1}{3}``);
* no ``answer`` in the metadata raises ``KeyError``: the sample fails (``failed_reward``), it is
  not a silent zero.

The table of cases is ``tests/unit/test_mathreward.py``; docs/rewards.md. Pure functions.
"""

from __future__ import annotations

import re
import threading
from typing import Any

NUMBER = re.compile(
    r"\\[dt]?frac\{-?\d+(?:\.\d+)?\}\{-?\d+(?:\.\d+)?\}"  # \frac{3}{4}
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,234.5
    r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"  # 72, -0.5, 3/4
)
BOXES = ("\\boxed{", "\\fbox{", "\\boxed {")
LIMIT_S = 5  # math-verify's own parse and verify limits (signal-based: the main thread only)


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{…}``, braces balanced; None without one (or if it is
    never closed)."""
    starts = [(text.rfind(b), b) for b in BOXES]
    at, box = max(starts)
    if at < 0:
        return None
    i, depth = at + len(box), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of ``text`` by the rules of the module docstring, or None."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        if after:
            return after
    numbers = NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def reference(metadata: dict[str, Any]) -> str:
    """The task's reference answer (``metadata["answer"]``), a solution text read by the same
    rules; KeyError without one."""
    if "answer" not in metadata:
        raise KeyError("metadata has no 'answer'")
    raw = str(metadata["answer"]).strip()
    if "####" in raw or any(b in raw for b in BOXES):
        return extract_answer(raw) or raw
    return raw


def _parse(answer: str, limit: int | None) -> Any:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${answer}$", extraction_config=config, parsing_timeout=limit)


def equivalent(gold: str, pred: str) -> bool:
    """Whether two extracted answers are the same mathematical object (``math-verify``)."""
    from math_verify import verify

    if gold.strip() == pred.strip():
        return True
    limit = LIMIT_S if threading.current_thread() is threading.main_thread() else None
    g, p = _parse(gold, limit), _parse(pred, limit)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=limit))


def math_answer(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 when the completion's final answer equals the reference answer, else 0.0."""
    gold = reference(metadata)
    pred = extract_answer(completion)
    return float(pred is not None and equivalent(gold, pred))
