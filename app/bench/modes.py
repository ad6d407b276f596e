"""The pipeline benchmark's modes and designs, by name (imported by the bench's command line
without the time model, so ``srl bench --help`` stays light)."""

from __future__ import annotations

from typing import Any

MODES = ("colocated", "sync", "stream", "async", "async+skew")
BARRIER = ("colocated", "sync", "stream")  # k = 0: one step of prompts per policy version
LPT_MODES = ("stream", "async+skew")  # longest-predicted first (oracle lengths)
RANDOM_DISPATCH = ("sync", "async")  # tasks to prompt partitions by key hash (the others: balanced)

# How the async modes keep samples within k (docs/benchmarks.md, "Asynchrony that keeps the
# long tail"): dispatcher settings, trainer settings.
DESIGNS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # step t's prompts released once step t-1-k is announced; step t trains exactly them
    "paced": ({}, {"batching": "windows", "stale_policy": "correct"}),
    # the same release (starts per version bounded), but each step takes the first B groups
    "paced-groups": ({}, {"batching": "groups", "stale_policy": "correct"}),
    # main before: a backlog bound on the prompt topics, first B complete groups per step,
    # a group with a stale sample dropped whole / only the stale samples dropped
    "unpaced": ({"max_staleness": None}, {"batching": "groups", "stale_policy": "drop"}),
    "unpaced-correct": ({"max_staleness": None}, {"batching": "groups", "stale_policy": "correct"}),
}
