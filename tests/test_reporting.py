"""The median's distribution-free interval (feather_env.reporting.median_interval): what the benchmarks'
intervals over seeds rest on."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from feather_env.reporting import median_interval


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40),
       st.sampled_from([0.5, 0.8, 0.9, 0.95]))
def test_the_interval_holds_the_median_and_says_its_coverage(values: list[float], level: float) -> None:
    low, high, coverage = median_interval(values, level)
    assert low <= statistics.median(values) <= high
    assert low in values and high in values
    wider = median_interval(values, min(0.99, level + 0.04))
    assert wider[0] <= low and high <= wider[1]  # a higher level never narrows it
    if coverage < level:  # too few values: the whole range
        assert (low, high) == (min(values), max(values))


def test_the_known_order_statistics() -> None:
    assert median_interval(list(range(1, 13)), 0.9) == pytest.approx((3, 10, 1 - 2 * 79 / 4096))
    assert median_interval([1.0, 2.0, 3.0]) == (1.0, 3.0, 0.75)
    assert median_interval([2.0, 1.0, 5.0, 4.0, 3.0]) == (1.0, 5.0, 1 - 2 / 32)
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval([1.0], 1.0)


def test_the_coverage_it_states_is_the_coverage_of_the_true_median() -> None:
    rng = np.random.default_rng(0)
    draws = 4000
    hits = 0
    for _ in range(draws):
        x = rng.lognormal(0.0, 1.0, 12)  # skewed, true median 1
        low, high, coverage = median_interval(list(x), 0.9)
        hits += low <= 1.0 <= high
    assert coverage == pytest.approx(0.961, abs=1e-3)
    assert abs(hits / draws - coverage) < 0.015
