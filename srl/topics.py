"""Topic names, length buckets and the partition layout of the trajectories topic.

Owns the naming every role and every monitoring tool relies on:

* ``{prefix}.prompts.{bucket}``: prompt tasks of one length bucket (one consumer group per pool)
* ``{prefix}.resume.{bucket}``: tasks that continue a started trajectory (a straggler handed to
  the long-tail pool): in-flight work, read by the same pool's group, never held back by the
  trainer-backlog bound (a fresh task ahead of it in one queue would block it)
* ``{prefix}.trajectories``: token chunks; partitions are grouped by length bucket
* ``{prefix}.weights``: weights announcements, compacted, key = run
* ``{prefix}.feedback``: applications' rewards of served completions (``srl serve``), key =
  trajectory id; trainers join them to the served trajectories
* ``{prefix}.metrics``: metric events from every role
* ``{prefix}.dlq``: records that could not be decoded or used, with the reason in headers
* ``{prefix}.pool.epochs`` / ``{prefix}.pool.beats``: generator pools' epochs (never deleted)
  and their members' heartbeats (kept 10 minutes): ``producers.pool``

Buckets are named by their upper bound in tokens (``le256``, ``le1024``, ``le4096``) and one
open bucket for the rest (``gt4096``). Bucket ``i`` owns trajectories partitions
``[i*P, (i+1)*P)`` with ``P = partitions_per_bucket``; inside its range a trajectory's
partition is ``crc32(trajectory_id) mod P``, so all its chunks stay in order on one partition.
Consumer-group names are spelled here too (:func:`trainer_group`, :func:`pool_group`), so
that the roles, the monitor and the demo agree on them. Pure functions only; admin calls live
in ``srl.kafka``.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass
from typing import Protocol


class LayoutConfig(Protocol):
    """What a layout is made from: any config with the prefix and the layout settings."""

    @property
    def topic_prefix(self) -> str: ...
    @property
    def bucket_bounds(self) -> tuple[int, ...]: ...
    @property
    def partitions_per_bucket(self) -> int: ...
    @property
    def prompt_partitions(self) -> int: ...
    @property
    def retention_ms(self) -> int | None: ...


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


@dataclass(frozen=True)
class Layout:
    prefix: str = "srl"
    bucket_bounds: tuple[int, ...] = (256, 1024, 4096)
    partitions_per_bucket: int = 2
    prompt_partitions: int = 2
    retention_ms: int | None = None  # of the data topics; None: the broker's default

    @classmethod
    def from_config(cls, cfg: LayoutConfig) -> Layout:
        return cls(
            cfg.topic_prefix,
            tuple(cfg.bucket_bounds),
            cfg.partitions_per_bucket,
            cfg.prompt_partitions,
            cfg.retention_ms,
        )

    # -- buckets -----------------------------------------------------------------------
    @property
    def buckets(self) -> list[str]:
        return [f"le{b}" for b in self.bucket_bounds] + [f"gt{self.bucket_bounds[-1]}"]

    def bucket_for(self, length: int) -> str:
        """Bucket of a (predicted) output length in tokens."""
        return self.buckets[bisect.bisect_left(self.bucket_bounds, length)]

    def bucket_index(self, bucket: str) -> int:
        try:
            return self.buckets.index(bucket)
        except ValueError:
            raise ValueError(
                f"unknown bucket {bucket!r}; buckets are {', '.join(self.buckets)}"
            ) from None

    # -- topic names -------------------------------------------------------------------
    def prompts(self, bucket: str) -> str:
        self.bucket_index(bucket)
        return f"{self.prefix}.prompts.{bucket}"

    def resumes(self, bucket: str) -> str:
        self.bucket_index(bucket)
        return f"{self.prefix}.resume.{bucket}"

    def is_task_topic(self, topic: str) -> bool:
        """A prompts or resume topic (what generator pools consume, not the trainer)."""
        return topic.startswith((f"{self.prefix}.prompts.", f"{self.prefix}.resume."))

    @property
    def trajectories(self) -> str:
        return f"{self.prefix}.trajectories"

    @property
    def weights(self) -> str:
        return f"{self.prefix}.weights"

    @property
    def feedback(self) -> str:
        return f"{self.prefix}.feedback"

    @property
    def metrics(self) -> str:
        return f"{self.prefix}.metrics"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    @property
    def pool_epochs(self) -> str:
        return f"{self.prefix}.pool.epochs"

    @property
    def pool_beats(self) -> str:
        return f"{self.prefix}.pool.beats"

    # -- trajectories partitions -------------------------------------------------------
    @property
    def trajectory_partition_count(self) -> int:
        return len(self.buckets) * self.partitions_per_bucket

    def trajectory_partitions(self, bucket: str) -> range:
        base = self.bucket_index(bucket) * self.partitions_per_bucket
        return range(base, base + self.partitions_per_bucket)

    def partition_for(self, bucket: str, trajectory_id: str) -> int:
        """The partition of a trajectory's chunks: stable, inside its bucket's range."""
        base = self.bucket_index(bucket) * self.partitions_per_bucket
        return base + zlib.crc32(trajectory_id.encode()) % self.partitions_per_bucket

    def bucket_of_partition(self, partition: int) -> str | None:
        """The bucket a trajectories partition belongs to; None for one beyond the layout (a
        topic someone created with more partitions: ``srl topics check`` names it)."""
        i = partition // self.partitions_per_bucket
        return self.buckets[i] if 0 <= i < len(self.buckets) else None

    # -- all topics --------------------------------------------------------------------
    def specs(self, configs: str = "srl") -> list[TopicSpec]:
        """Every topic of a deployment with its partition count and topic config.

        ``retention_ms`` bounds the data topics (trajectories, resume tasks, metrics, feedback,
        dead letters), with segments rolled every quarter of it (a broker deletes whole
        segments only, so data is kept for at most 1.25x the retention). The prompt topics
        keep the broker's default: they are the dispatcher's log (``producers.dispatch_log``),
        and a task deleted from them would be dispatched again by a restarted dispatcher.
        Pool epochs are kept forever (a pool's epoch numbers only grow); pool beats are read
        back 2 session timeouts at most: kept 10 minutes, in 10-minute segments (the smallest
        some managed clusters allow; with the default segment of 7 days nothing would ever be
        deleted). ``configs="minimal"`` leaves out all of that but what correctness needs
        (:data:`REQUIRED_CONFIGS`) and the retention the user asked for, for a cluster that
        refuses the rest."""
        specs = self._specs()
        if configs == "srl":
            return specs
        keep = {"retention.ms", "segment.ms"} if self.retention_ms is not None else set()
        return [
            TopicSpec(
                s.name,
                s.partitions,
                {
                    k: v
                    for k, v in s.config.items()
                    if k in REQUIRED_CONFIGS or (k in keep and not s.name.startswith(self._pool))
                },
            )
            for s in specs
        ]

    @property
    def _pool(self) -> str:
        return f"{self.prefix}.pool."

    def _specs(self) -> list[TopicSpec]:
        data: dict[str, str] = {}
        if self.retention_ms is not None:
            roll = max(self.retention_ms // 4, 1000)
            data = {"retention.ms": str(self.retention_ms), "segment.ms": str(roll)}
        specs = [TopicSpec(self.prompts(b), self.prompt_partitions, {}) for b in self.buckets]
        specs += [
            TopicSpec(self.resumes(b), self.prompt_partitions, dict(data)) for b in self.buckets
        ]
        specs += [
            TopicSpec(
                self.trajectories,
                self.trajectory_partition_count,
                {"max.message.bytes": "1048576", **data},
            ),
            TopicSpec(self.weights, 1, {"cleanup.policy": "compact"}),
            TopicSpec(self.feedback, 1, dict(data)),
            TopicSpec(self.metrics, 1, dict(data)),
            TopicSpec(self.dlq, 1, dict(data)),
            TopicSpec(self.pool_epochs, 1, {"retention.ms": "-1"}),
            TopicSpec(self.pool_beats, 1, {"retention.ms": "600000", "segment.ms": "600000"}),
        ]
        return specs


# What a topic's correctness needs, kept by ``configs="minimal"``: followers take the newest
# version per run from the compacted weights topic; a chunk is at most 1 MB.
REQUIRED_CONFIGS = frozenset({"cleanup.policy", "max.message.bytes"})


# -- consumer groups ---------------------------------------------------------------------
def trainer_group(prefix: str, run: str) -> str:
    """The trainer's consumer group on the trajectories topic (unless ``group_id`` overrides),
    scoped by the topic prefix as the pools' groups are: two deployments on one cluster with
    the same run name never share a group (on Apache Kafka a static member of one would take
    the other's place and its stale assignment)."""
    return f"{prefix}.trainer.{run}"


def pool_group(prefix: str, pool: str) -> str:
    """The consumer group of a generator pool on the prompt topics."""
    return f"{prefix}.gen.{pool}"
