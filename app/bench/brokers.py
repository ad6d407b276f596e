"""The brokers a benchmark runs on, side by side in one run: ``--broker embedded|kafka``.

Owns :func:`on_brokers` (what the repeatable ``--broker`` of ``srl bench dataplane``,
``pipeline``, ``serve`` and ``idle`` does, ``app.bench.cli``): the benchmark once on a fresh
broker of each engine asked for (``srl.broker.temporary``: the embedded noida-db, or one
Apache Kafka node in KRaft mode), one after the other, or once on ``--bootstrap`` (a broker
the user runs). The result is keyed by engine (``"external"`` for ``--bootstrap``), so that
both brokers' figures come from one command on the same machine at the same time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from srl.broker import temporary

EXTERNAL = "external"


def on_brokers(
    brokers: tuple[str, ...],
    external: str | None,
    run: Callable[[str], dict[str, Any]],
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """``run(bootstrap)`` on ``external``, or on a fresh broker of each of ``brokers``."""
    if external is not None:
        return {EXTERNAL: run(external)}
    out: dict[str, dict[str, Any]] = {}
    for engine in dict.fromkeys(brokers):  # each once, in the order given
        if progress is not None:
            progress(engine)
        with temporary(engine) as b:  # type: ignore[arg-type]
            out[engine] = run(b.bootstrap)
    return out
