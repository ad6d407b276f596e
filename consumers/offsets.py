"""Which consumer offsets may be committed: nothing a durable step has not finished with.

Owns the commit rule of the trainer. A record is *held* while the trajectory it belongs to
has no durable outcome (not yet trained in a checkpointed step, nor dropped, failed or
expired and checkpointed). The committable offset of a partition is the lowest held offset on
it, or one past the highest offset seen when nothing is held. Committing that is safe:
every record below it is either finished durably or a duplicate, and a restart re-reads the
rest (the ledger drops what was finished). A trajectory may span partitions (a resumed
trajectory continues in another bucket's partitions); holds are per (partition, trajectory).

Pure; the trainer calls ``seen`` per record and ``release`` after each checkpoint.
"""

from __future__ import annotations

from collections import defaultdict


class OffsetTracker:
    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}  # one past the highest offset seen
        self.holds: dict[tuple[str, int], dict[str, int]] = defaultdict(dict)  # tid -> min offset
        self.committed: dict[tuple[str, int], int] = {}

    def seen(self, topic: str, partition: int, offset: int, holder: str | None) -> None:
        """Record offset ``offset``; ``holder`` is the trajectory it waits for (None: nothing)."""
        tp = (topic, partition)
        self.next[tp] = max(self.next.get(tp, 0), offset + 1)
        if holder is not None:
            held = self.holds[tp]
            held[holder] = min(held.get(holder, offset), offset)

    def release(self, holders: set[str]) -> None:
        """Trajectories whose outcome is now durable no longer hold their records."""
        if not holders:
            return
        for held in self.holds.values():
            for tid in holders & held.keys():
                del held[tid]

    def committable(self) -> dict[tuple[str, int], int]:
        """Offsets to commit now: only partitions whose committable offset moved forward."""
        out = {}
        for tp, nxt in self.next.items():
            held = self.holds.get(tp)
            off = min(held.values()) if held else nxt
            if off > self.committed.get(tp, -1):
                out[tp] = off
        return out

    def mark_committed(self, offsets: dict[tuple[str, int], int]) -> None:
        self.committed.update(offsets)
