"""Poison records for an input topic: each kind of bad value a consumer must dead-letter (or,
for the monitor, count) without stopping, and the reason it must give.

``kinds(good, wrong, oversized)`` makes, from a good record of the topic's type, another record
type and an over-large but well-formed record of the topic's type: garbage bytes, an unknown
schema fingerprint, a truncated record, the oversized one, and the wrong schema.
"""

from __future__ import annotations

from typing import Any

from schemas.records import Record, encode
from srl.metrics import MAX_RECORD_BYTES

# kind -> what the reason header starts with
REASONS = {
    "garbage": "undecodable: not an srl record",
    "unknown fingerprint": "undecodable: unknown schema fingerprint",
    "truncated": "undecodable: malformed",
    "oversized": "oversized: ",
    "wrong schema": "undecodable: expected srl.",
}
BIG = MAX_RECORD_BYTES + 4096  # a field this long makes a record oversized


def kinds(good: Record, wrong: Record, oversized: Record) -> dict[str, bytes]:
    raw = encode(good)
    big = encode(oversized)
    assert len(big) > MAX_RECORD_BYTES
    return {
        "garbage": b"\x17 this is not an srl record",
        "unknown fingerprint": raw[:2] + bytes(8) + raw[10:],
        "truncated": raw[: len(raw) // 2],
        "oversized": big,
        "wrong schema": encode(wrong),
    }


def dead_letters(cfg: Any) -> list[tuple[str, str, bytes]]:
    """(reason, origin, value) of every record on the DLQ."""
    from srl.kafka import read_range
    from srl.topics import Layout

    out = []
    for m in read_range(cfg, Layout.from_config(cfg).dlq, timeout_s=20, role="poison-dlq"):
        h = {k: v for k, v in m.headers() or []}
        out.append((h["srl.reason"].decode(), h["srl.origin"].decode(), m.value() or b""))
    return out


def check_reasons(found: list[tuple[str, str, bytes]], expected: dict[str, str]) -> None:
    """Each expected kind (name -> what its reason contains) dead-lettered exactly once, and
    nothing else."""
    reasons = [r for r, _, _ in found]
    assert len(reasons) == len(expected), reasons
    for kind, part in expected.items():
        assert sum(part in r for r in reasons) == 1, f"{kind}: no single {part!r} in {reasons}"
