"""benchmarks/prefix_homogeneity.py's batch orders: each is a permutation with the promised layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.prefix_homogeneity import ORDERS, arrange, grouped_requests
from feather_env.workloads.request import Request


def _requests(sizes: list[int]) -> list[Request]:
    out = []
    for g, n in enumerate(sizes):
        out += [Request(f"g{g}-{i}", np.array([g + 3, i + 3], dtype=np.int32), g, 4) for i in range(n)]
    return out


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8), seed=st.integers(0, 1000),
       order=st.sampled_from(ORDERS))
def test_every_order_is_a_permutation(sizes: list[int], seed: int, order: str) -> None:
    reqs = _requests(sizes)
    out = arrange(list(np.random.default_rng(seed).permutation(reqs)), order, seed=seed)
    assert sorted(r.request_id for r in out) == sorted(r.request_id for r in reqs)


@settings(max_examples=200, deadline=None)
@given(groups=st.integers(2, 8), per_group=st.integers(1, 9))
def test_round_robin_never_puts_two_of_a_group_side_by_side(groups: int, per_group: int) -> None:
    out = arrange(_requests([per_group] * groups), "round-robin")
    assert all(a.prefix_group != b.prefix_group for a, b in zip(out, out[1:], strict=False))
    # and keeps each group's requests in their order
    for g in range(groups):
        assert [r.request_id for r in out if r.prefix_group == g] == [f"g{g}-{i}" for i in range(per_group)]


def test_sorted_is_grouped_and_random_is_seeded() -> None:
    reqs = grouped_requests(4, 5, prefix_len=8, suffix_len=2, output_len=4, seed=0)
    groups = [r.prefix_group for r in arrange(reqs, "sorted")]
    assert groups == sorted(groups)
    assert arrange(reqs, "random", seed=3) == arrange(reqs, "random", seed=3)
    assert arrange(reqs, "random", seed=3) != arrange(reqs, "random", seed=4)
    with pytest.raises(ValueError, match="unknown order"):
        arrange(reqs, "by-length")
