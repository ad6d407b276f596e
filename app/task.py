"""The demo task family: string operations with verifiable answers and long-tailed lengths.

Owns what a demo prompt is, its reference answer, the reward, the train/eval split and the
supervised corpus the warm start (``srl init-model``) learns from. See docs/demo-task.md.

A prompt is ``"{op} {operand}="`` and its answer is ``OPS[op](operand)``, e.g.
``"desc 93817="`` → ``"98731"`` and ``"dup kqz="`` → ``"kkqqzz"``. The operand length ``n``
is drawn from a clipped log-normal (median 7, 3 ≤ n ≤ 32), so answer lengths are
long-tailed, and the answer length is exact from the prompt: ``n`` for asc/desc/up,
``2n`` for dup (:func:`reference_length`). With the byte-level tokenizer of
``srl.tinymodel`` one character is one token.

What must hold:

* ``demo_prompts(n, split, seed)`` is a pure function of its arguments (no global RNG).
* The split is a function of the prompt text alone (:func:`split_of`, a SHA-256 hash), so
  train and eval prompts are disjoint by construction, whatever the seeds.
* ``demo_reward`` is 1.0 for the exact reference answer (surrounding whitespace ignored)
  and 0.0 otherwise, and needs only the prompt: the metadata answer is a shortcut.

Called by ``app.warmstart`` (SFT corpus), the dispatcher (prompts), the trainer (reward),
the ranker (true lengths) and the demo (held-out evaluation).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from srl.errors import SrlError

TASK_NAME = "strops"
TASK_VERSION = 1  # bump when prompts, answers or the demonstrator change (warm-start cache key)
DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# op -> (alphabet of the operand, answer function, answer length per operand character)
OPS: dict[str, tuple[str, Callable[[str], str], int]] = {
    "asc": (DIGITS, lambda s: "".join(sorted(s)), 1),
    "desc": (DIGITS, lambda s: "".join(sorted(s, reverse=True)), 1),
    "dup": (LETTERS, lambda s: "".join(c + c for c in s), 2),
    "up": (LETTERS, lambda s: s.upper(), 1),
}
OP_NAMES = tuple(OPS)

# Operand length: round(exp(N(MU, SIGMA))) kept in [MIN_N, MAX_N] by redrawing.
MIN_N, MAX_N = 3, 32
MU, SIGMA = math.log(7.0), 0.6
MAX_ANSWER_LEN = 2 * MAX_N  # longest answer in tokens (dup of 32 letters), EOS not counted

EVAL_PERCENT = 10  # share of the prompt space that is held out for evaluation

# The warm start imitates an imperfect demonstrator: on these ops it gives this plausible
# wrong answer with this probability (see docs/demo-task.md, "Warm start").
TEACHER_MISTAKES: dict[str, Callable[[str], str]] = {
    "asc": lambda s: "".join(sorted(s, reverse=True)),  # sorts descending
    "desc": lambda s: "".join(sorted(s)),  # sorts ascending
    "dup": lambda s: s,  # copies instead of doubling
    "up": lambda s: s,  # copies instead of upper-casing
}
TEACHER_ERROR = 0.6


@dataclass(frozen=True)
class Prompt:
    """One task instance. ``metadata`` is JSON-serialisable and holds the reference answer."""

    prompt_id: str
    text: str
    metadata: dict[str, Any]


class TaskError(SrlError):
    """A prompt that is not of the demo task's form."""


def split_of(text: str) -> Literal["train", "eval"]:
    """Which split a prompt text belongs to: a hash of the text, independent of any seed."""
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def answer_of(op: str, operand: str) -> str:
    return OPS[op][1](operand)


def parse(text: str) -> tuple[str, str]:
    """``"desc 93817="`` → ``("desc", "93817")``; :class:`TaskError` for anything else."""
    head, _, operand = text.rstrip("=").partition(" ")
    if head not in OPS or not text.endswith("=") or not operand:
        raise TaskError(f"not a demo-task prompt: {text[:60]!r}")
    alphabet = OPS[head][0]
    if any(c not in alphabet for c in operand):
        raise TaskError(f"operand of {head!r} must use {alphabet!r}: {text[:60]!r}")
    return head, operand


def reference_answer(text: str) -> str:
    return answer_of(*parse(text))


def reference_length(text: str) -> int:
    """Tokens in the reference answer of ``text`` (end-of-sequence token not counted)."""
    op, operand = parse(text)
    return OPS[op][2] * len(operand)


def _operand_len(rng: random.Random) -> int:
    while True:
        n = round(math.exp(rng.gauss(MU, SIGMA)))
        if MIN_N <= n <= MAX_N:
            return n


def _draw(rng: random.Random) -> tuple[str, str]:
    op = rng.choice(OP_NAMES)
    alphabet = OPS[op][0]
    return op, "".join(rng.choice(alphabet) for _ in range(_operand_len(rng)))


def make_prompt(op: str, operand: str, prompt_id: str | None = None) -> Prompt:
    text = f"{op} {operand}="
    parse(text)  # validates
    answer = answer_of(op, operand)
    meta = {
        "task": TASK_NAME,
        "op": op,
        "operand": operand,
        "answer": answer,
        "answer_len": len(answer),
        "split": split_of(text),
    }
    pid = prompt_id or hashlib.sha256(text.encode()).hexdigest()[:16]
    return Prompt(prompt_id=pid, text=text, metadata=meta)


def iter_prompts(
    split: Literal["train", "eval"], seed: int, stream: str = "prompts"
) -> Iterator[Prompt]:
    """Endless prompts of one split in a fixed order for ``(seed, stream)``; may repeat."""
    if split not in ("train", "eval"):
        raise TaskError(f"split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(f"{TASK_NAME}/{stream}/{seed}")
    while True:
        op, operand = _draw(rng)
        if split_of(f"{op} {operand}=") == split:
            yield make_prompt(op, operand)


def demo_prompts(n: int, split: Literal["train", "eval"], seed: int) -> list[Prompt]:
    """``n`` distinct prompts of ``split``; the same arguments give the same list.

    ``prompt_id`` is a hash of the text, so a prompt has the same id in every list.
    """
    if n < 0:
        raise TaskError(f"n must be >= 0, not {n}")
    out: list[Prompt] = []
    seen: set[str] = set()
    for draws, p in enumerate(iter_prompts(split, seed)):
        if len(out) == n:
            break
        if draws > 50 * n + 1000:  # the space holds ~1e45 prompts; this guards bad arguments
            raise TaskError(f"could not draw {n} distinct {split} prompts")
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


def is_correct(prompt: str, completion: str, metadata: dict[str, Any] | None = None) -> bool:
    answer = (metadata or {}).get("answer")
    if answer is None:
        return completion.strip() == reference_answer(prompt)
    return completion.strip() == str(answer).strip()


def demo_reward(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 for the exact reference answer, else 0.0 (the verifiable reward of the demo)."""
    return 1.0 if is_correct(prompt, completion, metadata) else 0.0


def teacher_answer(op: str, operand: str, rng: random.Random, error: float) -> str:
    """What the imperfect demonstrator writes: a known mistake with probability ``error``."""
    mistake = TEACHER_MISTAKES.get(op)
    if mistake is not None and rng.random() < error:
        return mistake(operand)
    return answer_of(op, operand)


def sft_pairs(seed: int, teacher_error: float = TEACHER_ERROR) -> Iterator[tuple[str, str]]:
    """Endless ``(prompt text, target)`` pairs from the train split for the warm start."""
    if not 0.0 <= teacher_error <= 1.0:
        raise TaskError(f"teacher_error must be in [0, 1], not {teacher_error}")
    rng = random.Random(f"{TASK_NAME}/sft/{seed}")
    for p in iter_prompts("train", seed, stream="sft"):
        meta = p.metadata
        yield p.text, teacher_answer(meta["op"], meta["operand"], rng, teacher_error)


def demo_pairs(n: int, split: Literal["train", "eval"], seed: int) -> tuple[list[str], np.ndarray]:
    """``n`` demo-task prompts of ``split`` and their true output lengths in tokens.

    The true length is the reference answer's (:func:`reference_length`; one token per
    character with the byte-level tokenizer) plus the end-of-sequence token the policy emits.
    """
    prompts = demo_prompts(n, split, seed)
    return [p.text for p in prompts], np.array(
        [reference_length(p.text) + 1 for p in prompts], dtype=np.float64
    )
