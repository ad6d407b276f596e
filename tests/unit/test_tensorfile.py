"""srl.tensorfile: our streamed files are safetensors files, and parsing checks the format."""

from __future__ import annotations

import struct

import orjson
import pytest
import torch
from safetensors.torch import load, save

from srl import tensorfile
from srl.errors import WeightsError
from srl.store import LocalStore


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "w": torch.randn(5, generator=g),
        "count": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(2, 2, generator=g).half(),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_streamed_parts_are_a_file_safetensors_reads(tmp_path) -> None:
    t = tensors()
    data = b"".join(bytes(p) for p in tensorfile.parts(t, {"format": "pt"}))
    _same(load(data), t)
    (n,) = struct.unpack_from("<Q", data)
    assert (8 + n) % 8 == 0 and orjson.loads(data[8 : 8 + n])["__metadata__"] == {"format": "pt"}
    # written through the store: one pass, the digest is the file's
    store = LocalStore(tmp_path)
    _uri, digest, size = store.put_chunks("k/model.safetensors", tensorfile.parts(t))
    buf, again = store.get_hashed("k/model.safetensors")
    assert (digest, size) == (again, len(buf))
    _same(tensorfile.parse(buf, "k"), t)


def test_parse_reads_what_safetensors_writes_as_views_of_the_buffer() -> None:
    t = tensors()
    buf = bytearray(save(t))
    got = tensorfile.parse(buf, "x")
    _same(got, t)
    got["w"][0] = 42.0  # a view: the buffer changes, nothing was copied
    assert load(bytes(buf))["w"][0].item() == 42.0


def _file(header: dict, data: bytes = b"\x00" * 8) -> bytearray:
    head = orjson.dumps(header)
    return bytearray(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (bytearray(b"\x01\x02"), "not a safetensors file"),
        (bytearray(struct.pack("<Q", 10**9) + b"{}"), "exceeds the file"),
        (bytearray(struct.pack("<Q", 2) + b"{x"), "not JSON"),
        (_file([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
        (
            _file({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}),
            "bad safetensors entry",
        ),
        (_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "inconsistent"),
        (_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "outside"),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), "hole"),
        (
            _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),
            "after the last tensor",
        ),
        (
            _file(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                }
            ),
            "overlap",
        ),
    ],
)
def test_malformed_files_are_weights_errors(buf: bytearray, match: str) -> None:
    with pytest.raises(WeightsError, match=match):
        tensorfile.parse(buf, "v1/model.safetensors")
