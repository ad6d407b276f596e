"""Consumer-group lag: the unconsumed backlog the producer side keeps bounded.

Owns one measure, used in two places: the records on ``topics`` that none of ``groups`` has
committed yet (per partition: high watermark minus the furthest committed offset among the
groups, or minus the low watermark where none has committed). The dispatcher bounds the lag
of the generator pools on the prompt topics (``max_pending``); a generator pauses intake while
the trainer's lag on the trajectories topic exceeds ``max_backlog_chunks``. For the trainer
the groups are its own and ``srl.kafka.position_group`` of it, where the trainer shares how
far it has read every second: its committed offsets trail every unfinished trajectory (a long
one holds its partition's offset for steps) and every checkpoint interval, so on their own
they overstate the backlog (docs/benchmarks.md: generators idle 65 % under such a bound).

One long-lived client, never a member of the groups it inspects (it only reads their
committed offsets), so measuring changes nothing. Not thread-safe: one caller thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import Consumer, TopicPartition

from srl.config import CommonConfig
from srl.kafka import consumer_settings


class GroupLag:
    def __init__(
        self,
        cfg: CommonConfig,
        groups: Sequence[str],
        topics: Sequence[str],
        timeout_s: float = 10.0,
    ) -> None:
        self.groups = list(groups)
        self.topics = list(topics)
        self.timeout_s = timeout_s
        self._clients = {g: Consumer(consumer_settings(cfg, g, "lag")) for g in self.groups}
        self.committed = 0  # sum of the furthest committed offsets, as of the last ``lag()``

    def _partitions(self) -> list[TopicPartition]:
        client = next(iter(self._clients.values()))
        md = client.list_topics(timeout=self.timeout_s)
        return [
            TopicPartition(t, p)
            for t in self.topics
            if t in md.topics
            for p in sorted(md.topics[t].partitions)
        ]

    def lag(self) -> int:
        """Records on the topics not yet committed by any of the groups."""
        tps = self._partitions()
        if not tps:
            return 0
        furthest: dict[tuple[str, int], int] = {}
        for client in self._clients.values():
            for tp in client.committed(tps, timeout=self.timeout_s):
                key = (tp.topic, tp.partition)
                furthest[key] = max(furthest.get(key, -1), tp.offset)
        client = next(iter(self._clients.values()))
        total = 0
        self.committed = sum(max(0, v) for v in furthest.values())
        for tp in tps:
            low, high = client.get_watermark_offsets(tp, timeout=self.timeout_s, cached=False)
            done = furthest.get((tp.topic, tp.partition), -1)
            total += max(0, high - (done if done >= 0 else low))
        return total

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
