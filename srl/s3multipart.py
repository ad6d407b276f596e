"""S3 multipart uploads for ``srl.s3store.S3Store``: cutting a stream of chunks into parts, the
part size, one create-only upload (aborted on any failure) and the once-per-process probe of
whether the server honours ``If-None-Match: *`` on ``CompleteMultipartUpload``.

What must hold is the store's contract (see ``srl.s3store``): an upload becomes an object only at
``CompleteMultipartUpload``, so it is atomic; it is create-only (``If-None-Match: *`` on the
completion where the server enforces it, else a HEAD before the upload starts and again before
it completes); memory holds one part; an upload that fails is aborted, leaving no object and no
pending upload; a retried completion that finds its own object (tagged with the upload's
``srl-put-id``) counts as done.

The store owns a ``MultipartWriter`` and calls it from ``put`` (above ``max_put_bytes``) and
``put_chunks``. The writer reaches S3 only through the store (``_call``, ``exists`` …), typed
here as the ``MultipartStore`` protocol, so this module does not import ``srl.s3store``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from srl.errors import StoreError
from srl.store import ObjectExists

log = logging.getLogger("srl.s3store")

MIN_PART_BYTES = 5 * 1024**2  # S3's smallest part (but the last); smaller part_bytes are raised
MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload
PUT_ID = "srl-put-id"  # user metadata naming the put() call that wrote an object

_mp_modes: dict[tuple[str | None, str], str] = {}  # (endpoint, bucket) -> probed mode
_lock = threading.Lock()


class NotImplementedByServer(StoreError):
    """The server does not implement a request feature (e.g. conditional puts)."""


class StoreSettings(Protocol):
    """What the writer reads of ``srl.s3store.S3Settings``."""

    @property
    def endpoint_url(self) -> str | None: ...

    @property
    def create_only(self) -> str: ...


class MultipartStore(Protocol):
    """What the writer uses of ``srl.s3store.S3Store``."""

    @property
    def bucket(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def settings(self) -> StoreSettings: ...

    def uri(self, key: str) -> str: ...

    def exists(self, key: str) -> bool: ...

    def create_only_mode(self) -> str: ...

    def multipart_create_only_mode(self) -> str: ...

    def _key(self, key: str) -> str: ...

    def _new_put_id(self) -> str: ...

    def _put_id(self, key: str) -> str | None: ...

    def _call(self, op: str, key: str, **kw: Any) -> Any: ...


@dataclass
class Part:
    data: bytearray  # the part's bytes (boto3 takes a bytearray, not a memoryview)
    last: bool  # the stream ended with this part

    @property
    def size(self) -> int:
        return len(self.data)


def part_size(part_bytes: int, total: int | None) -> int:
    """``part_bytes`` (at least S3's 5 MiB), grown to a whole MiB where ``total`` would need
    more than 10,000 parts."""
    part = max(part_bytes, MIN_PART_BYTES)
    need = -(-(total or 0) // MAX_PARTS)
    return part if need <= part else -(-need // 1024**2) * 1024**2


def cut_parts(
    chunks: Iterable[bytes | memoryview], part_bytes: int, h: hashlib._Hash | None
) -> Iterator[Part]:
    """Cut the concatenated ``chunks`` into parts of ``part_bytes`` and a shorter last one
    (empty where the stream ends on a part boundary), hashing each chunk into ``h`` as it is
    read. One buffer serves every part: a part yielded is valid until the next is asked for.
    The buffer grows with the first part (a small stream never holds a whole part), then is
    overwritten in place."""
    buf = bytearray()
    n = 0  # bytes of buf in use
    for c in chunks:
        view = memoryview(c).cast("B")
        if h is not None:
            h.update(view)
        while view:
            take = min(part_bytes - n, len(view))
            if n == len(buf):
                buf += view[:take]
            else:
                buf[n : n + take] = view[:take]
            n += take
            view = view[take:]
            if n == part_bytes:
                yield Part(buf, last=False)
                n = 0
    del buf[n:]
    yield Part(buf, last=True)


class MultipartWriter:
    """The multipart uploads of one store."""

    def __init__(self, store: MultipartStore) -> None:
        self.store = store

    def upload(self, key: str, parts: Iterator[Part]) -> tuple[str, int]:
        """One multipart upload of ``parts``, create-only; aborted on any failure (nothing is
        left behind: no object, no pending upload). Returns (uri, size)."""
        s = self.store
        full = s._key(key)
        conditional = s.multipart_create_only_mode() == "conditional"
        # Checked first in every mode: the object may be tens of GB, so refuse before uploading.
        if s.exists(key):
            raise _exists(s, key)
        put_id = s._new_put_id()
        resp = s._call(
            "create_multipart", key, Bucket=s.bucket, Key=full, Metadata={PUT_ID: put_id}
        )
        upload_id = str(resp["UploadId"])
        try:
            done, size = self._upload_parts(key, full, upload_id, parts)
            self._complete(key, full, upload_id, done, put_id, conditional)
        except BaseException:
            self._abort(key, full, upload_id)
            raise
        log.debug("upload %s: %d bytes in %d parts", key, size, len(done))
        return s.uri(key), size

    def _upload_parts(
        self, key: str, full: str, upload_id: str, parts: Iterator[Part]
    ) -> tuple[list[dict[str, Any]], int]:
        """Upload each part; returns the parts done (number, ETag) and their total size."""
        s = self.store
        done: list[dict[str, Any]] = []
        size = 0
        for part in parts:
            if part.size == 0 and done:  # the stream ended on a part boundary
                break
            number = len(done) + 1
            if number > MAX_PARTS:
                raise StoreError(
                    f"object {key} needs more than {MAX_PARTS} parts (S3's limit) after "
                    f"{size} bytes; raise part_bytes or pass size_hint"
                )
            resp = s._call(
                "upload_part",
                key,
                Bucket=s.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=part.data,
            )
            done.append({"PartNumber": number, "ETag": resp["ETag"]})
            size += part.size
        return done, size

    def _complete(
        self,
        key: str,
        full: str,
        upload_id: str,
        done: list[dict[str, Any]],
        put_id: str,
        conditional: bool,
    ) -> None:
        s = self.store
        kw: dict[str, Any] = {
            "Bucket": s.bucket,
            "Key": full,
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": done},
        }
        if conditional:
            kw["IfNoneMatch"] = "*"
        elif s.exists(key):  # check-then-put: check again, just before it lands
            raise _exists(s, key)
        try:
            s._call("complete_multipart", key, **kw)
        except StoreError:  # ObjectExists included: a retried complete may find its own
            if not self._landed(key, put_id):
                raise
            log.info("upload %s: a retried completion found its own earlier one landed", key)

    def _landed(self, key: str, put_id: str) -> bool:
        try:
            return self.store._put_id(key) == put_id
        except StoreError:
            return False

    def _abort(self, key: str, full: str, upload_id: str) -> None:
        s = self.store
        try:
            s._call("abort_multipart", key, Bucket=s.bucket, Key=full, UploadId=upload_id)
        except StoreError as e:  # the original error matters more; a lifecycle rule cleans up
            log.warning("cannot abort the multipart upload of %s (%s): %s", key, upload_id, e)

    # -- create-only mode --------------------------------------------------------------
    def create_only_mode(self) -> str:
        """The create-only mode of multipart uploads: the store's ``create_only_mode()``,
        except that in auto mode a server that enforces ``If-None-Match`` on PutObject is probed
        once more for CompleteMultipartUpload (some honour it on PutObject only)."""
        s = self.store
        mode = s.create_only_mode()
        if mode != "conditional" or s.settings.create_only == "conditional":
            return mode
        ident = (s.settings.endpoint_url, s.bucket)
        with _lock:
            if ident not in _mp_modes:
                _mp_modes[ident] = self._probe()
            return _mp_modes[ident]

    def _probe(self) -> str:
        """Complete two one-part uploads of one probe key with ``If-None-Match: *``: a 412 on
        the second means the server enforces it on CompleteMultipartUpload."""
        s = self.store
        key = f".srl-probe/{uuid.uuid4().hex}"
        full = s._key(key)
        mode = "check-then-put"
        try:
            self._probe_upload(key, full, b"1")
            try:
                self._probe_upload(key, full, b"2")
                log.warning(
                    "S3 server at %s ignores If-None-Match on CompleteMultipartUpload; "
                    "create-only multipart uploads fall back to check-then-put",
                    s.settings.endpoint_url or "AWS",
                )
            except ObjectExists:
                mode = "conditional"
        except NotImplementedByServer:
            log.warning(
                "S3 server at %s refuses If-None-Match on CompleteMultipartUpload; create-only "
                "multipart uploads fall back to check-then-put",
                s.settings.endpoint_url or "AWS",
            )
        finally:
            try:
                s._call("delete", key, Bucket=s.bucket, Key=full)
            except StoreError as e:  # a leftover probe object is harmless and hidden by list()
                log.debug("probe cleanup: %s", e)
        return mode

    def _probe_upload(self, key: str, full: str, body: bytes) -> None:
        s = self.store
        resp = s._call("create_multipart", key, Bucket=s.bucket, Key=full)
        upload_id = str(resp["UploadId"])
        try:
            part = s._call(
                "upload_part",
                key,
                Bucket=s.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=1,
                Body=body,
            )
            s._call(
                "complete_multipart",
                key,
                Bucket=s.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
                IfNoneMatch="*",
            )
        except BaseException:
            self._abort(key, full, upload_id)
            raise


def _exists(s: MultipartStore, key: str) -> ObjectExists:
    return ObjectExists(f"object {key} already exists in {s.url} (create-only store)")
