"""Ranking metrics and quantile mapping (the histograms themselves: test_workload.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ranker.metrics import ranking_report, recall_at, spearman
from ranker.workload import quantile_map, ranks01
from srl.workload import LengthHistogram

HIST = Path(__file__).parent / "data" / "streamrl_output_length_hist.csv"


def test_recall_perfect_reversed_and_by_hand() -> None:
    true = np.arange(100, dtype=float)
    assert recall_at(true, true, 0.2) == 1.0
    assert recall_at(true, -true, 0.2) == 0.0
    pred = true.copy()
    pred[99], pred[0] = pred[0], pred[99]  # the longest is now predicted shortest
    assert recall_at(true, pred, 0.2) == pytest.approx(19 / 20)
    assert recall_at(true, pred, 0.05) == pytest.approx(4 / 5)


def test_recall_breaks_ties_against_the_ranker() -> None:
    true = np.arange(50, dtype=float)
    assert recall_at(true, np.zeros(50), 0.2) == pytest.approx(0.2)


def test_spearman() -> None:
    x = np.array([1.0, 2, 3, 4, 5])
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(x, np.array([2.0, 1, 4, 3, 5])) == pytest.approx(0.8)
    assert spearman(x, np.ones(5)) == 0.0


def test_ranking_report_keys() -> None:
    r = ranking_report(np.arange(40.0), np.arange(40.0))
    assert set(r) == {"recall_at_20", "recall_at_10", "recall_at_5", "spearman", "n"}
    assert r["n"] == 40


def test_quantile_map_keeps_order_and_takes_the_histogram_shape() -> None:
    h = LengthHistogram.from_file(HIST)
    rng = np.random.default_rng(1)
    demo = rng.integers(1, 300, 5000).astype(float)  # e.g. demo-task lengths, other scale
    mapped = quantile_map(demo, h)
    assert spearman(demo, mapped) == pytest.approx(1.0, abs=1e-6)
    assert np.median(mapped) == pytest.approx(float(h.quantile(0.5)), rel=0.05)
    # ties share one rank
    r = ranks01(np.array([5.0, 1, 5, 3]))
    assert r[0] == r[2]


def test_recall_with_tied_true_lengths() -> None:
    true = np.array([10, 5, 5, 5, 5, 1, 1, 1, 1, 1], dtype=float)  # top 20 %: 10 and one 5
    assert recall_at(true, true, 0.2) == 1.0  # any 5 completes the true top set
    assert recall_at(true, true + np.arange(10) * 1e-3, 0.2) == 1.0
    # the ranker ranks a 1 above the 10: half of its top is wrong
    pred = np.array([0, 5, 5, 5, 5, 9, 1, 1, 1, 1], dtype=float)
    assert recall_at(true, pred, 0.2) == pytest.approx(0.5)
    assert recall_at(true, np.zeros(10), 0.2) == pytest.approx((0.2 * 1 + min(0.8, 1)) / 2)
