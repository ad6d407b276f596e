"""The S3 store against a local S3-compatible server (moto, server mode), and the weights
protocol through it with a real broker, crashes included."""

from __future__ import annotations

import hashlib
import http.client
import random
import subprocess
import sys
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError, ReadTimeoutError

from srl import s3multipart
from srl.errors import ConfigError, StoreError
from srl.s3store import S3Settings, S3Store, parse_url
from srl.store import (
    LocalStore,
    ObjectExists,
    ObjectMissing,
    ObjectStore,
)
from srl.stores import open_store, store_for_uri
from srl.weights import fetch_tensors, load_manifest, read_announcements, version_prefix
from tests.s3server import TEST_CREDENTIALS, MotoServer


@pytest.fixture(params=["local", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return open_store(request.getfixturevalue("s3_url"))


def test_store_contract(any_store: ObjectStore) -> None:
    store = any_store
    uri = store.put("a/b.bin", b"one")
    assert uri == store.uri("a/b.bin") and store.key_of(uri) == "a/b.bin"
    assert store.get("a/b.bin") == b"one" and store.exists("a/b.bin")
    with pytest.raises(ObjectExists):
        store.put("a/b.bin", b"two")
    with pytest.raises(ObjectExists):  # identical bytes from a second put are refused too
        store.put("a/b.bin", b"one")
    assert store.get("a/b.bin") == b"one"
    store.put("a/c/d.bin", b"")
    store.put("ab.bin", b"x")
    assert store.list("a") == ["a/b.bin", "a/c/d.bin"]
    assert store.list() == ["a/b.bin", "a/c/d.bin", "ab.bin"]
    assert store.list("nothing") == []
    with pytest.raises(ObjectMissing):
        store.get("a/missing.bin")
    assert not store.exists("a/missing.bin")
    for bad in ("", "/abs", "a/../b", "a//b"):
        with pytest.raises(StoreError):
            store.put(bad, b"x")
    store.delete("ab.bin")
    store.delete("ab.bin")  # deleting what is not there is not an error
    assert not store.exists("ab.bin")
    other, key = store_for_uri(uri)
    assert key.endswith("b.bin") and other.get(key) == b"one"


def test_s3_url_parsing_and_uris(s3_url: str) -> None:
    assert parse_url("s3://bkt/a/b/") == ("bkt", "a/b")
    assert parse_url("s3://bkt") == ("bkt", "")
    for bad in ("s3://", "s3:///x", "s3://b@d/x", "s3://bkt/a/../b"):
        with pytest.raises(ConfigError):
            parse_url(bad)
    store = S3Store.from_url(s3_url)
    assert store.uri("k") == f"{s3_url}/k"
    with pytest.raises(StoreError, match="is not in store"):
        store.key_of("s3://elsewhere/k")


def test_list_pages_through_many_keys(s3_url: str) -> None:
    store = S3Store.from_url(s3_url)
    store.list_page_size = 2
    keys = [f"p/{i:02d}" for i in range(7)]
    for k in keys:
        store.put(k, b"x")
    assert store.list("p") == keys


def test_conditional_put_is_detected_and_a_retried_put_of_ours_counts_as_done(
    s3_url: str,
) -> None:
    store = S3Store.from_url(s3_url)
    assert store.create_only_mode() == "conditional"
    assert store.list() == []  # the probe object is gone
    # boto3 retries a put whose answer was lost; the retry carries the same put id and gets
    # 412 from its own first attempt. Two puts with one id stand for that.
    store._new_put_id = lambda: "retried"  # type: ignore[method-assign]
    store.put("k", b"first")
    store.put("k", b"first")  # 412, but the object there is ours: done
    assert store._put_id("k") == "retried"
    store._new_put_id = lambda: "someone-else"  # type: ignore[method-assign]
    with pytest.raises(ObjectExists):
        store.put("k", b"first")


class _StripIfNoneMatch(BaseHTTPRequestHandler):
    """A proxy in front of the S3 server that drops If-None-Match: a server that ignores it."""

    upstream: tuple[str, int] = ("127.0.0.1", 0)
    protocol_version = "HTTP/1.1"  # answers boto3's "Expect: 100-continue" at once

    def _strips(self) -> bool:
        return True

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        strip = self._strips()
        headers = {
            k: v for k, v in self.headers.items() if not (strip and k.lower() == "if-none-match")
        }
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args: object) -> None:
        pass


class _StripIfNoneMatchOnComplete(_StripIfNoneMatch):
    """A server that enforces If-None-Match on PutObject but ignores it on
    CompleteMultipartUpload (``POST ?uploadId=``)."""

    def _strips(self) -> bool:
        return self.command == "POST" and "uploadId=" in self.path


@pytest.fixture
def ignoring_endpoint(s3_server) -> Iterator[str]:  # type: ignore[no-untyped-def]
    yield from _proxy(s3_server, _StripIfNoneMatch)


@pytest.fixture
def ignoring_on_complete_endpoint(s3_server: MotoServer) -> Iterator[str]:
    yield from _proxy(s3_server, _StripIfNoneMatchOnComplete)


def _proxy(s3_server: MotoServer, base: type[_StripIfNoneMatch]) -> Iterator[str]:
    handler = type("H", (base,), {"upstream": ("127.0.0.1", s3_server.port)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_server_that_ignores_if_none_match_falls_back_to_check_then_put(
    s3_url: str, ignoring_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    bucket, prefix = parse_url(s3_url)
    store = S3Store(bucket, prefix, S3Settings(endpoint_url=ignoring_endpoint))
    assert store.create_only_mode() == "check-then-put"
    assert "ignores If-None-Match" in caplog.text
    store.put("k", b"one")
    with pytest.raises(ObjectExists):
        store.put("k", b"two")
    assert store.get("k") == b"one" and store.list() == ["k"]
    # Pinning the mode skips the probe; "conditional" on such a server would overwrite, which
    # is why auto probes first.
    pinned = S3Store(
        bucket, prefix, S3Settings(endpoint_url=ignoring_endpoint, create_only="check-then-put")
    )
    with pytest.raises(ObjectExists):
        pinned.put("k", b"three")


def test_errors_are_one_line(s3_server, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    missing = S3Store(
        "no-such-bucket-here",
        "x",
        S3Settings(endpoint_url=s3_server.endpoint, create_only="conditional"),
    )
    with pytest.raises(StoreError, match="bucket no-such-bucket-here does not exist"):
        missing.put("k", b"x")
    from srl.broker import free_port

    dead = S3Store(
        "bkt",
        "",
        S3Settings(
            endpoint_url=f"http://127.0.0.1:{free_port()}",
            connect_timeout_s=0.5,
            create_only="conditional",
        ),
    )
    with pytest.raises(StoreError, match="cannot get k in s3://bkt") as e:
        dead.get("k")
    assert "\n" not in str(e.value)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    nocreds = S3Store.from_url(s3_url)
    with pytest.raises(StoreError, match="no S3 credentials"):
        nocreds.get("k")


def test_a_role_started_from_python_gets_its_configs_s3_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No process-wide S3 state: the store a role opens follows its own config."""
    from srl.config import CommonConfig, load_config
    from srl.stores import store_from_config

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    cli = {"store": "s3://bkt/p", "s3_endpoint_url": "http://127.0.0.1:1"}
    cfg = load_config(CommonConfig, cli=cli | {"s3_create_only": "check-then-put"}, env={})
    store = store_from_config(cfg)
    assert isinstance(store, S3Store)
    assert store.settings.endpoint_url == "http://127.0.0.1:1"
    assert store.settings.create_only == "check-then-put"
    other = store_from_config(load_config(CommonConfig, cli={"store": "s3://bkt/p"}, env={}))
    assert isinstance(other, S3Store) and other.settings.endpoint_url is None
    with pytest.raises(ConfigError, match="s3_create_only"):
        load_config(CommonConfig, cli=cli | {"s3_create_only": "sometimes"}, env={})


# -- multipart uploads: large objects streamed, create-only ------------------------------------

MiB = 1024**2
PART = 5 * MiB  # S3's (and moto's) smallest part but the last


def _small_part_store(url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[S3Store, list[int]]:
    """A store with 5 MiB parts and single puts up to 1 MiB, and the sizes of the parts it
    uploads."""
    store = S3Store.from_url(url)
    store.part_bytes = PART
    store.max_put_bytes = 1 * MiB
    sizes: list[int] = []
    upload_part = store._client.upload_part

    def record(**kw: Any) -> Any:
        if ".srl-probe/" not in kw["Key"]:
            sizes.append(len(kw["Body"]))
        return upload_part(**kw)

    monkeypatch.setattr(store._client, "upload_part", record)
    return store, sizes


def _pending_uploads(store: S3Store) -> list[str]:
    resp = store._client.list_multipart_uploads(Bucket=store.bucket)
    return [u["Key"] for u in resp.get("Uploads", [])]


def _chunks(data: bytes, size: int) -> Iterator[memoryview]:
    view = memoryview(data)
    for i in range(0, len(data), size):
        yield view[i : i + size]


def test_large_objects_stream_as_multipart_uploads_create_only(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, sizes = _small_part_store(s3_url, monkeypatch)
    data = random.Random(0).randbytes(12 * MiB + 12345)
    uri, digest, size = store.put_chunks("ckpt/model.bin", _chunks(data, 100_003))
    assert uri == store.uri("ckpt/model.bin") and size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert sizes == [PART, PART, len(data) - 2 * PART]
    assert store.get("ckpt/model.bin") == data
    assert store._put_id("ckpt/model.bin")  # tagged like a put, for a retried completion
    assert _pending_uploads(store) == []
    # create-only: refused before anything is uploaded, by put_chunks and put alike
    sizes.clear()
    with pytest.raises(ObjectExists):
        store.put_chunks("ckpt/model.bin", _chunks(data, 100_003))
    with pytest.raises(ObjectExists):
        store.put("ckpt/model.bin", data)
    assert sizes == [] and _pending_uploads(store) == []
    # put above max_put_bytes goes multipart too (no size ceiling)
    assert store.put("ckpt/other.bin", data) == store.uri("ckpt/other.bin")
    assert sizes == [PART, PART, len(data) - 2 * PART]
    assert store.get("ckpt/other.bin") == data
    assert store.list("ckpt") == ["ckpt/model.bin", "ckpt/other.bin"]
    assert _pending_uploads(store) == []


def test_small_streams_are_single_puts_or_one_part(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, sizes = _small_part_store(s3_url, monkeypatch)
    small = b"x" * (MiB // 2)  # below max_put_bytes: one PutObject
    assert store.put_chunks("a", _chunks(small, 1000))[1:] == (
        hashlib.sha256(small).hexdigest(),
        len(small),
    )
    assert store.put_chunks("empty", [])[1:] == (hashlib.sha256(b"").hexdigest(), 0)
    assert sizes == [] and store.get("a") == small and store.get("empty") == b""
    mid = b"y" * (3 * MiB)  # below a part but above max_put_bytes: a one-part upload
    store.put_chunks("b", _chunks(mid, 64 * 1024))
    exact = b"z" * PART  # exactly one part: the stream ends on a part boundary
    store.put_chunks("c", [exact[:100], exact[100:]])
    assert sizes == [len(mid), PART]
    assert store.get("b") == mid and store.get("c") == exact
    with pytest.raises(ObjectExists):
        store.put_chunks("a", [b"again"])


def test_a_failure_mid_stream_leaves_no_object_and_no_pending_upload(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, sizes = _small_part_store(s3_url, monkeypatch)

    def failing() -> Iterator[bytes]:
        for _ in range(2 * PART // MiB + 1):  # two parts are uploaded, then the writer fails
            yield b"w" * MiB
        raise RuntimeError("the trainer died")

    with pytest.raises(RuntimeError, match="the trainer died"):
        store.put_chunks("ckpt/broken.bin", failing())
    assert sizes == [PART, PART]
    assert not store.exists("ckpt/broken.bin") and _pending_uploads(store) == []

    # the server fails a part: the upload is aborted too
    upload_part = store._client.upload_part

    def failing_part_2(**kw: Any) -> Any:
        if kw["PartNumber"] == 2:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "x"}}, "UploadPart")
        return upload_part(**kw)

    monkeypatch.setattr(store._client, "upload_part", failing_part_2)
    with pytest.raises(StoreError, match="cannot upload_part ckpt/broken.bin"):
        store.put_chunks("ckpt/broken.bin", [b"v" * (3 * PART)])
    assert not store.exists("ckpt/broken.bin") and _pending_uploads(store) == []

    # more parts than S3 allows: refused, aborted
    monkeypatch.setattr(store._client, "upload_part", upload_part)
    monkeypatch.setattr(s3multipart, "MAX_PARTS", 2)
    with pytest.raises(StoreError, match="more than 2 parts"):
        store.put_chunks("ckpt/broken.bin", _chunks(b"u" * (2 * PART + 1), MiB))
    assert not store.exists("ckpt/broken.bin") and _pending_uploads(store) == []


def test_a_racing_writer_wins_at_completion_and_a_lost_completion_answer_counts_as_done(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _sizes = _small_part_store(s3_url, monkeypatch)
    assert store.multipart_create_only_mode() == "conditional"  # moto 5.2.5 enforces it
    other = S3Store.from_url(s3_url)

    def racing() -> Iterator[bytes]:
        yield b"r" * PART
        other.put("k", b"the other writer")  # lands while our upload is under way
        yield b"r" * PART

    with pytest.raises(ObjectExists):  # If-None-Match: * on CompleteMultipartUpload
        store.put_chunks("k", racing())
    assert store.get("k") == b"the other writer" and _pending_uploads(store) == []

    # The completion lands but its answer is lost; boto3's retry (or ours) finds the object
    # there, tagged with this upload's put id: done, not an error.
    complete = store._client.complete_multipart_upload

    def lost_answer(**kw: Any) -> Any:
        complete(**kw)
        raise ReadTimeoutError(endpoint_url="http://lost")

    monkeypatch.setattr(store._client, "complete_multipart_upload", lost_answer)
    data = b"s" * (PART + 7)
    assert store.put_chunks("mine", [data])[1] == hashlib.sha256(data).hexdigest()
    assert store.get("mine") == data and _pending_uploads(store) == []
    with pytest.raises(ObjectExists):  # another writer's completion still fails
        store.put_chunks("k2", _racing_put(other, "k2"))
    assert store.get("k2") == b"the other writer" and _pending_uploads(store) == []


def _racing_put(other: S3Store, key: str) -> Iterator[bytes]:
    yield b"r" * PART
    other.put(key, b"the other writer")
    yield b"r"


def test_put_chunks_holds_one_part_in_memory(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store, sizes = _small_part_store(s3_url, monkeypatch)
    chunk = 256 * 1024
    total = 6 * PART + 1000

    def produced() -> Iterator[bytes]:  # made on the fly, as a trainer serialises tensors
        for i in range(0, total, chunk):
            yield bytes([i % 251]) * min(chunk, total - i)

    h = hashlib.sha256()
    for c in produced():
        h.update(c)
    store.put_chunks("warm-up", [b"w" * (PART + 1)])  # boto3 loads its models on first use
    sizes.clear()
    tracemalloc.start()
    try:
        _uri, digest, size = store.put_chunks("big", produced())
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == total and digest == h.hexdigest()
    assert sizes[:-1] == [PART] * 6 and sizes[-1] == 1000
    # one part buffer and a chunk, plus boto3's working memory; far below the object's size
    assert peak < PART + 2 * chunk + 2 * MiB < total / 4, peak
    assert hashlib.sha256(store.get("big")).hexdigest() == digest


def test_part_size_grows_to_fit_s3s_part_limit(s3_url: str) -> None:
    store = S3Store.from_url(s3_url)
    assert store.part_bytes == 64 * MiB and store.max_put_bytes == 5 * 1024**3
    store.part_bytes = PART
    assert store._part_size(None) == PART
    assert store._part_size(10_000 * PART) == PART
    assert store._part_size(10_000 * PART + 1) == 6 * MiB
    assert store._part_size(10 * 1024**4) == 1049 * MiB  # 10 TiB in 10,000 parts
    store.part_bytes = MiB  # below S3's smallest part: raised to it
    assert store._part_size(None) == PART


def test_server_that_ignores_if_none_match_on_complete_falls_back_to_check_then_put(
    s3_url: str,
    ignoring_on_complete_endpoint: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket, prefix = parse_url(s3_url)
    store = S3Store(bucket, prefix, S3Settings(endpoint_url=ignoring_on_complete_endpoint))
    store.part_bytes = PART
    store.max_put_bytes = MiB
    assert store.create_only_mode() == "conditional"  # PutObject honours it
    assert store.multipart_create_only_mode() == "check-then-put"
    assert "ignores If-None-Match on CompleteMultipartUpload" in caplog.text
    assert store.list() == [] and _pending_uploads(store) == []  # the probe left nothing
    data = b"p" * (PART + 1)
    store.put_chunks("k", [data])
    with pytest.raises(ObjectExists):  # checked before the upload starts
        store.put_chunks("k", [data])
    with pytest.raises(ObjectExists):  # and again before it completes
        store.put_chunks("k2", _racing_put(store, "k2"))
    assert store.get("k") == data and store.get("k2") == b"the other writer"
    assert _pending_uploads(store) == []


# -- the weights protocol through S3, with crashes ---------------------------------------------

PUBLISHER = r"""
import os, signal, sys
import torch
from srl.config import CommonConfig, load_config
from srl.kafka import Producer
from srl.s3store import S3Settings, S3Store
from srl.topics import Layout
from srl.weights import announce, publish

crash_at, version = sys.argv[1], int(sys.argv[2])
cfg = load_config(CommonConfig)

class CrashingStore(S3Store):
    def put(self, key, data):
        if crash_at == "before-manifest" and key.endswith("manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # the shards are up, the manifest is not
        return super().put(key, data)

store = CrashingStore.from_url(cfg.store, S3Settings.from_config(cfg))
torch.manual_seed(version)
tensors = {"w": torch.randn(64, 32), "b": torch.randn(32)}
pub = publish(store, cfg.run, version, tensors, trainer_step=version, parent_version=version - 1,
              extra_files={"config.json": b"{}"}, max_shard_bytes=4096)
if crash_at == "before-announce":
    os.kill(os.getpid(), signal.SIGKILL)  # the manifest is up, the announcement is not
with Producer(cfg) as producer:
    announce(producer, Layout.from_config(cfg), pub)
"""


@pytest.mark.slow
def test_weights_protocol_through_s3_survives_crashes(  # type: ignore[no-untyped-def]
    s3_server, s3_url: str, make_cfg, cli_env: dict[str, str]
) -> None:
    from srl.kafka import create_topics
    from srl.topics import Layout

    cfg = make_cfg(store=s3_url, s3_endpoint_url=s3_server.endpoint, run="r1")
    create_topics(cfg)
    env = {
        **cli_env,
        **TEST_CREDENTIALS,
        "SRL_STORE": s3_url,
        "SRL_RUN": "r1",
        "SRL_S3_ENDPOINT_URL": s3_server.endpoint,
    }

    def publisher(crash_at: str, version: int) -> int:
        p = subprocess.run(
            [sys.executable, "-c", PUBLISHER, crash_at, str(version)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode in (0, -9), p.stderr
        return p.returncode

    assert publisher("none", 1) == 0
    assert publisher("before-manifest", 2) == -9
    assert publisher("before-announce", 3) == -9
    assert publisher("none", 4) == 0

    store = S3Store.from_url(s3_url, S3Settings(endpoint_url=s3_server.endpoint))
    v2, v3 = store.list(version_prefix("r1", 2)), store.list(version_prefix("r1", 3))
    assert v2 and not any(k.endswith("manifest.json") for k in v2)  # crashed mid-upload
    assert any(k.endswith("manifest.json") for k in v3)  # crashed before announcing
    anns = read_announcements(cfg, Layout.from_config(cfg))
    assert sorted(a.version for a in anns) == [1, 4]
    # A restarted publisher can write the version the crash left unfinished.
    assert publisher("none", 2) == 0
    anns = read_announcements(cfg, Layout.from_config(cfg))
    assert sorted(a.version for a in anns) == [1, 2, 4]
    for ann in anns:  # every announced version is complete and verifies
        manifest = load_manifest(store, ann)
        assert len(manifest.files) > 2  # sharded: several objects per version
        torch.manual_seed(ann.version)
        expected = {"w": torch.randn(64, 32), "b": torch.randn(32)}
        got = fetch_tensors(store, manifest)
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert all(a.manifest_uri.startswith(s3_url) for a in anns)


def test_store_init_creates_the_bucket_once(  # type: ignore[no-untyped-def]
    s3_server, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import bin_path

    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    env = {
        **cli_env,
        **TEST_CREDENTIALS,
        "SRL_STORE": "s3://made-by-init/run",
        "SRL_S3_ENDPOINT_URL": s3_server.endpoint,
    }
    first = subprocess.run(
        [bin_path("srl"), "store", "init"], env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("bucket made-by-init created at http://127.0.0.1:")
    assert first.stdout.rstrip().endswith("create-only writes: conditional")
    again = subprocess.run(
        [bin_path("srl"), "store", "init"], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and "bucket made-by-init exists" in again.stdout
    store = S3Store.from_url("s3://made-by-init/run", S3Settings(endpoint_url=s3_server.endpoint))
    store.put("k", b"v")
    assert store.list() == ["k"]


def test_a_checkpoint_shard_over_the_single_put_limit_saves_and_restores_through_multipart(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer checkpoint whose shards are larger than one put may be (lowered to 1 MiB here;
    5 GiB on S3) streams up in parts and loads back row for row, on either world size."""
    from consumers import checkpoint as ckpts

    store, sizes = _small_part_store(s3_url, monkeypatch)
    run = f"big-{uuid.uuid4().hex[:8]}"
    full = torch.randn(3 * 1024 + 1, 1024)  # 12 MiB of fp32 rows, an odd count
    half = (full.shape[0] + 1) // 2  # torch.chunk's split over 2 ranks
    layout = [(0, full[:half]), (half, full[half:])]
    entries = [
        ckpts.write_shard(
            store,
            run,
            1,
            r,
            2,
            {"model/w": rows.contiguous()},
            {"layout": {"model/w": [len(full), at]}},
        )
        for r, (at, rows) in enumerate(layout)
    ]
    ckpts.save(store, run, 1, step=1, version=1, ledger={}, events=[], shards=entries)
    assert sizes.count(PART) >= 2, f"both shards went up in parts: {sizes}"
    assert not _pending_uploads(store)
    shards = ckpts.load(store, run, 1).shards
    assert torch.equal(shards.rows("model/w", 0, len(full), len(full)), full)  # on one rank
    assert torch.equal(shards.rows("model/w", half, len(full), len(full)), full[half:])
