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
  (docs/metrics.md) of the last ``window_s`` seconds; ``serving`` (only when a ``srl serve``
  reported ``serve_stats`` in the window) from those events and the trainer's ``sample``
  events of served trajectories; ``stalled``: partitions with lag whose
  group has no member on them, or whose committed offset has not moved for ``stall_after_s``.

``Monitor`` holds the readers: the admin client, a reader that samples backlog records,
:class:`MetricWindow` on the metrics topic and :class:`StallWatch` across snapshots. Rows,
backlog, stalls and the event summary are pure functions below them.

Reads only: it joins no group and commits nothing. Called by ``app.top``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from app.configs import TopConfig
from app.serve.protocol import COMPLETION_ID
from schemas.codec import SchemaError
from schemas.records import MetricEvent, PromptTask, TrajectoryChunk, decode, decode_as, now_ms
from srl.errors import SrlError
from srl.kafka import (
    POSITION_SUFFIX,
    GroupState,
    KafkaException,
    Member,
    PartitionLag,
    TopicPartition,
    admin,
    describe,
    describe_groups,
    reader,
    topic_watermarks,
    wait_for_broker,
)
from srl.metrics import MAX_RECORD_BYTES
from srl.stores import store_for_uri, store_from_config
from srl.topics import Layout
from srl.weights import latest_announcement, load_manifest

FRESH_MS = 30_000  # a gen_stats / train_step event older than this no longer counts as "now"

Parts = dict[tuple[str, int], tuple[int, int]]  # {(topic, partition): (low, high)}
Sampled = dict[tuple[str, int], list[tuple[int, int | None]]]  # (offset, tokens) per partition


class Monitor:
    """The broker, metrics and store readers behind one ``snapshot()``; the arithmetic is in
    the pure functions below, the metric window in :class:`MetricWindow`."""

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
        wait_for_broker(cfg)
        self.admin = admin(cfg)
        self._reader = reader(cfg, "top")
        self._timeout = cfg.connect_timeout_s
        self.metrics = MetricWindow(cfg, self.layout, self.window_ms)
        self._stalls = StallWatch(int(stall_after_s * 1000))
        self.group_info: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        for c in (self._reader, self.metrics.reader):
            with contextlib.suppress(RuntimeError, KafkaException):
                c.close()

    # -- broker state ------------------------------------------------------------------
    def partitions(self) -> Parts:
        """``{(topic, partition): (low, high)}`` for every srl topic, one admin round trip."""
        return topic_watermarks(self.admin, self.layout.prefix, self._timeout)

    def group_rows(self, parts: Parts) -> list[dict[str, Any]]:
        rows, self.group_info = group_rows(
            self.layout, describe_groups(self.admin, self._timeout, self.layout.prefix), parts
        )
        return rows

    def backlog(
        self, rows: list[dict[str, Any]], parts: Parts
    ) -> tuple[list[dict[str, Any]], Counter[int]]:
        """Backlog per (group, topic, bucket) and the policy versions of sampled chunks."""
        starts = backlog_starts(rows, parts)
        sampled, versions = self._sample({(t, p): s for (_, t, p), s in starts.items()}, parts)
        return aggregate_backlog(rows, starts, sampled), versions

    def _sample(
        self, starts: dict[tuple[str, int], int], parts: Parts
    ) -> tuple[Sampled, Counter[int]]:
        """Up to ``sample`` records from each start: (offset, tokens) and chunk versions."""
        out: Sampled = defaultdict(list)
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

    # -- weights -------------------------------------------------------------------------
    def weights(self) -> dict[str, Any]:
        """The run's latest announcement and whether its manifest and files are all there."""
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
            raise SrlError(f"{self.cfg.bootstrap_servers}: {describe(e)}") from None

    def _snapshot(self) -> dict[str, Any]:
        now = now_ms()
        parts = self.partitions()
        rows = self.group_rows(parts)
        backlog, in_backlog = self.backlog(rows, parts)
        self.metrics.read()
        summary = summarize_events(self.metrics.events, self.cfg.run, now_ms())
        summary["versions"]["in_backlog"] = {str(v): n for v, n in sorted(in_backlog.items())}
        dlq = parts.get((self.layout.dlq, 0))
        summary["drops"]["dead_letter_records"] = dlq[1] - dlq[0] if dlq else 0
        summary["drops"]["unreadable_metric_records"] = self.metrics.unreadable
        return {
            "ts_ms": now,
            "bootstrap": self.cfg.bootstrap_servers,
            "prefix": self.layout.prefix,
            "run": self.cfg.run,
            "window_s": self.window_ms / 1000,
            "topics": [
                {
                    "topic": t,
                    "partition": p,
                    "bucket": bucket_of(self.layout, t, p),
                    "low": lo,
                    "high": hi,
                }
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
        """Partitions with lag and no consumer, or whose committed offset stands still."""
        return self._stalls.stalled(rows, now)


class MetricWindow:
    """The last ``window_ms`` of ``{prefix}.metrics``, read forward from where the previous
    call stopped (the first call starts at the window's start, by timestamp)."""

    def __init__(self, cfg: TopConfig, layout: Layout, window_ms: int) -> None:
        self.topic = layout.metrics
        self.window_ms = window_ms
        self.reader = reader(cfg, "top-metrics")
        self.next: int | None = None  # next offset of {prefix}.metrics to read
        self.events: deque[MetricEvent] = deque()
        # records that are no metric event (undecodable, another type, oversized): counted and
        # shown, not dead-lettered: a monitor commits no position, so every `srl top` started
        # would send the same record to the DLQ again
        self.unreadable = 0
        self._timeout = cfg.connect_timeout_s

    def read(self) -> None:
        """Bring ``events`` up to date: the last ``window_ms`` of the metrics topic."""
        now = now_ms()
        tp0 = TopicPartition(self.topic, 0)
        try:
            _, high = self.reader.get_watermark_offsets(tp0, timeout=self._timeout, cached=False)
        except KafkaException:
            return  # no metrics topic yet
        if self.next is None:
            tp = TopicPartition(self.topic, 0, now - self.window_ms)
            start = self.reader.offsets_for_times([tp], timeout=self._timeout)[0].offset
            self.next = start if start >= 0 else high  # -1: nothing that recent
            self.reader.assign([TopicPartition(self.topic, 0, self.next)])
        deadline = time.monotonic() + self._timeout
        while self.next < high and time.monotonic() < deadline:
            for msg in self.reader.consume(1000, 0.2):
                if msg.error():
                    continue
                self.next = (msg.offset() or 0) + 1
                value = msg.value() or b""
                try:
                    if len(value) > MAX_RECORD_BYTES:
                        raise SchemaError(f"oversized: {len(value)} bytes")
                    self.events.append(decode_as(value, MetricEvent))
                except SchemaError:
                    self.unreadable += 1
        while self.events and self.events[0].ts_ms < now - self.window_ms:
            self.events.popleft()


class StallWatch:
    """When each (group, topic, partition)'s committed offset last moved, across snapshots."""

    def __init__(self, stall_after_ms: int) -> None:
        self.stall_after_ms = stall_after_ms
        self._moved: dict[tuple[str, str, int], tuple[int | None, int]] = {}  # offset, since ms

    def stalled(self, rows: list[dict[str, Any]], now: int) -> list[dict[str, Any]]:
        out = []
        for r in rows:
            key = (r["group"], r["topic"], r["partition"])
            offset, since = self._moved.get(key, (None, now))
            if offset != r["current_offset"]:
                self._moved[key] = (r["current_offset"], now)
                since = now
            reason = stall_reason(r, now - since, self.stall_after_ms)
            if reason is not None:
                out.append(
                    {
                        "group": r["group"],
                        "topic": r["topic"],
                        "partition": r["partition"],
                        "lag": r["lag"],
                        "reason": reason,
                    }
                )
        return out


# -- pure parts ----------------------------------------------------------------------------
def stall_reason(row: dict[str, Any], unmoved_ms: int, stall_after_ms: int) -> str | None:
    """Why a partition with lag is stalled (its committed offset unmoved for ``unmoved_ms``),
    or None: no lag, or a consumer that has moved recently enough."""
    if not row["lag"]:
        return None
    # a position group (srl.kafka.position_group) never has members: only its offset
    # standing still means something
    if row["consumer_id"] is None and not row["group"].endswith(POSITION_SUFFIX):
        return "no consumer assigned"
    if unmoved_ms >= stall_after_ms:
        return f"committed offset unchanged for {unmoved_ms / 1000:.0f}s"
    return None


def bucket_of(layout: Layout, topic: str, part: int) -> str | None:
    """The length bucket (trajectories) or pool (prompts, resume) a partition serves."""
    if topic == layout.trajectories:
        return layout.bucket_of_partition(part)
    for kind in ("prompts", "resume"):
        head = f"{layout.prefix}.{kind}."
        if topic.startswith(head):
            return topic[len(head) :]
    return None


def group_rows(
    layout: Layout, groups: list[GroupState], parts: Parts
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """One row per (srl group, partition of an srl topic it reads), and each such group's
    state and member count."""
    rows = []
    info = {}
    for g in groups:
        keys = [*g.committed, *g.owners]
        topics = {t for t, _ in keys if t.startswith(f"{layout.prefix}.")}
        if not topics:
            continue  # not an srl group (or not one of this prefix)
        info[g.group] = {"state": g.state, "members": g.members}
        for key in sorted(k for k in parts if k[0] in topics):
            rows.append(
                group_row(
                    layout,
                    g.group,
                    g.state,
                    key,
                    parts[key],
                    g.committed.get(key),
                    g.owners.get(key),
                )
            )
    return rows, info


def group_row(
    layout: Layout,
    gid: str,
    state: str,
    key: tuple[str, int],
    ends: tuple[int, int],
    current: int | None,
    member: Member | None,
) -> dict[str, Any]:
    """A row in the columns of ``kafka-consumer-groups.sh`` (plus bucket and state)."""
    topic, part = key
    return {
        "group": gid,
        "topic": topic,
        "partition": part,
        "bucket": bucket_of(layout, topic, part),
        "current_offset": current,
        "log_end_offset": ends[1],
        "lag": None if current is None else PartitionLag(topic, part, *ends, current).lag,
        "consumer_id": member.member_id if member else None,
        "host": member.host if member else None,
        "client_id": member.client_id if member else None,
        "state": state,
    }


def backlog_starts(rows: list[dict[str, Any]], parts: Parts) -> dict[tuple[str, str, int], int]:
    """``{(group, topic, partition): first unconsumed offset}`` for bucketed partitions with
    a backlog: the committed offset, else the low watermark (where srl consumers start)."""
    starts = {}
    for r in rows:
        if r["bucket"] is None:
            continue
        key = (r["topic"], r["partition"])
        start = r["current_offset"] if r["current_offset"] is not None else parts[key][0]
        if start < r["log_end_offset"]:
            starts[(r["group"], *key)] = start
    return starts


def aggregate_backlog(
    rows: list[dict[str, Any]], starts: dict[tuple[str, str, int], int], sampled: Sampled
) -> list[dict[str, Any]]:
    """Records and tokens per (group, topic, bucket): tokens exact when every pending record
    was sampled and decoded, else the sampled mean times the count."""
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
    return list(agg.values())


@dataclass
class EventTally:
    """The run's metric events of the window, reduced: the latest of each kind and source,
    sample outcomes and staleness counts, and the times of trained samples."""

    gen: dict[str, MetricEvent] = field(default_factory=dict)  # latest gen_stats per source
    counters: dict[str, MetricEvent] = field(default_factory=dict)  # latest counter per source
    train: MetricEvent | None = None  # latest train_step
    published: MetricEvent | None = None  # latest weights_published
    checkpoint: MetricEvent | None = None  # latest checkpoint_saved
    refused: dict[str, MetricEvent] = field(default_factory=dict)  # latest store_refused by what
    staleness: Counter[int] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    trained_ts: list[int] = field(default_factory=list)
    serve: dict[str, list[MetricEvent]] = field(default_factory=dict)  # serve_stats per source
    served_trained: set[str] = field(default_factory=set)  # served trajectories trained


def tally_events(events: Iterable[MetricEvent], run: str) -> EventTally:
    t = EventTally()
    for e in events:
        if e.run != run:
            continue
        if e.kind == "gen_stats":
            t.gen[e.source] = e
        elif e.kind == "train_step":
            t.train = e
        elif e.kind == "weights_published":
            t.published = e
        elif e.kind == "checkpoint_saved":
            t.checkpoint = e
        elif e.kind == "store_refused":
            t.refused[e.labels.get("what", "?")] = e
        elif e.kind == "counter":
            t.counters[e.source] = e
        elif e.kind == "serve_stats":
            t.serve.setdefault(e.source, []).append(e)
        elif e.kind == "sample":
            outcome = e.labels.get("outcome", "trained")
            t.outcomes[outcome] += 1
            if math.isfinite(e.values.get("staleness", math.nan)):
                t.staleness[int(e.values["staleness"])] += 1
            if outcome == "trained":
                t.trained_ts.append(e.ts_ms)
                if COMPLETION_ID.match(e.labels.get("prompt_id", "")):  # a served group
                    t.served_trained.add(e.labels.get("trajectory_id", ""))
    return t


def summarize_events(events: Iterable[MetricEvent], run: str, now: int) -> dict[str, Any]:
    """``throughput``, ``versions``, ``staleness`` and ``drops`` of one run's events at
    ``now`` (ms); generator and trainer rates count only if fresher than :data:`FRESH_MS`."""
    t = tally_events(events, run)
    fresh_gen = {s: e for s, e in t.gen.items() if now - e.ts_ms <= FRESH_MS}
    span = (now - min(t.trained_ts)) / 1000 if t.trained_ts else 0.0
    n = sum(t.staleness.values())
    dead = sum(e.values.get("dead_letters", 0.0) for e in t.counters.values())
    train = t.train
    serving = serving_summary(t, now)
    return {
        "throughput": {
            "gen_tokens_per_s": sum(e.values.get("tokens_per_s", 0.0) for e in fresh_gen.values())
            if fresh_gen
            else None,
            "train_tokens_per_s": train.values.get("tokens_per_s")
            if train and now - train.ts_ms <= FRESH_MS
            else None,
            "trajectories_per_s": len(t.trained_ts) / span if span > 0 else None,
            "simulated": any(e.labels.get("simulated") == "true" for e in fresh_gen.values()),
        },
        "versions": {
            "trainer": _int(train.values.get("policy_version")) if train else None,
            "published": _int(t.published.values.get("version")) if t.published else None,
            "generators": {
                s: _int(e.values.get("policy_version")) for s, e in sorted(fresh_gen.items())
            },
        },
        "staleness": {
            "histogram": {str(k): v for k, v in sorted(t.staleness.items())},
            "mean": sum(k * v for k, v in t.staleness.items()) / n if n else None,
            "max": max(t.staleness) if t.staleness else None,
        },
        "drops": {
            "by_outcome": {k: v for k, v in sorted(t.outcomes.items()) if k != "trained"},
            "dead_letters_counted": int(dead),
        },
        "store": store_summary(t, now),
        **({"serving": serving} if serving is not None else {}),
    }


def store_summary(t: EventTally, now: int) -> dict[str, Any]:
    """The trainer's writes to the store: its last checkpoint (number, step, seconds, age) and
    each kind of write (``publish``, ``checkpoint``) the store refused since that kind last
    succeeded: the reason, refusals in a row and the back-off before the trainer tries again."""
    ckpt = t.checkpoint
    last_ok = {"checkpoint": ckpt, "publish": t.published}
    refused = {}
    for what, e in sorted(t.refused.items()):
        ok = last_ok.get(what)
        if ok is None or ok.ts_ms < e.ts_ms:
            refused[what] = {
                "reason": e.labels.get("reason", ""),
                "in_a_row": _int(e.values.get("in_a_row")),
                "retry_s": e.values.get("retry_s"),
                "age_s": (now - e.ts_ms) / 1000,
            }
    return {
        "checkpoint": None
        if ckpt is None
        else {
            "number": _int(ckpt.values.get("number")),
            "step": ckpt.step,
            "seconds": ckpt.values.get("seconds"),
            "age_s": (now - ckpt.ts_ms) / 1000,
        },
        "refused": refused,
    }


def serving_summary(t: EventTally, now: int) -> dict[str, Any] | None:
    """The ``srl serve`` workers of the window, from their ``serve_stats`` events; None when
    none reported. ``requests_per_s``: between each worker's last two events; ``running`` /
    ``waiting``: its last event if fresher than :data:`FRESH_MS`; ``served`` (choices
    finished), ``published`` (trajectories handed to the producer), drops and failures: grown
    since its first event of the window; ``queue_wait_ms``: the mean wait for a first batch
    slot of the requests that got one in the window; ``trained``: served trajectories
    (``prompt_id`` a completion id) the trainer reported trained in the window."""
    if not t.serve:
        return None
    rates = []
    for evs in t.serve.values():
        prev, last = evs[-2:] if len(evs) > 1 else (None, evs[-1])
        if prev is not None and last.ts_ms > prev.ts_ms:
            rates.append(_grown(prev, last, "requests") / ((last.ts_ms - prev.ts_ms) / 1000))
    fresh = [evs[-1] for evs in t.serve.values() if now - evs[-1].ts_ms <= FRESH_MS]
    running = sum(int(e.values.get("running", 0.0)) for e in fresh)
    waiting = sum(int(e.values.get("waiting", 0.0)) for e in fresh)

    def grown(key: str) -> int:
        return sum(_grown(evs[0], evs[-1], key) for evs in t.serve.values())

    return {
        "servers": len(fresh),
        "requests_per_s": sum(rates) if rates else None,
        "in_flight": running + waiting if fresh else None,
        "running": running if fresh else None,
        "waiting": waiting if fresh else None,
        "queue_timeouts": grown("queue_timeouts"),
        "queue_wait_ms": _mean(grown("queue_wait_ms"), grown("queue_waits")),
        "served": grown("completions"),
        "published": grown("published_trajectories"),
        "trained": len(t.served_trained),
        "publish_dropped": grown("publish_dropped"),
        "delivery_failures": grown("delivery_failures"),
    }


def _mean(total: int, n: int) -> float | None:
    return round(total / n, 1) if n else None


def _grown(first: MetricEvent, last: MetricEvent, key: str) -> int:
    """How much a cumulative ``serve_stats`` counter grew from ``first`` to ``last``; a
    counter that went down (the server restarted) counts from 0."""
    a, b = first.values.get(key, 0.0), last.values.get(key, 0.0)
    return int(b - a if b >= a else b)


def _int(x: float | None) -> int | None:
    return None if x is None or not math.isfinite(x) else int(x)


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
