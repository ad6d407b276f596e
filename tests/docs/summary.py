"""The docs blocks' summary at the end of the run: how many ran, and which were marked not
runnable here, with their reasons (``tests/docs/blocks.py``). Called by ``tests/conftest.py``'s
``pytest_terminal_summary``: under pytest-xdist only the top conftest is loaded where the
summary is written (a conftest of tests/docs/ is loaded by the workers alone)."""

from __future__ import annotations

from collections import Counter

import pytest


def docs_summary(terminalreporter: pytest.TerminalReporter) -> None:
    def ours(kind: str) -> list[pytest.TestReport]:
        reports = terminalreporter.stats.get(kind, [])
        return [r for r in reports if "test_doc_blocks.py::" in getattr(r, "nodeid", "")]

    ran = [r for r in ours("passed") if r.when == "call"]
    failed = [r for r in ours("failed") if r.when == "call"]
    skipped = ours("skipped")
    if not (ran or failed or skipped):
        return
    reasons: Counter[str] = Counter()
    for r in skipped:
        text = str(r.longrepr[2]) if isinstance(r.longrepr, tuple) else str(r.longrepr)
        reasons[text.removeprefix("Skipped: ").split(": ", 1)[-1]] += 1
    tr = terminalreporter
    tr.section("docs blocks")
    tr.write_line(
        f"docs blocks: {len(ran)} ran and passed, {len(failed)} failed, "
        f"{len(skipped)} marked not runnable here"
    )
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"  {n} × {reason}")
