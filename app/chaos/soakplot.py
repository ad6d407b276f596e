"""The soak's series on disk and in a picture: ``soak.json``, ``soak.csv``, ``soak.png``.

Owns how ``app.chaos.soak``'s samples are written and summarised. The summary gives, per
series, its value after warm-up (the first quarter of the run is warm-up) and at the end, and
its growth per 10 minutes over the rest (a least-squares slope): what "flat after warm-up"
is judged by. The plot has one panel per kind (RSS of every role, the newest checkpoint, the
broker's data and the object store), the faults as vertical lines, and the machine's load in
the title. Called by ``app.chaos.soak``.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from app.chaos.config import ChaosConfig

WARMUP_SHARE = 0.25


def growth(t: list[float], y: list[float | None]) -> dict[str, float | None]:
    """After warm-up: first and last value, and the slope in units per 10 minutes."""
    pts = [(a, b) for a, b in zip(t, y, strict=True) if b is not None]
    if not pts:
        return {"after_warmup": None, "end": None, "per_10min": None}
    start = pts[0][0] + WARMUP_SHARE * (pts[-1][0] - pts[0][0])
    rest = [(a, b) for a, b in pts if a >= start] or pts
    slope = (
        float(np.polyfit([a for a, _ in rest], [b for _, b in rest], 1)[0])
        if len(rest) > 1
        else 0.0
    )
    return {
        "after_warmup": round(rest[0][1], 2),
        "end": round(rest[-1][1], 2),
        "per_10min": round(slope * 600, 2),
    }


def columns(series: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """Every plotted quantity as one column: ``rss_mb.ROLE``, ``checkpoint_mb``, …"""
    roles = sorted({r for s in series for r in s["rss_mb"]})
    cols: dict[str, list[float | None]] = {
        k: [s[k] for s in series]
        for k in ("t_s", "step", "checkpoint_mb", "broker_data_mb", "store_mb", "load1")
    }
    for r in roles:
        cols[f"rss_mb.{r}"] = [s["rss_mb"].get(r) for s in series]
    return cols


def write_series(
    out: Path, series: list[dict[str, Any]], faults: list[Any], cfg: ChaosConfig, seconds: float
) -> dict[str, Any]:
    """Write soak.json, soak.csv and soak.png under ``out``; the summary."""
    cols = columns(series)
    t = [float(x or 0) for x in cols["t_s"]]
    summary: dict[str, Any] = {
        "seconds": seconds,
        "fault_every_s": cfg.fault_every_s,
        "samples": len(series),
        "steps": max((s["step"] for s in series), default=0),
        "load1_mean": round(float(np.mean([s["load1"] for s in series])), 2) if series else None,
        "growth": {k: growth(t, v) for k, v in cols.items() if k not in ("t_s", "step", "load1")},
        "faults": [{"fault": p.name, "at_s": p.offset_s} for p in faults if p.thread],
    }
    (out / "soak.json").write_bytes(
        orjson.dumps({"summary": summary, "series": series}, option=orjson.OPT_INDENT_2)
    )
    with (out / "soak.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(cols))
        w.writerows(zip(*cols.values(), strict=True))
    plot(cols, summary, out / "soak.png")
    return summary


def plot(cols: dict[str, list[float | None]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [float(x or 0) / 60 for x in cols["t_s"]]

    def y(key: str) -> list[float]:
        return [np.nan if x is None else float(x) for x in cols[key]]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes.ravel()
    for k in cols:
        if k.startswith("rss_mb."):
            ax[0].plot(t, y(k), label=k.removeprefix("rss_mb."))
    ax[0].set(title="resident memory of every role", ylabel="MB")
    ax[0].legend(fontsize=7)
    ax[1].plot(t, y("checkpoint_mb"), color="C3")
    ax[1].set(title="newest complete checkpoint (model, optimizer, ledger)", ylabel="MB")
    ax[2].plot(t, y("broker_data_mb"), color="C0")
    ax[2].set(title="broker data directory", ylabel="MB")
    ax[3].plot(t, y("store_mb"), color="C1")
    ax[3].set(title="object store (every published version, checkpoints)", ylabel="MB")
    for a in ax:
        a.set_xlabel("minutes")
        a.set_ylim(0, max(1e-3, a.get_ylim()[1]) * 1.15)  # from zero: growth shows as it is
        for f in summary["faults"]:
            a.axvline(f["at_s"] / 60, color="grey", alpha=0.25, lw=0.8)
    fig.suptitle(
        f"srl chaos --soak {summary['seconds']:g}: {summary['steps']} steps, a fault every "
        f"{summary['fault_every_s']:g} s (grey lines); load average {summary['load1_mean']} on "
        f"{_cores()} cores",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cores() -> int:
    return len(os.sched_getaffinity(0))
