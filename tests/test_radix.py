"""Radix-tree baseline: SGLang's LPM and DFS-weight orderings, and field agreement with the CHT.

The brute-force reference and workload driver live in ``tests/test_cht.py``; this file extends
the reference with SGLang's KV prefix cache (finished requests' tokens stay matchable) and with
a token-trie model of DFS-weight, for both the active-batch tree and the cache tree.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import test_cht
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

# ---------------------------------------------------------------------------- reference


class CacheReference(ReferenceIndex):
    """The brute-force reference plus SGLang's KV prefix cache (no eviction).

    The cache is the set of prompts of the active and of the finished requests; an aborted
    request (``remove``) leaves nothing behind. Matching is a plain longest common prefix.
    """

    def __init__(self, chunk_size: int) -> None:
        super().__init__(chunk_size)
        self.finished: list[tuple[int, ...]] = []

    def finish(self, rid: str) -> None:
        self.finished.append(self.tokens[rid])
        super().finish(rid)

    def active_prompts(self) -> list[tuple[int, ...]]:
        return [self.tokens[a] for a in self.active]

    def cache_prompts(self) -> list[tuple[int, ...]]:
        return self.active_prompts() + self.finished

    def cache_match(self, rid: str) -> int:
        return _lcp_with_any(self.tokens[rid], self.cache_prompts())

    def best_lpm_cached(self, fallback: int | None) -> str:
        """LPM against the cache: longest cached match, earliest inserted among ties."""
        if fallback is not None and len(self.waiting) > fallback:
            return self.waiting[0]
        return max(self.waiting, key=lambda r: (self.cache_match(r), -self.seq[r]))

    def lpm_order(self, fallback: int | None, cache: bool, in_batch: tuple[int, int] | None) -> list[str]:
        """SGLang's LPM order, brute force (``_compute_prefix_matches`` then
        ``_sort_by_longest_prefix``). ``in_batch`` = (check, deprioritize) thresholds, or None
        without the in-batch check. In queue order, a request matching at most ``check`` tokens
        is deprioritized if it shares at least ``deprioritize`` tokens with a request kept
        before it (the temporary waiting-queue tree), else kept; then a stable sort by
        -match, deprioritized requests last."""
        if fallback is not None and len(self.waiting) > fallback:
            return list(self.waiting)
        kept: list[tuple[int, ...]] = []
        keyed: list[tuple[float, str]] = []
        for r in self.waiting:
            m = self.cache_match(r) if cache else self.token_match(r)
            if in_batch is not None and m <= in_batch[0]:
                if _lcp_with_any(self.tokens[r], kept) >= in_batch[1]:
                    keyed.append((float("inf"), r))
                    continue
                kept.append(tuple(self.tokens[r]))
            keyed.append((-m, r))
        return [r for _, r in sorted(keyed, key=lambda x: x[0])]


@contextmanager
def cache_reference() -> Iterator[None]:
    """Make ``run_workload`` drive a :class:`CacheReference` (a superset of the reference)."""
    with mock.patch.object(test_cht, "ReferenceIndex", CacheReference):
        yield


def _lcp_with_any(tokens: Sequence[int], prompts: list[tuple[int, ...]]) -> int:
    best = 0
    for p in prompts:
        i = 0
        while i < min(len(tokens), len(p)) and tokens[i] == p[i]:
            i += 1
        best = max(best, i)
    return best


def _prefixes(prompts: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """Every non-empty prefix: the nodes of the token trie, one per token of a radix tree."""
    return {p[:k] for p in prompts for k in range(1, len(p) + 1)}


class TrieModel:
    """A token trie of what a radix tree holds, with its branches in the radix tree's order.

    A radix node's children dict keeps a branch where it was first added (a split keeps the
    key in place), and a branch that disappears and comes back is appended again; so siblings
    are ordered by when their prefix last came into the tree. ``update`` is called after
    every operation, each of which adds at most one new branch.
    """

    def __init__(self) -> None:
        self.born: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def update(self, prompts: list[tuple[int, ...]]) -> None:
        present = _prefixes(prompts)
        for p in [p for p in self.born if p not in present]:
            del self.born[p]
        for p in sorted(present - self.born.keys(), key=len):
            self.born[p] = self.clock
            self.clock += 1

    def match(self, tokens: Sequence[int]) -> int:
        k = 0
        while k < len(tokens) and tuple(tokens[: k + 1]) in self.born:
            k += 1
        return k

    def dfs_weight_order(self, waiting: list[tuple[int, ...]]) -> list[int]:
        """SGLang's DFS-weight order, on the uncompressed trie.

        A request's last node is the trie node where its match ends; a node weighs the
        requests ending in its subtree; children are visited heaviest first (ties in branch
        order), a node's own requests (queue order) after its children. Compressing chains
        into radix nodes changes nothing: matches split nodes, so no match ends inside one.
        """
        ends = [tuple(w[: self.match(w)]) for w in waiting]
        weight: Counter = Counter()
        for e in ends:
            for k in range(len(e) + 1):
                weight[e[:k]] += 1
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
        for p in sorted(self.born, key=self.born.__getitem__):
            children[p[:-1]].append(p)
        at: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, e in enumerate(ends):
            at[e].append(i)
        order: list[int] = []
        stack: list[tuple[tuple[int, ...], bool]] = [((), False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.extend(at[node])
                continue
            stack.append((node, True))
            kids = sorted(children[node], key=lambda c: -weight[c])
            stack.extend((c, False) for c in reversed(kids))
        return order


@pytest.mark.parametrize("cache", [False, True], ids=["active-batch", "kv-cache"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    chunk_size=st.integers(1, 8),
    fallback=st.one_of(st.none(), st.integers(0, 6)),
    # LPM's in-batch check: off, SGLang's (32, 32) (never triggers on these <= 30-token
    # prompts), or small (check, deprioritize) thresholds so that it does.
    in_batch=st.one_of(st.none(), st.just((32, 32)), st.tuples(st.integers(-1, 6), st.integers(0, 6))),
)
def test_radix_and_cht_agree_with_reference(
    cache: bool,
    data: st.DataObject,
    chunk_size: int,
    fallback: int | None,
    in_batch: tuple[int, int] | None,
) -> None:
    """All three structures, driven in lockstep, report the reference's fields for their pick.

    They may pick different requests (that is the point of an ordering), never different
    depths or ``w`` for the same request. The radix trees hold the active batch's prompts, or
    with ``cache_finished`` the KV cache's (active and finished prompts, not aborted ones):
    their tokens, match lengths, LPM choice and order (with or without the in-batch check)
    and whole DFS-weight order follow that content.
    """
    candidates: dict[str, Candidate | None] = {}
    tries: dict[int, TrieModel] = {}
    last_ref: list[CacheReference] = []

    def check(index, ref: CacheReference, cand: Candidate | None) -> None:
        if isinstance(index, ChunkedHashTree):
            candidates["cht"] = cand
            if cand is not None:
                assert cand.request_id == ref.best_cht()
            return
        assert isinstance(index, RadixTree)
        last_ref[:] = [ref]
        held = ref.cache_prompts() if cache else ref.active_prompts()
        trie = tries.setdefault(id(index), TrieModel())
        trie.update(held)
        assert index.num_tree_tokens == len(trie.born)
        assert index.num_cached_tokens == len(trie.born) - len(_prefixes(ref.active_prompts()))
        for rid in ref.waiting:
            assert index.match_length(rid) == trie.match(ref.tokens[rid])
        if index.ordering == "lpm":
            checked = None if in_batch is None or in_batch[0] < 0 else in_batch
            order = index.lpm_order()
            assert order == ref.lpm_order(fallback, cache, checked)
            if cand is not None:
                assert cand.request_id == order[0]
                plain = ref.best_lpm_cached(fallback) if cache else ref.best_lpm(fallback)
                # Deprioritize >= check threshold (SGLang's): the candidate is plain LPM's.
                if checked is None or checked[1] >= checked[0]:
                    assert cand.request_id == plain
        else:
            order = index.dfs_weight_order()
            expected = trie.dfs_weight_order([ref.tokens[r] for r in ref.waiting])
            assert order == [ref.waiting[i] for i in expected]
            if cand is not None:
                assert cand.request_id == order[0]
            # With an empty tree every match ends at the root: insertion order.
            if not held:
                assert order == ref.waiting
        # Same request as the CHT's candidate -> identical Candidate.
        other = candidates.get("cht")
        if cand is not None and other is not None and other.request_id == cand.request_id:
            assert cand == other

    with cache_reference():
        indexes = run_workload(
            data,
            chunk_size,
            [
                ChunkedHashTree,
                lambda c: RadixTree(
                    "lpm",
                    chunk_size=c,
                    lpm_fcfs_fallback=fallback,
                    cache_finished=cache,
                    lpm_in_batch_check=in_batch is not None,
                    **(
                        {}
                        if in_batch is None
                        else {
                            "in_batch_check_threshold": in_batch[0],
                            "in_batch_deprioritize_threshold": in_batch[1],
                        }
                    ),
                ),
                lambda c: RadixTree("dfs-weight", chunk_size=c, cache_finished=cache),
            ],
            check,
        )
    # Everything finished or aborted: only the finished prompts stay, and only in the cache.
    finished = last_ref[0].finished if cache else []
    for index in indexes[1:]:
        assert index.num_tree_tokens == len(_prefixes(finished))
        assert index.is_empty_tree() == (not finished)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=st.integers(1, 4), budget=st.integers(0, 40))
def test_lru_budget_evicts_only_cached_tokens(data: st.DataObject, chunk_size: int, budget: int) -> None:
    """With ``cache_tokens``: every active token stays, nothing outside the cache appears, an
    activation leaves the tree within budget unless only referenced tokens remain, matches lie
    between the active-batch match and the unbounded cache's, and the fields stay exact."""
    active_before: dict[int, set[str]] = {}

    def check(index, ref: CacheReference, cand: Candidate | None) -> None:
        cached = index.num_cached_tokens
        assert index.num_tree_tokens - cached == len(_prefixes(ref.active_prompts()))
        assert index.num_tree_tokens <= len(_prefixes(ref.cache_prompts()))
        now = set(ref.active)
        if now - active_before.get(id(index), set()):  # this step activated a request
            assert index.num_tree_tokens <= budget or cached == 0
        active_before[id(index)] = now
        for rid in ref.waiting:
            assert ref.token_match(rid) <= index.match_length(rid) <= ref.cache_match(rid)
        if cand is not None and index.ordering == "dfs-weight":
            assert index.dfs_weight_order()[0] == cand.request_id

    def make(ordering: str):
        return lambda c: RadixTree(ordering, c, None, cache_finished=True, cache_tokens=budget)

    with cache_reference():
        run_workload(data, chunk_size, [make("lpm"), make("dfs-weight")], check)


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


# SGLang's in-batch prefix caching check, thresholds 32/32. P: the active (or cached) prompt,
# D and E: documents nobody has run yet.
P = list(range(1000, 1040))  # 40 tokens
D = list(range(100, 150))  # 50 tokens
E = list(range(200, 250))  # 50 tokens
IN_BATCH_WAITING = [
    D + [1],  # x1: match 0 <= 32, checked; the waiting-queue tree is empty: kept, inserted
    D + [2],  # x2: match 0, shares 50 >= 32 with x1: deprioritized
    P[:20] + E,  # x3: match 20, shares 0: kept, inserted
    P + [3],  # x4: match 40 > 32: not checked (neither matched against nor inserted)
    P[:20] + E[:12] + [4],  # x5: match 20, shares exactly 32 with x3: deprioritized (>=)
    P[:20] + E[:11] + [5],  # x6: match 20, shares 31 with x3: kept, inserted
    P + [6],  # x7: match 40, shares 40 with x4, but x4 is not in that tree: not checked anyway
    P[:32] + [7],  # x8: match 32, at the check threshold: checked, shares 31 with x6: kept
    P[:32] + [8],  # x9: match 32, shares 32 with x8: deprioritized
]


@pytest.mark.parametrize("cache", [False, True], ids=["active-batch", "kv-cache"])
def test_lpm_in_batch_check_deprioritizes_shared_short_matches(cache: bool) -> None:
    """Worked out by hand from SGLang's ``_compute_prefix_matches`` and
    ``_sort_by_longest_prefix`` (``managers/schedule_policy.py``): sort keys x1..x9 are
    0, inf, -20, -40, inf, -20, -40, -32, inf; a stable sort puts x4 x7 (40) x8 (32) x3 x6 (20)
    x1 (0) first and the deprioritized x2 x5 x9 last, in queue order. Plain LPM keeps x9 with
    x8, x5 between x3 and x6 and x2 after x1. The candidate is x4 either way: a deprioritized
    request always has an earlier kept one with the same match (module docstring).
    """
    if cache:
        tree = _cache_tree("lpm", [P], [], IN_BATCH_WAITING, lpm_fcfs_fallback=None)
        fields = Candidate("x4", 0, 41, 0)  # relative to the (empty) active batch
    else:
        tree = _tree("lpm", [P], IN_BATCH_WAITING, lpm_fcfs_fallback=None)
        fields = Candidate("x4", 40, 40, 1)  # x7 shares its first 40 tokens
    assert [tree.match_length(f"x{i}") for i in range(1, 10)] == [0, 0, 20, 40, 20, 20, 40, 32, 32]
    checked = ["x4", "x7", "x8", "x3", "x6", "x1", "x2", "x5", "x9"]
    plain = ["x4", "x7", "x8", "x9", "x3", "x5", "x6", "x1", "x2"]
    assert tree.lpm_in_batch_check  # the default, as in SGLang
    assert tree.lpm_order() == checked
    assert tree.best_candidate() == fields
    tree.lpm_in_batch_check = False
    assert tree.lpm_order() == plain
    assert tree.best_candidate() == fields
    # A negative check threshold disables the check (SGLang's -1).
    tree.lpm_in_batch_check = True
    tree.in_batch_check_threshold = -1
    assert tree.lpm_order() == plain
    # Above the FCFS fallback nothing is matched, in-batch check included: queue order.
    tree.in_batch_check_threshold = 32
    tree.lpm_fcfs_fallback = 8
    assert tree.lpm_order() == [f"x{i}" for i in range(1, 10)]
    assert tree.best_candidate().request_id == "x1"
    # Once x4 x7 x8 x3 x6 x1 are admitted, the deprioritized ones match what their kept twins
    # brought into the batch: x2 50 tokens (> 32, not checked), x5 32 (x3's P[:20] + E[:12])
    # and x9 32 (x8's P[:32]), both checked and sharing only 20 tokens: all kept.
    tree.lpm_fcfs_fallback = None
    for rid in ["x4", "x7", "x8", "x3", "x6", "x1"]:
        tree.activate(rid)
    assert [tree.match_length(r) for r in ("x2", "x5", "x9")] == [50, 32, 32]
    assert tree.lpm_order() == ["x2", "x5", "x9"]


def test_lpm_in_batch_check_can_change_the_candidate_below_the_check_threshold() -> None:
    """With SGLang's environment overrides, deprioritize (4) < check (32): x2 matches 20 tokens
    along a1's branch, more than x1's 10 along a0's, but shares 5 >= 4 tokens with x1 (kept
    before it), so it is deprioritized and x1 leads. With 32/32 x2 leads, as in plain LPM."""
    active = [P, P[:5] + list(range(300, 320))]
    waiting = [P[:10] + [1], P[:5] + list(range(300, 315)) + [2]]
    tree = _tree("lpm", active, waiting, in_batch_deprioritize_threshold=4)
    assert [tree.match_length("x1"), tree.match_length("x2")] == [10, 20]
    assert tree.lpm_order() == ["x1", "x2"]
    assert tree.best_candidate().request_id == "x1"
    assert _tree("lpm", active, waiting).best_candidate().request_id == "x2"
    assert _tree("lpm", active, waiting, lpm_in_batch_check=False).lpm_order() == ["x2", "x1"]


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


# ------------------------------------------------------------------ KV cache semantics


def _cache_tree(
    ordering: str,
    finished: list[list[int]],
    active: list[list[int]],
    waiting: list[list[int]],
    **kw,
) -> RadixTree:
    """Finished prompts f0.. (cached), then active a0.., then waiting x1.. (chunk size 1)."""
    tree = RadixTree(ordering, chunk_size=1, cache_finished=True, **kw)
    for i, prompt in enumerate(finished):
        tree.insert(f"f{i}", prompt)
        tree.activate(f"f{i}")
        tree.finish(f"f{i}")
    for i, prompt in enumerate(active):
        tree.insert(f"a{i}", prompt)
        tree.activate(f"a{i}")
    for i, prompt in enumerate(waiting, start=1):
        tree.insert(f"x{i}", prompt)
    return tree


def test_finished_prefix_stays_matchable_only_with_cache() -> None:
    for cache in (False, True):
        tree = RadixTree("lpm", chunk_size=2, cache_finished=cache)
        tree.insert("a", [1, 2, 3, 4, 5])
        tree.activate("a")
        tree.finish("a")
        tree.insert("b", [1, 2, 3, 9])
        assert tree.match_length("b") == (3 if cache else 0)
        assert tree.num_tree_tokens == (5 if cache else 0)
        assert tree.num_cached_tokens == (5 if cache else 0)
        assert tree.num_active == 0 and "a" not in tree and len(tree) == 1
        # The batch is empty, so the fields are those of an empty batch either way.
        assert tree.best_candidate() == Candidate("b", 0, 2, 0)
        tree.activate("b")  # reuses the cached [1 2 3]: only [9] is new
        assert tree.num_tree_tokens == (6 if cache else 4)
        assert tree.num_cached_tokens == (2 if cache else 0)


def test_lpm_picks_longest_cached_match() -> None:
    """Cached A = 1 2 3 4 5 (finished), active B = 7 8 9.

    Against the cache x2 matches 4 tokens, x1 only 2 (in the batch), x3 2: cache-LPM picks x2,
    batch-only LPM picks x1, and so does the CHT (fewest chunks missing from the batch). x2's
    fields are relative to the batch: it shares nothing with B, so depth_after = 0.
    """
    finished = [[1, 2, 3, 4, 5]]
    active = [[7, 8, 9]]
    waiting = [[7, 8, 0], [1, 2, 3, 4, 0], [1, 2, 0]]
    tree = _cache_tree("lpm", finished, active, waiting, lpm_fcfs_fallback=None)
    assert [tree.match_length(f"x{i}") for i in (1, 2, 3)] == [2, 4, 2]
    assert tree.best_candidate() == Candidate("x2", 3, 0, 2)
    batch_only = _tree("lpm", active, waiting, lpm_fcfs_fallback=None)
    assert batch_only.best_candidate() == Candidate("x1", 3, 2, 0)
    cht = ChunkedHashTree(chunk_size=1)
    cht.insert("a0", active[0])
    cht.activate("a0")
    for i, prompt in enumerate(waiting, start=1):
        cht.insert(f"x{i}", prompt)
    assert cht.best_candidate() == Candidate("x1", 3, 2, 0)
    # Above the FCFS threshold the cache does not matter.
    tree = _cache_tree("lpm", finished, active, waiting, lpm_fcfs_fallback=2)
    assert tree.best_candidate() == Candidate("x1", 3, 2, 0)


def test_dfs_weight_weighs_the_cache_tree() -> None:
    """Cached A = 1 2 3 (finished), active B = 5 6; the root's children: [1 2 3], [5 6].

    Matches: x1 ends at [5 6]; x2 and x4 split A to end at [1 2]; x3 ends at [3]. Weights:
    [1 2] = 3 (x2, x4, x3 below), [5 6] = 1. DFS: [1 2]'s child [3] (x3), then [1 2]'s own
    x2 x4, then [5 6]: x1. Batch-only, only x1 matches anything: x1 first, then queue order.
    """
    waiting = [[5, 6, 7], [1, 2, 9], [1, 2, 3, 4], [1, 2, 8]]
    tree = _cache_tree("dfs-weight", [[1, 2, 3]], [[5, 6]], waiting)
    assert tree.dfs_weight_order() == ["x3", "x2", "x4", "x1"]
    assert tree.best_candidate() == Candidate("x3", 2, 0, 3)
    batch_only = _tree("dfs-weight", [[5, 6]], waiting)
    assert batch_only.dfs_weight_order() == ["x1", "x2", "x3", "x4"]
    assert batch_only.best_candidate() == Candidate("x1", 2, 2, 0)


def test_remove_of_active_request_drops_only_what_it_alone_held() -> None:
    tree = _cache_tree("lpm", [[1, 2, 3, 4]], [[7, 8, 1]], [])
    assert tree.num_tree_tokens == 7 and tree.num_cached_tokens == 4
    for rid, prompt in [("b", [1, 2, 3, 9, 9]), ("c", [5, 6]), ("d", [7, 8, 2])]:
        tree.insert(rid, prompt)
        tree.activate(rid)
    assert tree.num_tree_tokens == 7 + 2 + 2 + 1 and tree.num_cached_tokens == 1
    tree.remove("b")  # [9 9] was b's alone; [1 2 3] is cached by f0
    tree.remove("c")  # nothing of [5 6] is cached or held by another request
    tree.remove("d")  # [7 8] stays for a0
    assert tree.num_tree_tokens == 7 and tree.num_cached_tokens == 4
    tree.insert("x", [1, 2, 3, 9])
    tree.insert("y", [5, 6])
    tree.insert("z", [7, 8, 2])
    assert [tree.match_length(r) for r in "xyz"] == [3, 0, 2]
    # A waiting request's abort never touches the cache.
    tree.remove("x")
    assert tree.num_tree_tokens == 7
    # The last active request finishing leaves its tokens cached, and the batch empty.
    tree.finish("a0")
    assert tree.num_cached_tokens == 7 and tree.shared_depth == 0
    # Empty batch, yet LPM still prefers z, whose [7 8] is cached, over the earlier y.
    assert tree.best_candidate() == Candidate("z", 0, 3, 0)


def test_lru_budget_evicts_least_recently_used_leaves() -> None:
    """Budget 6 tokens; cached A = 1 2 3 (finished first) and B = 4 5 6, then D = 7 8 activates.

    Without a match since, A's node is the oldest: it goes and the tree fits (5 tokens). If a
    waiting request matched A's prefix in between (an LPM decision), the match refreshed A's
    nodes (and split A into [1 2] -> [3], both refreshed as in SGLang), so B goes instead.
    """
    for touched in (False, True):
        tree = _cache_tree("lpm", [[1, 2, 3], [4, 5, 6]], [], [], cache_tokens=6)
        assert tree.num_tree_tokens == 6
        tree.insert("c", [1, 2, 9])
        if touched:
            assert tree.best_candidate().request_id == "c"
        tree.insert("d", [7, 8])
        tree.activate("d")
        assert tree.num_tree_tokens == 5 and tree.num_cached_tokens == 3
        tree.insert("e", [4, 5])
        assert tree.match_length("c") == (2 if touched else 0)
        assert tree.match_length("e") == (0 if touched else 2)


def test_lru_budget_never_evicts_referenced_tokens() -> None:
    tree = _cache_tree("dfs-weight", [[1, 2, 3]], [], [], cache_tokens=0)
    # Eviction runs when an activation overflows the budget, not on finish.
    assert tree.num_cached_tokens == 3
    tree.insert("a", [1, 2, 4])
    tree.insert("b", [1, 2, 5])
    tree.activate("a")
    # [1 2] is a's now: only the cached [3] could go, and did.
    assert tree.num_tree_tokens == 3 and tree.num_cached_tokens == 0
    assert tree.best_candidate() == Candidate("b", 3, 2, 0)
    tree.finish("a")
    tree.activate("b")
    assert tree.num_tree_tokens == 3 and tree.num_cached_tokens == 0
    tree.finish("b")
    tree.insert("c", [9])
    tree.activate("c")
    assert tree.num_tree_tokens == 1
    tree.finish("c")
    tree.insert("d", [8])
    tree.activate("d")
    tree.remove("d")
    assert tree.is_empty_tree()


def test_cache_options_are_validated() -> None:
    with pytest.raises(ValueError):
        RadixTree("lpm", cache_tokens=10)  # needs cache_finished
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError):
            RadixTree("lpm", cache_finished=True, cache_tokens=bad)  # type: ignore[arg-type]
    tree = RadixTree("lpm", 16, None, cache_finished=True, cache_tokens=0)
    assert tree.cache_finished and tree.cache_tokens == 0 and tree.lpm_fcfs_fallback is None
    assert not RadixTree("lpm").cache_finished  # the default is unchanged


def test_in_batch_check_options() -> None:
    # batching.py's positional construction: the check is on by default, SGLang's thresholds.
    tree = RadixTree("lpm", 16, 128)
    assert tree.lpm_in_batch_check
    assert (tree.in_batch_check_threshold, tree.in_batch_deprioritize_threshold) == (32, 32)
    assert not RadixTree("lpm", lpm_in_batch_check=False).lpm_in_batch_check
    for bad in (2.5, True, None):
        with pytest.raises(ValueError):
            RadixTree("lpm", in_batch_check_threshold=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            RadixTree("lpm", in_batch_deprioritize_threshold=bad)  # type: ignore[arg-type]
