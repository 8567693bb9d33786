"""The policy-lag experiment's comparisons (benchmarks/policy_lag_experiment.py): which cell a cell is compared
with, and the paired statistics, against hand-computed values."""

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "policy_lag_experiment.py"


@pytest.fixture(scope="module")
def exp():
    spec = importlib.util.spec_from_file_location("policy_lag_experiment", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_cells(exp):
    assert exp.reference_cell("warmstart") is None
    assert exp.reference_cell("trl_k1_s3") is None
    assert exp.reference_cell("trl_k8_s2") == "trl_k1_s2"  # the lag effect itself
    assert exp.reference_cell("tis_k8_s2") == "trl_k8_s2"
    assert exp.reference_cell("topp_recompute_k1_s2") == "topp_trl_is_k1_s2"
    assert exp.reference_cell("topp_trl_is_k1_s1") is None
    assert exp.reference_cell("topp_trl_is_k8_s1") == "topp_trl_is_k1_s1"


def test_paired_difference_and_exact_mcnemar_by_hand(exp):
    a = [1, 1, 1, 0, 0, 1, 1, 0]  # a right / b wrong on items 0, 1, 5; b right / a wrong on item 3
    b = [0, 0, 1, 1, 0, 0, 1, 0]
    m, se = exp.paired(a, b)
    d = [1, 1, 0, -1, 0, 1, 0, 0]  # mean 2/8; sample sd of d / sqrt(8)
    mean = sum(d) / 8
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 7)
    assert m == pytest.approx(0.25, abs=1e-12)
    assert se == pytest.approx(sd / math.sqrt(8), rel=1e-12)
    n10, n01, p = exp.mcnemar(a, b)
    assert (n10, n01) == (3, 1)
    assert p == pytest.approx(2 * (1 + 4) / 16, abs=1e-12)  # two-sided binomial(4, 1/2): P(X<=1)+P(X>=3) = 10/16
