"""The pipeline bench's hand-off timeline (``app.bench.timeline``) and its weight-sync charge
(``app.bench.synccost``, ``Workload.sync``): accounting on synthetic events, not speed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.bench import synccost, timeline
from app.bench.pipemodel import StepWork, Workload, model_iteration, run_bound
from app.bench.timeline import Load, Records, Traj
from srl.errors import ConfigError


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=12))
def test_segments_are_never_negative_and_add_up_to_the_span(times: list[float]) -> None:
    names = [f"s{i}" for i in range(len(times) - 1)]
    seg = timeline.segments(times, names)
    assert list(seg) == names
    assert all(v >= 0 for v in seg.values())
    assert sum(seg.values()) == pytest.approx(max(times) - times[0], abs=1e-6)


def test_an_event_stamped_before_the_one_it_follows_counts_as_at_it() -> None:
    # published 1 ms "before" the step's end (millisecond stamps): publish 0, not -0.001
    seg = timeline.segments([10.0, 9.999, 10.5, 12.0], ["publish", "announce", "fetch"])
    assert seg == pytest.approx({"publish": 0.0, "announce": 0.5, "fetch": 1.5})


def test_segments_need_one_name_fewer_than_events() -> None:
    with pytest.raises(ValueError):
        timeline.segments([1.0, 2.0], ["a", "b"])


def records(k: int) -> Records:
    """Four steps 10 s apart; each version published 0.5 s after its step; two generators;
    each step's 2 trajectories released 0.1 s after the publish of step t-1-k."""
    step_end = {s: 10.0 * s for s in range(1, 5)}
    published = {s: (s, 10.0 * s + 0.5) for s in range(1, 5)}
    loads = [
        Load(w, v, 10.0 * v + 0.6 + i * 0.1, 0.2, 0.05, 10.0 * v + 1.0 + i * 0.1)
        for v in range(1, 5)
        for i, w in enumerate(("gen-0", "gen-1"))
    ]
    released, trajs = {}, {}
    for t in range(1, 5):
        base = 10.0 * (t - 1 - k) + 0.6 if t - 1 - k >= 1 else 0.0
        released[t] = base
        for i, w in enumerate(("gen-0", "gen-1")):
            start = base + 0.5 + i
            trajs[f"{t}-{w}"] = Traj(
                t, w, max(0, t - 1 - k), start, start + 0.3, start + 4.0, start + 4.2
            )
    return Records(step_end, published, loads, released, trajs)


@pytest.mark.parametrize("k", [0, 1])
def test_the_step_chain_adds_up_to_the_steps_between_its_trigger_and_its_end(k: int) -> None:
    r = records(k)
    rows = timeline.step_rows(r, k)
    # step t is triggered by step t-1-k: steps 2..4 (k = 0), 3..4 (k = 1)
    assert [row["step"] for row in rows] == list(range(2 + k, 5))
    for row in rows:
        seg = row["segments"]
        assert list(seg) == list(timeline.STEP_SEGMENTS)
        assert all(v >= 0 for v in seg.values())
        t, s = row["step"], row["trigger_step"]
        assert s == t - 1 - k
        assert sum(seg.values()) == pytest.approx(r.step_end[t] - r.step_end[s])
        assert row["span_s"] == pytest.approx(10.0 * (k + 1))
        assert seg["publish"] == pytest.approx(0.5) and seg["release"] == pytest.approx(0.1)
        assert seg["admit"] == pytest.approx(0.5)  # release -> first token
        assert seg["first_chunk"] == pytest.approx(0.3)
        assert seg["generate"] == pytest.approx(1 + 4.0 - 0.3)  # first -> last chunk
        assert seg["ready"] == pytest.approx(0.2)
    if k == 0:  # a barrier mode's chain is its step
        assert all(row["step_s"] == pytest.approx(row["span_s"]) for row in rows)


def test_the_weights_chain_per_version_and_generator() -> None:
    r = records(0)
    rows = timeline.weights_rows(r)
    # version 4 is never generated with (no step 5): its rows have no first token
    assert sorted({(row["version"], row["worker"]) for row in rows}) == [
        (v, w) for v in (1, 2, 3) for w in ("gen-0", "gen-1")
    ]
    for row in rows:
        seg = row["segments"]
        assert list(seg) == list(timeline.WEIGHTS_SEGMENTS)
        assert all(v >= 0 for v in seg.values())
        assert sum(seg.values()) == pytest.approx(row["span_s"])
        assert seg["publish"] == pytest.approx(0.5)
        assert seg["fetch_verify"] == pytest.approx(0.2) and seg["swap"] == pytest.approx(0.05)
        i = int(row["worker"][-1])
        assert seg["announce"] == pytest.approx(0.1 + 0.1 * i)
        assert seg["swap_wait"] == pytest.approx(0.4 - 0.2 - 0.05)


def test_a_step_with_a_trajectory_not_ready_is_left_out() -> None:
    r = records(0)
    r.trajs["3-gen-1"].ready = None
    assert [row["step"] for row in timeline.step_rows(r, 0)] == [2, 4]


def test_summary_quantiles_in_wall_and_simulated_seconds_and_shares_add_to_one() -> None:
    out = timeline.timeline(records(1), 1, 20.0)
    chain = out["step_chain"]
    assert chain["rows"] == 2 and out["k"] == 1 and out["compression"] == 20.0
    assert sum(chain[n]["share"] for n in timeline.STEP_SEGMENTS) == pytest.approx(1.0, abs=1e-3)
    assert chain["publish"]["p50_s"] == pytest.approx(0.5)
    assert chain["publish"]["p50_sim_s"] == pytest.approx(10.0)
    assert chain["span"]["p99_sim_s"] == pytest.approx(400.0)
    assert [s["step"] for s in out["steps"]] == [3, 4]
    w = out["weights_chain"]
    assert w["rows"] == 4 and w["fetch_verify"]["p99_s"] == pytest.approx(0.2)


def test_quantiles_of_nothing_are_empty() -> None:
    assert timeline.quantiles([], 20.0) == {}
    q = timeline.quantiles(np.arange(101.0), 2.0)
    assert q["p50_s"] == 50 and q["p99_s"] == 99 and q["p99_sim_s"] == 198


# -- the weight-sync charge -----------------------------------------------------------------
def test_sync_rates_given_in_gb_per_s() -> None:
    r = synccost.parse_rates("publish=1,fetch=2, verify=0.5,load=4")
    assert r is not None
    assert r.seconds(15.2e9) == pytest.approx(
        {"publish": 15.2, "fetch": 7.6, "verify": 30.4, "load": 3.8}
    )
    part = synccost.parse_rates("load=2")
    assert part is not None and part.seconds(4e9) == {
        "publish": 0.0,
        "fetch": 0.0,
        "verify": 0.0,
        "load": 2.0,
    }
    assert synccost.parse_rates("measure") is None


@pytest.mark.parametrize("spec", ["", "publish=0", "publish=x", "copy=1", "load=1,load=2"])
def test_bad_sync_rates_are_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        synccost.parse_rates(spec)


def test_rates_from_a_weights_bench_row_split_verify_out_of_fetch() -> None:
    row = {"bytes": 1e9, "publish_s": 2.0, "fetch_verify_s": 1.5, "load_s": 0.25}
    r = synccost.rates_from_row(row, verify_rate=1e9, source="test")
    s = r.seconds(1e9)
    assert s["publish"] == pytest.approx(2.0) and s["load"] == pytest.approx(0.25)
    assert s["fetch"] + s["verify"] == pytest.approx(1.5) and s["verify"] == pytest.approx(1.0)
    assert synccost.settings(15.2e9, r)["model_bytes"] == 15_200_000_000
    assert synccost.MODEL_BYTES == 15_200_000_000


@pytest.fixture
def synced(tmp_path: Path) -> Workload:
    hist = tmp_path / "h.csv"
    hist.write_text("# lo,hi,probability\n20,60,0.6\n60,200,0.3\n200,400,0.1\n")
    return Workload(
        lengths=str(hist),
        iterations=3,
        sync_publish_s=4.0,
        sync_fetch_s=2.0,
        sync_verify_s=1.0,
        sync_load_s=0.5,
    )


def test_colocated_is_charged_the_load_only(synced: Workload) -> None:
    assert synced.sync_chain_s("colocated") == 0.5
    assert synced.sync_chain_s("sync") == synced.sync_chain_s("async") == 7.5


@pytest.mark.parametrize("mode", ["colocated", "sync", "stream", "async", "async+skew"])
def test_the_bound_pays_the_sync_of_every_version_generated_with(
    synced: Workload, mode: str
) -> None:
    split = {"instances": 3, "trainer_devices": 3}
    work = [StepWork(s, [100] * 24, 2400) for s in (1, 2, 3)]
    free = Workload(lengths=synced.lengths, iterations=3)
    with_sync = run_bound(synced, mode, split, work)["bound_s"]
    without = run_bound(free, mode, split, work)["bound_s"]
    if mode in ("colocated", "sync", "stream"):  # steps 2 and 3 wait for their version
        assert with_sync == pytest.approx(without + 2 * synced.sync_chain_s(mode), abs=1e-6)
    else:  # k = 1: step 3 waits for version 1's sync at most
        assert without <= with_sync <= without + synced.sync_chain_s(mode) + 1e-6
    it = model_iteration(synced, mode, np.array([100.0] * 12), 3, 3)
    it0 = model_iteration(free, mode, np.array([100.0] * 12), 3, 3)
    assert it["iteration_s"] >= it0["iteration_s"]
