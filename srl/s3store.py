"""S3 object store (``s3://bucket/prefix``): the ``ObjectStore`` contract on Amazon S3 or any
S3-compatible server (MinIO, Ceph RGW, moto …).

What must hold, as for ``LocalStore``:

* **create-only**: a key, once written, is never overwritten. By default each put is a
  conditional ``PutObject`` with ``If-None-Match: *``; the server answers 412 if the key exists
  and the put fails with ``ObjectExists``. A server that ignores the header (it answers 200 and
  overwrites) or refuses it (501) is detected once per process by a probe under
  ``{prefix}/.srl-probe/`` and the store falls back to *check-then-put* (HEAD, then PUT), which
  is create-only for a single writer per key, the case of the weights protocol (one trainer
  writes a version) but not under a race between two writers. ``s3_create_only`` pins the mode.
* **atomic**: a single ``PutObject`` is visible all at once or not at all (S3 semantics), and
  so is a multipart upload, which becomes an object only at ``CompleteMultipartUpload``.
* **no size ceiling, bounded memory**: ``put_chunks`` streams its chunks into multipart parts
  of ``part_bytes`` (64 MiB), hashing them on the way, holding one part in memory; an object
  smaller than one part (and at most ``max_put_bytes``) is a single ``PutObject``. ``put`` of
  more than ``max_put_bytes`` (5 GiB, S3's single-put limit) goes multipart too. S3 allows
  10,000 parts: a ``put`` (its size known) grows the part size to fit, a stream of unknown size
  stops at 10,000 x ``part_bytes`` (640 GB at 64 MiB; pass ``size_hint`` or raise
  ``part_bytes`` for more). The multipart upload is aborted on any failure: no orphaned parts.
  Create-only holds as for puts: ``If-None-Match: *`` on ``CompleteMultipartUpload`` (probed
  once per process too, as some servers honour it on PutObject only), else a HEAD before the
  upload starts and again before it completes.
* a conditional put that boto3 retries after its first attempt landed (the answer was lost on
  a long link) gets 412; each put (and each multipart upload) tags its object with a random
  ``srl-put-id`` metadata value, so the store sees that the object there is its own and the put
  counts as done.

The multipart machinery (parts, uploads, their create-only probe) is ``srl.s3multipart``'s.

Where the server is and who we are: ``s3_endpoint_url`` / ``s3_region`` / ``s3_profile`` from the
config (``srl.stores.store_from_config``), else the usual AWS
variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``). Secrets never go in srl
config files. The bucket must exist. boto3 is imported on first use, not at import.

Called through ``srl.stores.open_store`` / ``store_for_uri`` by the weights protocol, the
trainer's checkpoints and the ranker.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from srl.errors import ConfigError, StoreError
from srl.s3multipart import (
    PUT_ID,
    MultipartWriter,
    NotImplementedByServer,
    cut_parts,
    part_size,
)
from srl.store import ObjectExists, ObjectMissing, ObjectStore, check_key

if TYPE_CHECKING:
    from srl.config import StoreSettings

log = logging.getLogger("srl.s3store")

CreateOnly = Literal["auto", "conditional", "check-then-put"]
MAX_PUT_BYTES = 5 * 1024**3  # S3's limit on a single PutObject; more goes multipart
PART_BYTES = 64 * 1024**2  # multipart part size (S3: >= 5 MiB except the last part)


@dataclass(frozen=True)
class S3Settings:
    """How to reach the S3 server; None means boto3's own default (AWS variables, ~/.aws)."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    create_only: CreateOnly = "auto"
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: StoreSettings) -> S3Settings:
        return cls(
            endpoint_url=cfg.s3_endpoint_url,
            region=cfg.s3_region,
            profile=cfg.s3_profile,
            addressing_style=cfg.s3_addressing_style,
            create_only=cfg.s3_create_only,
            connect_timeout_s=cfg.connect_timeout_s,
        )


_modes: dict[tuple[str | None, str], str] = {}  # (endpoint, bucket) -> probed create-only mode
_lock = threading.Lock()


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → (``bucket``, ``some/prefix``); ConfigError when malformed."""
    if not url.startswith("s3://"):
        raise ConfigError(f"store: {url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not all(c.isalnum() or c in ".-_" for c in bucket):
        raise ConfigError(f"store: bad bucket name in {url!r}; use s3://bucket/prefix")
    if prefix:
        try:
            check_key(prefix)
        except StoreError:
            raise ConfigError(f"store: bad prefix in {url!r}") from None
    return bucket, prefix


class S3Store(ObjectStore):
    list_page_size = 1000  # keys per ListObjectsV2 page (S3's maximum)
    # Overridable per instance (tests lower them): the largest single PutObject, and the size
    # of the parts of a multipart upload (all but the last; >= 5 MiB on S3).
    max_put_bytes = MAX_PUT_BYTES
    part_bytes = PART_BYTES

    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.settings = settings or S3Settings()
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = _make_client(self.settings)
        self._multipart = MultipartWriter(self)

    @classmethod
    def from_url(cls, url: str, settings: S3Settings | None = None) -> S3Store:
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, settings)

    # -- keys --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"{self.url}/{key}"

    # -- the contract ------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview) -> str:
        size = memoryview(data).nbytes
        if size > self.max_put_bytes:  # above S3's single-put limit: a multipart upload
            return self._multipart.upload(key, cut_parts([data], self._part_size(size), None))[0]
        body = bytes(data)
        full = self._key(key)
        if self.create_only_mode() == "conditional":
            put_id = self._new_put_id()
            try:
                self._call(
                    "put",
                    key,
                    Bucket=self.bucket,
                    Key=full,
                    Body=body,
                    IfNoneMatch="*",
                    Metadata={PUT_ID: put_id},
                )
            except ObjectExists:
                if self._put_id(key) != put_id:
                    raise
                log.info("put %s: a retried attempt found its own earlier attempt landed", key)
        else:
            if self.exists(key):
                raise ObjectExists(f"object {key} already exists in {self.url} (create-only store)")
            self._call("put", key, Bucket=self.bucket, Key=full, Body=body)
        return self.uri(key)

    def put_chunks(
        self,
        key: str,
        chunks: Iterable[bytes | memoryview],
        *,
        size_hint: int | None = None,
    ) -> tuple[str, str, int]:
        """Write concatenated ``chunks`` create-only, streamed: each chunk is hashed as it is
        read and copied into a part buffer of ``part_bytes``, which is uploaded as one part of a
        multipart upload when full; memory holds one part and the chunk being read. A stream
        that ends within its first part (and is at most ``max_put_bytes``) is one ``put``.
        ``size_hint`` (the total, if known) grows the part size so that it fits in 10,000
        parts; without it the ceiling is 10,000 x ``part_bytes``. Returns (uri, sha256 hex,
        size)."""
        self._key(key)  # a bad key fails before a chunk is read
        h = hashlib.sha256()
        parts = cut_parts(chunks, self._part_size(size_hint), h)
        first = next(parts)
        if first.last and first.size <= self.max_put_bytes:
            return self.put(key, bytes(first.data)), h.hexdigest(), first.size
        uri, size = self._multipart.upload(key, itertools.chain([first], parts))
        return uri, h.hexdigest(), size

    def get(self, key: str) -> bytes:
        resp = self._call("get", key, Bucket=self.bucket, Key=self._key(key))
        return bytes(resp["Body"].read())

    def exists(self, key: str) -> bool:
        try:
            self._call("head", key, Bucket=self.bucket, Key=self._key(key))
        except ObjectMissing:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        under = base + (prefix.strip("/") + "/" if prefix.strip("/") else "")
        keys: list[str] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": under,
                "MaxKeys": self.list_page_size,
            }
            if token:
                kw["ContinuationToken"] = token
            resp = self._call("list", prefix or "/", **kw)
            keys += [o["Key"][len(base) :] for o in resp.get("Contents", [])]
            if not resp.get("IsTruncated"):
                break
            token = resp.get("NextContinuationToken")
        return sorted(k for k in keys if not k.startswith(".srl-probe/"))

    def delete(self, key: str) -> None:
        self._call("delete", key, Bucket=self.bucket, Key=self._key(key))

    def ensure_bucket(self) -> bool:
        """Create the bucket if it does not exist; True if it was created (for ``srl store
        init``)."""
        try:
            self._call("head_bucket", self.bucket, Bucket=self.bucket)
            return False
        except (ObjectMissing, StoreError):
            pass
        kw: dict[str, Any] = {"Bucket": self.bucket}
        region = self._client.meta.region_name
        if region and region != "us-east-1":  # S3 wants the region spelled out elsewhere
            kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._call("create_bucket", self.bucket, **kw)
        except StoreError as e:
            if "BucketAlreadyOwnedByYou" not in str(e):
                raise
            return False
        return True

    # -- create-only mode --------------------------------------------------------------
    def create_only_mode(self) -> str:
        """``conditional`` or ``check-then-put``: the configured mode, or the probed one."""
        if self.settings.create_only != "auto":
            return self.settings.create_only
        ident = (self.settings.endpoint_url, self.bucket)
        with _lock:
            if ident not in _modes:
                _modes[ident] = self._probe()
            return _modes[ident]

    def _probe(self) -> str:
        """Write one probe object twice with ``If-None-Match: *``: a 412 on the second means
        the server enforces it."""
        key = f".srl-probe/{uuid.uuid4().hex}"
        full = self._key(key)
        mode = "check-then-put"
        try:
            self._call("put", key, Bucket=self.bucket, Key=full, Body=b"1", IfNoneMatch="*")
            try:
                self._call("put", key, Bucket=self.bucket, Key=full, Body=b"2", IfNoneMatch="*")
                log.warning(
                    "S3 server at %s ignores If-None-Match; create-only falls back to "
                    "check-then-put",
                    self.settings.endpoint_url or "AWS",
                )
            except ObjectExists:
                mode = "conditional"
        except NotImplementedByServer:
            log.warning(
                "S3 server at %s refuses If-None-Match; create-only falls back to check-then-put",
                self.settings.endpoint_url or "AWS",
            )
        finally:
            try:
                self._call("delete", key, Bucket=self.bucket, Key=full)
            except StoreError as e:  # a leftover probe object is harmless and hidden by list()
                log.debug("probe cleanup: %s", e)
        return mode

    # -- multipart uploads (srl.s3multipart) -----------------------------------------
    def multipart_create_only_mode(self) -> str:
        """The create-only mode of multipart uploads: ``create_only_mode()``, except that in
        auto mode a server that enforces ``If-None-Match`` on PutObject is probed once more for
        CompleteMultipartUpload (some honour it on PutObject only)."""
        return self._multipart.create_only_mode()

    def _part_size(self, total: int | None) -> int:
        """``part_bytes`` (at least S3's 5 MiB), grown to a whole MiB where ``total`` would
        need more than 10,000 parts."""
        return part_size(self.part_bytes, total)

    # -- boto3 calls with one-line errors ----------------------------------------------
    def _new_put_id(self) -> str:
        return uuid.uuid4().hex

    def _put_id(self, key: str) -> str | None:
        resp = self._call("head", key, Bucket=self.bucket, Key=self._key(key))
        return resp.get("Metadata", {}).get(PUT_ID)

    def _call(self, op: str, key: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        method = {
            "put": self._client.put_object,
            "get": self._client.get_object,
            "head": self._client.head_object,
            "list": self._client.list_objects_v2,
            "delete": self._client.delete_object,
            "head_bucket": self._client.head_bucket,
            "create_bucket": self._client.create_bucket,
            "create_multipart": self._client.create_multipart_upload,
            "upload_part": self._client.upload_part,
            "complete_multipart": self._client.complete_multipart_upload,
            "abort_multipart": self._client.abort_multipart_upload,
        }[op]
        where = f"{self.url} ({self.settings.endpoint_url or 'AWS'})"
        for _attempt in range(3):
            try:
                return method(**kw)
            except ClientError as e:
                err = e.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code == "PreconditionFailed" or status == 412:
                    raise ObjectExists(
                        f"object {key} already exists in {self.url} (create-only store)"
                    ) from None
                if code == "ConditionalRequestConflict" or status == 409:
                    continue  # a concurrent conditional write; S3 says retry
                if code in ("NoSuchKey", "404", "NotFound"):
                    raise ObjectMissing(f"object {key} not found in {self.url}") from None
                if code == "NoSuchBucket":
                    raise StoreError(
                        f"bucket {self.bucket} does not exist at {where}; create it first"
                    ) from None
                if code == "NotImplemented" or status == 501:
                    raise NotImplementedByServer(
                        f"{op} {key}: {err.get('Message', code)}"
                    ) from None
                raise StoreError(
                    f"cannot {op} {key} in {where}: {code} {err.get('Message', '')}".rstrip()
                ) from None
            except NoCredentialsError:
                raise StoreError(
                    f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / s3_profile"
                ) from None
            except BotoCoreError as e:
                raise StoreError(f"cannot {op} {key} in {where}: {e}") from None
        raise StoreError(f"cannot {op} {key} in {where}: conflicting concurrent writes")


def _make_client(s: S3Settings) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("store: s3:// needs boto3 (pip install boto3)") from None

    style = s.addressing_style
    if style == "auto" and (s.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")):
        style = "path"  # self-hosted servers rarely have wildcard DNS for virtual-host buckets
    config = Config(
        connect_timeout=s.connect_timeout_s,
        read_timeout=s.read_timeout_s,
        retries={"max_attempts": 5, "mode": "standard"},
        s3={"addressing_style": style},
    )
    try:
        session = boto3.session.Session(profile_name=s.profile)
        return session.client(
            "s3", endpoint_url=s.endpoint_url, region_name=s.region, config=config
        )
    except Exception as e:  # botocore raises several unrelated types for bad settings
        raise ConfigError(f"store: cannot make an S3 client: {e}") from None
