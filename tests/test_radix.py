"""Radix-tree baseline: SGLang's LPM and DFS-weight orderings, and field agreement with the CHT.

The brute-force reference and workload driver live in ``tests/test_cht.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cht import (
    ReferenceIndex,
    check_against_reference,
    run_workload,
    snapshot,
)

from scheduler_runtime import ChunkedHashTree, RadixTree
from scheduler_runtime.prefix_index import (
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    chunk_size=st.integers(1, 8),
    fallback=st.one_of(st.none(), st.integers(0, 6)),
)
def test_radix_and_cht_agree_with_reference(
    data: st.DataObject, chunk_size: int, fallback: int | None
) -> None:
    """All three structures, driven in lockstep, report the reference's fields for their pick.

    They may pick different requests (that is the point of an ordering), never different
    depths or ``w`` for the same request.
    """
    candidates: dict[str, Candidate | None] = {}

    def check(index, ref: ReferenceIndex, cand: Candidate | None) -> None:
        if isinstance(index, ChunkedHashTree):
            candidates["cht"] = cand
            if cand is not None:
                assert cand.request_id == ref.best_cht()
            return
        assert isinstance(index, RadixTree)
        if index.ordering == "lpm":
            if cand is not None:
                assert cand.request_id == ref.best_lpm(fallback)
                for rid in ref.waiting:
                    assert index.match_length(rid) == ref.token_match(rid)
        elif cand is not None:
            assert index.dfs_weight_order()[0] == cand.request_id
            assert sorted(index.dfs_weight_order()) == sorted(ref.waiting)
            # With an empty batch every match ends at the root: insertion order.
            if not ref.active:
                assert cand.request_id == ref.waiting[0]
        # Same request as the CHT's candidate -> identical Candidate.
        other = candidates.get("cht")
        if cand is not None and other is not None and other.request_id == cand.request_id:
            assert cand == other

    indexes = run_workload(
        data,
        chunk_size,
        [
            ChunkedHashTree,
            lambda c: RadixTree("lpm", chunk_size=c, lpm_fcfs_fallback=fallback),
            lambda c: RadixTree("dfs-weight", chunk_size=c),
        ],
        check,
    )
    for index in indexes[1:]:
        assert index.is_empty_tree()


def _tree(ordering: str, active: list[list[int]], waiting: list[list[int]], **kw) -> RadixTree:
    tree = RadixTree(ordering, chunk_size=1, **kw)
    for i, prompt in enumerate(active):
        tree.insert(f"a{i}", prompt)
        tree.activate(f"a{i}")
    for i, prompt in enumerate(waiting, start=1):
        tree.insert(f"x{i}", prompt)
    return tree


# Active A = 1 2 3 4 and B = 1 2 5 6: root -> [1 2] -> {[3 4], [5 6]} (children in that order).
ACTIVE = [[1, 2, 3, 4], [1, 2, 5, 6]]
WAITING = [
    [9, 9],  # x1: no match, ends at the root
    [1, 2, 5, 6, 7],  # x2: matches 4, ends at [5 6]
    [1, 2, 3, 8],  # x3: matches 3, splits [3 4] into [3] -> [4], ends at [3]
    [1, 2, 5, 9],  # x4: matches 3, splits [5 6] into [5] -> [6], ends at [5]
    [1, 2, 5, 6, 8],  # x5: matches 4, ends at [6] (x2's node, now the lower half)
    [1, 2, 3, 7],  # x6: ends at [3]
    [1, 2, 3, 6],  # x7: ends at [3]
    [1, 2, 3, 1],  # x8: ends at [3]
]


def test_lpm_picks_longest_match_earliest_first() -> None:
    tree = _tree("lpm", ACTIVE, WAITING)
    assert [tree.match_length(f"x{i}") for i in range(1, 9)] == [0, 4, 3, 3, 4, 3, 3, 3]
    cand = tree.best_candidate()
    # x2 and x5 both match 4 tokens; x2 was inserted first. Batch shares [1 2] (2 chunks).
    assert cand == Candidate("x2", 2, 2, 6)


def test_lpm_falls_back_to_fcfs_above_threshold() -> None:
    # 8 waiting > 7: FCFS picks x1 although it matches nothing.
    tree = _tree("lpm", ACTIVE, WAITING, lpm_fcfs_fallback=7)
    assert tree.best_candidate() == Candidate("x1", 2, 0, 7)
    # At the threshold (8 waiting, not more) it still matches.
    tree = _tree("lpm", ACTIVE, WAITING, lpm_fcfs_fallback=8)
    assert tree.best_candidate().request_id == "x2"
    tree = _tree("lpm", ACTIVE, WAITING, lpm_fcfs_fallback=None)
    assert tree.best_candidate().request_id == "x2"


def test_dfs_weight_order_follows_sglang() -> None:
    """Worked out by hand from SGLang's DFS-weight code (``_sort_by_dfs_weight`` in
    ``managers/schedule_policy.py``, which calls ``_dfs_weight_order`` in
    ``mem_cache/base_prefix_cache.py``): matching splits nodes, weights count requests per
    subtree, children are visited heaviest first, a node's own requests come after them.

    Last nodes after matching: root {x1}, [3] {x3, x6, x7, x8}, [5] {x4}, [6] {x2, x5}.
    Weights: [6]=2, [5]=3, [4]=0, [3]=4, [1 2]=7, root=8. DFS from the root: [1 2]; its
    children by descending weight: [3] (4) before [5] (3). Under [3]: child [4] holds no
    request, then [3]'s own requests in queue order x3 x6 x7 x8. Under [5]: [6] first (x2 x5),
    then [5]'s own x4. Back at the root: x1.
    """
    tree = _tree("dfs-weight", ACTIVE, WAITING)
    assert tree.dfs_weight_order() == ["x3", "x6", "x7", "x8", "x2", "x5", "x4", "x1"]
    # DFS-weight prefers the heavier subtree over LPM's longer match.
    cand = tree.best_candidate()
    assert cand == Candidate("x3", 2, 2, 6)
    assert _tree("lpm", ACTIVE, WAITING).best_candidate().request_id == "x2"


def test_dfs_weight_ties_keep_children_order() -> None:
    # [3] and [5] subtrees both weigh 1: [3 4] was the root's first child branch.
    tree = _tree("dfs-weight", ACTIVE, [[1, 2, 5, 6, 0], [1, 2, 3, 4, 0], [7]])
    assert tree.dfs_weight_order() == ["x2", "x1", "x3"]


def test_dfs_weight_with_empty_batch_is_fcfs() -> None:
    tree = _tree("dfs-weight", [], [[3, 3, 3], [1], [1, 2]])
    assert tree.dfs_weight_order() == ["x1", "x2", "x3"]
    assert tree.best_candidate() == Candidate("x1", 0, 3, 0)


def test_depths_with_partial_and_identical_prompts() -> None:
    tree = RadixTree("lpm", chunk_size=2)
    cht = ChunkedHashTree(chunk_size=2)
    for index in (tree, cht):
        index.insert("a", [1, 2, 3])  # chunks [1 2] [3]
        index.insert("b", [1, 2, 3])  # identical to a
        index.insert("c", [1, 2, 3, 4])
        index.activate("a")
        assert index.shared_depth == 2
        assert index.best_candidate() == Candidate("b", 2, 2, 0)
        index.activate("b")
        assert index.shared_depth == 2
        # c shares only the full chunk [1 2] with the partial-chunk prompts.
        assert index.best_candidate() == Candidate("c", 2, 1, 0)
        index.activate("c")
        assert index.shared_depth == 1
        index.finish("a")
        index.finish("b")
        assert index.shared_depth == 2
        index.finish("c")
        assert index.shared_depth == 0 and len(index) == 0
    assert tree.is_empty_tree()


@pytest.mark.parametrize("ordering", ["lpm", "dfs-weight"])
def test_radix_errors_leave_state_unchanged(ordering: str) -> None:
    tree = RadixTree(ordering, chunk_size=2)
    tree.insert("a", [1, 2, 3])
    tree.insert("b", [1, 2, 4])
    tree.activate("a")
    before = snapshot(tree)
    with pytest.raises(DuplicateRequestError):
        tree.insert("a", [1])
    with pytest.raises(DuplicateRequestError):
        tree.insert("b", [1])
    for call, rid in [
        (tree.activate, "a"),
        (tree.activate, "zz"),
        (tree.finish, "b"),
        (tree.remove, "zz"),
        (tree.match_length, "a"),
    ]:
        with pytest.raises(UnknownRequestError):
            call(rid)
    with pytest.raises(ValueError):
        tree.insert("c", np.array([], dtype=np.int32))
    assert snapshot(tree) == before
    tree.remove("a")
    tree.remove("b")
    assert tree.is_empty_tree()


def test_radix_validates_arguments() -> None:
    with pytest.raises(ValueError):
        RadixTree("fcfs")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RadixTree("lpm", chunk_size=0)
    with pytest.raises(ValueError):
        RadixTree("lpm", lpm_fcfs_fallback=-1)


def test_check_against_reference_helper_on_fixed_case() -> None:
    """The shared checker itself: a known state must pass for every structure."""
    for index in (ChunkedHashTree(2), RadixTree("lpm", 2), RadixTree("dfs-weight", 2)):
        ref = ReferenceIndex(2)
        for rid, prompt in [("p", [1, 1, 2, 2]), ("q", [1, 1, 3]), ("r", [4])]:
            index.insert(rid, prompt)
            ref.insert(rid, prompt)
        index.activate("p")
        ref.activate("p")
        cand = check_against_reference(index, ref)
        assert cand is not None and cand.depth_before == 2
