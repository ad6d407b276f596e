"""Typed records for the five message kinds, and the packing of token arrays.

Each record is a frozen dataclass mirroring its ``.avsc`` file field for field; the field
comments there say what each value and each null means. Conversion is explicit:
``rec.to_dict()`` / ``Cls.from_dict(d)``, and ``encode(rec)`` / ``decode(data)`` go through
the process-wide :class:`~schemas.codec.Codec` (or one you pass). For a flat schema (every
field primitive: ``TrajectoryChunk``, ``WeightsAnnouncement``, ``Feedback``) they skip the
dict: ``encode`` hands the record itself to the compiled writer, and ``decode_as`` has the
compiled reader fill a new record's slots directly: no dict and no ``__init__`` per record,
the cost that dominates a small chunk (figures in docs/benchmarks.md, "Data plane").

Token ids travel as packed little-endian int32 and log-probs as little-endian float32
(``pack_tokens`` / ``unpack_tokens`` / ``pack_logprobs`` / ``unpack_logprobs``).
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from schemas.codec import Codec, SchemaError

T = TypeVar("T", bound="Record")

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


MIGRATED = "migrated"  # finish_reason of a non-last chunk: the trajectory continues in another pool
ABORTED = "abort"  # finish_reason of a trajectory cut short (client gone, shutdown): not trained


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def pack_tokens(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype=_I32).tobytes()


def unpack_tokens(data: bytes | bytearray) -> np.ndarray:
    if len(data) % 4:
        raise SchemaError(f"packed int32 tokens: {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype=_I32)


def pack_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def unpack_logprobs(data: bytes | bytearray) -> np.ndarray:
    if len(data) % 4:
        raise SchemaError(f"packed float32 logprobs: {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype=_F32)


class Record:
    """Base of the typed records: dict conversion and the Avro name."""

    avro_name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {n: _to_plain(getattr(self, n)) for n in _names(type(self))}

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        names = _name_set(cls)
        if d.keys() <= names:  # the usual case: the current schema's fields
            return cls(**d)
        return cls(**{k: v for k, v in d.items() if k in names})


_NAMES: dict[type, tuple[str, ...]] = {}
_NAME_SETS: dict[type, frozenset[str]] = {}


def _names(cls: type) -> tuple[str, ...]:
    """Field names of a record class, in order (dataclasses.fields per record is slow)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _name_set(cls: type) -> frozenset[str]:
    names = _NAME_SETS.get(cls)
    if names is None:
        names = _NAME_SETS[cls] = frozenset(_names(cls))
    return names


def _to_plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclass(frozen=True, slots=True)
class ResumePrefix(Record):
    avro_name: ClassVar[str] = "srl.ResumePrefix"
    trajectory_id: str
    sample_index: int
    next_seq: int
    tokens: bytes
    min_version: int
    reason: str


@dataclass(frozen=True, slots=True)
class PromptTask(Record):
    avro_name: ClassVar[str] = "srl.PromptTask"
    task_id: str
    prompt_id: str
    prompt: str
    group_size: int
    max_new_tokens: int
    bucket: str
    created_ms: int = field(default_factory=now_ms)
    prompt_tokens: bytes | None = None
    sample_indices: tuple[int, ...] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    predicted_length: int | None = None
    ranker_version: int | None = None
    metadata: str | None = None
    resume: ResumePrefix | None = None
    step: int | None = None  # trainer step that trains this group (null: unscheduled)
    step_groups: int | None = None  # groups released for that step
    min_version: int | None = None  # oldest policy version a worker may start it with
    run: str | None = None  # the run whose dispatcher published it

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PromptTask:
        d = dict(d)
        if d.get("resume") is not None:
            d["resume"] = ResumePrefix.from_dict(d["resume"])
        if d.get("sample_indices") is not None:
            d["sample_indices"] = tuple(d["sample_indices"])
        return super(PromptTask, cls).from_dict(d)

    def samples(self) -> tuple[int, ...]:
        """Sample indices this task asks for."""
        if self.resume is not None:
            return (self.resume.sample_index,)
        if self.sample_indices is not None:
            return self.sample_indices
        return tuple(range(self.group_size))


@dataclass(frozen=True, slots=True)
class TrajectoryChunk(Record):
    avro_name: ClassVar[str] = "srl.TrajectoryChunk"
    trajectory_id: str
    prompt_id: str
    task_id: str
    sample_index: int
    group_size: int
    seq: int
    token_offset: int
    tokens: bytes
    logprobs: bytes
    policy_version: int
    is_last: bool
    worker_id: str
    bucket: str
    started_ms: int
    created_ms: int = field(default_factory=now_ms)
    finish_reason: str | None = None
    predicted_length: int | None = None
    prompt_tokens: bytes | None = None
    metadata: str | None = None
    step: int | None = None  # seq 0 only: the task's trainer step
    step_groups: int | None = None  # seq 0 only: groups released for that step
    pool: str | None = None  # the writer's pool under pool epochs (null: unfenced)
    pool_epoch: int | None = None  # the epoch it held the task's partition in
    temperature: float | None = None  # seq 0 only: sampled at (0: greedy; null: run's own)
    top_p: float | None = None  # seq 0 only: nucleus mass sampled with (null: run's own)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    def token_ids(self) -> np.ndarray:
        return unpack_tokens(self.tokens)

    def logprob_values(self) -> np.ndarray:
        return unpack_logprobs(self.logprobs)


@dataclass(frozen=True, slots=True)
class WeightsAnnouncement(Record):
    avro_name: ClassVar[str] = "srl.WeightsAnnouncement"
    run: str
    version: int
    manifest_uri: str
    manifest_sha256: str
    trainer_step: int
    total_bytes: int
    parent_version: int | None = None
    created_ms: int = field(default_factory=now_ms)


@dataclass(frozen=True, slots=True)
class MetricEvent(Record):
    avro_name: ClassVar[str] = "srl.MetricEvent"
    kind: str
    source: str
    run: str
    values: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    ts_ms: int = field(default_factory=now_ms)


@dataclass(frozen=True, slots=True)
class Feedback(Record):
    avro_name: ClassVar[str] = "srl.Feedback"
    trajectory_id: str
    completion_id: str
    choice_index: int
    reward: float
    source: str
    metadata: str | None = None
    created_ms: int = field(default_factory=now_ms)


RECORD_TYPES: dict[str, type[Record]] = {
    cls.avro_name: cls
    for cls in (PromptTask, TrajectoryChunk, WeightsAnnouncement, MetricEvent, Feedback)
}

_default_codec: Codec | None = None


def default_codec() -> Codec:
    """The process-wide codec over the project's schema files (built on first use)."""
    global _default_codec
    if _default_codec is None:
        _default_codec = Codec()
    return _default_codec


def set_default_codec(codec: Codec) -> None:
    """Install a codec (e.g. one with a schema registry) for ``encode``/``decode``."""
    global _default_codec
    _default_codec = codec


# per (codec, record class): (the codec, kept alive so its id is not reused; whether the
# class's current schema is flat; the straight-line constructor for the flat reader or None)
_FAST: dict[tuple[int, type], tuple[Codec, bool, Any]] = {}


def _fast(codec: Codec, cls: type[Record]) -> tuple[Codec, bool, Any]:
    """The codec hot path for ``cls``: a flat schema is written from the record's attributes
    (no ``to_dict``) and read straight into a record (no dict, no ``__init__``). The
    constructor sets the slots in the schema's field order; it exists only when the schema's
    fields are exactly the class's and every field is a slot."""
    key = (id(codec), cls)
    hit = _FAST.get(key)
    if hit is None:
        flat = codec.is_flat(cls.avro_name)
        make = None
        names = codec.field_names(cls.avro_name) if flat else ()
        slots = [getattr(cls, n, None) for n in names]
        if (
            flat
            and set(names) == _name_set(cls)
            and all(isinstance(d, types.MemberDescriptorType) for d in slots)
        ):
            args = ", ".join(f"v{i}" for i in range(len(names)))
            body = "".join(f"    s{i}(o, v{i})\n" for i in range(len(names)))
            env: dict[str, Any] = {"new": object.__new__, "C": cls}
            env |= {f"s{i}": d.__set__ for i, d in enumerate(slots)}  # type: ignore[union-attr]
            src = f"def make({args}):\n    o = new(C)\n{body}    return o\n"
            exec(compile(src, f"<make {cls.__name__}>", "exec"), env)  # noqa: S102
            make = env["make"]
        hit = _FAST[key] = (codec, flat, make)
    return hit


def encode(record: Record, codec: Codec | None = None) -> bytes:
    c = codec or default_codec()
    flat = _fast(c, type(record))[1]
    return c.encode(record.avro_name, record if flat else record.to_dict())


def decode(data: bytes, expect: type[T] | None = None, codec: Codec | None = None) -> Record:
    """The typed record in ``data``; SchemaError for anything malformed or unexpected."""
    c = codec or default_codec()
    make = _fast(c, expect)[2] if expect is not None else None
    name, d = c.decode(data, expect.avro_name if expect else None, make)
    if not isinstance(d, dict):  # built by ``make``: the expected class, all fields read
        return d
    cls = RECORD_TYPES.get(name)
    if cls is None:
        raise SchemaError(f"no record type for {name}")
    try:
        return cls.from_dict(d)
    except TypeError as e:
        raise SchemaError(f"{name}: {e}") from None


def decode_as(data: bytes, cls: type[T], codec: Codec | None = None) -> T:
    """Like ``decode`` but requires, and is typed as, record class ``cls``."""
    record = decode(data, cls, codec)
    assert isinstance(record, cls)
    return record
