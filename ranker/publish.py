"""Ranker versions in the object store, published like weights: files first, manifest last.

Layout: ``ranker/{run}/v{version:08d}/model.safetensors``, ``config.json``, then
``manifest.json`` (run, version, files with size and sha256, pairs trained on, metrics,
created time). The **pointer** is the manifest: a version exists once its manifest does, and
the latest version is the highest one with a manifest. Writes are create-only, so a version
never changes; a crash before the manifest leaves files nobody points to.

Steps of :func:`publish`, in this order: (1) pick one past the highest version directory
(a crashed publication's files keep their number, which is never reused); (2) put each file
create-only, hashing what is written; (3) put the manifest. Two trainers racing for one
version number: the loser's create-only put fails with ``ObjectExists`` and it moves on to
the next number.

Readers (:func:`load_version`, :class:`RankerFollower`) verify every file against the manifest
before parsing it, and never unpickle. Called by ``ranker.online`` (writer), the dispatcher
and ``srl ranker eval`` (readers).
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import orjson

from ranker.model import LengthRanker, RankerError
from srl.store import ObjectExists, ObjectStore

MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{8})$")


def version_prefix(run: str, version: int) -> str:
    return f"ranker/{run}/v{version:08d}"


def _numbers(store: ObjectStore, run: str, file: str | None = None) -> set[int]:
    """Version numbers of ``run`` with any file in their directory, or with ``file``."""
    out = set()
    for key in store.list(f"ranker/{run}/"):
        parts = key.split("/")
        wanted = len(parts) == 4 and (file is None or parts[3] == file)
        if wanted and (m := _VERSION_DIR.match(parts[2])):
            out.add(int(m.group(1)))
    return out


def versions(store: ObjectStore, run: str) -> list[int]:
    """Published versions (those with a manifest), ascending."""
    return sorted(_numbers(store, run, MANIFEST))


def _highest_dir(store: ObjectStore, run: str) -> int:
    """Highest version number with any file, manifest or not (0 if none): a crashed
    publication's files keep their number, and a new version takes the next one."""
    return max(_numbers(store, run), default=0)


def latest_version(store: ObjectStore, run: str) -> int | None:
    v = versions(store, run)
    return v[-1] if v else None


def publish(
    store: ObjectStore, run: str, ranker: LengthRanker, extra: dict[str, Any] | None = None
) -> LengthRanker:
    """Write a new version (files, then manifest); returns the ranker with its version set."""
    files = ranker.to_files()
    version = _highest_dir(store, run)
    for _attempt in range(5):
        version += 1
        prefix = version_prefix(run, version)
        try:
            entries = []
            for name, data in sorted(files.items()):
                store.put(f"{prefix}/{name}", data)
                entries.append(
                    {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                )
        except ObjectExists:
            continue  # another trainer took this number; take the next one
        manifest = {
            "run": run,
            "version": version,
            "files": entries,
            "info": ranker.info,
            "extra": extra or {},
            "created_ms": time.time_ns() // 1_000_000,
        }
        try:
            store.put(f"{prefix}/{MANIFEST}", orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        except ObjectExists:
            continue
        return ranker.with_version(version)
    raise RankerError(f"ranker: could not claim a version number for run {run!r} after 5 tries")


def load_manifest(store: ObjectStore, run: str, version: int) -> dict[str, Any]:
    data = store.get(f"{version_prefix(run, version)}/{MANIFEST}")
    try:
        manifest: dict[str, Any] = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise RankerError(f"ranker {run} v{version}: manifest is not JSON") from None
    if manifest.get("run") != run or manifest.get("version") != version:
        raise RankerError(f"ranker {run} v{version}: manifest names another version")
    return manifest


def load_version(store: ObjectStore, run: str, version: int | None = None) -> LengthRanker:
    """A published version (default: the latest), each file checked against the manifest."""
    if version is None:
        version = latest_version(store, run)
        if version is None:
            raise RankerError(
                f"no ranker published for run {run!r} in {store.url}; run `srl ranker train` first"
            )
    manifest = load_manifest(store, run, version)
    files: dict[str, bytes] = {}
    for entry in manifest["files"]:
        data = store.get(f"{version_prefix(run, version)}/{entry['name']}")
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RankerError(f"ranker {run} v{version}: {entry['name']} fails verification")
        files[entry["name"]] = data
    return LengthRanker.from_files(files, version)


class RankerFollower:
    """Keeps the newest published ranker; ``poll()`` looks for a newer one every ``every_s``.

    Versions only move forward; a version that fails verification is added to ``refused``
    and skipped (the previous one stays in use).
    """

    def __init__(self, store: ObjectStore, run: str, every_s: float = 10.0) -> None:
        self.store, self.run, self.every_s = store, run, every_s
        self.current: LengthRanker | None = None
        self.refused: set[int] = set()
        self._next = 0.0

    def poll(self, force: bool = False) -> LengthRanker | None:
        now = time.monotonic()
        if not force and now < self._next:
            return self.current
        self._next = now + self.every_s
        have = self.current.version if self.current is not None else 0
        for v in reversed(versions(self.store, self.run)):
            if v <= (have or 0):
                break
            if v in self.refused:
                continue
            try:
                self.current = load_version(self.store, self.run, v)
                break
            except RankerError:
                self.refused.add(v)
        return self.current
