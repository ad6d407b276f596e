"""Avro codec for every record srl puts on Kafka.

Owns the wire format. Two framings, told apart by the first byte:

* ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint + Avro body: Avro single-object
  encoding, the default. Anyone holding the ``.avsc`` files can decode it.
* ``00`` + 4-byte big-endian schema id + Avro body: Confluent Schema Registry framing, used
  when a registry URL is configured (``schema_registry_url``).

Invariants:

* ``decode`` raises :class:`SchemaError` with a one-line reason for any malformed input
  (garbage, truncated, trailing bytes, unknown fingerprint or id); no other exception escapes.
* The writer schema is found by fingerprint among every known version (the current files in
  ``schemas/`` and the old ones in ``schemas/history/``); the reader schema is the current
  version, so old bytes gain new fields' defaults and new bytes lose fields old readers lack.

Called by ``schemas.records`` (typed encode/decode) and by tests; nothing else touches bytes.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import fastavro

from schemas.errors import SchemaError
from schemas.flat import compile_flat

SCHEMA_DIR = Path(__file__).resolve().parent
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0x00
_SO_HEADER = len(SINGLE_OBJECT_MAGIC) + 8
_CF_HEADER = 5


def _crc64_table() -> list[int]:
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO (Rabin) fingerprint of ``data``, as the Avro specification defines it."""
    fp = 0xC15D213AA4D7A795
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp


@dataclass(frozen=True)
class SchemaVersion:
    """One version of one named record schema."""

    name: str  # full name, e.g. "srl.TrajectoryChunk"
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO of the parsing canonical form
    canonical: str  # parsing canonical form
    parsed: Any  # fastavro parsed schema
    source: str  # file it came from, for messages
    raw: str  # the schema JSON as written (defaults and docs kept), for a registry

    @classmethod
    def from_json(cls, schema: dict[str, Any], source: str = "<dict>") -> SchemaVersion:
        try:
            parsed: Any = fastavro.parse_schema(schema, named_schemas={})
            canonical = fastavro.schema.to_parsing_canonical_form(parsed)
        except Exception as e:  # fastavro raises several kinds for a bad schema
            raise SchemaError(f"invalid schema in {source}: {_one_line(e)}") from None
        fp = crc64_avro(canonical.encode()).to_bytes(8, "little")
        return cls(str(parsed["name"]), fp, canonical, parsed, source, json.dumps(schema))

    @classmethod
    def from_file(cls, path: Path) -> SchemaVersion:
        try:
            schema = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SchemaError(f"cannot read schema {path}: {_one_line(e)}") from None
        return cls.from_json(schema, str(path))


class Registry(Protocol):
    """What the codec needs from a Confluent-compatible schema registry."""

    def id_for(self, version: SchemaVersion) -> int: ...

    def schema_for(self, schema_id: int) -> dict[str, Any]: ...


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())[:300]


class Codec:
    """Encodes and decodes srl records.

    ``current`` files define the schema each name is written and read with; ``history``
    files are older versions, known only so that their bytes decode.
    """

    def __init__(
        self,
        current: Iterable[Path] | None = None,
        history: Iterable[Path] | None = None,
        registry: Registry | None = None,
    ) -> None:
        if current is None:
            current = sorted(SCHEMA_DIR.glob("*.avsc"))
            history = (
                sorted((SCHEMA_DIR / "history").glob("*.avsc")) if history is None else history
            )
        self.current: dict[str, SchemaVersion] = {}
        self.by_fingerprint: dict[bytes, SchemaVersion] = {}
        for path in current:
            v = SchemaVersion.from_file(Path(path))
            self.current[v.name] = v
            self.by_fingerprint[v.fingerprint] = v
        for path in history or ():
            v = SchemaVersion.from_file(Path(path))
            self.by_fingerprint.setdefault(v.fingerprint, v)
        # compiled reader/writer of each current flat schema (schemas.flat): the hot path
        self._flat = {
            v.fingerprint: f
            for v in self.current.values()
            if (f := compile_flat(json.loads(v.raw))) is not None
        }
        self.registry = registry
        self._registry_ids: dict[bytes, int] = {}
        self._registry_schemas: dict[int, SchemaVersion] = {}

    # -- encode ------------------------------------------------------------------------
    def is_flat(self, name: str) -> bool:
        """Whether the current schema ``name`` has the compiled reader and writer."""
        return self._current(name).fingerprint in self._flat

    def field_names(self, name: str) -> tuple[str, ...]:
        """The current schema's field names, in its order (a flat reader's ``make`` order)."""
        return tuple(f["name"] for f in json.loads(self._current(name).raw)["fields"])

    def encode(self, name: str, record: Any) -> bytes:
        """Bytes for ``record`` under the current schema ``name`` (short or full name): a dict,
        or for a flat schema (:meth:`is_flat`) also an object with the fields as attributes."""
        version = self._current(name)
        buf = io.BytesIO()
        if self.registry is None:
            buf.write(SINGLE_OBJECT_MAGIC)
            buf.write(version.fingerprint)
        else:
            buf.write(struct.pack(">bI", CONFLUENT_MAGIC, self._registry_id(version)))
        flat = self._flat.get(version.fingerprint)
        if flat is not None:
            try:
                buf.write(flat[1](record, dict.get if isinstance(record, dict) else getattr))
            except SchemaError as e:
                raise SchemaError(f"cannot encode {version.name}: {e}") from None
            return buf.getvalue()
        try:
            fastavro.schemaless_writer(buf, version.parsed, record)
        except Exception as e:
            raise SchemaError(f"cannot encode {version.name}: {_one_line(e)}") from None
        return buf.getvalue()

    # -- decode ------------------------------------------------------------------------
    def decode(
        self, data: bytes, expect: str | None = None, make: Callable[..., Any] | None = None
    ) -> tuple[str, Any]:
        """``(full name, record dict)`` for ``data``; raises SchemaError, nothing else.

        ``expect``: a record name the caller requires; another name is a SchemaError.
        ``make``: when the body is read by the compiled flat reader (written with the current
        schema), ``make(*values)`` in :meth:`field_names` order is returned instead of the dict.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise SchemaError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if not data:
            raise SchemaError("empty record")
        if data[0] == SINGLE_OBJECT_MAGIC[0]:
            if len(data) < _SO_HEADER or data[:2] != SINGLE_OBJECT_MAGIC:
                raise SchemaError("truncated or bad single-object header")
            writer = self.by_fingerprint.get(data[2:_SO_HEADER])
            if writer is None:
                raise SchemaError(f"unknown schema fingerprint {data[2:_SO_HEADER].hex()}")
            body = data[_SO_HEADER:]
        elif data[0] == CONFLUENT_MAGIC:
            if len(data) < _CF_HEADER:
                raise SchemaError("truncated Confluent header")
            (schema_id,) = struct.unpack(">I", data[1:_CF_HEADER])
            writer = self._registry_schema(schema_id)
            body = data[_CF_HEADER:]
        else:
            raise SchemaError(f"not an srl record: first byte 0x{data[0]:02x} is neither C3 nor 00")
        if expect is not None and writer.name != self._full_name(expect):
            raise SchemaError(f"expected {self._full_name(expect)}, got {writer.name}")
        reader = self.current.get(writer.name)
        if reader is None:
            raise SchemaError(f"no current schema for {writer.name}")
        return writer.name, self._read(body, writer, reader, make)

    def _read(
        self,
        body: bytes,
        writer: SchemaVersion,
        reader: SchemaVersion,
        make: Callable[..., Any] | None = None,
    ) -> Any:
        flat = self._flat.get(writer.fingerprint) if writer is reader else None
        if flat is not None:
            try:
                return flat[0](body, make)
            except SchemaError as e:
                raise SchemaError(f"malformed {writer.name} body: {e}") from None
        buf = io.BytesIO(body)
        try:
            if writer.fingerprint == reader.fingerprint:
                record = fastavro.schemaless_reader(buf, writer.parsed, None)
            else:
                record = fastavro.schemaless_reader(buf, writer.parsed, reader.parsed)
        except Exception as e:  # EOFError, ValueError, UnicodeDecodeError, IndexError, …
            raise SchemaError(f"malformed {writer.name} body: {_one_line(e)}") from None
        if buf.tell() != len(body):
            raise SchemaError(
                f"malformed {writer.name} body: {len(body) - buf.tell()} trailing bytes"
            )
        if not isinstance(record, dict):
            raise SchemaError(f"malformed {writer.name} body: not a record")
        return record

    # -- helpers -----------------------------------------------------------------------
    def _full_name(self, name: str) -> str:
        return name if "." in name else f"srl.{name}"

    def _current(self, name: str) -> SchemaVersion:
        version = self.current.get(self._full_name(name))
        if version is None:
            raise SchemaError(
                f"unknown record type {name!r}; known: {', '.join(sorted(self.current))}"
            )
        return version

    def _registry_id(self, version: SchemaVersion) -> int:
        assert self.registry is not None
        if version.fingerprint not in self._registry_ids:
            self._registry_ids[version.fingerprint] = self.registry.id_for(version)
        return self._registry_ids[version.fingerprint]

    def _registry_schema(self, schema_id: int) -> SchemaVersion:
        if schema_id in self._registry_schemas:
            return self._registry_schemas[schema_id]
        if self.registry is None:
            raise SchemaError(
                f"Confluent-framed record (schema id {schema_id}) but no schema registry is "
                f"configured"
            )
        try:
            schema = self.registry.schema_for(schema_id)
        except SchemaError:
            raise
        except Exception as e:
            raise SchemaError(
                f"schema registry lookup of id {schema_id} failed: {_one_line(e)}"
            ) from None
        version = SchemaVersion.from_json(schema, f"registry id {schema_id}")
        self._registry_schemas[schema_id] = version
        return version
