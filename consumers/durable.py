"""What the trainer's rank 0 writes to the store: weights versions and checkpoints.

Owns three counters that survive a restart, and the writes that move them:

* ``version``: the policy versions this run has published. It only grows and is never
  reused: a restart continues after the newest manifest in the store, even one published
  after the checkpoint it resumes from;
* ``lineage``: the version the weights really descend from (a manifest's ``parent_version``),
  which lags ``version`` after a restart from an older checkpoint; saved with checkpoints;
* ``skipped``: the versions published after the checkpoint a restart resumed from (a crash
  between a publish and its checkpoint): they exist and followers may run them, but they
  are no update of the weights trained from then on, so the staleness gate does not count
  them (``consumers.gate.staleness``); saved with checkpoints;
* ``number``: checkpoint numbers, one past the highest in the store, complete or not
  (create-only writes never meet an interrupted one again).

``publish`` snapshots the weights and has ``weights/{run}/v{N}/`` written (``srl.weights``:
files, manifest last) and announced in the background while the next step trains
(``consumers.publisher``), ``collect`` takes the finished upload; ``reannounce`` repeats the
newest announcement after a restart; ``save`` writes a checkpoint (``consumers.checkpoint``:
marker last) and prunes old ones. A write the store refuses (a full disk) fails the publish
or the checkpoint, not the trainer: nothing of it is left in the store, nothing is announced
or made durable, the next one tries again. When each happens, and what follows a checkpoint
(sample events, commits), is ``consumers.trainer``'s order.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from consumers import checkpoint as ckpts
from consumers.config import TrainConfig
from consumers.distributed import Dist, save_shard
from consumers.engine import extra_files
from consumers.outcomes import Outcomes
from consumers.publisher import Publisher, Upload
from consumers.train_engine import TrainEngine
from srl.errors import StoreError
from srl.kafka import Producer
from srl.metrics import Metrics
from srl.store import ObjectStore
from srl.topics import Layout
from srl.weights import MANIFEST, Manifest, Published, announce, prune_versions, version_prefix

log = logging.getLogger("srl.trainer")

RETRY_FIRST_S = 5.0  # a refused write is tried again on its own after this long, doubling
RETRY_MAX_S = 300.0  # up to this (a full store is not freed in seconds)


class Durable:
    """Weights versions and checkpoints of one run; see the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: TrainEngine,
        store: ObjectStore,
        dist: Dist | None,
        producer: Producer,
        metrics: Metrics,
        ckpt: ckpts.Checkpoint | None,
    ) -> None:
        self.cfg, self.engine, self.store, self.dist = cfg, engine, store, dist
        self.producer, self.metrics = producer, metrics
        self.layout = Layout.from_config(cfg)
        self.files = extra_files(cfg.model)  # config and tokenizer: each version HF-loadable
        self.number = ckpts.highest_number(store, cfg.run)
        self.lineage = int(ckpt.extra.get("lineage", ckpt.version)) if ckpt else 0
        self.version = max(ckpt.version if ckpt else 0, ckpts.newest_published(store, cfg.run))
        before = ckpt.extra.get("skipped", []) if ckpt else []
        self.skipped = frozenset(before) | frozenset(range(self.lineage + 1, self.version + 1))
        self.owed = False  # the last publish was refused: the current weights are not out
        self.refusals: dict[str, int] = {}  # what → refusals in a row (``_refused``)
        self.retry_at: dict[str, float] = {}  # what → monotonic time of the next retry
        self.saved_at = time.monotonic()  # of the last checkpoint (``checkpoint_every_s``)
        self.publisher = Publisher(
            store, cfg.run, producer, self.layout, self.files, cfg.publish_background
        )

    def publish(self, step: int) -> None:
        """Version ``version + 1`` from the engine's weights: the snapshot now (every rank
        joins the export), the upload in the background (``consumers.publisher``). The
        weights trained from now on are that version, so ``version`` moves at once; an upload
        the store refuses moves it back (:meth:`collect`) and the next publish tries the same
        version again with newer weights. The previous upload is collected first: one
        snapshot in memory at a time."""
        t0 = time.perf_counter()
        self.collect(wait=True)
        t1 = time.perf_counter()
        tensors = self._export()
        up = Upload(self.version + 1, step, self.lineage, time.perf_counter() - t1, t1 - t0)
        self.version = self.lineage = up.version
        self.publisher.start(up, tensors)
        del tensors  # the upload holds the only reference
        if not self.publisher.background:
            self.collect(wait=True)

    def collect(self, wait: bool = False) -> bool | None:
        """The finished upload, if any (``wait``: the one in flight, once it has finished):
        True published and announced, False refused by the store, None none to collect."""
        up = self.publisher.wait() if wait else self.publisher.done()
        if up is None:
            return None
        if up.error is not None:
            self.version, self.lineage = up.version - 1, up.parent
            self.owed = True  # the trainer tries again while idle (``publish_owed``)
            return self._refused("publish", up.version, up.step, up.error)
        assert up.published is not None  # finished without an error: published
        self.owed = False
        self._succeeded("publish")
        self._prune_versions(up.step)
        values = {
            "version": up.version,
            "bytes": up.published.manifest.total_bytes,
            "publish_s": up.snapshot_s + up.upload_s,
            "snapshot_s": up.snapshot_s,
            "upload_s": up.upload_s,
            "wait_s": up.wait_s,
        }
        self.metrics.emit("weights_published", values, step=up.step)
        return True

    def _prune_versions(self, step: int) -> None:
        """Keep the newest ``keep_versions`` versions in the store (a bounded store in a long
        run); a failed delete is logged and tried again after the next publish."""
        try:
            gone = prune_versions(self.store, self.cfg.run, self.cfg.keep_versions)
        except StoreError as e:
            log.warning("pruning weights versions at step %d failed: %s", step, e)
            return
        if gone:
            self.metrics.incr("versions_pruned", len(gone))

    def _refused(self, what: str, number: int, step: int, e: StoreError) -> bool:
        """A write the store refused (a full disk, a store that is down): the trainer goes on
        without it; logged, counted (``{what}_failures``), a ``store_refused`` event, and not
        tried again on its own before a back-off (``due``) that doubles with each refusal in a
        row, from ``RETRY_FIRST_S`` to ``RETRY_MAX_S``."""
        n = self.refusals.get(what, 0) + 1
        self.refusals[what] = n
        wait = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (n - 1))
        self.retry_at[what] = time.monotonic() + wait
        log.warning(
            "%s %d at step %d failed, training goes on (%d in a row; tried again in %.0f s at "
            "the earliest): %s",
            *(what, number, step, n, wait, e),
        )
        self.metrics.incr(f"{what}_failures")
        labels = {"what": what, "reason": str(e)[:300]}
        values = {"number": float(number), "in_a_row": float(n), "retry_s": wait}
        self.metrics.emit("store_refused", values, labels, step=step)
        return False

    def checkpoint_due(self, step: int) -> bool:
        """Whether step ``step`` checkpoints: every ``checkpoint_every`` steps, at least
        ``checkpoint_every_s`` after the last checkpoint, and not in a refusal's back-off."""
        since = time.monotonic() - self.saved_at
        every = step % self.cfg.checkpoint_every == 0
        return every and since >= self.cfg.checkpoint_every_s and self.due("checkpoint")

    def publish_owed(self, step: int) -> None:
        """Publish again a version the store refused, once its back-off has passed."""
        if self.owed and not self.publisher.busy and self.due("publish"):
            self.publish(step)

    def due(self, what: str) -> bool:
        """Whether a retry of ``what`` (``publish``, ``checkpoint``) that nothing forces may
        run: its back-off after a refusal has passed."""
        return time.monotonic() >= self.retry_at.get(what, 0.0)

    def _succeeded(self, what: str) -> None:
        self.refusals.pop(what, None)
        self.retry_at.pop(what, None)

    def reannounce(self) -> None:
        """After a restart: announce the newest version again (its manifest is in the store)."""
        if self.version <= 0:
            return
        key = f"{version_prefix(self.cfg.run, self.version)}/{MANIFEST}"
        body = self.store.get(key)
        pub = Published(
            Manifest.from_json(body, key), self.store.uri(key), hashlib.sha256(body).hexdigest()
        )
        announce(self.producer, self.layout, pub)

    def _export(self) -> dict[str, Any]:
        """The weights in the serving dtype (every rank joins: FSDP gathers them in turn)."""
        import torch

        name = self.cfg.dtype if self.cfg.publish_dtype == "auto" else self.cfg.publish_dtype
        if self.dist is not None:
            self.dist.export()
        return self.engine.export(getattr(torch, name))

    def save(self, step: int, outcomes: Outcomes) -> bool:
        """Checkpoint ``number + 1``: every rank's shard of the model and optimizer, the ledger
        and the window's events. False if the store refused a write: nothing of it is left,
        nothing became durable."""
        self.collect(wait=True)  # the checkpoint holds a version that is out, or none
        t0 = time.perf_counter()
        self.number += 1
        try:
            if self.dist is not None:
                self.dist.save(self.number)
            shards = save_shard(self.engine, self.dist, self.store, self.cfg.run, self.number)
            ckpts.save(
                self.store,
                self.cfg.run,
                self.number,
                step=step,
                version=self.version,
                ledger=outcomes.ledger.entries,
                events=outcomes.window,
                shards=shards,
                extra={
                    "lineage": self.lineage,
                    "skipped": sorted(self.skipped),
                    **outcomes.ledger.saved_extra(),
                },
            )
        except StoreError as e:
            ckpts.remove(self.store, self.cfg.run, self.number)
            return self._refused("checkpoint", self.number, step, e)
        ckpts.prune(self.store, self.cfg.run, self.cfg.keep_checkpoints)
        self._succeeded("checkpoint")
        self.saved_at = time.monotonic()
        values = {"number": self.number, "seconds": time.perf_counter() - t0}
        self.metrics.emit("checkpoint_saved", values, step=step)
        return True
