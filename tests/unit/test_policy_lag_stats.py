"""benchmarks/policy_lag_stats.py (issue 47's statistics) against hand values: Student-t intervals checked with the
closed-form t distributions of 1 and 2 degrees of freedom (independent of scipy), curve areas and frontier
interpolation by hand."""

import math

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def st():
    return load_script("benchmarks/policy_lag_stats.py")


def test_t_interval_three_values_matches_the_closed_form_t2(st):
    # df = 2: quantile t_q = (2q - 1) / sqrt(2 q (1 - q)); two-sided p = 1 - t / sqrt(2 + t^2)
    xs = [0.02, 0.04, 0.09]  # mean 0.05, deviations -0.03, -0.01, +0.04: variance 0.0026 / 2
    se = math.sqrt(0.0013) / math.sqrt(3)
    q = 0.975
    half = (2 * q - 1) / math.sqrt(2 * q * (1 - q)) * se  # 4.302653 * se
    t = 0.05 / se
    iv = st.t_interval(xs)
    assert (iv.n, iv.df) == (3, 2)
    assert iv.mean == pytest.approx(0.05, abs=1e-15)
    assert (iv.lo, iv.hi) == (pytest.approx(0.05 - half, rel=1e-9), pytest.approx(0.05 + half, rel=1e-9))
    assert iv.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)  # 0.1383
    assert st.fmt_interval(iv, p=True) == "+5.0 [-4.0, +14.0], p 0.14"


def test_t_interval_two_values_matches_the_cauchy_t1(st):
    # df = 1 is the Cauchy distribution: t_q = tan(pi (q - 1/2)); two-sided p = 1 - 2 atan(|t|) / pi
    iv = st.t_interval([0.25, 0.375])  # mean 0.3125, sd 0.0883883, se 0.0625
    half = math.tan(math.pi * 0.475) * 0.0625  # 12.7062 * 0.0625 = 0.794
    assert (iv.n, iv.df) == (2, 1)
    assert (iv.lo, iv.hi) == (pytest.approx(0.3125 - half, rel=1e-9), pytest.approx(0.3125 + half, rel=1e-9))
    assert iv.p == pytest.approx(1 - 2 * math.atan(5.0) / math.pi, rel=1e-9)  # t = 5: p 0.1257
    assert st.fmt_interval(iv, p=True) == "+31.2 [-48.2, +110.7], p 0.13"


def test_t_interval_edges(st):
    one = st.t_interval([0.2])
    assert (one.mean, one.n, one.df) == (0.2, 1, 0) and math.isnan(one.lo) and math.isnan(one.p)
    assert st.fmt_interval(one) == "+20.0 (n = 1: no interval)"
    zero = st.t_interval([0.0, 0.0, 0.0])
    assert (zero.lo, zero.hi, zero.p) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="at least one finite value"):
        st.t_interval([])
    with pytest.raises(ValueError, match="at least one finite value"):
        st.t_interval([0.1, float("nan")])
    with pytest.raises(ValueError, match=r"level must lie in \(0, 1\)"):
        st.t_interval([0.1, 0.2], level=95)


def test_paired_items_is_the_t_interval_of_the_item_differences(st):
    a, b = [1, 1, 0, 1], [0, 1, 0, 0]  # differences 1, 0, 0, 1: mean 0.5, sd sqrt(1/3), se sqrt(1/12)
    iv = st.paired_items(a, b)
    assert (iv.mean, iv.n, iv.df) == (0.5, 4, 3)
    assert iv.hi - iv.mean == pytest.approx(3.182446305284263 * math.sqrt(1 / 12), rel=1e-9)  # t(0.975, 3), table
    with pytest.raises(ValueError, match="equal lengths"):
        st.paired_items([1, 0], [1])


def test_item_curve_areas_by_hand(st):
    # two items checked at steps 0, 8, 16 and (the final evaluation) 32
    points = [(0, [1, 0]), (8, [1, 1]), (16, [0, 1]), (32, [0, 0])]
    # item 0: (8 * 1 + 8 * 0.5 + 16 * 0) / 32 = 0.375; item 1: (8 * 0.5 + 8 * 1 + 16 * 0.5) / 32 = 0.625
    assert st.item_curve_areas(points) == [0.375, 0.625]
    assert st.curve_area([(0, 0.5), (8, 1.0), (16, 0.5), (32, 0.0)]) == 0.5  # the items' mean curve, same area
    with pytest.raises(ValueError, match="strictly increasing"):
        st.item_curve_areas([(0, [1]), (0, [1])])
    with pytest.raises(ValueError, match="strictly increasing"):
        st.curve_area([(0, 0.5)])


def test_curve_checks_appends_the_final_evaluation_on_the_check_items(st):
    curve = [{"step": 8, "scores": [0, 1]}, {"step": 0, "scores": [1, 1]}]  # out of order in the file
    assert st.curve_checks(curve, [1, 0, 1, 1], 16) == [(0, [1, 1]), (8, [0, 1]), (16, [1, 0])]
    with pytest.raises(ValueError, match="no step-0 check"):
        st.curve_checks([{"step": 8, "scores": [1]}], [1], 16)
    with pytest.raises(ValueError, match="different sizes"):
        st.curve_checks([{"step": 0, "scores": [1, 1]}, {"step": 8, "scores": [1]}], [1, 1], 16)
    with pytest.raises(ValueError, match="not before the last step"):
        st.curve_checks([{"step": 0, "scores": [1]}, {"step": 16, "scores": [1]}], [1], 16)


def test_end_kl_averages_the_last_logged_steps(st):
    steps = [{"step": 1, "k": 0.1}, {"step": 2, "k": 0.2}, {"step": 3, "k": 0.3}, {"step": 4, "k": 0.4},
             {"step": 5, "k": 0.8}, {"step": 6}, {"step": 7, "k": float("nan")}]  # 6-7: nothing kept, no KL
    mean, used = st.end_kl(steps, "k", last=4)
    assert used == [2, 3, 4, 5] and mean == pytest.approx(0.425)
    assert st.end_kl(steps, "other") == (pytest.approx(float("nan"), nan_ok=True), [])


def test_frontier_interpolates_linearly_and_never_extrapolates(st):
    pts = [(2.0, 0.3), (0.0, 0.4), (1.0, 0.2), (1.0, 0.1)]  # two points at KL 1: their mean 0.15
    assert st.frontier_at(pts, 0.5) == pytest.approx(0.275)
    assert st.frontier_at(pts, 1.5) == pytest.approx(0.225)
    assert st.frontier_at(pts, 0.0) == pytest.approx(0.4) and st.frontier_at(pts, 2.0) == pytest.approx(0.3)
    assert st.frontier_at(pts, 2.5) is None and st.frontier_at(pts, -0.1) is None
    assert st.frontier_at([(0.0, 0.4)], 0.0) == 0.4 and st.frontier_at([(0.0, 0.4)], 0.3) is None
    with pytest.raises(ValueError, match="at least one point"):
        st.frontier_at([], 0.1)
