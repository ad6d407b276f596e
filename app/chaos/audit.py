"""The audit of a chaos run, from its topics: read back after every role has stopped, or
gathered as they grew (:class:`Recorded`, fed by ``app.chaos.watch``: the soak, whose data
topics have a retention).

Owns the numbers of a run's rows. Like the demo's report (``app.report``), nothing comes from
the roles' own summaries:

* the prompt topics say which samples were asked for: each task's ``(prompt_id, sample)``;
* the trajectories topic says what was generated, read by the readers' own rule
  (``srl.lineage``): a trajectory is *complete* when its chunks ``0..last`` are all there; a
  seq published twice with different tokens is a *conflict* (``published_twice``), unless
  the second copy is a fenced writer's (a zombie generator's after SIGCONT, superseded by a
  newer pool epoch), which every reader drops: those are counted apart (``fenced``);
* the trainer's ``sample`` events (metrics topic) say what became of each trajectory, at
  which step and at what staleness; the trainer group's committed offsets say what it has
  made durable.

Every sample asked for gets one verdict, so ``asked = trained + dropped + failed + pending +
lost`` (``generated`` counts complete trajectories). A sample is *lost* when it was not
trained, not dropped as stale, did not fail on its own account (reward error, invalid
record) and is not pending, which includes a trajectory the trainer gave up on
(``expired``: its generator died and nobody finished it) and one never generated although
its step was trained. *Pending*: generated with none of its records below the trainer's
committed offsets (on each partition it spans: a migrated trajectory's chunks lie in two
buckets' partitions), or not generated yet while its step is still ahead of the trainer: a
continued run trains it. A sample trained at two steps or under two trajectory ids is
*trained twice*. Records of the poison fault (``POISON_PREFIX`` ids) are left out here; the
poison fault's check looks for them in the dead-letter topic (``app.chaos.storefaults``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from app.report import metric_events, passed_commit, read_all
from schemas.records import MetricEvent, PromptTask, SchemaError, TrajectoryChunk, decode_as
from srl.config import CommonConfig
from srl.kafka import committed_offsets
from srl.lineage import Lineage
from srl.topics import Layout, trainer_group

POISON_PREFIX = "chaos-poison"
Sample = tuple[str, int]  # (prompt_id, sample index)


@dataclass
class Traj:
    """What the trajectories topic holds of one trajectory: its chunks that count, by the
    readers' own rule (``srl.lineage``: a fenced zombie's chunks do not), and where its records
    lie. A migrated trajectory spans partitions (its first chunks in one bucket's, the rest
    in the long-tail bucket's), so the first offset is kept per partition."""

    sample: Sample
    firsts: dict[int, int] = field(default_factory=dict)  # partition -> its first offset
    lineage: Lineage = field(default_factory=Lineage)
    conflict: bool = False  # two different copies of one seq, neither fenced

    @property
    def complete(self) -> bool:
        return self.lineage.done

    @property
    def fenced(self) -> int:
        return self.lineage.fenced

    def passed(self, committed: dict[int, int | None]) -> bool:
        """Some record of it lies below the committed offset of its partition: a restarted
        trainer would not read it again (``app.report.passed_commit``)."""
        return passed_commit(self.firsts, committed)


@dataclass
class Audit:
    """One run's numbers (see the module docstring)."""

    asked: int = 0
    generated: int = 0
    trained: int = 0
    dropped: int = 0
    failed: int = 0
    expired: int = 0
    pending: int = 0
    lost: int = 0
    trained_twice: int = 0
    published_twice: int = 0
    fenced: int = 0  # chunks of fenced writers (zombies) in the topic, dropped by every reader
    max_staleness: int = 0
    steps: int = 0
    lost_examples: list[str] = field(default_factory=list)
    poison_decided: dict[str, str] = field(default_factory=dict)  # poison trajectory -> outcome

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Recorded:
    """What a run's topics held, as the audit needs it: gathered while they grew
    (``app.chaos.watch`` feeds one; needed when the data topics have a retention, as in the
    soak) or read back at the end (:func:`read_back`)."""

    asked: dict[Sample, int | None] = field(default_factory=dict)  # -> its task's step
    trajs: dict[str, Traj] = field(default_factory=dict)
    decided: dict[str, dict[int, tuple[str, int]]] = field(
        default_factory=lambda: defaultdict(dict)
    )  # trajectory -> {step: (outcome, staleness)}; a restarted trainer's repeats collapse
    steps: int = 0

    def task(self, task: PromptTask) -> None:
        if not task.prompt_id.startswith(POISON_PREFIX):
            for i in task.samples():
                self.asked[(task.prompt_id, i)] = task.step

    def chunk(self, partition: int, offset: int, c: TrajectoryChunk) -> None:
        fold(self.trajs, partition, offset, c)

    def event(self, e: MetricEvent) -> None:
        if e.kind == "sample" and e.labels.get("trajectory_id"):
            staleness = int(e.values.get("staleness", 0))
            self.decided[e.labels["trajectory_id"]][int(e.step or 0)] = (
                e.labels["outcome"],
                staleness,
            )
        elif e.kind == "train_step" and e.step:
            self.steps = max(self.steps, int(e.step))


def fold(seen: dict[str, Traj], partition: int, offset: int, c: TrajectoryChunk) -> None:
    """Add one chunk to what is known of its trajectory, as its readers do (``srl.lineage``):
    a copy of a seq with other tokens is a *conflict* unless it is a fenced writer's (a zombie
    generator's, which every reader drops); one with the same tokens is a harmless
    duplicate (a producer retry)."""
    t = seen.get(c.trajectory_id)
    if t is None:
        t = seen[c.trajectory_id] = Traj((c.prompt_id, c.sample_index))
    t.firsts[partition] = min(t.firsts.get(partition, offset), offset)
    c = replace(c, logprobs=b"")  # kept for the whole run (the soak's): only what is compared
    held = t.lineage.chunks.get(c.seq)
    if t.lineage.add(c) == "duplicate" and held is not None:
        t.conflict = t.conflict or held.tokens != c.tokens


def read_back(cfg: CommonConfig) -> Recorded:
    """Every record of the run, read back from its topics (all still there)."""
    rec = Recorded()
    for e in metric_events(cfg, cfg.run):
        rec.event(e)
    layout = Layout.from_config(cfg)
    for p, o, value in read_all(cfg, layout.trajectories):
        with contextlib.suppress(SchemaError):
            rec.chunk(p, o, decode_as(value, TrajectoryChunk))
    for bucket in layout.buckets:
        for _p, _o, value in read_all(cfg, layout.prompts(bucket)):
            with contextlib.suppress(SchemaError):
                rec.task(decode_as(value, PromptTask))
    return rec


def audit_run(cfg: CommonConfig, finished: bool, recorded: Recorded | None = None) -> Audit:
    """The audit of the run on ``cfg``'s topics, from ``recorded`` (read back when None);
    ``finished``: the trainer did all its steps."""
    rec = recorded if recorded is not None else read_back(cfg)
    layout = Layout.from_config(cfg)
    done = committed_offsets(
        cfg,
        trainer_group(cfg.topic_prefix, cfg.run),
        {(layout.trajectories, p) for t in rec.trajs.values() for p in t.firsts},
    )
    committed = {p: off for (_t, p), off in done.items()}
    return tally(rec.asked, rec.trajs, rec.decided, committed, rec.steps, finished)


def tally(
    asked: dict[Sample, int | None],
    trajs: dict[str, Traj],
    decided: dict[str, dict[int, tuple[str, int]]],
    committed: dict[int, int | None],
    steps: int,
    finished: bool,
) -> Audit:
    """The numbers (pure): every asked sample's verdict, the trajectories' conflicts, the
    highest staleness trained, the poison trajectories' outcomes."""
    a = Audit(steps=steps, asked=len(asked))
    by_sample: dict[Sample, list[str]] = defaultdict(list)
    for tid, t in trajs.items():
        if t.sample[0].startswith(POISON_PREFIX):
            last = max(decided.get(tid, {}).items(), default=(0, ("", 0)))[1][0]
            a.poison_decided[tid] = last or "undecided"
            continue
        by_sample[t.sample].append(tid)
        a.generated += int(t.complete)
        a.published_twice += int(t.conflict)
        a.fenced += t.fenced
    a.max_staleness = max((d[1] for _step, d in _trained(decided, trajs)), default=0)
    for sample, step in asked.items():
        verdict = _verdict(sample, step, by_sample, trajs, decided, committed, steps, finished)
        _count(a, sample, verdict)
    return a


def _trained(
    decided: dict[str, dict[int, tuple[str, int]]], trajs: dict[str, Traj]
) -> list[tuple[int, tuple[str, int]]]:
    """Every (step, (outcome, staleness)) that trained a non-poison trajectory."""
    return [
        (step, d)
        for tid, by_step in decided.items()
        if tid in trajs and not trajs[tid].sample[0].startswith(POISON_PREFIX)
        for step, d in by_step.items()
        if d[0] == "trained"
    ]


def _verdict(
    sample: Sample,
    step: int | None,
    by_sample: dict[Sample, list[str]],
    trajs: dict[str, Traj],
    decided: dict[str, dict[int, tuple[str, int]]],
    committed: dict[int, int | None],
    last_step: int,
    finished: bool,
) -> str:
    """One asked sample's fate: trained, trained-twice, dropped, failed, pending or lost-…"""
    tids = by_sample.get(sample, [])
    outcomes = [(tid, s, d[0]) for tid in tids for s, d in decided.get(tid, {}).items()]
    trained = [(tid, s) for tid, s, o in outcomes if o == "trained"]
    if trained:
        return "trained-twice" if len(trained) > 1 else "trained"
    final = {o for _tid, _s, o in outcomes}
    for outcome, verdict in (
        ("dropped_stale", "dropped"),
        ("failed_reward", "failed"),
        ("invalid", "failed"),
        ("expired", "lost-expired"),
    ):
        if outcome in final:
            return verdict
    complete = [trajs[t] for t in tids if trajs[t].complete]
    if complete:
        return "lost-passed" if all(t.passed(committed) for t in complete) else "pending"
    if not finished or step is None or step > last_step:
        return "pending"
    return "lost-never-generated"


def _count(a: Audit, sample: Sample, verdict: str) -> None:
    if verdict in ("trained", "trained-twice"):
        a.trained += 1
        a.trained_twice += int(verdict == "trained-twice")
    elif verdict == "dropped":
        a.dropped += 1
    elif verdict == "failed":
        a.failed += 1
    elif verdict == "pending":
        a.pending += 1
    else:
        a.lost += 1
        a.expired += int(verdict == "lost-expired")
        if len(a.lost_examples) < 5:
            a.lost_examples.append(f"{sample[0]}#{sample[1]}: {verdict.removeprefix('lost-')}")
