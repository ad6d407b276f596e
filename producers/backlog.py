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

from srl.config import CommonConfig
from srl.kafka import Lag


class GroupLag:
    """``srl.kafka.Lag`` of fixed groups on fixed topics, and the committed total it saw."""

    def __init__(
        self,
        cfg: CommonConfig,
        groups: Sequence[str],
        topics: Sequence[str],
        timeout_s: float = 10.0,
    ) -> None:
        self.groups = list(groups)
        self.topics = list(topics)
        self._lag = Lag(cfg, timeout_s)
        self.committed = 0  # sum of the furthest committed offsets, as of the last ``lag()``

    def lag(self) -> int:
        """Records on the topics not yet committed by any of the groups."""
        rows = self._lag.partitions(self.groups, self.topics)
        self.committed = sum(r.committed or 0 for r in rows)
        return sum(r.lag for r in rows)

    def close(self) -> None:
        self._lag.close()
