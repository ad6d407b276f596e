"""What ``srl chaos`` shows: one row per fault injected, as JSON or a table, and its progress.

Owns :class:`Row` (the acceptance of one fault: recovered within :data:`RECOVERY_BOUND_S`,
nothing lost, trained twice, published twice or dropped as stale, staleness never above k,
every step of the run trained),
``result`` (the ``--json`` document: ``{"k": K, "faults": [{"fault", "recovered_s", "lost",
"trained_twice", "max_staleness", …}, …]}``), ``table`` (the human view) and
:class:`Progress` (one line per phase on stderr; a live line on a terminal). Used by
``app.chaos.run`` and the CLI.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import click

RECOVERY_BOUND_S = 30.0


@dataclass
class Row:
    fault: str
    recovered_s: float | None
    lost: int
    trained_twice: int
    max_staleness: int
    published_twice: int = 0
    dropped: int = 0  # dropped as stale: the paced pipeline drops none unless a fault made it
    complete: bool = True  # the run did all its steps (a stalled pipeline fails every row)
    note: str = ""
    skipped: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def ok(self, k: int) -> bool:
        return (
            self.skipped is None
            and self.recovered_s is not None
            and self.recovered_s <= RECOVERY_BOUND_S
            and self.lost == 0
            and self.trained_twice == 0
            and self.published_twice == 0
            and self.dropped == 0
            and self.max_staleness <= k
            and self.complete
        )

    def to_dict(self, k: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fault": self.fault,
            "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 1),
            "lost": self.lost,
            "trained_twice": self.trained_twice,
            "max_staleness": self.max_staleness,
            "published_twice": self.published_twice,
            "dropped": self.dropped,
            "run_complete": self.complete,
            "ok": self.ok(k),
            "note": self.note,
        }
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out | {"detail": self.detail}


def result(k: int, rows: list[Row], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"k": k, "faults": [r.to_dict(k) for r in rows], **(extra or {})}


def table(res: dict[str, Any]) -> str:
    """The rows as a table (rich), then each failing row's note."""
    from rich.console import Console
    from rich.table import Table

    t = Table("FAULT", "RECOVERED S", "LOST", "TRAINED TWICE", "MAX STALENESS", "OK", box=None)
    if "broker" in res:
        t.title = f"srl chaos on the {res['broker']} broker, k = {res['k']}"
    for r in res["faults"]:
        rec = "-" if r["recovered_s"] is None else f"{r['recovered_s']:.1f}"
        ok = "skipped" if "skipped" in r else ("yes" if r["ok"] else "NO")
        t.add_row(
            r["fault"], rec, str(r["lost"]), str(r["trained_twice"]), str(r["max_staleness"]), ok
        )
    console = Console(record=True, width=110)
    with console.capture() as cap:
        console.print(t)
    notes = [f"{r['fault']}: {r.get('skipped') or r['note']}" for r in res["faults"] if not r["ok"]]
    head = f"k = {res['k']}; acceptance: recovered <= {RECOVERY_BOUND_S:g} s, lost 0, trained "
    head += "twice 0, published twice 0, dropped 0, staleness <= k, every step trained\n"
    return head + cap.get() + ("\n".join(notes) + "\n" if notes else "")


class Progress:
    """``phase(run, text)``: one line per phase on stderr (``quiet``: none)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.live = sys.stderr.isatty()
        self.last = ""

    def phase(self, run: str, text: str) -> None:
        line = f"[{run}] {text}"
        if self.quiet or line == self.last:
            return
        self.last = line
        if self.live:
            click.echo("\r\033[K" + line[:150], err=True, nl=False)
        else:
            click.echo(line, err=True)

    def done(self, run: str, text: str) -> None:
        if not self.quiet:
            click.echo(("\r\033[K" if self.live else "") + f"[{run}] {text}", err=True)
        self.last = ""
