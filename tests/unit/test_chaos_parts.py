"""The chaos suite's pure parts: the audit's verdicts, the rows' acceptance, the schedule,
the poison records and the soak's growth figures."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from app.chaos.audit import POISON_PREFIX, Traj, fold, tally
from app.chaos.catalogue import CATALOGUE, mixed_faults
from app.chaos.config import FAULTS, ChaosConfig
from app.chaos.poison import KINDS, plan
from app.chaos.report import RECOVERY_BOUND_S, Row, result, table
from app.chaos.soakplot import growth, write_series
from schemas.records import (
    PromptTask,
    SchemaError,
    TrajectoryChunk,
    WeightsAnnouncement,
    decode_as,
    pack_logprobs,
    pack_tokens,
)
from srl.config import CommonConfig
from srl.errors import ConfigError
from srl.topics import Layout


def chunk(tid: str, seq: int, last: bool, tokens: list[int], prompt: str = "p") -> TrajectoryChunk:
    return TrajectoryChunk(
        trajectory_id=tid,
        prompt_id=prompt,
        task_id="t",
        sample_index=0,
        group_size=1,
        seq=seq,
        token_offset=0,
        tokens=pack_tokens(tokens),
        logprobs=pack_logprobs([0.0] * len(tokens)),
        policy_version=0,
        is_last=last,
        worker_id="w",
        bucket="le16",
        started_ms=0,
    )


# -- the audit -------------------------------------------------------------------------------
def traj(sample: tuple[str, int], partition: int = 0, offset: int = 10, done: bool = True) -> Traj:
    t = Traj(sample, {partition: offset})
    t.lineage.add(chunk("t", 0, done, [1], prompt=sample[0]))
    return t


def test_fold_tells_duplicates_from_conflicting_copies() -> None:
    seen: dict[str, Traj] = {}
    fold(seen, 3, 7, chunk("a", 0, False, [5, 6]))
    fold(seen, 3, 9, chunk("a", 0, False, [5, 6]))  # a producer retry: same tokens
    fold(seen, 3, 8, chunk("a", 1, True, [7]))
    assert seen["a"].complete and not seen["a"].conflict and seen["a"].firsts == {3: 7}
    fold(seen, 3, 12, chunk("a", 1, True, [9]))  # a second writer's other version of seq 1
    assert seen["a"].conflict


def test_fold_drops_a_fenced_zombies_copies_as_every_reader_does() -> None:
    # pool epoch 1 wrote seq 0 and 1 and was dropped (SIGSTOP); epoch 2 read seq 0 back and
    # went on from seq 1; the zombie's queued seq 1 and 2 went out after SIGCONT, before and
    # after its successor finished: fenced (or cut), never a conflict
    def pooled(seq: int, last: bool, tokens: list[int], epoch: int) -> TrajectoryChunk:
        return replace(chunk("z", seq, last, tokens), pool="regular", pool_epoch=epoch)

    seen: dict[str, Traj] = {}
    fold(seen, 0, 1, pooled(0, False, [1], 1))
    fold(seen, 0, 2, pooled(1, False, [2], 1))
    fold(seen, 0, 5, pooled(1, False, [7], 2))  # cuts the zombie's seq 1
    fold(seen, 0, 6, pooled(2, False, [2], 1))  # the zombie again: fenced
    fold(seen, 0, 7, pooled(2, True, [8], 2))
    fold(seen, 0, 9, pooled(3, True, [3], 1))  # after completion, still fenced
    z = seen["z"]
    assert z.complete and not z.conflict and z.fenced == 3
    held = [c.tokens for _s, c in sorted(z.lineage.chunks.items())]
    assert held == [pack_tokens([1]), pack_tokens([7]), pack_tokens([8])]
    a = tally({("p", 0): 1}, seen, {}, {}, 0, finished=False)
    assert (a.published_twice, a.fenced, a.pending) == (0, 3, 1)


def test_a_migrated_trajectory_is_pending_until_the_commit_passes_it_on_any_partition() -> None:
    # the regular pool wrote seq 0 on partition 0 (offset 100), the long-tail pool the rest on
    # partition 4 (offset 20): each partition's commit is compared with its own first offset,
    # whichever of the two was read first
    at = {0: (100, chunk("m", 0, False, [1])), 4: (20, chunk("m", 1, True, [2]))}
    for order in ((0, 4), (4, 0)):
        seen: dict[str, Traj] = {}
        for p in order:
            fold(seen, p, *at[p])
        verdicts = [
            tally({("p", 0): 1}, seen, {}, commit, 1, finished=True)
            for commit in ({0: 100, 4: 20}, {0: 60, 4: 21}, {0: 101, 4: 0})
        ]
        assert [(a.pending, a.lost) for a in verdicts] == [(1, 0), (0, 1), (0, 1)]


def test_every_asked_sample_gets_one_verdict() -> None:
    asked = {(f"p{i}", 0): 1 for i in range(8)} | {("late", 0): 9}
    trajs = {
        "t0": traj(("p0", 0)),
        "t1": traj(("p1", 0)),
        "t1b": traj(("p1", 0)),  # p1 generated again under a second id (a re-dispatch)
        "t2": traj(("p2", 0)),
        "t3": traj(("p3", 0), offset=50),  # above the committed offset: pending
        "t4": traj(("p4", 0), offset=5),  # below it, never decided: the trainer passed it
        "t5": traj(("p5", 0)),
        "t6": traj(("p6", 0)),
        # p7 was never generated, and its step (1) was trained: lost
    }
    decided = {
        "t0": {1: ("trained", 1)},
        "t1": {1: ("trained", 0)},
        "t1b": {4: ("trained", 1)},
        "t2": {1: ("expired", 0)},
        "t5": {1: ("dropped_stale", 2)},
        "t6": {1: ("failed_reward", 0)},
    }
    a = tally(asked, trajs, decided, {0: 20}, steps=4, finished=True)
    assert (a.asked, a.trained, a.trained_twice) == (9, 2, 1)
    assert (a.dropped, a.failed, a.pending) == (1, 1, 2)  # p3, and "late" (step 9 > 4)
    assert (a.lost, a.expired) == (3, 1)  # p2 expired, p4 passed, p7 never generated
    assert a.asked == a.trained + a.dropped + a.failed + a.pending + a.lost
    assert a.max_staleness == 1  # of what trained; the dropped one's 2 does not count
    assert any("never-generated" in x for x in a.lost_examples)


def test_a_restarted_trainer_repeating_a_step_is_not_training_twice() -> None:
    # the same (trajectory, step) decision re-sent after a restart collapses in ``decisions``
    a = tally({("p", 0): 1}, {"t": traj(("p", 0))}, {"t": {1: ("trained", 0)}}, {}, 1, True)
    assert (a.trained, a.trained_twice, a.lost) == (1, 0, 0)


def test_unfinished_runs_leave_ungenerated_samples_pending_and_poison_apart() -> None:
    poison = f"{POISON_PREFIX}-future-version-1"
    trajs = {"x": traj((poison, 0)), "y": traj(("p", 0), done=False)}
    a = tally({("p", 0): 1}, trajs, {"x": {2: ("trained", -5)}}, {}, 0, finished=False)
    assert (a.pending, a.lost, a.generated, a.max_staleness) == (1, 0, 0, 0)
    assert a.poison_decided == {"x": "trained"}


# -- rows and output --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("row", "ok"),
    [
        (Row("f", 3.0, 0, 0, 1), True),
        (Row("f", RECOVERY_BOUND_S + 0.1, 0, 0, 1), False),
        (Row("f", None, 0, 0, 0), False),
        (Row("f", 1.0, 1, 0, 0), False),
        (Row("f", 1.0, 0, 1, 0), False),
        (Row("f", 1.0, 0, 0, 2), False),
        (Row("f", 1.0, 0, 0, 0, published_twice=1), False),
        (Row("f", None, 0, 0, 0, skipped="no root"), False),
        (Row("f", 1.0, 0, 0, 0, complete=False), False),
        (Row("f", 1.0, 0, 0, 0, dropped=3), False),
    ],
)
def test_row_acceptance(row: Row, ok: bool) -> None:
    assert row.ok(k=1) is ok


def test_result_has_the_documented_keys_and_the_table_says_why_rows_fail() -> None:
    res = result(1, [Row("a", 2.04, 0, 0, 1), Row("b", None, 3, 0, 0, note="wedged")])
    assert res["k"] == 1
    first = res["faults"][0]
    assert {"fault", "recovered_s", "lost", "trained_twice", "max_staleness"} <= set(first)
    assert first["recovered_s"] == 2.0 and first["ok"] and not res["faults"][1]["ok"]
    text = table(res)
    assert "b: wedged" in text and "a: " not in text


# -- config and schedule ----------------------------------------------------------------
def test_config_checks_fault_names_and_warmup() -> None:
    with pytest.raises(ConfigError, match="unknown fault 'nope'"):
        ChaosConfig(faults=("nope",))
    with pytest.raises(ConfigError, match="warmup_steps"):
        ChaosConfig(steps=4, warmup_steps=4)
    assert ChaosConfig().schedule() == FAULTS
    assert ChaosConfig(faults=("poison", "generator-kill")).schedule() == (
        "generator-kill",
        "poison",
    )


def test_mixed_faults_are_seeded_one_per_role_and_available() -> None:
    available = set(FAULTS) - {"generator-partition"}
    first = mixed_faults(random.Random(3), available)
    assert first == mixed_faults(random.Random(3), available)
    roles = [CATALOGUE[f].role for f in first]
    assert len(roles) == len(set(roles)) == 4
    assert "generator-partition" not in first
    assert set(mixed_faults(random.Random(1), {"poison"})) == {"poison"}


# -- poison ----------------------------------------------------------------------------------
def test_poison_covers_every_input_topic_with_every_kind() -> None:
    cfg = CommonConfig(run="r", topic_prefix="px", bucket_bounds=(16, 32))
    records = plan(cfg, random.Random(0))
    lay = Layout.from_config(cfg)
    inputs = {lay.trajectories, lay.weights} | {
        t for b in lay.buckets for t in (lay.prompts(b), lay.resumes(b))
    }
    assert {(t, k) for t, k, _v in records} == {(t, k) for t in inputs for k in KINDS}
    types = {lay.trajectories: TrajectoryChunk, lay.weights: WeightsAnnouncement}
    for topic, kind, value in records:
        cls = types.get(topic, PromptTask)
        assert len(value) < 1_000_000
        if kind in ("garbage", "unknown-fingerprint", "truncated", "wrong-schema"):
            with pytest.raises(SchemaError):
                decode_as(value, cls)
            continue
        rec = decode_as(value, cls)  # valid, and poison all the same
        if kind == "oversized":
            assert len(value) > 500_000
            continue
        version = (
            rec.policy_version
            if isinstance(rec, TrajectoryChunk)
            else rec.version
            if isinstance(rec, WeightsAnnouncement)
            else rec.min_version
        )
        assert version is not None
        assert version > 10**6 if kind == "future-version" else version < 0


# -- the soak's figures --------------------------------------------------------------------
def test_growth_is_judged_after_warmup() -> None:
    t = [float(x) for x in range(0, 1200, 60)]
    flat = [100.0 if x < 300 else 50.0 for x in t]  # warm-up, then flat
    assert growth(t, flat)["per_10min"] == 0.0
    rising = [x / 60 for x in t]  # 1 MB a minute
    assert growth(t, rising)["per_10min"] == pytest.approx(10.0)
    assert growth(t, [None] * len(t))["per_10min"] is None


def test_series_are_written_as_json_csv_and_png(tmp_path: Path) -> None:
    series = [
        {
            "t_s": float(i * 5),
            "step": i,
            "rss_mb": {"trainer": 300.0 + i, "broker": 20.0},
            "checkpoint_mb": 11.0,
            "broker_data_mb": 1.0 + i,
            "store_mb": 4.0 * i,
            "load1": 2.0,
        }
        for i in range(6)
    ]
    summary = write_series(tmp_path, series, [], ChaosConfig(), 30.0)
    assert summary["steps"] == 5 and summary["growth"]["checkpoint_mb"]["per_10min"] == 0.0
    header = (tmp_path / "soak.csv").read_text().splitlines()[0]
    assert "rss_mb.trainer" in header and "broker_data_mb" in header
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert (tmp_path / "soak.json").exists()


def test_a_checkpoint_kill_that_found_no_checkpoint_is_a_skipped_row(tmp_path: Path) -> None:
    """The soak printed a trainer-kill-checkpoint row's ``recovered_s`` as a wall-clock time:
    no checkpoint started, nothing was killed, and its start stayed 0. Now it is skipped."""
    import threading
    from types import SimpleNamespace

    from app.chaos.faults import Injection, kill_trainer_mid_checkpoint

    halt = threading.Event()
    halt.set()  # the run is over: no checkpoint will start
    stage = SimpleNamespace(store_dir=tmp_path, run="r")
    sc = SimpleNamespace(halt=halt, stage=stage)
    inj = Injection("trainer-kill-checkpoint")
    kill_trainer_mid_checkpoint(sc, inj)  # type: ignore[arg-type]
    assert inj.skipped == "no checkpoint started in 60 s" and inj.start == 0.0
