"""benchmarks/bench_vllm_spin.py (claim V4): the A/B order and the paired log-ratio interval, on hand values."""

import math

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def b():
    return load_script("benchmarks/bench_vllm_spin.py", "bench_vllm_spin")


def test_pairs_alternate_their_order(b):
    assert b.order(2) == ["spin1", "spin0", "spin0", "spin1"]
    assert b.order(3)[4:] == ["spin1", "spin0"] and b.order(0) == []


def test_log_ratio_interval_on_hand_values(b):
    # ratios 0.5 and 0.5: mean log ratio log 0.5, no spread -> a zero-width interval at 0.5
    assert b.log_ratio_interval([(2.0, 1.0), (4.0, 2.0)]) == pytest.approx((0.5, 0.5, 0.5))
    # ratios 1 and 4: logs 0 and log 4, mean log 2, s = log 4 / sqrt 2, t(0.975, 1) = 12.706
    ratio, lo, hi = b.log_ratio_interval([(1.0, 1.0), (1.0, 4.0)])
    h = 12.7062047 * (math.log(4) / math.sqrt(2)) / math.sqrt(2)
    assert ratio == pytest.approx(2.0) and lo == pytest.approx(math.exp(math.log(2) - h), rel=1e-6)
    assert hi == pytest.approx(math.exp(math.log(2) + h), rel=1e-6)
    assert b.log_ratio_interval([(1.0, 2.0)]) is None


def test_the_report_pairs_runs_in_their_order(b):
    rows = [{"label": "spin1", "generate_s": 10.0, "server_cores": 2.0, "idle_cores": 0.2, "foreign_cores": 0.0},
            {"label": "spin0", "generate_s": 9.0, "server_cores": 1.0, "idle_cores": 0.0, "foreign_cores": 0.01},
            {"label": "spin0", "generate_s": 9.0, "server_cores": 1.0, "idle_cores": 0.0, "foreign_cores": 0.0},
            {"label": "spin1", "generate_s": 10.0, "server_cores": 2.0, "idle_cores": 0.2, "foreign_cores": 0.0}]
    text = b.report(rows)
    assert "| spin1 | 2 | 10.00 | 2.00 | 0.20 | 0.00 |" in text and "| spin0 | 2 | 9.00 | 1.00 | 0.00 | 0.01 |" in text
    assert "generate_s: spin0 / spin1 = 0.900 [0.900, 0.900]" in text
    assert "server_cores: spin0 / spin1 = 0.500 [0.500, 0.500]" in text
