"""Faults of the data rather than the processes: bad weights objects, a full store, poison.

Same contract as ``app.chaos.faults`` (an injector stamps an :class:`Injection`, a check says
when the role recovered); the catalogue of every fault is ``app.chaos.catalogue``.

* ``weights-corrupt`` / ``weights-delete``: the moment a new version's safetensors file lands
  in the store (files are linked into place complete, before the manifest and the
  announcement), a few of its bytes are inverted in place, or it is deleted. The manifest then
  holds the hash of what the trainer wrote, so every follower must refuse the version, keep
  its weights and say why (a ``weights_refused`` event). If any generator loaded the version
  anyway (the injector lost the race), the next version is tried, up to three.
* ``store-disk-full``: the store's tmpfs is filled to the last 64 KB (the next publish fails
  with ENOSPC partway) for ``disk_full_s``, then freed.
* ``poison``: ``app.chaos.poison``'s records on every input topic.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from app.chaos import poison
from app.chaos.faults import POLL_S, Injection, Scene, new_step_trained


def _weights(sc: Scene) -> Path:
    return sc.stage.store_dir / "weights" / sc.stage.run


def _newest(sc: Scene) -> int:
    root = _weights(sc)
    return max((int(d.name[1:]) for d in root.iterdir() if d.name.startswith("v")), default=0)


def _wait_landed(sc: Scene, newest: int, timeout_s: float = 60.0) -> Path | None:
    """The first safetensors file of version ``newest + 1`` once it is in place."""
    where = _weights(sc) / f"v{newest + 1:08d}"
    deadline = time.monotonic() + timeout_s
    while not sc.halt.is_set() and time.monotonic() < deadline:
        if where.is_dir() and (files := sorted(where.glob("*.safetensors"))):
            return files[0]
        time.sleep(POLL_S)
    return None


def _spoil(path: Path, delete: bool) -> None:
    if delete:
        path.unlink()
        return
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        data = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _fates(sc: Scene, version: int) -> dict[str, str]:
    """What each generator did with ``version``: refused, loaded, or nothing yet."""
    workers = [g.removeprefix("gen-") for g in sc.stage.generators]
    with sc.watch.lock:
        refused = {w for _t, w, v, _r in sc.watch.seen.refused if v == version}
        loaded = {w for _t, w, v in sc.watch.seen.loaded if v >= version}
    return {w: "refused" if w in refused else "loaded" if w in loaded else "-" for w in workers}


def spoil_weights(delete: bool) -> Callable[[Scene, Injection], None]:
    what = "deleted" if delete else "corrupted"

    def inject(sc: Scene, inj: Injection) -> None:
        notes = []
        for _attempt in range(3):
            newest = _newest(sc)
            path = _wait_landed(sc, newest)
            if path is None:
                notes.append("no version published in 60 s")
                break
            inj.version = newest + 1
            inj.start = inj.end = time.time()
            _spoil(path, delete)
            sc.until(lambda: "-" not in _fates(sc, inj.version).values(), 30)
            fates = _fates(sc, inj.version)
            if all(f == "refused" for f in fates.values()):
                notes.append(f"v{inj.version} {what} ({path.name}): refused by every generator")
                break
            notes.append(f"v{inj.version} {what} too late: {fates}")
        inj.note = "; ".join(notes)

    return inject


def refused_then_newer(sc: Scene, inj: Injection) -> float | None:
    """Every generator refused the spoiled version, then loaded a newer one."""
    fates = _fates(sc, inj.version)
    if not inj.version or any(f != "refused" for f in fates.values()):
        return None
    with sc.watch.lock:
        loaded = sc.watch.seen.loaded
        times = [
            min((t for t, w, v in loaded if w == worker and v > inj.version), default=None)
            for worker in fates
        ]
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


def fill_store(sc: Scene, inj: Injection) -> None:
    if sc.disk is None:
        inj.skipped = "no size-limited store"
        return
    before = sum(sc.cast.crashes().values())
    inj.start = time.time()
    taken = sc.disk.fill()
    try:
        sc.sleep(sc.cfg.disk_full_s)
    finally:
        sc.disk.free()
    inj.end = time.time()
    with sc.watch.lock:
        during = [v for t, v in sc.watch.seen.published if inj.start <= t <= inj.end]
    inj.note = (
        f"store full for {sc.cfg.disk_full_s:g} s ({taken >> 20} MB taken); versions published "
        f"meanwhile: {len(during)}; trainer exits: {sum(sc.cast.crashes().values()) - before}"
    )


def published_again(sc: Scene, inj: Injection) -> float | None:
    with sc.watch.lock:
        pub = min((t for t, _v in sc.watch.seen.published if t > inj.end), default=None)
        step = sc.watch.first_step_after(inj.end)
    return None if pub is None or step is None else max(pub, step)


def write_poison(sc: Scene, inj: Injection) -> None:
    inj.start = time.time()
    inj.crashes = sum(sc.cast.crashes().values())
    inj.origins = poison.inject(sc.stage.common(), sc.rng)
    inj.end = time.time()
    topics = {o.split()[0] for o in inj.origins.values()}
    inj.note = f"{len(inj.origins)} poison records on {len(topics)} topics"


def poison_handled(sc: Scene, inj: Injection) -> float | None:
    """Every poison record dead-lettered, no role exited, and a step released after the
    poison was trained."""
    if sum(sc.cast.crashes().values()) > inj.crashes:
        return None
    with sc.watch.lock:
        letters = [sc.watch.seen.dlq.get(o) for o in inj.origins]
    if not letters or any(not x for x in letters):
        return None
    last = max(t for x in letters if x for t, _r in x)
    step = new_step_trained(sc, inj)
    return None if step is None else max(last, step)


def missing_letters(sc: Scene, inj: Injection) -> list[str]:
    """The poison records (``"topic kind"``) not in the dead-letter topic."""
    with sc.watch.lock:
        return sorted(k for o, k in inj.origins.items() if not sc.watch.seen.dlq.get(o))
