"""Confluent framing through a schema registry's REST API.

No Confluent Schema Registry installs from PyPI, so the registry here is a small HTTP
server speaking the two endpoints the codec uses (register, fetch by id); the framing and
the codec under test are real.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from schemas.codec import Codec, SchemaError
from schemas.records import MetricEvent, decode, encode
from schemas.registry import HttpRegistry


@pytest.fixture
def registry_url() -> Iterator[str]:
    schemas: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["schema"] not in schemas:
                schemas.append(body["schema"])
            self.reply(200, {"id": schemas.index(body["schema"]) + 1})

        def do_GET(self) -> None:
            schema_id = int(self.path.rsplit("/", 1)[-1])
            if 1 <= schema_id <= len(schemas):
                self.reply(200, {"schema": schemas[schema_id - 1]})
            else:
                self.reply(404, {"error_code": 40403, "message": "Schema not found"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_registry_framing_round_trip_and_first_byte_dispatch(registry_url: str) -> None:
    codec = Codec(registry=HttpRegistry(registry_url))
    event = MetricEvent(kind="k", source="s", run="r", values={"x": 1.0})
    framed = encode(event, codec)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == 1
    assert decode(framed, codec=codec) == event
    # the same codec still reads single-object records, told apart by the first byte
    assert decode(encode(event), codec=codec) == event
    # a fresh codec learns the schema from the registry by id
    assert decode(framed, codec=Codec(registry=HttpRegistry(registry_url))) == event


def test_unknown_registry_id_and_unreachable_registry(registry_url: str) -> None:
    codec = Codec(registry=HttpRegistry(registry_url))
    with pytest.raises(SchemaError, match="HTTP 404"):
        codec.decode(b"\x00\x00\x00\x00\x63" + b"\x00")
    dead = Codec(registry=HttpRegistry("http://127.0.0.1:9", timeout_s=1))
    with pytest.raises(SchemaError, match="unreachable"):
        dead.decode(b"\x00\x00\x00\x00\x01\x00")
