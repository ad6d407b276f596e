"""Minimal client for a Confluent-compatible Schema Registry (REST), used by the codec.

Only two calls are needed: register a schema under the record-name subject and get its id
(``POST /subjects/{name}-value/versions``), and fetch a schema by id
(``GET /schemas/ids/{id}``). Both are cached by the codec. Standard library only, so that
``--help`` stays fast and no extra dependency is pulled in.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from schemas.codec import SchemaError, SchemaVersion


class HttpRegistry:
    """Talks to ``url`` (e.g. http://127.0.0.1:8081); subjects use RecordNameStrategy."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise SchemaError(f"schema registry {method} {path}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SchemaError(f"schema registry at {self.url} unreachable: {e}") from None
        if not isinstance(out, dict):
            raise SchemaError(f"schema registry {method} {path}: unexpected reply")
        return out

    def id_for(self, version: SchemaVersion) -> int:
        out = self._call(
            "POST", f"/subjects/{version.name}-value/versions", {"schema": version.raw}
        )
        return int(out["id"])

    def schema_for(self, schema_id: int) -> dict[str, Any]:
        out = self._call("GET", f"/schemas/ids/{schema_id}")
        try:
            return dict(json.loads(out["schema"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"schema registry id {schema_id}: bad schema text ({e})") from None
