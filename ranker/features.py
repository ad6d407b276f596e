"""Prompt features for the length ranker: hashed n-grams, numbers and sizes, from text alone.

Owns the map ``prompt text → float32 vector`` that the model reads. It needs no tokenizer and
no vocabulary file, so a dispatcher and a trainer on different machines featurize alike:

* hashed word unigrams and bigrams and character trigrams (crc32 into ``buckets`` slots each,
  value ``log1p(count)``; digits read as ``0`` so a number's value does not scatter over
  arbitrary hash slots): what the prompt asks for;
* the numbers in the prompt (``log1p`` of the first ``MAX_NUMBERS`` in order, of their max and
  sum, and how many there are): how much it asks for, which answer length often tracks;
* ``log1p`` of the prompt's characters, words and lines, of its longest alphanumeric run, and
  of its digit and letter counts: how much material it hands over to work on.

Must hold: the same text always gives the same vector (crc32, not Python's salted ``hash``);
the layout is fixed by ``FeatureSpec``, which is saved with the model. Called by
``ranker.model``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

MAX_NUMBERS = 6
_WORD = re.compile(r"[A-Za-z]+|[^\sA-Za-z0-9]")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_DIGIT = re.compile(r"\d")
_RUN = re.compile(r"[A-Za-z0-9]+")


@dataclass(frozen=True)
class FeatureSpec:
    buckets: int = 16  # hashed slots per n-gram family (words, word pairs, char trigrams)

    @property
    def dim(self) -> int:
        return 3 * self.buckets + MAX_NUMBERS + 3 + 3 + 3

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _slot(token: str, buckets: int) -> int:
    return zlib.crc32(token.encode("utf-8", "surrogatepass")) % buckets


def featurize_one(text: str, spec: FeatureSpec, out: np.ndarray) -> None:
    """Write the features of ``text`` into the zeroed row ``out`` (length ``spec.dim``)."""
    b = spec.buckets
    words = [w.lower() for w in _WORD.findall(text)]
    for w in words:
        out[_slot(w, b)] += 1
    for w1, w2 in zip(words, words[1:], strict=False):
        out[b + _slot(f"{w1} {w2}", b)] += 1
    low = _DIGIT.sub("0", text.lower())  # numbers count through the numeric features only
    for i in range(len(low) - 2):
        out[2 * b + _slot(low[i : i + 3], b)] += 1
    np.log1p(out[: 3 * b], out=out[: 3 * b])
    nums = [float(x) for x in _NUMBER.findall(text)]
    base = 3 * b
    for i, x in enumerate(nums[:MAX_NUMBERS]):
        out[base + i] = np.log1p(x)
    base += MAX_NUMBERS
    if nums:
        out[base] = np.log1p(max(nums))
        out[base + 1] = np.log1p(sum(nums))
    out[base + 2] = np.log1p(len(nums))
    out[base + 3] = np.log1p(len(text))
    out[base + 4] = np.log1p(len(words))
    out[base + 5] = np.log1p(text.count("\n"))
    # sizes of what the prompt hands over to work on (operands, lists, numbers)
    runs = _RUN.findall(text)
    out[base + 6] = np.log1p(max((len(r) for r in runs), default=0))
    out[base + 7] = np.log1p(sum(c.isdigit() for c in text))
    out[base + 8] = np.log1p(sum(c.isalpha() for c in text))


def featurize(texts: Sequence[str], spec: FeatureSpec) -> np.ndarray:
    """``(len(texts), spec.dim)`` float32 features."""
    x = np.zeros((len(texts), spec.dim), dtype=np.float32)
    for i, t in enumerate(texts):
        featurize_one(t, spec, x[i])
    return x
