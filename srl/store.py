"""Object store for weights, checkpoints and ranker versions.

Owns the one rule the weights protocol stands on: **writes are create-only** (a key, once
written, is never overwritten) and **atomic** (a reader sees all of an object or none).
Keys are ``/``-separated relative paths such as ``weights/run/v00000001/model.safetensors``.

* ``file://DIR``: :class:`LocalStore`, a directory tree; an object is written to a temporary
  file, fsynced, then hard-linked into place (``link`` fails if the key exists).
* ``s3://bucket/prefix``: see ``srl.s3store`` (``srl.stores.open_store`` picks by URL).

Called by ``srl.weights``, the trainer's checkpointing and the ranker.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from srl.errors import StoreError


class ObjectExists(StoreError):
    """A create-only write found the key already there."""


class ObjectMissing(StoreError):
    """A read found no object at the key."""


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"bad object key {key!r}")
    return key


class ObjectStore(ABC):
    """Create-only object storage addressed by key; ``uri(key)`` names an object anywhere."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> str:
        """Write ``data`` at ``key`` (create-only, atomic); returns the object's URI."""

    def put_chunks(self, key: str, chunks: Iterable[bytes | memoryview]) -> tuple[str, str, int]:
        """Write concatenated ``chunks`` create-only; returns (uri, sha256 hex, size)."""
        h = hashlib.sha256()
        parts = []
        for c in chunks:
            h.update(c)
            parts.append(bytes(c))
        data = b"".join(parts)
        return self.put(key, data), h.hexdigest(), len(data)

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    def get_hashed(self, key: str) -> tuple[bytearray | mmap.mmap, str]:
        """The object in a writable buffer (tensors may view it) and its sha256 hex."""
        data = self.get(key)
        return bytearray(data), hashlib.sha256(data).hexdigest()

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def uri(self, key: str) -> str: ...

    def key_of(self, uri: str) -> str:
        """The key of a URI this store produced; StoreError for another store's URI."""
        base = self.uri("")
        if not uri.startswith(base):
            raise StoreError(f"{uri} is not in store {self.url}")
        return check_key(uri[len(base) :])

    def local_path(self, key: str) -> Path | None:
        """A filesystem path for the object when the store is local (zero-copy reads)."""
        return None


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes | memoryview) -> str:
        return self._write(key, [data])[0]

    def put_chunks(self, key: str, chunks: Iterable[bytes | memoryview]) -> tuple[str, str, int]:
        """Streamed: each chunk is hashed (in a helper thread) while it is written."""
        h = hashlib.sha256()
        uri, size = self._write(key, chunks, h)
        return uri, h.hexdigest(), size

    def get_hashed(self, key: str) -> tuple[bytearray | mmap.mmap, str]:
        """A private copy-on-write map of the file (nothing is read twice or copied: tensors
        view it) and its sha256. The store is create-only, so the file never changes."""
        try:
            with open(self._path(key), "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return bytearray(), hashlib.sha256(b"").hexdigest()
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise ObjectMissing(f"object {key} not found in {self.url}") from None
        except OSError as e:
            raise StoreError(f"cannot read {key} from {self.url}: {e.strerror or e}") from None
        return m, hashlib.sha256(m).hexdigest()

    def _write(
        self, key: str, chunks: Iterable[bytes | memoryview], h: hashlib._Hash | None = None
    ) -> tuple[str, int]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            raise ObjectExists(f"object {key} already exists in {self.url} (create-only store)")
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        size = 0
        try:
            with open(tmp, "wb", buffering=0) as f, _Hasher(h) as hasher:
                for c in chunks:
                    hasher.update(c)
                    view = memoryview(c).cast("B")
                    while view:
                        n = f.write(view)
                        view = view[n:]
                        size += n
                hasher.wait()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ObjectExists(
                    f"object {key} already exists in {self.url} (create-only store)"
                ) from None
            _fsync_dir(path.parent)
        except OSError as e:
            raise StoreError(f"cannot write {key} to {self.url}: {e.strerror or e}") from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return self.uri(key), size

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"object {key} not found in {self.url}") from None
        except OSError as e:
            raise StoreError(f"cannot read {key} from {self.url}: {e.strerror or e}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*"):
            if p.is_file() and not p.name.startswith(".tmp-"):
                out.append(p.relative_to(self.root).as_posix())
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def uri(self, key: str) -> str:
        return f"{self.url}/{key}"

    def local_path(self, key: str) -> Path | None:
        return self._path(key)


_PIECE = 16 * 1024 * 1024


class _Hasher:
    """Feeds a hash in one helper thread, in order, so hashing overlaps the file I/O
    (hashlib and file reads/writes release the GIL on large buffers). ``h=None``: no-op."""

    def __init__(self, h: hashlib._Hash | None) -> None:
        self.h = h
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None

    def __enter__(self) -> _Hasher:
        if self.h is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="srl-sha256")
        return self

    def update(self, data: bytes | memoryview) -> None:
        if self._pool is not None and self.h is not None:
            self._last = self._pool.submit(self.h.update, data)

    def wait(self) -> None:
        if self._last is not None:
            self._last.result()

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self.wait()
            self._pool.shutdown()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
