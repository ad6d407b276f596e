"""What ``srl top`` shows, collected from the broker, the metrics topic and the object store.

``Monitor.snapshot()`` returns one JSON-ready dict (the shape is in docs/operations.md):

* ``groups``: one row per (group, partition) of every srl topic a group has committed offsets
  on or is assigned, with the columns of ``kafka-consumer-groups.sh``. ``lag`` is exactly
  ``log_end_offset - current_offset`` from the broker's high watermark and the committed
  offset; ``current_offset`` and ``lag`` are None where nothing is committed.
* ``backlog``: per group and length bucket, records not yet consumed and their tokens (exact
  when the backlog is at most ``sample`` records per partition, else the sampled mean times
  the count, flagged ``tokens_exact: false``). A partition with nothing committed counts
  from its low watermark, where srl consumers start (``auto.offset.reset=earliest``).
* ``weights``: the run's latest announcement and whether its manifest verifies and every file
  it lists exists; ``throughput``, ``versions``, ``staleness``, ``drops`` from metric events
  (docs/metrics.md) of the last ``window_s`` seconds; ``stalled``: partitions with lag whose
  group has no member on them, or whose committed offset has not moved for ``stall_after_s``.

Reads only: it joins no group and commits nothing. Called by ``app.top``.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict, deque
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from app.configs import TopConfig
from schemas.codec import SchemaError
from schemas.records import MetricEvent, PromptTask, TrajectoryChunk, decode, decode_as, now_ms
from srl.errors import SrlError
from srl.kafka import POSITION_SUFFIX, _short, admin, base_settings, wait_for_broker
from srl.stores import store_for_uri, store_from_config
from srl.topics import Layout
from srl.weights import latest_announcement, load_manifest

FRESH_MS = 30_000  # a gen_stats / train_step event older than this no longer counts as "now"


class Monitor:
    def __init__(
        self,
        cfg: TopConfig,
        window_s: float = 300.0,
        sample: int = 64,
        stall_after_s: float = 60.0,
    ) -> None:
        self.cfg = cfg
        self.layout = Layout.from_config(cfg)
        self.window_ms = int(window_s * 1000)
        self.sample = sample
        self.stall_after_ms = int(stall_after_s * 1000)
        wait_for_broker(cfg)
        self.admin = admin(cfg)
        self._reader = Consumer(
            base_settings(cfg, "top")
            | cfg.kafka
            | {"group.id": "srl-top", "enable.auto.commit": False, "enable.partition.eof": False}
        )
        self._metrics = Consumer(
            base_settings(cfg, "top-metrics")
            | cfg.kafka
            | {"group.id": "srl-top", "enable.auto.commit": False}
        )
        self._metrics_next: int | None = None  # next offset of {prefix}.metrics to read
        self.events: deque[MetricEvent] = deque()
        self._moved: dict[tuple[str, str, int], tuple[int | None, int]] = {}  # offset, since ms
        self._timeout = cfg.connect_timeout_s
        self.group_info: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        for c in (self._reader, self._metrics):
            with contextlib.suppress(RuntimeError, KafkaException):
                c.close()

    # -- broker state ------------------------------------------------------------------
    def partitions(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``{(topic, partition): (low, high)}`` for every srl topic, one admin round trip."""
        md = self.admin.list_topics(timeout=self._timeout)
        tps = [
            TopicPartition(t, p)
            for t, tm in md.topics.items()
            if t.startswith(f"{self.layout.prefix}.")
            for p in tm.partitions
        ]
        if not tps:
            return {}
        ends: dict[str, dict[tuple[str, int], int]] = {}
        for name, spec in (("low", OffsetSpec.earliest()), ("high", OffsetSpec.latest())):
            futures = self.admin.list_offsets(
                {tp: spec for tp in tps}, request_timeout=self._timeout
            )
            ends[name] = {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
        return {k: (ends["low"][k], ends["high"][k]) for k in sorted(ends["high"])}

    def group_rows(self, parts: dict[tuple[str, int], tuple[int, int]]) -> list[dict[str, Any]]:
        listed = self.admin.list_consumer_groups(request_timeout=self._timeout).result()
        ids = sorted(g.group_id for g in listed.valid)
        if not ids:
            return []
        described = self.admin.describe_consumer_groups(ids, request_timeout=self._timeout)
        rows = []
        self.group_info = {}
        for gid in ids:
            try:
                desc = described[gid].result()
                req = [ConsumerGroupTopicPartitions(gid)]
                offsets = self.admin.list_consumer_group_offsets(req, request_timeout=self._timeout)
                committed = {
                    (tp.topic, tp.partition): tp.offset
                    for tp in offsets[gid].result().topic_partitions
                    if tp.offset >= 0
                }
            except KafkaException:
                continue  # the group went away between the calls
            owner = {
                (tp.topic, tp.partition): m
                for m in desc.members
                for tp in (m.assignment.topic_partitions if m.assignment else [])
            }
            topics = {t for t, _ in [*committed, *owner] if t.startswith(f"{self.layout.prefix}.")}
            if not topics:
                continue  # not an srl group (or not one of this prefix)
            state = str(desc.state).split(".")[-1]
            self.group_info[gid] = {"state": state, "members": len(desc.members)}
            for key in sorted(k for k in parts if k[0] in topics):
                rows.append(
                    self._row(gid, state, key, parts[key], committed.get(key), owner.get(key))
                )
        return rows

    def _row(
        self,
        gid: str,
        state: str,
        key: tuple[str, int],
        ends: tuple[int, int],
        current: int | None,
        member: Any,
    ) -> dict[str, Any]:
        topic, part = key
        return {
            "group": gid,
            "topic": topic,
            "partition": part,
            "bucket": self._bucket(topic, part),
            "current_offset": current,
            "log_end_offset": ends[1],
            "lag": None if current is None else ends[1] - current,
            "consumer_id": member.member_id if member else None,
            "host": member.host if member else None,
            "client_id": member.client_id if member else None,
            "state": state,
        }

    def _bucket(self, topic: str, part: int) -> str | None:
        if topic == self.layout.trajectories:
            return self.layout.bucket_of_partition(part)
        for kind in ("prompts", "resume"):
            head = f"{self.layout.prefix}.{kind}."
            if topic.startswith(head):
                return topic[len(head) :]
        return None

    # -- backlog -----------------------------------------------------------------------
    def backlog(
        self, rows: list[dict[str, Any]], parts: dict[tuple[str, int], tuple[int, int]]
    ) -> tuple[list[dict[str, Any]], Counter[int]]:
        """Backlog per (group, topic, bucket) and the policy versions of sampled chunks."""
        starts = {}
        for r in rows:
            if r["bucket"] is None:
                continue
            key = (r["topic"], r["partition"])
            start = r["current_offset"] if r["current_offset"] is not None else parts[key][0]
            if start < r["log_end_offset"]:
                starts[(r["group"], *key)] = start
        sampled, versions = self._sample({(t, p): s for (_, t, p), s in starts.items()}, parts)
        agg: dict[tuple[str, str, str], dict[str, Any]] = {}
        for r in rows:
            if r["bucket"] is None:
                continue
            key = (r["topic"], r["partition"])
            a = agg.setdefault(
                (r["group"], r["topic"], r["bucket"]),
                {
                    "group": r["group"],
                    "topic": r["topic"],
                    "bucket": r["bucket"],
                    "records": 0,
                    "tokens": 0,
                    "tokens_exact": True,
                },
            )
            start = starts.get((r["group"], *key))
            if start is None:
                continue
            n = r["log_end_offset"] - start
            got = [t for off, t in sampled.get(key, []) if off >= start]
            seen = [t for t in got if t is not None]  # None: a record that does not decode
            a["records"] += n
            if seen:
                a["tokens"] += round(sum(seen) / len(seen) * n)
            a["tokens_exact"] &= len(seen) == n
        return list(agg.values()), versions

    def _sample(
        self, starts: dict[tuple[str, int], int], parts: dict[tuple[str, int], tuple[int, int]]
    ) -> tuple[dict[tuple[str, int], list[tuple[int, int | None]]], Counter[int]]:
        """Up to ``sample`` records from each start: (offset, tokens) and chunk versions."""
        out: dict[tuple[str, int], list[tuple[int, int | None]]] = defaultdict(list)
        versions: Counter[int] = Counter()
        if not starts:
            return out, versions
        self._reader.assign([TopicPartition(t, p, off) for (t, p), off in starts.items()])
        want = {k: min(self.sample, parts[k][1] - off) for k, off in starts.items()}
        deadline = time.monotonic() + min(self._timeout, 5.0)
        while any(len(out[k]) < n for k, n in want.items()) and time.monotonic() < deadline:
            for msg in self._reader.consume(500, 0.2):
                key = (msg.topic() or "", msg.partition() or 0)
                if msg.error() or len(out[key]) >= want.get(key, 0):
                    continue
                tokens, version = _record_tokens(msg.value() or b"")
                out[key].append((msg.offset() or 0, tokens))
                if version is not None:
                    versions[version] += 1
        self._reader.unassign()
        return out, versions

    # -- metric events -----------------------------------------------------------------
    def read_events(self) -> None:
        """Bring ``events`` up to date: the last ``window_s`` seconds of ``{prefix}.metrics``."""
        now = now_ms()
        tp0 = TopicPartition(self.layout.metrics, 0)
        try:
            _, high = self._metrics.get_watermark_offsets(tp0, timeout=self._timeout, cached=False)
        except KafkaException:
            return  # no metrics topic yet
        if self._metrics_next is None:
            tp = TopicPartition(self.layout.metrics, 0, now - self.window_ms)
            start = self._metrics.offsets_for_times([tp], timeout=self._timeout)[0].offset
            self._metrics_next = start if start >= 0 else high  # -1: nothing that recent
            self._metrics.assign([TopicPartition(self.layout.metrics, 0, self._metrics_next)])
        deadline = time.monotonic() + self._timeout
        while self._metrics_next < high and time.monotonic() < deadline:
            for msg in self._metrics.consume(1000, 0.2):
                if msg.error():
                    continue
                self._metrics_next = (msg.offset() or 0) + 1
                with contextlib.suppress(SchemaError):
                    self.events.append(decode_as(msg.value() or b"", MetricEvent))
        while self.events and self.events[0].ts_ms < now - self.window_ms:
            self.events.popleft()

    def summarize_events(self) -> dict[str, Any]:
        now = now_ms()
        gen: dict[str, MetricEvent] = {}
        counters: dict[str, MetricEvent] = {}
        train: MetricEvent | None = None
        published: MetricEvent | None = None
        staleness: Counter[int] = Counter()
        outcomes: Counter[str] = Counter()
        trained_ts: list[int] = []
        for e in self.events:
            if e.run != self.cfg.run:
                continue
            if e.kind == "gen_stats":
                gen[e.source] = e
            elif e.kind == "train_step":
                train = e
            elif e.kind == "weights_published":
                published = e
            elif e.kind == "counter":
                counters[e.source] = e
            elif e.kind == "sample":
                outcome = e.labels.get("outcome", "trained")
                outcomes[outcome] += 1
                if "staleness" in e.values:
                    staleness[int(e.values["staleness"])] += 1
                if outcome == "trained":
                    trained_ts.append(e.ts_ms)
        fresh_gen = {s: e for s, e in gen.items() if now - e.ts_ms <= FRESH_MS}
        span = (now - min(trained_ts)) / 1000 if trained_ts else 0.0
        n = sum(staleness.values())
        dead = sum(e.values.get("dead_letters", 0.0) for e in counters.values())
        return {
            "throughput": {
                "gen_tokens_per_s": sum(
                    e.values.get("tokens_per_s", 0.0) for e in fresh_gen.values()
                )
                if fresh_gen
                else None,
                "train_tokens_per_s": train.values.get("tokens_per_s")
                if train and now - train.ts_ms <= FRESH_MS
                else None,
                "trajectories_per_s": len(trained_ts) / span if span > 0 else None,
                "simulated": any(e.labels.get("simulated") == "true" for e in fresh_gen.values()),
            },
            "versions": {
                "trainer": _int(train.values.get("policy_version")) if train else None,
                "published": _int(published.values.get("version")) if published else None,
                "generators": {
                    s: _int(e.values.get("policy_version")) for s, e in sorted(fresh_gen.items())
                },
            },
            "staleness": {
                "histogram": {str(k): v for k, v in sorted(staleness.items())},
                "mean": sum(k * v for k, v in staleness.items()) / n if n else None,
                "max": max(staleness) if staleness else None,
            },
            "drops": {
                "by_outcome": {k: v for k, v in sorted(outcomes.items()) if k != "trained"},
                "dead_letters_counted": int(dead),
            },
        }

    # -- weights -------------------------------------------------------------------------
    def weights(self) -> dict[str, Any]:

        out: dict[str, Any] = {
            "run": self.cfg.run,
            "version": None,
            "manifest_uri": None,
            "manifest_ok": None,
            "error": None,
        }
        ann = latest_announcement(self.cfg, self.layout, self.cfg.run, self._timeout)
        if ann is None:
            return out
        out.update(version=ann.version, manifest_uri=ann.manifest_uri, manifest_ok=False)
        try:
            store, _ = store_for_uri(ann.manifest_uri, store_from_config(self.cfg))
            manifest = load_manifest(store, ann)
            prefix = ann.manifest_uri[: -len("manifest.json")]
            missing = [
                f.name for f in manifest.files if not store.exists(store.key_of(prefix + f.name))
            ]
            if missing:
                out["error"] = f"missing from the store: {', '.join(missing)}"
            else:
                out["manifest_ok"] = True
        except SrlError as e:
            out["error"] = str(e)
        return out

    # -- everything ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything ``srl top`` shows; SrlError (one line) when the broker does not answer."""
        try:
            return self._snapshot()
        except KafkaException as e:
            raise SrlError(f"{self.cfg.bootstrap_servers}: {_short(e)}") from None

    def _snapshot(self) -> dict[str, Any]:
        now = now_ms()
        parts = self.partitions()
        rows = self.group_rows(parts)
        backlog, in_backlog = self.backlog(rows, parts)
        self.read_events()
        summary = self.summarize_events()
        summary["versions"]["in_backlog"] = {str(v): n for v, n in sorted(in_backlog.items())}
        dlq = parts.get((self.layout.dlq, 0))
        summary["drops"]["dead_letter_records"] = dlq[1] - dlq[0] if dlq else 0
        return {
            "ts_ms": now,
            "bootstrap": self.cfg.bootstrap_servers,
            "prefix": self.layout.prefix,
            "run": self.cfg.run,
            "window_s": self.window_ms / 1000,
            "topics": [
                {"topic": t, "partition": p, "bucket": self._bucket(t, p), "low": lo, "high": hi}
                for (t, p), (lo, hi) in parts.items()
            ],
            "groups": rows,
            "group_info": self.group_info,
            "backlog": backlog,
            "weights": self.weights(),
            "stalled": self.stalled(rows, now),
            **summary,
        }

    def stalled(self, rows: list[dict[str, Any]], now: int) -> list[dict[str, Any]]:
        out = []
        for r in rows:
            key = (r["group"], r["topic"], r["partition"])
            offset, since = self._moved.get(key, (None, now))
            if offset != r["current_offset"]:
                self._moved[key] = (r["current_offset"], now)
                since = now
            behind = r["lag"] if r["lag"] is not None else 0
            if not behind:
                continue
            # a position group (srl.kafka.position_group) never has members: only its offset
            # standing still means something
            if r["consumer_id"] is None and not r["group"].endswith(POSITION_SUFFIX):
                reason = "no consumer assigned"
            elif now - since >= self.stall_after_ms:
                reason = f"committed offset unchanged for {(now - since) / 1000:.0f}s"
            else:
                continue
            out.append(
                {
                    "group": r["group"],
                    "topic": r["topic"],
                    "partition": r["partition"],
                    "lag": behind,
                    "reason": reason,
                }
            )
        return out


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)


def _record_tokens(value: bytes) -> tuple[int | None, int | None]:
    """(tokens, policy version) of a trajectory chunk or prompt task; (None, None) if unreadable.

    A prompt task counts the tokens it will produce: predicted length (else max_new_tokens)
    times the samples it asks for."""
    try:
        rec = decode(value)
    except SchemaError:
        return None, None
    if isinstance(rec, TrajectoryChunk):
        return rec.n_tokens, rec.policy_version
    if isinstance(rec, PromptTask):
        return (rec.predicted_length or rec.max_new_tokens) * len(rec.samples()), None
    return None, None
