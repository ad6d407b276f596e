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

``publish`` writes ``weights/{run}/v{N}/`` (``srl.weights``: files, manifest last) and then
announces it; ``reannounce`` repeats the newest announcement after a restart; ``save`` writes
a checkpoint (``consumers.checkpoint``: marker last) and prunes old ones. A write the store
refuses (a full disk) fails the publish or the checkpoint, not the trainer: nothing of it is
left in the store, nothing is announced or made durable, the next one tries again. When each
happens, and what follows a checkpoint (sample events, commits), is ``consumers.trainer``'s
order.
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
from consumers.train_engine import TrainEngine
from srl.errors import StoreError
from srl.kafka import Producer
from srl.metrics import Metrics
from srl.store import ObjectStore
from srl.topics import Layout
from srl.weights import (
    MANIFEST,
    Manifest,
    Published,
    announce,
    prune_versions,
    publish,
    version_prefix,
)

log = logging.getLogger("srl.trainer")


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

    def publish(self, step: int) -> bool:
        """Version ``version + 1`` from the engine's weights: files, manifest, announcement.
        False if the store refused a write (:meth:`_refused`): nothing is announced and the
        next publish tries the same version again."""
        t0 = time.perf_counter()
        version = self.version + 1
        try:
            pub = publish(
                self.store,
                self.cfg.run,
                version,
                self._export(),
                trainer_step=step,
                parent_version=self.lineage,
                extra_files=self.files,
            )
        except StoreError as e:
            self.owed = True  # the trainer tries again while idle (``publish_owed``)
            return self._refused("publish", version, step, e)
        announce(self.producer, self.layout, pub)
        self.version = self.lineage = version
        self.owed = False
        self._prune_versions(step)
        self.metrics.emit(
            "weights_published",
            {
                "version": version,
                "bytes": pub.manifest.total_bytes,
                "publish_s": time.perf_counter() - t0,
            },
            step=step,
        )
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
        without it; logged, counted (``{what}_failures``) and a ``store_refused`` event."""
        log.warning("%s %d at step %d failed, training goes on: %s", what, number, step, e)
        self.metrics.incr(f"{what}_failures")
        labels = {"what": what, "reason": str(e)[:300]}
        self.metrics.emit("store_refused", {"number": float(number)}, labels, step=step)
        return False

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
        return True
