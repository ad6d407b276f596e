"""What a generator worker makes of a prompt task: its sample plans, and what recovery leaves.

Owns two pure decisions of the worker, with no Kafka and no engine (the worker tokenizes and
lets the engine validate; the results come in as arguments):

* **planning** (:func:`task_target`, :func:`sample_plans`, :func:`task_state`): a task's
  sample indices must lie inside its group and its metadata must be a JSON object
  (otherwise :class:`BadTask`, and the task goes to the DLQ); ``metadata.sim_length`` is the
  target length (the sim engine's oracle); a fresh task plans one trajectory per sample
  index with the id ``trajectory_id_for(task_id, sample_index)``, so whichever worker takes
  a redelivered task writes the same trajectories; a ``resume`` task plans its one trajectory
  from the prefix it carries;
* **recovery** (:func:`prefix_query`, :func:`recovered`): for tasks a previous owner of their
  partition may have started, which trajectories to read back and from when; then, from what
  ``producers.recovery.read_prefixes`` found, per sample: skipped (complete, or migrated to
  the long-tail pool, which continues it), resumed from the contiguous published prefix
  (its tokens appended, the next seq, the prefix's start time), or generated from the start;
  a gap in a trajectory's seq numbers kills the whole task.

Also the two records a plan becomes when it starts (:func:`request_for`,
:func:`trajectory_start`). Called by ``producers.worker``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from producers.chunker import TrajectoryStart
from producers.engines.base import Request
from producers.recovery import Found, trajectory_id_for
from producers.tasks import SamplePlan, TaskState, TopicPart
from schemas.records import PromptTask, now_ms, pack_tokens, unpack_tokens


class BadTask(ValueError):
    """A prompt task no engine can run (goes to the DLQ)."""


# -- planning -----------------------------------------------------------------------------------
MAX_GROUP_SIZE = 1024  # samples of one prompt; a larger group is poison, not work


def task_target(task: PromptTask) -> int | None:
    """The task's target length (``metadata.sim_length``, if a number); BadTask for a group
    of more than ``MAX_GROUP_SIZE``, sample indices outside the group, a resume prefix with a
    negative seq or version, a negative ``min_version``, or metadata that is not a JSON
    object."""
    if not 1 <= task.group_size <= MAX_GROUP_SIZE:
        raise BadTask(f"task {task.task_id}: group of {task.group_size} (1..{MAX_GROUP_SIZE})")
    samples = task.samples()
    if any(not 0 <= s < task.group_size for s in samples):
        raise BadTask(
            f"task {task.task_id}: sample indices {samples} outside group of {task.group_size}"
        )
    if (r := task.resume) is not None and (r.next_seq < 0 or r.min_version < 0):
        raise BadTask(
            f"task {task.task_id}: resume at seq {r.next_seq}, policy version {r.min_version}"
        )
    if task.min_version is not None and task.min_version < 0:
        raise BadTask(f"task {task.task_id}: min_version {task.min_version}")
    meta: Any = {}
    if task.metadata:
        try:
            meta = orjson.loads(task.metadata)
        except orjson.JSONDecodeError:
            meta = None
        if not isinstance(meta, dict):
            raise BadTask(f"task {task.task_id}: metadata is not a JSON object")
    sim_length = meta.get("sim_length")
    return int(sim_length) if isinstance(sim_length, int | float) else None


def check_versions(
    task: PromptTask, exists: Callable[[int, int | None], bool], produced_ms: int | None
) -> None:
    """BadTask for a task stamped with a policy version no run has published (``exists``:
    ``srl.weights.KnownVersions.exists``): its ``min_version`` (the newest announced version
    when the dispatcher released it, so its manifest was written) or its resume prefix's.
    ``produced_ms``: when the task's record was produced (released), not ``created_ms`` (when
    it was planned: a paced dispatcher plans a window before the version it waits for exists;
    judged by that, a fresh listing was trusted not to miss a version announced after it)."""
    resumed = task.resume.min_version if task.resume is not None else None
    for v in (task.min_version, resumed):
        if v and not exists(v, produced_ms):
            raise BadTask(f"task {task.task_id}: policy version {v} was never published")


def sample_plans(task: PromptTask) -> list[SamplePlan]:
    """The trajectories of a task: its resume prefix, or one fresh one per sample index."""
    if task.resume is not None:
        r = task.resume
        prefix = unpack_tokens(r.tokens).tolist()
        return [SamplePlan(r.trajectory_id, r.sample_index, prefix, r.next_seq)]
    return [SamplePlan(trajectory_id_for(task.task_id, s), s) for s in task.samples()]


def task_state(
    task: PromptTask, tp: TopicPart, offset: int, prompt_ids: list[int], target: int | None
) -> TaskState:
    """A consumed task with its plans, every planned trajectory counted as generating."""
    plans = sample_plans(task)
    return TaskState(task, tp, offset, prompt_ids, target, plans, {p.trajectory_id for p in plans})


def request_for(st: TaskState, plan: SamplePlan) -> Request:
    """The engine request of one planned sample (priority: the predicted length)."""
    t = st.task
    return Request(
        plan.trajectory_id,
        st.prompt_ids,
        t.max_new_tokens,
        t.temperature,
        t.top_p,
        plan.prefix,
        float(t.predicted_length or 0),
        st.target_length,
    )


def trajectory_start(
    st: TaskState, plan: SamplePlan, started_ms: int | None = None
) -> TrajectoryStart:
    """What the chunker repeats on every chunk of one planned sample; a resumed sample keeps
    its prefix's start time, a fresh one starts at ``started_ms`` (default: now)."""
    t = st.task
    return TrajectoryStart(
        plan.trajectory_id,
        t.prompt_id,
        t.task_id,
        plan.sample_index,
        t.group_size,
        t.bucket,
        t.predicted_length,
        plan.next_seq,
        len(plan.prefix),
        pack_tokens(st.prompt_ids),
        t.metadata,
        plan.started_ms or started_ms or now_ms(),
        t.step,
        t.step_groups,
        pool=st.writer[0] if st.writer else None,
        pool_epoch=st.writer[1] if st.writer else None,
    )


# -- recovery -----------------------------------------------------------------------------------
def prefix_query(
    states: Sequence[TaskState], partition_for: Callable[[str, str], int], slack_s: float
) -> tuple[dict[str, tuple[int, int]], int]:
    """What to read back for ``states``: ``{trajectory_id: (partition, first seq)}`` of every
    planned sample, and the time to read from (the oldest task's creation minus ``slack_s``)."""
    wanted = {
        p.trajectory_id: (partition_for(st.task.bucket, p.trajectory_id), p.next_seq)
        for st in states
        for p in st.todo
    }
    since = min(st.task.created_ms for st in states) - int(slack_s * 1000)
    return wanted, since


@dataclass
class Recovered:
    """What recovery leaves of one task's plans."""

    todo: list[SamplePlan] = field(default_factory=list)  # to generate (fresh or resumed)
    skipped: list[str] = field(default_factory=list)  # complete or migrated: nothing to do
    resumed: int = 0  # plans in todo that continue a published prefix
    gap: str | None = None  # a trajectory with a gap in its seqs: the task goes to the DLQ


def recovered(
    plans: Sequence[SamplePlan],
    found: Mapping[str, Found],
    writer: tuple[str, int] | None = None,
) -> Recovered:
    """Per plan, by ``found[trajectory_id].state(next_seq, writer)``: skip, resume or start
    over (``writer``: the resumer's pool and epoch, which fences what a dropped writer left
    after a gap).

    At the first gap the task is killed: ``todo`` is empty, and what was counted for the plans
    before it (skipped, resumed) stays counted, as it always was.
    """
    out = Recovered()
    for p in plans:
        f = found[p.trajectory_id]
        state = f.state(p.next_seq, writer)
        if state == "gap":
            out.todo, out.gap = [], p.trajectory_id
            return out
        if state in ("complete", "migrated"):  # migrated: the long-tail pool has it
            out.skipped.append(p.trajectory_id)
            continue
        if state == "prefix":
            run = f.contiguous(p.next_seq)
            p = dataclasses.replace(
                p,
                prefix=p.prefix + [t for c in run for t in c.token_ids().tolist()],
                next_seq=run[-1].seq + 1,
                started_ms=run[0].started_ms,
            )
            out.resumed += 1
        out.todo.append(p)
    return out
