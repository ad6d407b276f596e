"""Message schemas (``*.avsc``), the Avro codec and the typed records built on them.

Layout: ``*.avsc`` are the current versions, ``history/`` holds older ones, ``codec.py``
turns dicts into bytes and back, ``records.py`` holds the typed dataclasses.
"""

from schemas.codec import Codec, SchemaError
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

__all__ = [
    "Codec",
    "Feedback",
    "MetricEvent",
    "PromptTask",
    "ResumePrefix",
    "SchemaError",
    "TrajectoryChunk",
    "WeightsAnnouncement",
    "decode",
    "decode_as",
    "encode",
    "pack_logprobs",
    "pack_tokens",
    "unpack_logprobs",
    "unpack_tokens",
]
