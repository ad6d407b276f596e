"""srl.workload: length histograms, the PTL(BS) model and the instance time model, by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from srl.errors import ConfigError
from srl.workload import (
    PTL,
    LengthHistogram,
    PtlModel,
    WorkloadError,
    finish_times,
    instance_makespan,
    longest_s,
    parse_rows,
    throughput_s,
)

HIST = Path(__file__).parent / "data" / "streamrl_output_length_hist.csv"


# -- histograms -------------------------------------------------------------------------------
def test_histogram_statistics_match_workload_doc() -> None:
    h = LengthHistogram.from_file(HIST)
    # WORKLOAD.md: mean ≈ 4.5K, median ≈ 2.7K, P90 ≈ 12.8K (digitised; ±5 %)
    assert h.mean() == pytest.approx(4500, rel=0.08)
    assert float(h.quantile(0.5)) == pytest.approx(2700, rel=0.08)
    assert float(h.quantile(0.9)) == pytest.approx(12800, rel=0.08)
    x = h.sample(50_000, np.random.default_rng(0))
    top = np.sort(x)[-10_000:]
    assert top.sum() / x.sum() == pytest.approx(0.56, abs=0.04)  # longest 20 % hold ≈ 56 %
    quarter = LengthHistogram.from_file(HIST, scale=0.25)
    assert float(quarter.quantile(0.5)) == pytest.approx(float(h.quantile(0.5)) / 4)
    assert quarter.mean() == pytest.approx(h.mean() / 4)


def test_histogram_draws_stay_in_the_bins_and_scale() -> None:
    h = LengthHistogram.from_file(HIST)
    x = h.sample(20_000, np.random.default_rng(0))
    assert x.min() >= 280 and x.max() <= 20_000
    assert 4_000 < x.mean() < 5_000  # WORKLOAD.md: mean about 4.5K
    quarter = LengthHistogram.from_file(HIST, 0.25).sample(20_000, np.random.default_rng(0))
    assert quarter.mean() == pytest.approx(x.mean() / 4, rel=0.02)


def test_a_draw_is_a_bin_by_probability_then_uniform_inside_it() -> None:
    """The draw the sim engine and the ``sim`` prompt source make, pinned: the same seed gives
    the same workload (benchmark figures depend on it)."""
    h = LengthHistogram.from_bins(np.array([0.0, 10.0]), np.array([10.0, 30.0]), np.array([1, 3]))
    rng = np.random.default_rng(7)
    bins = rng.choice(2, size=50, p=[0.25, 0.75])
    want = np.maximum(1, np.rint(rng.uniform(h.lo[bins], h.hi[bins]))).astype(np.int64)
    assert h.sample(50, np.random.default_rng(7)).tolist() == want.tolist()


def test_zero_width_bins_are_point_masses(tmp_path: Path) -> None:
    p = tmp_path / "h.csv"
    p.write_text("100,100,0.5\n200,300,0.5\n")
    h = LengthHistogram.from_file(p)
    assert float(h.quantile(0.25)) == 100 and float(h.quantile(0.75)) == 250
    assert h.mean() == pytest.approx(175)
    assert np.count_nonzero(h.sample(1000, np.random.default_rng(0)) == 100) > 400


@pytest.mark.parametrize(
    "text, msg",
    [
        ("", "no bins"),
        ("1,2\n", r"h\.csv:2: expected lo,hi,probability, got '1,2'"),
        ("1,2,3,4\n", "expected lo,hi,probability"),
        ("1,x,3\n", "expected lo,hi,probability"),
        ("2,1,0.5\n", "0 <= lo <= hi"),
        ("-1,5,0.5\n", "0 <= lo <= hi"),
        ("0,5,0.5\n4,8,0.5\n", "overlap"),
        ("0,5,0\n", "positive sum"),
        ("0,5,-1\n5,6,2\n", "positive sum"),
    ],
)
def test_bad_histogram_files(tmp_path: Path, text: str, msg: str) -> None:
    p = tmp_path / "h.csv"
    p.write_text("# comment\n" + text)
    with pytest.raises(WorkloadError, match=msg):
        LengthHistogram.from_file(p)


def test_histogram_errors_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        LengthHistogram.from_file(tmp_path / "missing.csv")
    with pytest.raises(ConfigError, match="length scale must be positive"):
        LengthHistogram.from_file(HIST, scale=0)
    assert parse_rows("# lo,hi,p\n\n1,2,0.5\n 3 , 4 , 1 \n", "x").tolist() == [
        [1, 2, 0.5],
        [3, 4, 1],
    ]


# -- PTL(BS) and one instance ----------------------------------------------------------------
def test_ptl_matches_workload_figures() -> None:
    # WORKLOAD.md: 8.3 ms at BS 1 and 36.9 ms at BS 512 (StreamRL Fig. 6), within the fit
    assert PTL(1) == pytest.approx(8.156)
    assert PTL(512) == pytest.approx(36.772)
    assert PTL.describe() == "8.1 + 0.056*BS" and PtlModel(1.0, 2.0)(3) == 7.0


@pytest.mark.parametrize(
    "lengths, cap, want",
    [
        ([3, 5], 1, [3 * PTL(1), 8 * PTL(1)]),  # cap 1: one after another
        ([1, 2], 2, [PTL(2), PTL(2) + PTL(1)]),  # one step with both, one with the survivor
        # refill: [4, 1, 1] cap 2 → step 1 (4,1), step 2 (4,1'), steps 3-4 (4 alone)
        ([4, 1, 1], 2, [2 * PTL(2) + 2 * PTL(1), PTL(2), 2 * PTL(2)]),
        ([0, 2], 2, [PTL(2), PTL(2) + PTL(1)]),  # a sample takes at least one step
        ([], 4, []),
    ],
)
def test_finish_times_by_hand(lengths: list[int], cap: int, want: list[float]) -> None:
    got = finish_times(np.array(lengths, dtype=np.int64), cap)
    assert got.tolist() == pytest.approx([w / 1000 for w in want])
    makespan = instance_makespan(np.array(lengths, dtype=np.int64), cap)
    assert makespan == pytest.approx(max(want, default=0.0) / 1000)


def test_instance_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="cap"):
        finish_times(np.array([1]), 0)


def test_the_bound_terms_by_hand() -> None:
    assert longest_s([3, 9, 4]) == pytest.approx(9 * PTL(1) / 1000)
    assert longest_s(np.array([], dtype=np.int64)) == 0.0
    assert throughput_s(1000, 2, 4) == pytest.approx(1000 * PTL(4) / 8 / 1000)
    steep = PtlModel(1.0, 1.0)
    assert throughput_s(10, 1, 2, steep) == pytest.approx(10 * 3 / 2 / 1000)


@pytest.mark.parametrize("cap", [1, 4, 16])
def test_the_model_is_the_sim_engines(cap: int) -> None:
    """The instance model and the sim engine agree step for step (same PTL, same continuous
    batching, admission by priority = predicted length)."""
    from producers.engines import base, sim

    lengths = np.random.default_rng(cap).integers(1, 300, 100)
    engine = sim.SimEngine(max_batch=cap, time_scale=0.0, seed=0)
    for i, n in enumerate(lengths):
        engine.add(
            base.Request(
                key=str(i),
                prompt_ids=[5],
                max_new_tokens=10_000,
                priority=float(n),
                target_length=int(n),
            )
        )
    while engine.has_work:
        engine.step()
    ours = instance_makespan(np.sort(lengths)[::-1].copy(), cap, PTL)
    assert engine.simulated_ms / 1000 == pytest.approx(ours, rel=1e-9)
