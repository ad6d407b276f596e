"""An outside consumer's view: decode srl records with nothing but fastavro and the .avsc files.

The decoding half of this test imports no srl code; only producing the bytes does.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import fastavro
import fastavro.schema

from schemas.records import (
    MetricEvent,
    PromptTask,
    TrajectoryChunk,
    encode,
    pack_logprobs,
    pack_tokens,
)

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def outside_decoder() -> dict[bytes, dict]:
    """fingerprint (8 bytes, as on the wire) -> parsed schema, from the .avsc files alone."""
    table = {}
    for path in sorted(SCHEMAS.glob("*.avsc")) + sorted((SCHEMAS / "history").glob("*.avsc")):
        parsed = fastavro.parse_schema(json.loads(path.read_text()), named_schemas={})
        canonical = fastavro.schema.to_parsing_canonical_form(parsed)
        fp = bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))
        table[fp] = parsed
    return table


def outside_decode(table: dict[bytes, dict], data: bytes) -> dict:
    assert data[:2] == b"\xc3\x01", "Avro single-object encoding"
    schema = table[data[2:10]]
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None)


def test_outside_consumer_decodes_with_fastavro_and_the_schema_files() -> None:
    table = outside_decoder()
    c = TrajectoryChunk(
        trajectory_id="traj",
        prompt_id="p",
        task_id="t",
        sample_index=1,
        group_size=2,
        seq=3,
        token_offset=48,
        tokens=pack_tokens([10, 20]),
        logprobs=pack_logprobs([-0.1, -0.2]),
        policy_version=4,
        is_last=True,
        worker_id="w",
        bucket="le1024",
        started_ms=1,
        created_ms=2,
        finish_reason="stop",
    )
    rec = outside_decode(table, encode(c))
    assert rec["trajectory_id"] == "traj" and rec["seq"] == 3 and rec["finish_reason"] == "stop"
    assert struct.unpack("<2i", rec["tokens"]) == (10, 20)
    assert struct.unpack("<2f", rec["logprobs"]) == struct.unpack(
        "<2f", struct.pack("<2f", -0.1, -0.2)
    )

    task = PromptTask(
        task_id="t", prompt_id="p", prompt="hi", group_size=2, max_new_tokens=8, bucket="le256"
    )
    assert outside_decode(table, encode(task))["prompt"] == "hi"
    event = MetricEvent(kind="sample", source="s", run="r", values={"staleness": 1.0})
    assert outside_decode(table, encode(event))["values"] == {"staleness": 1.0}
