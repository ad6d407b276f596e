"""Compiled Avro binary reader and writer for flat records: the codec's hot path.

Owns the encoding of records whose fields are all primitive (``boolean``, ``int``, ``long``,
``float``, ``double``, ``bytes``, ``string``) or a ``["null", primitive]`` union — the
``TrajectoryChunk`` every generator writes and every trainer reads, per chunk. What must hold:

* the bytes are exactly what ``fastavro.schemaless_writer`` writes for the same record, and
  reading gives exactly the dict ``fastavro.schemaless_reader`` gives (tests compare both on
  random records), so the wire format is plain Avro and other tools read it;
* anything malformed raises ``SchemaError`` (truncated body, trailing bytes, a bad union
  index, a negative length, invalid UTF-8, a value of the wrong type or out of range); no
  other exception escapes;
* a schema that is not flat gets ``None`` from :func:`compile_flat` and stays on fastavro.

Why: fastavro's per-call setup is most of its cost on small records such as a 32-token
chunk; straight-line code generated once per schema skips it (figures in docs/benchmarks.md,
"Data plane"). Called
by ``schemas.codec.Codec`` only when the writer and reader schema are the same version.
"""

from __future__ import annotations

import numbers
import struct
from collections.abc import Callable
from operator import index
from typing import Any

from schemas.errors import SchemaError

PRIMITIVES = ("boolean", "int", "long", "float", "double", "bytes", "string")
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_F = struct.Struct("<f")
_D = struct.Struct("<d")


def _rl(b: bytes, p: int) -> tuple[int, int]:
    """A zigzag varint at ``p``: (value, next position)."""
    x = b[p]
    p += 1
    if x < 0x80:
        return (x >> 1) ^ -(x & 1), p
    v, shift = x & 0x7F, 7
    while True:
        x = b[p]
        p += 1
        v |= (x & 0x7F) << shift
        if x < 0x80:
            return (v >> 1) ^ -(v & 1), p
        shift += 7
        if shift > 70:
            raise SchemaError("varint longer than 10 bytes")


_SMALL = [bytes((((n << 1) ^ (n >> 63)) & 0xFFFFFFFFFFFFFFFF,)) for n in range(-64, 64)]


def _wl(n: int) -> bytes:
    """Zigzag varint of ``n``."""
    if -64 <= n < 64:
        return _SMALL[n + 64]
    z = ((n << 1) ^ (n >> 63)) & 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _field_type(t: Any) -> tuple[str, bool] | None:
    """(primitive, nullable) for a flat field type, else None."""
    if isinstance(t, dict) and t.get("type") in PRIMITIVES and "logicalType" not in t:
        t = t["type"]
    if isinstance(t, str) and t in PRIMITIVES:
        return t, False
    if isinstance(t, list) and len(t) == 2 and t[0] == "null":
        inner = _field_type(t[1])
        if inner is not None and not inner[1]:
            return inner[0], True
    return None


def _varint(var: str, ind: str) -> list[str]:
    """Inline one-byte varints (most fields); longer ones call ``rl``."""
    return [
        f"{ind}x = b[p]",
        f"{ind}if x < 128:",
        f"{ind}    {var} = (x >> 1) ^ -(x & 1)",
        f"{ind}    p += 1",
        f"{ind}else:",
        f"{ind}    {var}, p = rl(b, p)",
    ]


def _read_lines(kind: str, var: str, ind: str) -> list[str]:
    if kind in ("int", "long"):
        return _varint(var, ind)
    if kind == "boolean":
        return [
            f"{ind}x = b[p]",
            f"{ind}p += 1",
            f"{ind}if x > 1: raise SchemaError('boolean byte ' + str(x))",
            f"{ind}{var} = x == 1",
        ]
    if kind == "float":
        return [f"{ind}{var} = F(b, p)[0]", f"{ind}p += 4"]
    if kind == "double":
        return [f"{ind}{var} = D(b, p)[0]", f"{ind}p += 8"]
    conv = ".decode()" if kind == "string" else ""
    return [
        *_varint("n", ind),
        f"{ind}if n < 0 or p + n > len(b): raise SchemaError('bad length ' + str(n))",
        f"{ind}{var} = b[p:p + n]{conv}",
        f"{ind}p += n",
    ]


def _write_lines(kind: str, var: str, name: str, ind: str) -> list[str]:
    bad = f"raise SchemaError('field {name}: expected {kind}, got ' + type({var}).__name__)"
    if kind in ("int", "long"):
        lo, hi = _INT32 if kind == "int" else _INT64
        return [
            f"{ind}if type({var}) is not int:",
            f"{ind}    try: {var} = index({var})",
            f"{ind}    except TypeError: {bad}",
            f"{ind}if not {lo} <= {var} <= {hi}: raise SchemaError('field {name}: ' + str({var}) "
            f"+ ' out of {kind} range')",
            f"{ind}out.append(wl({var}))",
        ]
    if kind == "boolean":
        return [
            f"{ind}if not isinstance({var}, bool): {bad}",
            f"{ind}out.append(b'\\x01' if {var} else b'\\x00')",
        ]
    if kind in ("float", "double"):
        packer = "FP" if kind == "float" else "DP"
        return [
            f"{ind}if type({var}) is not float and not isinstance({var}, Real): {bad}",
            f"{ind}out.append({packer}({var}))",
        ]
    if kind == "string":
        return [
            f"{ind}if not isinstance({var}, str): {bad}",
            f"{ind}e = {var}.encode()",
            f"{ind}out.append(wl(len(e)))",
            f"{ind}out.append(e)",
        ]
    return [
        f"{ind}if not isinstance({var}, (bytes, bytearray, memoryview)): {bad}",
        f"{ind}out.append(wl(len({var})))",
        f"{ind}out.append(bytes({var}))",
    ]


Field = tuple[str, str, bool]  # (name, primitive, nullable)


def flat_fields(schema: Any) -> list[Field] | None:
    """The fields of a flat record schema in order, or None if it is not a flat record."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return None
    fields = []
    for f in schema.get("fields", []):
        ft = _field_type(f.get("type"))
        if ft is None:
            return None
        fields.append((f["name"], *ft))
    return fields


def _read_field(var: str, kind: str, nullable: bool) -> list[str]:
    if not nullable:
        return _read_lines(kind, var, "    ")
    return [
        *_varint("u", "    "),
        "    if u == 0:",
        f"        {var} = None",
        "    elif u == 1:",
        *_read_lines(kind, var, "        "),
        "    else: raise SchemaError('union index ' + str(u))",
    ]


def _write_field(var: str, name: str, kind: str, nullable: bool) -> list[str]:
    if not nullable:
        return [
            f"    {var} = g(r, {name!r}, None)",
            f"    if {var} is None: raise SchemaError('field {name}: no value')",
            *_write_lines(kind, var, name, "    "),
        ]
    return [
        f"    {var} = g(r, {name!r}, None)",
        f"    if {var} is None:",
        "        out.append(b'\\x00')",
        "    else:",
        "        out.append(b'\\x02')",
        *_write_lines(kind, var, name, "        "),
    ]


def reader_source(fields: list[Field]) -> list[str]:
    """Lines of ``read(b, make=None)``: each field in order, then no trailing bytes."""
    read = ["def read(b, make=None):", "    p = 0"]
    for i, (_name, kind, nullable) in enumerate(fields):
        read += _read_field(f"v{i}", kind, nullable)
    values = ", ".join(f"v{i}" for i in range(len(fields)))
    return [
        *read,
        "    if p != len(b): raise SchemaError(str(len(b) - p) + ' trailing bytes')",
        f"    if make is not None: return make({values})",
        "    return {" + ", ".join(f"{n!r}: v{i}" for i, (n, _k, _u) in enumerate(fields)) + "}",
    ]


def writer_source(fields: list[Field]) -> list[str]:
    """Lines of ``write(r, g=dget)``: each field checked and encoded in order."""
    write = ["def write(r, g=dget):", "    out = []"]
    for i, (name, kind, nullable) in enumerate(fields):
        write += _write_field(f"v{i}", name, kind, nullable)
    return [*write, "    return b''.join(out)"]


# the names the generated code refers to
_ENV: dict[str, Any] = {
    "rl": _rl,
    "wl": _wl,
    "SchemaError": SchemaError,
    "F": _F.unpack_from,
    "D": _D.unpack_from,
    "FP": _F.pack,
    "DP": _D.pack,
    "index": index,
    "Real": numbers.Real,
    "dget": dict.get,
}


def compile_flat(
    schema: dict[str, Any],
) -> tuple[Callable[..., Any], Callable[..., bytes]] | None:
    """(reader, writer) for a flat record schema, or None if it is not flat.

    ``reader(body)`` is the record's dict; ``reader(body, make)`` is ``make(v0, v1, …)``, the
    values in the schema's field order (a record object built without an intermediate dict).
    ``writer(record)`` takes a dict; ``writer(obj, getattr)`` reads the fields as attributes."""
    fields = flat_fields(schema)
    if fields is None:
        return None
    env = dict(_ENV)
    src = "\n".join([*reader_source(fields), "", *writer_source(fields)])
    exec(compile(src, f"<flat {schema.get('name')}>", "exec"), env)  # noqa: S102
    reader, writer = env["read"], env["write"]

    def safe_read(body: bytes, make: Callable[..., Any] | None = None) -> Any:
        try:
            return reader(body, make)
        except (IndexError, struct.error):
            raise SchemaError("truncated body") from None
        except UnicodeDecodeError as e:
            raise SchemaError(f"invalid UTF-8 in a string: {e.reason}") from None

    def safe_write(record: Any, get: Callable[..., Any] = dict.get) -> bytes:
        try:
            return writer(record, get)
        except (struct.error, OverflowError, UnicodeEncodeError) as e:
            raise SchemaError(str(e)) from None

    return safe_read, safe_write
