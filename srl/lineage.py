"""Which chunks of one trajectory count, when a writer may have been fenced: ``Lineage``.

A generator that was silent for its session timeout (SIGSTOPped, cut off by the network) is
dropped from its pool; another worker reads the trajectories it was writing back and resumes
them from their published prefixes. The silent one, a *zombie*, may still publish: chunks
that sat in its producer's queue go out the moment it runs again, before it can learn that
it was dropped. So two different chunks with the same ``(trajectory_id, seq)`` can exist: the
zombie's and its successor's. Every writer under pool epochs stamps its chunks with its pool
and the epoch in which it held the task's partition (``TrajectoryChunk.pool``,
``pool_epoch``); successive holders of a partition have increasing epochs. The rule, applied
to one trajectory's chunks in log order (they share one partition per pool):

* a chunk of epoch ``e`` of pool ``p`` at seq ``s`` is *fenced* (dropped) when a chunk of a
  newer epoch of ``p`` was already seen at a seq ``<= s``: it continues a prefix that a newer
  writer has continued already;
* a chunk of epoch ``e`` of ``p`` at seq ``s`` removes the held chunks of older epochs of
  ``p`` at seqs ``>= s`` (the zombie's, which landed before its successor's first chunk);
  chunks below ``s`` are the prefix the successor read, and stay;
* otherwise the first copy of a seq wins (a later one is a duplicate: a producer retry, a
  replay); chunks without a pool (written outside pool epochs) follow this rule alone;
* once complete (its last chunk and every seq below it held), a trajectory is final: what
  arrives later changes nothing. So every reader (the trainer's assembler, a generator
  reading a prefix back, an audit) that reads the log in order reaches the same trajectory,
  whichever writer's chain that is.

Chunks of another pool never fence each other: a trajectory changes pool only by migration,
whose hand-off chunk is acknowledged before the next pool is told to continue it. But a
fenced writer's hand-off can still go out (a request in flight through a network partition,
answered when it heals) while its successor, which read the prefix before, continues the
trajectory in its own pool: when the chain completes, another pool's chunks that follow no
``MIGRATED`` hand-off are *orphans*, dropped and counted as fenced, and the chain waits for
the successor's own chunks (found in the 30-minute soak: 8 trajectories dead-lettered as
inconsistent, docs/reliability.md).

Pure logic, no Kafka. Used by ``consumers.assembler`` and ``producers.recovery``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from schemas.records import MIGRATED, TrajectoryChunk

Verdict = Literal["kept", "duplicate", "fenced"]


@dataclass
class Lineage:
    """The chunks that count of one trajectory, by seq, read in log order."""

    chunks: dict[int, TrajectoryChunk] = field(default_factory=dict)
    last_seq: int | None = None  # seq of the held last chunk
    fenced: int = 0  # chunks dropped (or removed) as a fenced writer's
    done: bool = False  # complete: nothing that arrives later counts
    _starts: dict[str, dict[int, int]] = field(default_factory=dict)  # pool -> epoch -> 1st seq

    def add(self, c: TrajectoryChunk) -> Verdict:
        """Apply one chunk (the module docstring's rule); what became of it."""
        if self.fences(c):
            self.fenced += 1
            return "fenced"
        if self.done:
            return "duplicate"
        if c.pool is not None and c.pool_epoch is not None:
            starts = self._starts.setdefault(c.pool, {})
            starts[c.pool_epoch] = min(starts.get(c.pool_epoch, c.seq), c.seq)
            if len(starts) > 1:  # one writer so far (the usual case): nothing to cut
                self._cut(c.pool, c.pool_epoch, c.seq)
        if (orphan := self._crossed(c)) is not None:
            if orphan is c:
                self.fenced += 1
                return "fenced"
            self._drop_orphans(c.seq, orphan.pool)
        if c.seq in self.chunks:
            return "duplicate"
        self.chunks[c.seq] = c
        if c.is_last:
            self.last_seq = c.seq
        self.done = (
            self.last_seq is not None
            and len(self.chunks) > self.last_seq
            and all(s in self.chunks for s in range(self.last_seq + 1))
        )
        if self.done and (at := self._orphaned()) is not None:
            self._drop_orphans(*at)
            if c.seq not in self.chunks:
                return "fenced"
        return "kept"

    # -- orphans: another pool's chunks that continue no hand-off ---------------------------
    # Where a chain changes pool at seq ``s``, the chunk at ``s - 1`` must be a ``MIGRATED``
    # hand-off. A fenced writer whose hand-off went out after its fencing (its request in
    # flight through a network partition) sends the long-tail pool on, while its successor
    # continues the same trajectory in its own pool: the successor's chain counts, the other
    # pool's chunks from ``s`` on are orphans. A pool's chunks arrive in seq order (one
    # partition), so the successor's chunk at ``s - 1`` is held when either copy of ``s``
    # arrives; a chain completed with an orphan in it is checked again (``_orphaned``).
    def _crossed(self, c: TrajectoryChunk) -> TrajectoryChunk | None:
        """The orphan when ``c`` and the held chunk at its seq are of two pools and the held
        chunk before them continues in ``c``'s or the held one's pool without a hand-off."""
        held, prev = self.chunks.get(c.seq), self.chunks.get(c.seq - 1)
        if held is None or prev is None or None in (held.pool, c.pool, prev.pool):
            return None
        if held.pool == c.pool or prev.finish_reason == MIGRATED or not self._succeeded(prev):
            return None
        if prev.pool == c.pool:
            return held
        return c if prev.pool == held.pool else None

    def _orphaned(self) -> tuple[int, str | None] | None:
        """Where a complete chain changes pool without a hand-off: (seq, the later pool)."""
        assert self.last_seq is not None
        for s in range(1, self.last_seq + 1):
            prev, cur = self.chunks[s - 1], self.chunks[s]
            switched = None not in (prev.pool, cur.pool) and prev.pool != cur.pool
            if switched and prev.finish_reason != MIGRATED and self._succeeded(prev):
                return s, cur.pool
        return None

    def _succeeded(self, c: TrajectoryChunk) -> bool:
        """``c``'s pool had a successor writer (two epochs): only then can another pool's
        chain be an orphan (a worker taken over under a new group continues legitimately)."""
        return len(self._starts.get(c.pool or "", {})) > 1

    def _drop_orphans(self, seq: int, pool: str | None) -> None:
        for s in [s for s, c in self.chunks.items() if s >= seq and c.pool == pool]:
            del self.chunks[s]
            self.fenced += 1
            if s == self.last_seq:
                self.last_seq = None
        self.done = False

    def fences(self, c: TrajectoryChunk) -> bool:
        """``c`` is a fenced writer's: a newer epoch of its pool was seen at a seq ``<= c.seq``."""
        if c.pool is None or c.pool_epoch is None:
            return False
        starts = self._starts.get(c.pool, {})
        return any(e > c.pool_epoch and first <= c.seq for e, first in starts.items())

    def _cut(self, pool: str, epoch: int, seq: int) -> None:
        """Remove the held chunks of older epochs of ``pool`` at ``seq`` and after."""
        for s in [
            s
            for s, c in self.chunks.items()
            if s >= seq and c.pool == pool and (c.pool_epoch or 0) < epoch
        ]:
            del self.chunks[s]
            self.fenced += 1
            if s == self.last_seq:
                self.last_seq = None

    def complete(self) -> bool:
        """The last chunk and every seq below it are held (final from then on)."""
        return self.done

    def contiguous(self, first_seq: int) -> list[TrajectoryChunk]:
        """The held chunks from ``first_seq`` up to the first gap or the last chunk."""
        out, seq = [], first_seq
        while seq in self.chunks:
            out.append(self.chunks[seq])
            if self.chunks[seq].is_last:
                break
            seq += 1
        return out

    def beyond_last(self) -> list[int]:
        """Held seqs after the last chunk written by the last chunk's own writer (a producer
        bug; another writer's are a different lineage's and do not count)."""
        if self.last_seq is None:
            return []
        last = self.chunks[self.last_seq]
        return sorted(
            s
            for s, c in self.chunks.items()
            if s > self.last_seq and (c.pool, c.pool_epoch) == (last.pool, last.pool_epoch)
        )
