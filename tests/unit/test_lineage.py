"""``srl.lineage``: which chunks of a trajectory count when a zombie writer was fenced.

Each case is a log (chunks in the order a reader meets them) and the chain it must come to:
(seq, writer) pairs, the verdicts, and the fenced count. Writers are ``pool@epoch``.
"""

from __future__ import annotations

import pytest

from schemas.records import MIGRATED, TrajectoryChunk, pack_logprobs, pack_tokens
from srl.lineage import Lineage


def ch(
    seq: int, writer: str | None, last: bool = False, reason: str | None = None
) -> TrajectoryChunk:
    pool, epoch = writer.split("@") if writer else (None, None)
    return TrajectoryChunk(
        trajectory_id="t",
        prompt_id="p",
        task_id="k",
        sample_index=0,
        group_size=1,
        seq=seq,
        token_offset=seq,
        tokens=pack_tokens([seq]),
        logprobs=pack_logprobs([-1.0]),
        policy_version=0,
        is_last=last,
        finish_reason="stop" if last else reason,
        worker_id=writer or "w",
        bucket="le256",
        started_ms=0,
        pool=pool,
        pool_epoch=int(epoch) if epoch is not None else None,
    )


def chain(lin: Lineage) -> list[tuple[int, str]]:
    return [(s, c.worker_id) for s, c in sorted(lin.chunks.items())]


CASES = [
    (  # no pool epochs: the first copy of a seq wins, as before
        "unfenced",
        [ch(0, None), ch(1, None), ch(1, None), ch(2, None, last=True)],
        ["kept", "kept", "duplicate", "kept"],
        [(0, "w"), (1, "w"), (2, "w")],
        0,
    ),
    (  # the zombie's queued chunks land after its successor's first chunk: dropped
        "zombie after",
        [ch(0, "p@1"), ch(1, "p@1"), ch(2, "p@2"), ch(2, "p@1"), ch(3, "p@1"), ch(3, "p@2")],
        ["kept", "kept", "kept", "fenced", "fenced", "kept"],
        [(0, "p@1"), (1, "p@1"), (2, "p@2"), (3, "p@2")],
        2,
    ),
    (  # they land before it: the successor's first chunk removes them
        "zombie before",
        [ch(0, "p@1"), ch(1, "p@1"), ch(2, "p@1"), ch(3, "p@1"), ch(2, "p@2"), ch(3, "p@1")],
        ["kept", "kept", "kept", "kept", "kept", "fenced"],
        [(0, "p@1"), (1, "p@1"), (2, "p@2")],
        3,
    ),
    (  # the zombie's chain completed first: final, the successor's chunks change nothing
        "zombie complete first",
        [ch(0, "p@1"), ch(1, "p@1", last=True), ch(1, "p@2"), ch(2, "p@2", last=True)],
        ["kept", "kept", "duplicate", "duplicate"],
        [(0, "p@1"), (1, "p@1")],
        0,
    ),
    (  # three holders; the prefix written in older epochs below the newest's start stays
        "three epochs",
        [ch(0, "p@1"), ch(1, "p@2"), ch(2, "p@2"), ch(3, "p@3"), ch(3, "p@2"), ch(1, "p@1")],
        ["kept", "kept", "kept", "kept", "fenced", "fenced"],
        [(0, "p@1"), (1, "p@2"), (2, "p@2"), (3, "p@3")],
        2,
    ),
    (  # migration: another pool's epochs never fence this one's
        "other pool",
        [ch(0, "a@7"), ch(1, "a@7", reason=MIGRATED), ch(2, "b@1"), ch(3, "b@1", last=True)],
        ["kept", "kept", "kept", "kept"],
        [(0, "a@7"), (1, "a@7"), (2, "b@1"), (3, "b@1")],
        0,
    ),
    (  # a worker taken over under a new group (--take-over-from): another pool, no
        # hand-off, but no successor in the old pool either: its chain counts
        "taken over",
        [ch(0, "a@1"), ch(1, "a@1"), ch(2, "g@1"), ch(3, "g@1", last=True)],
        ["kept", "kept", "kept", "kept"],
        [(0, "a@1"), (1, "a@1"), (2, "g@1"), (3, "g@1")],
        0,
    ),
    (  # a fenced writer's hand-off went out after its successor continued in its own pool:
        # the long-tail pool's chain follows no hand-off that counts, so it is dropped
        "orphaned migration",
        [
            ch(0, "a@1"),
            ch(1, "a@2"),
            ch(1, "a@1", reason=MIGRATED),
            ch(2, "b@1"),
            ch(3, "b@1", last=True),
            ch(2, "a@2"),
            ch(3, "a@2", last=True),
        ],
        ["kept", "kept", "fenced", "kept", "fenced", "kept", "kept"],
        [(0, "a@1"), (1, "a@2"), (2, "a@2"), (3, "a@2")],
        3,
    ),
    (  # the same, the successor's copy of seq 2 meets the orphan's: it replaces it
        "orphaned migration, crossing",
        [
            ch(0, "a@1"),
            ch(1, "a@2"),
            ch(2, "b@1"),
            ch(2, "a@2"),
            ch(3, "b@1", last=True),
            ch(3, "a@2", last=True),
        ],
        ["kept", "kept", "kept", "kept", "fenced", "kept"],
        [(0, "a@1"), (1, "a@2"), (2, "a@2"), (3, "a@2")],
        2,
    ),
    (  # the same, the long-tail pool's partition read first
        "orphaned migration read first",
        [
            ch(2, "b@1"),
            ch(3, "b@1", last=True),
            ch(0, "a@1"),
            ch(1, "a@2"),
            ch(2, "a@2"),
            ch(3, "a@2", last=True),
        ],
        ["kept", "kept", "kept", "kept", "kept", "kept"],
        [(0, "a@1"), (1, "a@2"), (2, "a@2"), (3, "a@2")],
        2,
    ),
]


@pytest.mark.parametrize(
    ("log", "verdicts", "expected", "fenced"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_the_chain_a_reader_comes_to(
    log: list[TrajectoryChunk], verdicts: list[str], expected: list[tuple[int, str]], fenced: int
) -> None:
    lin = Lineage()
    assert [lin.add(c) for c in log] == verdicts
    assert chain(lin) == expected and lin.fenced == fenced


def test_complete_and_contiguous_follow_the_chain_that_counts() -> None:
    lin = Lineage()
    for c in (ch(0, "p@1"), ch(1, "p@1"), ch(2, "p@1", last=True)):
        if c.seq < 2:
            lin.add(c)
    lin.add(ch(1, "p@2"))  # the successor took over at seq 1 before the zombie's last landed
    assert lin.add(ch(2, "p@1", last=True)) == "fenced"
    assert not lin.complete() and lin.last_seq is None
    assert [c.worker_id for c in lin.contiguous(0)] == ["p@1", "p@2"]
    lin.add(ch(2, "p@2", last=True))
    assert lin.complete() and [c.worker_id for c in lin.contiguous(0)] == ["p@1", "p@2", "p@2"]


def test_only_the_last_chunks_own_writer_counts_beyond_it() -> None:
    lin = Lineage()
    lin.add(ch(3, "b@1"))  # read early from another partition: another lineage's
    lin.add(ch(0, "a@1"))
    lin.add(ch(1, "a@1", last=True))
    assert lin.beyond_last() == [] and lin.complete()
    bad = Lineage()
    for c in (ch(0, "a@1"), ch(2, "a@1"), ch(1, "a@1", last=True)):
        bad.add(c)
    assert bad.beyond_last() == [2]
