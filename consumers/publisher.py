"""The trainer's weights upload, off the step: a snapshot goes up while the next step trains.

Owns the upload of one weights version after its snapshot was taken (``Durable.publish``:
every rank joins the export, rank 0 holds the serving-dtype copy on the CPU): steps 1 to 3 of
the weights protocol (``srl.weights.publish``: files, manifest last; then the announcement)
run in one background thread, so the step that follows waits only for the snapshot. At most
one upload is in flight: the next publish waits for it before it takes its own snapshot, so
rank 0's host holds one copy of the model in the serving dtype, never two. The announcement
goes out from the thread the moment the manifest is up (the Kafka producer is thread-safe);
what follows it on the trainer's side (its counters, metrics, pruning) happens on the
trainer's thread when it collects the finished upload (``done`` / ``wait``). A write the store
refuses comes back as the upload's ``error`` (nothing of the version is left in the store);
any other failure is raised again on the trainer's thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from srl.errors import StoreError
from srl.kafka import Producer
from srl.store import ObjectStore
from srl.topics import Layout
from srl.weights import Published, announce, publish


@dataclass
class Upload:
    """One version's upload; ``published`` or ``error`` once it has finished."""

    version: int
    step: int
    parent: int
    snapshot_s: float  # what the step waited for: the export into the serving dtype
    wait_s: float  # what the step waited for the upload before it, if one was in flight
    started: float = field(default_factory=time.perf_counter)
    upload_s: float = 0.0  # files, manifest and announcement, in the background
    published: Published | None = None
    error: StoreError | None = None
    crash: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class Publisher:
    """Uploads versions of ``run`` one at a time; ``background`` False: in the caller."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        producer: Producer,
        layout: Layout,
        files: dict[str, bytes],
        background: bool = True,
    ) -> None:
        self.store, self.run, self.producer, self.layout = store, run, producer, layout
        self.files, self.background = files, background
        self.current: Upload | None = None

    @property
    def busy(self) -> bool:
        return self.current is not None

    def start(self, up: Upload, tensors: dict[str, Any]) -> None:
        """Upload ``tensors`` (a snapshot nobody writes to) as ``up.version``; the caller has
        collected the previous upload (``wait``)."""
        if self.current is not None:
            raise RuntimeError(f"v{up.version}: v{self.current.version} is still uploading")
        self.current = up
        if not self.background:
            self._upload(up, tensors)
            return
        name = f"publish-v{up.version}"
        threading.Thread(target=self._upload, args=(up, tensors), name=name, daemon=True).start()

    def _upload(self, up: Upload, tensors: dict[str, Any]) -> None:
        try:
            pub = publish(
                self.store,
                self.run,
                up.version,
                tensors,
                trainer_step=up.step,
                parent_version=up.parent,
                extra_files=self.files,
            )
            announce(self.producer, self.layout, pub)
            up.published = pub
        except StoreError as e:
            up.error = e
        except BaseException as e:  # raised again on the trainer's thread (``_take``)
            up.crash = e
        finally:
            up.upload_s = time.perf_counter() - up.started
            up.finished.set()

    def done(self) -> Upload | None:
        """The upload in flight if it has finished (once), else None; never blocks."""
        up = self.current
        if up is None or not up.finished.is_set():
            return None
        return self._take(up)

    def wait(self) -> Upload | None:
        """The upload in flight once it has finished (None if there is none)."""
        up = self.current
        if up is None:
            return None
        up.finished.wait()
        return self._take(up)

    def _take(self, up: Upload) -> Upload:
        self.current = None
        if up.crash is not None:
            raise up.crash
        return up
