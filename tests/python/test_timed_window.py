"""bench/timed_window.py: the figures every benchmark reports for its timed window, against values
worked out by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timed_window import window_figures  # noqa: E402


def test_a_window_with_one_slow_iteration():
    times = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    f = window_figures(times, tokens_per_iteration=4096)
    assert f["iter_s_median"] == 1.0 and f["iter_s_max"] == 3.0
    assert f["iter_s_p90"] == 1.0  # nearest rank: the 9th of 10
    assert f["iter_s_mean"] == pytest.approx(1.2) and f["mean_over_median"] == pytest.approx(1.2)
    assert f["window_s"] == pytest.approx(12.0) and f["window_iterations"] == 10
    assert f["wall_tokens_per_s"] == pytest.approx(4096 * 10 / 12.0)  # not 4096 / median


def test_p90_by_nearest_rank_and_no_tokens():
    f = window_figures([0.5, 2.0, 1.0, 4.0, 3.0])  # sorted: 0.5 1 2 3 4; ceil(4.5) = 5th
    assert f["iter_s_p90"] == 4.0 and f["iter_s_median"] == 2.0 and f["p90_over_median"] == 2.0
    assert "wall_tokens_per_s" not in f
    assert window_figures([]) == {}
