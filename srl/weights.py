"""The weights protocol: publish a policy version to the store, announce it, fetch and verify it.

Steps, in this order (DESIGN.md, "Weights protocol"):

1. ``publish`` writes ``weights/{run}/v{version:08d}/`` with create-only puts: safetensors
   shards (HF layout: ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` plus
   ``model.safetensors.index.json``) and any extra files (``config.json``, tokenizer files),
   computing each file's sha256 from the bytes it writes.
2. It writes ``manifest.json`` **last**: run, version, trainer step, parent version, files with
   size and sha256, dtype, created time.
3. ``announce`` publishes a ``WeightsAnnouncement`` (key = run) on the compacted weights topic.

A crash between 1 and 3 leaves files without a manifest or a manifest without an
announcement: no pointer to missing files. Publishing that version again removes files left
without a manifest first (step 1 of a retry); a manifest left without an announcement makes
the version "already published", and the caller announces it or moves on to the next. Followers
call ``load_manifest`` (checks the
manifest's sha256) and ``fetch_tensors`` (checks every file's sha256) and never unpickle
anything: safetensors and JSON only. Versions only move forward (the follower,
``producers.follower``, loads only versions newer than its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from schemas.codec import SchemaError
from schemas.records import WeightsAnnouncement, decode_as, encode, now_ms
from srl import tensorfile
from srl.errors import StoreError, WeightsError
from srl.kafka import read_range
from srl.store import ObjectStore

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from srl.kafka import Producer
    from srl.topics import Layout

log = logging.getLogger("srl.weights")
T = TypeVar("T")

MANIFEST = "manifest.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
# A version this large is cut into one shard per core, written and hashed (and verified by
# followers) in parallel: a single sha256 stream is the bound on a follower's verification of
# one file (figures in docs/benchmarks.md, "Weights").
PARALLEL_MIN_BYTES = 64 * 1024**2


def io_workers() -> int:
    """Threads for shard I/O: the cores this process may use, at most 8."""
    cores = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return max(1, min(8, len(cores)))


def version_prefix(run: str, version: int) -> str:
    return f"weights/{run}/v{version:08d}"


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    run: str
    version: int
    trainer_step: int
    parent_version: int | None
    files: tuple[FileEntry, ...]
    dtype: str
    created_ms: int = field(default_factory=now_ms)
    format: str = "safetensors"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        d = {
            "run": self.run,
            "version": self.version,
            "trainer_step": self.trainer_step,
            "parent_version": self.parent_version,
            "dtype": self.dtype,
            "format": self.format,
            "created_ms": self.created_ms,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return orjson.dumps(d, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        try:
            d = orjson.loads(data)
            files = tuple(
                FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in d["files"]
            )
            parent = d.get("parent_version")
            return cls(
                run=str(d["run"]),
                version=int(d["version"]),
                trainer_step=int(d["trainer_step"]),
                parent_version=None if parent is None else int(parent),
                files=files,
                dtype=str(d["dtype"]),
                created_ms=int(d["created_ms"]),
                format=str(d.get("format", "safetensors")),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{where}: not a valid manifest ({e})") from None


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    manifest_uri: str
    manifest_sha256: str

    def announcement(self) -> WeightsAnnouncement:
        m = self.manifest
        return WeightsAnnouncement(
            run=m.run,
            version=m.version,
            manifest_uri=self.manifest_uri,
            manifest_sha256=self.manifest_sha256,
            trainer_step=m.trainer_step,
            total_bytes=m.total_bytes,
            parent_version=m.parent_version,
        )


def _shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _parallel(fn: Callable[..., T], args: list[tuple[Any, ...]], workers: int) -> list[T]:
    """``fn(*a)`` for each ``a``, in threads (hashing and file I/O release the GIL), in order."""
    if workers <= 1 or len(args) <= 1:
        return [fn(*a) for a in args]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(workers, len(args)), thread_name_prefix="srl-weights") as pool:
        return list(pool.map(lambda a: fn(*a), args))


def shard_names(n: int) -> list[str]:
    """File names of a version's ``n`` safetensors shards, in the Hugging Face layout."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def shard_index(names: list[str], shards: list[dict[str, Any]], total: int) -> bytes:
    """``model.safetensors.index.json`` of a sharded version: which file holds each tensor."""
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return orjson.dumps(index, option=orjson.OPT_INDENT_2)


def _put(store: ObjectStore, prefix: str, name: str, data: bytes) -> FileEntry:
    store.put(f"{prefix}/{name}", data)
    return FileEntry(name, len(data), hashlib.sha256(data).hexdigest())


def _put_tensors(
    store: ObjectStore, prefix: str, name: str, shard: dict[str, torch.Tensor]
) -> FileEntry:
    """One safetensors file: streamed (hashed while written, never assembled in memory) when
    the tensors allow it, else built by ``safetensors.torch.save``."""
    if not tensorfile.streamable(shard):
        from safetensors.torch import save

        return _put(store, prefix, name, save(shard, metadata={"format": "pt"}))
    _uri, digest, size = store.put_chunks(
        f"{prefix}/{name}", tensorfile.parts(shard, {"format": "pt"})
    )
    return FileEntry(name, size, digest)


def _clear_unfinished(store: ObjectStore, run: str, version: int) -> None:
    """Remove the files of a publication that died between steps 1 and 2. Nothing points at
    them (no manifest, so no announcement); left there, the create-only puts would refuse the
    version forever."""
    leftovers = store.list(version_prefix(run, version))
    if leftovers:
        log.warning(
            "weights %s v%d: removing %d file(s) of an unfinished publication",
            run,
            version,
            len(leftovers),
        )
        for key in leftovers:
            store.delete(key)


def _write_tensors(
    store: ObjectStore, prefix: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[FileEntry]:
    """Step 1 for the tensors: one file, or (a large version) one shard per I/O worker written
    and hashed in parallel, plus the HF index file."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    workers = io_workers() if total >= PARALLEL_MIN_BYTES else 1
    shards = _shards(tensors, min(max_shard_bytes, -(-total // workers)))
    names = shard_names(len(shards))
    if len(shards) == 1:
        return [_put_tensors(store, prefix, names[0], shards[0])]
    args = [(store, prefix, name, shard) for name, shard in zip(names, shards, strict=True)]
    entries = _parallel(_put_tensors, args, workers)
    index = shard_index(names, shards, total)
    return [*entries, _put(store, prefix, "model.safetensors.index.json", index)]


def publish(
    store: ObjectStore,
    run: str,
    version: int,
    tensors: dict[str, torch.Tensor],
    *,
    trainer_step: int,
    parent_version: int | None,
    extra_files: dict[str, bytes] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Published:
    """Steps 1 and 2 of the protocol; returns what step 3 announces. A write the store
    refuses (a full disk, say) raises StoreError after the version's files are removed, so
    nothing is left half-written and the version may be published again."""
    prefix = version_prefix(run, version)
    if store.exists(f"{prefix}/{MANIFEST}"):
        raise WeightsError(f"weights {run} v{version} already published")
    _clear_unfinished(store, run, version)
    try:
        return _write_version(
            store, run, version, tensors, trainer_step, parent_version, extra_files, max_shard_bytes
        )
    except StoreError:
        with contextlib.suppress(StoreError):
            _clear_unfinished(store, run, version)
        raise


def _write_version(
    store: ObjectStore,
    run: str,
    version: int,
    tensors: dict[str, torch.Tensor],
    trainer_step: int,
    parent_version: int | None,
    extra_files: dict[str, bytes] | None,
    max_shard_bytes: int,
) -> Published:
    prefix = version_prefix(run, version)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    entries = _write_tensors(store, prefix, tensors, max_shard_bytes)
    entries += [_put(store, prefix, name, data) for name, data in (extra_files or {}).items()]
    manifest = Manifest(
        run, version, trainer_step, parent_version, tuple(entries), ",".join(dtypes)
    )
    body = manifest.to_json()
    uri = store.put(f"{prefix}/{MANIFEST}", body)  # written last: the version now exists
    return Published(manifest, uri, hashlib.sha256(body).hexdigest())


def prune_versions(store: ObjectStore, run: str, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` published versions of ``run`` (each one's manifest
    first: from then on it does not exist); returns the versions removed. A follower that is
    still on a removed version keeps running it and takes the newest when it comes; one that
    was fetching it refuses it and takes the next. ``keep`` 0: keep every version."""
    if keep <= 0:
        return []
    files: dict[int, list[str]] = {}
    for key in store.list(f"weights/{run}/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[2][:1] == "v" and parts[2][1:].isdigit():
            files.setdefault(int(parts[2][1:]), []).append(key)
    published = sorted(v for v, keys in files.items() if any(k.endswith(MANIFEST) for k in keys))
    gone = published[:-keep]
    for v in gone:
        manifest = f"{version_prefix(run, v)}/{MANIFEST}"
        store.delete(manifest)
        for key in files[v]:
            if key != manifest:
                store.delete(key)
    return gone


def announce(producer: Producer, layout: Layout, published: Published) -> None:
    """Step 3: the pointer on the compacted weights topic (key = run). Flushes."""
    ann = published.announcement()
    producer.produce(layout.weights, encode(ann), key=ann.run)
    producer.flush()


def load_manifest(store: ObjectStore, ann: WeightsAnnouncement) -> Manifest:
    """The announced manifest, after checking its sha256 and that it names the announced version."""
    key = store.key_of(ann.manifest_uri)
    data = store.get(key)
    digest = hashlib.sha256(data).hexdigest()
    if digest != ann.manifest_sha256:
        raise WeightsError(
            f"manifest of {ann.run} v{ann.version}: sha256 {digest[:12]}… != announced "
            f"{ann.manifest_sha256[:12]}…"
        )
    manifest = Manifest.from_json(data, ann.manifest_uri)
    if manifest.run != ann.run or manifest.version != ann.version:
        raise WeightsError(
            f"manifest at {ann.manifest_uri} is {manifest.run} v{manifest.version}, announced "
            f"v{ann.version}"
        )
    return manifest


def fetch_file(store: ObjectStore, manifest: Manifest, entry: FileEntry) -> bytearray | mmap.mmap:
    """One file of a version, verified (size and sha256) before anyone parses it."""
    key = f"{version_prefix(manifest.run, manifest.version)}/{entry.name}"
    try:
        data, digest = store.get_hashed(key)
    except StoreError as e:
        raise WeightsError(f"{manifest.run} v{manifest.version}: {e}") from None
    if len(data) != entry.size or digest != entry.sha256:
        raise WeightsError(
            f"{manifest.run} v{manifest.version}: {entry.name} fails verification "
            f"(sha256 {digest[:12]}…, size {len(data)}; manifest says {entry.sha256[:12]}…, "
            f"{entry.size})"
        )
    return data


def fetch_tensors(
    store: ObjectStore, manifest: Manifest, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of a version, each file verified before it is parsed (safetensors only)."""
    tensors: dict[str, torch.Tensor] = {}
    files = [e for e in manifest.files if e.name.endswith(".safetensors")]
    # every file is verified (in parallel, one sha256 stream per file) before any is parsed
    buffers = _parallel(
        lambda e: fetch_file(store, manifest, e), [(e,) for e in files], io_workers()
    )
    for entry, buf in zip(files, buffers, strict=True):
        where = f"{manifest.run} v{manifest.version}/{entry.name}"
        # views of the verified buffer: no second copy before the engine's own
        for k, v in tensorfile.parse(buf, where).items():
            tensors[k] = v.to(device) if device != "cpu" else v
    if not tensors:
        raise WeightsError(
            f"{manifest.run} v{manifest.version}: manifest lists no safetensors file"
        )
    return tensors


def materialize(store: ObjectStore, manifest: Manifest, out_dir: Path) -> Path:
    """Write a verified version as a Hugging Face model directory (for from_pretrained / vLLM)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for entry in manifest.files:
        (out_dir / entry.name).write_bytes(fetch_file(store, manifest, entry))
    return out_dir


def newest_version(store: ObjectStore) -> int:
    """The highest weights version with a manifest in ``store``, over every run (0: none)."""
    best = 0
    for key in store.list("weights/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[3] == MANIFEST and parts[2][1:].isdigit():
            best = max(best, int(parts[2][1:]))
    return best


class KnownVersions:
    """Which policy versions exist: a record stamped with a version no run has published is
    from the future (poison; a negative one is poison anyway).

    A version up to ``floor()`` (the reader's own, e.g. the trainer's) or up to the newest
    manifest seen in the store (any run: a second trainer reads the lead run's stream) exists.
    For a version beyond both, the store is listed again, unless the last listing came after
    the record was produced (``produced_ms``, with ``SKEW_MS`` for clocks apart): a manifest is
    written before its version is announced, loaded and sampled, so that listing saw it. A
    flood of such records costs one listing per batch of them produced within the skew.
    """

    SKEW_MS = 5_000

    def __init__(self, store: ObjectStore, floor: Callable[[], int] = lambda: 0) -> None:
        self.store, self.floor = store, floor
        self.newest, self.listed_ms, self.listings = 0, -(10**15), 0

    def exists(self, version: int, produced_ms: int | None = None) -> bool:
        if version < 0:
            return False
        if version <= max(self.floor(), self.newest):
            return True
        if produced_ms is None or produced_ms >= self.listed_ms - self.SKEW_MS:
            self.listed_ms = now_ms()
            self.newest = newest_version(self.store)
            self.listings += 1
        return version <= max(self.floor(), self.newest)


def read_announcements(
    cfg: Any, layout: Layout, timeout_s: float = 10.0
) -> list[WeightsAnnouncement]:
    """Every readable announcement on the weights topic, oldest first (for tools and tests)."""
    out: list[WeightsAnnouncement] = []
    for msg in read_range(cfg, layout.weights, timeout_s=timeout_s, role="weights-reader"):
        with contextlib.suppress(SchemaError):
            out.append(decode_as(msg.value() or b"", WeightsAnnouncement))
    return out


def latest_announcement(
    cfg: Any, layout: Layout, run: str, timeout_s: float = 10.0
) -> WeightsAnnouncement | None:
    anns = [a for a in read_announcements(cfg, layout, timeout_s) if a.run == run]
    return max(anns, key=lambda a: a.version) if anns else None
