"""Codec: exact bytes, round trips, schema evolution both ways, and malformed input."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import struct
from pathlib import Path
from typing import Any

import fastavro
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import SCHEMA_DIR, Codec, SchemaError, SchemaVersion, crc64_avro
from schemas.flat import compile_flat, flat_fields
from schemas.records import (
    Feedback,
    MetricEvent,
    PromptTask,
    ResumePrefix,
    TrajectoryChunk,
    WeightsAnnouncement,
    decode,
    decode_as,
    encode,
    pack_logprobs,
    pack_tokens,
    unpack_logprobs,
    unpack_tokens,
)

DATA = Path(__file__).parent / "data"


# -- a tiny independent Avro encoder for the expected bytes -------------------------------
def zz(n: int) -> bytes:
    """Avro long: zigzag, then base-128 varint."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_bytes(b: bytes) -> bytes:
    return zz(len(b)) + b


def avro_str(s: str) -> bytes:
    return avro_bytes(s.encode())


def chunk() -> TrajectoryChunk:
    return TrajectoryChunk(
        trajectory_id="t1",
        prompt_id="p1",
        task_id="k1",
        sample_index=2,
        group_size=4,
        seq=0,
        token_offset=0,
        tokens=pack_tokens([1, 2, 300]),
        logprobs=pack_logprobs([-0.5, -1.0, -0.25]),
        policy_version=3,
        is_last=False,
        worker_id="w",
        bucket="le256",
        started_ms=1_700_000_000_000,
        created_ms=1_700_000_000_123,
    )


def test_crc64_avro_matches_the_spec_vector() -> None:
    # Avro specification: the fingerprint of the schema "int" is 0x7275d51a3f395c8f.
    assert crc64_avro(b'"int"') == 0x7275D51A3F395C8F


def test_exact_bytes_for_a_fixed_chunk() -> None:
    version = Codec().current["srl.TrajectoryChunk"]
    tokens = struct.pack("<3i", 1, 2, 300)
    logprobs = struct.pack("<3f", -0.5, -1.0, -0.25)
    expected = (
        b"\xc3\x01"
        + crc64_avro(version.canonical.encode()).to_bytes(8, "little")
        + avro_str("t1")
        + avro_str("p1")
        + avro_str("k1")
        + zz(2)
        + zz(4)
        + zz(0)
        + zz(0)
        + avro_bytes(tokens)
        + avro_bytes(logprobs)
        + zz(3)
        + b"\x00"
        + b"\x00"  # is_last false, finish_reason null
        + avro_str("w")
        + avro_str("le256")
        + b"\x00"
        + b"\x00"
        + b"\x00"  # predicted_length, prompt_tokens, metadata null
        + zz(1_700_000_000_000)
        + zz(1_700_000_000_123)
        + b"\x00"
        + b"\x00"  # step, step_groups null
        + b"\x00"
        + b"\x00"  # pool, pool_epoch null
        + b"\x00"
        + b"\x00"  # temperature, top_p null
    )
    assert encode(chunk()) == expected
    stepped = TrajectoryChunk(**{**chunk().to_dict(), "step": 7, "step_groups": 12})
    tail = b"\x00" * 4
    assert encode(stepped) == expected[:-6] + b"\x02" + zz(7) + b"\x02" + zz(12) + tail
    fenced = TrajectoryChunk(**{**chunk().to_dict(), "pool": "g", "pool_epoch": 3})
    pooled = b"\x02" + avro_str("g") + b"\x02" + zz(3)
    assert encode(fenced) == expected[:-4] + pooled + b"\x00\x00"
    sampled = TrajectoryChunk(**{**chunk().to_dict(), "temperature": 0.5, "top_p": 0.25})
    doubles = b"\x02" + struct.pack("<d", 0.5) + b"\x02" + struct.pack("<d", 0.25)
    assert encode(sampled) == expected[:-2] + doubles
    assert tokens == bytes.fromhex("01000000020000002c010000")


def test_a_chunk_from_before_the_sampling_settings_still_decodes() -> None:
    old = Codec(current=[SCHEMA_DIR / "history" / "trajectory_chunk.v3.avsc"])
    fields = {k: v for k, v in chunk().to_dict().items() if k not in ("temperature", "top_p")}
    got = decode_as(old.encode("srl.TrajectoryChunk", fields), TrajectoryChunk)
    assert got == chunk() and got.temperature is None and got.top_p is None


def test_round_trip_every_record_type() -> None:
    records = [
        chunk(),
        TrajectoryChunk(
            **{
                **chunk().to_dict(),
                "is_last": True,
                "finish_reason": "stop",
                "prompt_tokens": pack_tokens([5, 6]),
                "metadata": '{"answer": "42"}',
                "predicted_length": 17,
            }
        ),
        PromptTask(
            task_id="k",
            prompt_id="p",
            prompt="2+2=",
            group_size=4,
            max_new_tokens=64,
            bucket="le256",
            sample_indices=(0, 3),
            metadata='{"a": 1}',
            predicted_length=12,
            ranker_version=2,
        ),
        PromptTask(
            task_id="k",
            prompt_id="p",
            prompt="",
            group_size=4,
            max_new_tokens=64,
            bucket="gt4096",
            prompt_tokens=pack_tokens([1]),
            resume=ResumePrefix("t1", 1, 5, pack_tokens([7, 8]), 2, "migrate"),
        ),
        WeightsAnnouncement(
            run="r",
            version=7,
            manifest_uri="file:///x/manifest.json",
            manifest_sha256="ab" * 32,
            trainer_step=70,
            total_bytes=123,
            parent_version=6,
        ),
        MetricEvent(
            kind="train_step",
            source="trainer-0",
            run="r",
            step=3,
            values={"loss": 0.5},
            labels={"a": "b"},
        ),
        Feedback("t1", "cmpl-1", 2, -0.5, "host-1-serve", '{"app": "x"}', created_ms=5),
        Feedback("t2", "chatcmpl-2", 0, 1.0, "host-1-serve"),
    ]
    for rec in records:
        assert decode(encode(rec)) == rec
        assert decode_as(encode(rec), type(rec)) == rec


def test_token_packing() -> None:
    assert list(unpack_tokens(pack_tokens([0, -1, 2**31 - 1]))) == [0, -1, 2**31 - 1]
    assert unpack_logprobs(pack_logprobs([-0.5])).tolist() == [-0.5]
    with pytest.raises(SchemaError):
        unpack_tokens(b"\x00\x01\x02")


def evo_codec(current: str, *history: str) -> Codec:
    return Codec(current=[DATA / current], history=[DATA / h for h in history])


def test_old_bytes_read_with_the_evolved_schema() -> None:
    old = evo_codec("evo_v1.avsc").encode("srl.test.Evo", {"id": "a", "n": 5})
    name, rec = evo_codec("evo_v2.avsc", "evo_v1.avsc").decode(old)
    assert (name, rec) == ("srl.test.Evo", {"id": "a", "n": 5, "note": None})


def test_new_bytes_read_with_the_old_schema() -> None:
    new = evo_codec("evo_v2.avsc").encode("srl.test.Evo", {"id": "a", "n": 5, "note": "hi"})
    name, rec = evo_codec("evo_v1.avsc", "evo_v2.avsc").decode(new)
    assert (name, rec) == ("srl.test.Evo", {"id": "a", "n": 5})


def test_unknown_fingerprint_is_a_schema_error() -> None:
    new = evo_codec("evo_v2.avsc").encode("srl.test.Evo", {"id": "a", "n": 5, "note": None})
    with pytest.raises(SchemaError, match="unknown schema fingerprint"):
        evo_codec("evo_v1.avsc").decode(new)


GOOD = encode(chunk())


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"\xc3", "header"),
        (b"\xc3\x02" + GOOD[2:], "header"),
        (GOOD[:9], "header"),
        (GOOD[:10], "malformed"),
        (GOOD[:-3], "malformed"),
        (GOOD[:12], "malformed"),
        (GOOD + b"\x00", "trailing"),
        (b"\x7b\x22json\x22: 1}", "first byte"),
        (b"\x00\x00\x00\x00\x07" + GOOD[10:], "no schema registry"),
        (b"\x00\x01", "truncated Confluent"),
        (GOOD[:2] + b"\xff" * 8 + GOOD[10:], "unknown schema fingerprint"),
        # a string length that runs past the end, and invalid UTF-8 in a string
        (GOOD[:10] + zz(1000) + b"t1", "malformed"),
        (GOOD[:10] + avro_bytes(b"\xff\xfe") + GOOD[13:], "malformed"),
    ],
)
def test_malformed_input_raises_schema_error(data: bytes, reason: str) -> None:
    for read in (decode, lambda d: decode_as(d, TrajectoryChunk)):  # dict path, record path
        with pytest.raises(SchemaError, match=reason) as info:
            read(data)
        assert "\n" not in str(info.value)


def test_expecting_another_record_type_is_a_schema_error() -> None:
    with pytest.raises(SchemaError, match="expected srl.PromptTask"):
        decode_as(GOOD, PromptTask)


def test_encoding_a_bad_record_is_a_schema_error() -> None:
    bad = TrajectoryChunk(**{**chunk().to_dict(), "seq": "zero"})
    with pytest.raises(SchemaError, match="cannot encode"):
        encode(bad)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_schema_error(data: bytes) -> None:
    with contextlib.suppress(SchemaError):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=10, max_value=len(GOOD) - 1), st.integers(0, 255))
def test_flipped_body_bytes_only_ever_raise_schema_error(pos: int, value: int) -> None:
    data = bytearray(GOOD)
    data[pos] = value
    with contextlib.suppress(SchemaError):
        decode(bytes(data))
    with contextlib.suppress(SchemaError):
        decode_as(bytes(data), TrajectoryChunk)  # straight into a record: the same checks


def test_every_schema_file_is_documented() -> None:
    import json

    for path in SCHEMA_DIR.glob("*.avsc"):
        schema = json.loads(path.read_text())
        assert schema.get("doc"), path
        for f in schema["fields"]:
            assert f.get("doc"), f"{path.name}: field {f['name']} has no doc"
            if isinstance(f["type"], list) and "null" in f["type"]:
                assert "null" in f["doc"].lower(), (
                    f"{path.name}: {f['name']} must say what null means"
                )
        SchemaVersion.from_file(path)


# -- the compiled flat-record path is byte-for-byte fastavro --------------------------------
@functools.cache
def _codec() -> Codec:
    """One codec for the property tests below (reading every schema file per example was most
    of their time); the tests that check a fresh codec make their own."""
    return Codec()


@functools.cache
def _fastavro(name: str) -> tuple[Any, Any]:
    codec = _codec()
    v = codec.current[name]
    flat = compile_flat(orjson.loads(v.raw))
    assert flat is not None, f"{name} should be flat"
    return v.parsed, flat


_i32 = st.integers(-(2**31), 2**31 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_text = st.text(max_size=40)
_blob = st.binary(max_size=300)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "trajectory_id": _text,
            "prompt_id": _text,
            "task_id": _text,
            "sample_index": _i32,
            "group_size": _i32,
            "seq": _i32,
            "token_offset": _i32,
            "tokens": _blob,
            "logprobs": _blob,
            "policy_version": _i64,
            "is_last": st.booleans(),
            "finish_reason": st.none() | _text,
            "worker_id": _text,
            "bucket": _text,
            "predicted_length": st.none() | _i32,
            "prompt_tokens": st.none() | _blob,
            "metadata": st.none() | _text,
            "started_ms": _i64,
            "created_ms": _i64,
        }
    )
)
def test_flat_chunk_path_writes_and_reads_exactly_what_fastavro_does(record: dict) -> None:
    parsed, (read, write) = _fastavro("srl.TrajectoryChunk")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    assert write(record) == buf.getvalue()
    assert read(buf.getvalue()) == fastavro.schemaless_reader(
        io.BytesIO(buf.getvalue()), parsed, None
    )
    # the record-object paths (no dict, no __init__) give the same bytes and the same record
    rec = TrajectoryChunk.from_dict(record)
    assert encode(rec) == encode_via_dict(rec)
    fast = decode_as(encode(rec), TrajectoryChunk)
    assert fast == rec and type(fast) is TrajectoryChunk
    assert fast.n_tokens == len(record["tokens"]) // 4


def encode_via_dict(rec: TrajectoryChunk) -> bytes:
    return _codec().encode(rec.avro_name, rec.to_dict())


def test_record_objects_go_straight_through_the_flat_path_and_stay_frozen() -> None:
    c = chunk()
    back = decode_as(encode(c), TrajectoryChunk)
    assert back == c and hash(back) == hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.seq = 9  # type: ignore[misc]
    # ``make`` gets the values in field_names order from the compiled reader; bytes written
    # with an older schema go through fastavro's resolution and come back as a dict
    old = evo_codec("evo_v1.avsc").encode("srl.test.Evo", {"id": "a", "n": 5})
    v1 = evo_codec("evo_v1.avsc")
    assert v1.field_names("srl.test.Evo") == ("id", "n")
    assert v1.decode(old, make=lambda *v: v) == ("srl.test.Evo", ("a", 5))
    evolved = evo_codec("evo_v2.avsc", "evo_v1.avsc").decode(old, make=lambda *v: v)
    assert evolved == ("srl.test.Evo", {"id": "a", "n": 5, "note": None})


@settings(max_examples=100, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "run": _text,
            "version": _i64,
            "manifest_uri": _text,
            "manifest_sha256": _text,
            "trainer_step": _i64,
            "parent_version": st.none() | _i64,
            "total_bytes": _i64,
            "created_ms": _i64,
        }
    )
)
def test_flat_announcement_path_matches_fastavro(record: dict) -> None:
    parsed, (read, write) = _fastavro("srl.WeightsAnnouncement")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    assert write(record) == buf.getvalue() and read(buf.getvalue()) == record


@settings(max_examples=100, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "trajectory_id": _text,
            "completion_id": _text,
            "choice_index": _i32,
            "reward": st.floats(allow_nan=False),
            "metadata": st.none() | _text,
            "source": _text,
            "created_ms": _i64,
        }
    )
)
def test_flat_feedback_path_matches_fastavro(record: dict) -> None:
    parsed, (read, write) = _fastavro("srl.Feedback")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    assert write(record) == buf.getvalue() and read(buf.getvalue()) == record


def test_nested_and_map_schemas_stay_on_fastavro() -> None:
    codec = Codec()
    for name in ("srl.PromptTask", "srl.MetricEvent"):
        assert compile_flat(orjson.loads(codec.current[name].raw)) is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"seq": 2**31}, "out of int range"),
        ({"seq": None}, "no value"),
        ({"tokens": "abc"}, "expected bytes"),
        ({"is_last": 1}, "expected boolean"),
        ({"finish_reason": 5}, "expected string"),
    ],
)
def test_flat_encoding_refuses_bad_values_with_a_schema_error(change: dict, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        Codec().encode("srl.TrajectoryChunk", {**chunk().to_dict(), **change})


def _record(*types: object) -> dict[str, object]:
    return {
        "type": "record",
        "name": "R",
        "fields": [{"name": f"f{i}", "type": t} for i, t in enumerate(types)],
    }


@pytest.mark.parametrize(
    "schema, want",
    [
        (_record("long", "string"), [("f0", "long", False), ("f1", "string", False)]),
        (
            _record(["null", "bytes"], {"type": "int"}),
            [("f0", "bytes", True), ("f1", "int", False)],
        ),
        (_record(), []),
        (_record(["long", "null"]), None),  # null must come first
        (_record(["null", ["null", "int"]]), None),
        (_record({"type": "long", "logicalType": "timestamp-millis"}), None),
        (_record({"type": "array", "items": "int"}), None),
        (_record({"type": "map", "values": "double"}), None),
        ({"type": "enum", "name": "E", "symbols": ["A"]}, None),
        ("long", None),
    ],
)
def test_flat_fields(schema: object, want: list[tuple[str, str, bool]] | None) -> None:
    assert flat_fields(schema) == want
    assert (compile_flat(schema) is None) == (want is None)  # type: ignore[arg-type]
