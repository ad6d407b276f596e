"""The demo audit's classification (pending vs lost) and the report plot."""

from __future__ import annotations

from pathlib import Path

from app.report import Audit, TrajSeen, plot


def seen(partition: int, first: int, seqs: range, last: bool = True) -> TrajSeen:
    s = TrajSeen(partition, first, seqs=set(seqs))
    s.last_seq = max(seqs) if last else None
    return s


def test_pending_is_at_or_after_the_committed_offset_and_lost_is_below_it() -> None:
    audit = Audit(
        trajectories={
            "trained": seen(0, 0, range(3)),
            "unread": seen(0, 10, range(2)),  # first chunk at the committed offset
            "skipped": seen(0, 4, range(2)),  # below it, never decided: lost
            "other-partition": seen(1, 0, range(1)),  # nothing committed there
            "cut": seen(0, 12, range(2), last=False),  # no last chunk: not generated
            "gap": seen(0, 14, range(0, 3, 2)),  # seq 1 missing: not complete
        },
        duplicate_chunks=0,
        undecodable=0,
        outcomes={"trained": "trained"},
        decided_twice=0,
        committed={0: 10, 1: None},
    )
    assert audit.generated == {"trained", "unread", "skipped", "other-partition"}
    assert audit.pending() == {"unread", "other-partition"}
    assert audit.lost() == {"skipped"}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    report = {
        "mode": "async",
        "seed": 0,
        "eval_accuracy_before": 0.2,
        "eval_accuracy_after": 0.5,
        "steps": 3,
        "wall_s": 10.0,
        "lost": 0,
        "eval_prompts": 8,
        "staleness_hist": {"0": 5, "1": 3},
        "series": {
            "step": [1, 2, 3],
            "t_s": [1.0, 2.0, 3.0],
            "reward_mean": [0.1, 0.3, 0.4],
            "train_tokens_per_s": [10.0, 12.0, 11.0],
            "staleness_mean": [0, 0.5, 0.4],
            "gen": [[0.5, "regular-0", 100.0], [1.5, "regular-0", 120.0]],
            "ready_latency_ms": [5.0, 7.0, 30.0],
        },
    }
    plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
