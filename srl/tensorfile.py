"""safetensors files without extra copies: streamed out of the tensors, parsed in place.

Owns the byte layout of the weights files the protocol moves (``srl.weights``). What must hold:

* :func:`parts` yields a standard safetensors file (8-byte little-endian header length, JSON
  header with dtype, shape and data offsets, padded with spaces to 8 bytes, then the tensors'
  bytes back to back) as a header followed by zero-copy views of each tensor's memory, so a
  publisher hashes and writes the bytes once and never builds the file in memory;
  ``safetensors.torch.load`` reads it (tested);
* :func:`parse` reads any safetensors file (ours or ``safetensors.torch.save``'s) from a
  writable buffer into tensors that are views of that buffer (``torch.frombuffer``), after
  checking what the format promises: a JSON header, known dtypes, offsets inside the data,
  sizes that match shape × dtype, and data covered without holes or overlaps. JSON and raw
  bytes only: nothing is unpickled. Anything else is a ``WeightsError`` naming the file.

Called by ``srl.weights`` (publish, fetch).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson

from srl.errors import WeightsError

if TYPE_CHECKING:
    import torch

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
PIECE = 16 * 1024 * 1024  # views are cut to this size so hashing and writing interleave


def _codes() -> dict[Any, str]:
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }


def streamable(tensors: dict[str, torch.Tensor]) -> bool:
    """True when every tensor is a contiguous CPU tensor of a dtype :func:`parts` writes."""
    codes = _codes()
    return all(
        t.dtype in codes and t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()
    )


def parts(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Iterator[bytes | memoryview]:
    """The safetensors file of ``tensors`` (see :func:`streamable`) as header + memory views."""
    import torch

    codes = _codes()
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": codes[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = orjson.dumps(header)
    head += b" " * (-len(head) % 8)
    yield struct.pack("<Q", len(head)) + head
    for t in tensors.values():
        if t.numel():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy().data)
            for i in range(0, len(view), PIECE):
                yield view[i : i + PIECE]


def parse(buf: bytearray | mmap.mmap, where: str) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buf`` (a whole safetensors file); WeightsError if it is not one."""
    import torch

    dtypes = {code: dt for dt, code in _codes().items()}
    if len(buf) < 8:
        raise WeightsError(f"{where}: {len(buf)} bytes is not a safetensors file")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(MAX_HEADER, len(buf) - 8):
        raise WeightsError(f"{where}: safetensors header length {n} exceeds the file")
    try:
        header = orjson.loads(bytes(buf[8 : 8 + n]))
    except orjson.JSONDecodeError as e:
        raise WeightsError(f"{where}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{where}: safetensors header is not a JSON object")
    base, size = 8 + n, len(buf) - 8 - n
    out: dict[str, torch.Tensor] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtypes[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightsError(
                f"{where}: bad safetensors entry for {name!r}: {str(info)[:200]}"
            ) from None
        count = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (
            min(shape, default=0) < 0
            or not 0 <= begin <= end <= size
            or end - begin != count * itemsize
        ):
            raise WeightsError(
                f"{where}: tensor {name!r} ({info['dtype']}{shape}) has data offsets "
                f"[{begin}, {end}) outside or inconsistent with {size} data bytes"
            )
        spans.append((begin, end))
        if count:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + begin).view(
                shape
            )
        else:
            out[name] = torch.empty(shape, dtype=dtype)
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise WeightsError(f"{where}: safetensors data has a hole or an overlap at byte {pos}")
        pos = end
    if pos != size:
        raise WeightsError(f"{where}: {size - pos} bytes after the last tensor")
    return out
