"""Chunked Hash Tree: exact agreement with a brute-force reference on random workloads.

The reference (:class:`ReferenceIndex`) recomputes everything from token lists on every call,
following the semantics in ``scheduler_runtime/prefix_index.py`` word by word: key ``k`` of a
prompt is its first ``min((k + 1) * chunk_size, n)`` tokens. ``tests/test_radix.py`` reuses it
and the workload driver defined here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_runtime import cht as cht_module
from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import (
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
)

# ---------------------------------------------------------------------------- reference


class ReferenceIndex:
    """Naive prefix index: plain Python over token tuples, nothing cached."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.tokens: dict[str, tuple[int, ...]] = {}
        self.seq: dict[str, int] = {}
        self.waiting: list[str] = []  # insertion order
        self.active: list[str] = []  # activation order
        self._next_seq = 0

    def keys(self, rid: str) -> list[tuple[int, tuple[int, ...]]]:
        t = self.tokens[rid]
        n = len(t)
        num_keys = -(-n // self.chunk_size)
        return [(k, t[: min((k + 1) * self.chunk_size, n)]) for k in range(num_keys)]

    def insert(self, rid: str, tokens: Sequence[int]) -> None:
        self.tokens[rid] = tuple(tokens)
        self.seq[rid] = self._next_seq
        self._next_seq += 1
        self.waiting.append(rid)

    def activate(self, rid: str) -> None:
        self.waiting.remove(rid)
        self.active.append(rid)

    def finish(self, rid: str) -> None:
        self.active.remove(rid)
        del self.tokens[rid]

    def remove(self, rid: str) -> None:
        (self.active if rid in self.active else self.waiting).remove(rid)
        del self.tokens[rid]

    def working_set(self) -> Counter:
        return Counter(key for a in self.active for key in self.keys(a))

    def missing(self, rid: str) -> int:
        ws = self.working_set()
        return sum(1 for key in self.keys(rid) if ws[key] == 0)

    def shared_depth(self) -> int:
        if not self.active:
            return 0
        all_keys = [self.keys(a) for a in self.active]
        k = 0
        while all(len(ks) > k and ks[k] == all_keys[0][k] for ks in all_keys):
            k += 1
        return k

    def fields(self, rid: str) -> tuple[int, int, int]:
        """(depth_before, depth_after, w) if ``rid`` were the candidate."""
        depth_before = self.shared_depth()
        mine = self.keys(rid)
        if not self.active:
            depth_after = len(mine)
        else:
            ref = self.keys(self.active[0])
            lcp = 0
            while lcp < min(len(mine), len(ref)) and mine[lcp] == ref[lcp]:
                lcp += 1
            depth_after = min(depth_before, lcp)
        w = sum(
            1 for r in self.waiting if r != rid and self.keys(r)[:depth_after] == mine[:depth_after]
        )
        return depth_before, depth_after, w

    def best_cht(self) -> str:
        return min(self.waiting, key=lambda r: (self.missing(r), self.seq[r]))

    def token_match(self, rid: str) -> int:
        """Longest common token prefix with any active prompt (what a radix match returns)."""
        best = 0
        for a in self.active:
            x, y = self.tokens[rid], self.tokens[a]
            i = 0
            while i < min(len(x), len(y)) and x[i] == y[i]:
                i += 1
            best = max(best, i)
        return best

    def best_lpm(self, fallback: int | None) -> str:
        if fallback is not None and len(self.waiting) > fallback:
            return self.waiting[0]
        best, best_len = self.waiting[0], -1
        for r in self.waiting:
            m = self.token_match(r)
            if m > best_len:
                best, best_len = r, m
        return best


# ----------------------------------------------------------------------- workload driver


@st.composite
def prompt_families(draw: st.DrawFn) -> tuple[int, list[list[int]]]:
    """(vocab, group prefixes): few groups, small vocab, so prefixes collide often."""
    vocab = draw(st.integers(2, 4))
    n_groups = draw(st.integers(1, 3))
    prefixes = [
        draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=24)) for _ in range(n_groups)
    ]
    return vocab, prefixes


def draw_prompt(data: st.DataObject, vocab: int, prefixes: list[list[int]]) -> list[int]:
    prefix = data.draw(st.sampled_from(prefixes))
    cut = data.draw(st.integers(0, len(prefix)))
    suffix = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    return (prefix[:cut] + suffix) or [0]


def snapshot(index) -> tuple:
    return (
        index.waiting_ids(),
        index.active_ids(),
        index.num_waiting,
        index.num_active,
        len(index),
        index.shared_depth,
        index.best_candidate(),
    )


def check_against_reference(index, ref: ReferenceIndex) -> Candidate | None:
    """Every observable of ``index`` equals the reference's; returns its candidate."""
    assert index.waiting_ids() == ref.waiting
    assert index.active_ids() == ref.active
    assert index.num_waiting == len(ref.waiting)
    assert index.num_active == len(ref.active)
    assert len(index) == len(ref.waiting) + len(ref.active)
    assert not set(ref.waiting) & set(ref.active)
    for rid in ref.waiting + ref.active:
        assert rid in index
    assert index.shared_depth == ref.shared_depth()
    cand = index.best_candidate()
    if not ref.waiting:
        assert cand is None
        return None
    assert cand is not None
    assert cand.request_id in ref.waiting
    assert (cand.depth_before, cand.depth_after, cand.w) == ref.fields(cand.request_id)
    assert cand.delta == cand.depth_before - cand.depth_after
    return cand


def run_workload(
    data: st.DataObject,
    chunk_size: int,
    make: Sequence[Callable[[int], object]],
    check_one: Callable[[object, ReferenceIndex, Candidate | None], None],
    max_ops: int = 40,
) -> list[object]:
    """Drive the indexes built by ``make`` and a reference through the same random operations.

    ``check_one(index, ref, candidate)`` adds index-specific checks after every operation.
    Which request "activate best" takes is drawn among the indexes' candidates, so all of them
    stay in the same state even when their orderings differ.
    """
    vocab, prefixes = data.draw(prompt_families())
    indexes = [m(chunk_size) for m in make]
    ref = ReferenceIndex(chunk_size)
    next_id = 0
    n_ops = data.draw(st.integers(1, max_ops))
    ops = ["insert", "insert", "activate_best", "activate_best", "activate_any", "finish"]
    ops += ["remove", "error"]
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(ops))
        if op == "insert" or (not ref.waiting and op.startswith("activate")):
            rid = f"r{next_id}"
            next_id += 1
            prompt = draw_prompt(data, vocab, prefixes)
            for index in indexes:
                index.insert(rid, np.array(prompt))
            ref.insert(rid, prompt)
        elif op == "activate_best":
            cands = [index.best_candidate() for index in indexes]
            rid = data.draw(st.sampled_from([c.request_id for c in cands]))
            for index in indexes:
                index.activate(rid)
            ref.activate(rid)
        elif op == "activate_any":
            rid = data.draw(st.sampled_from(ref.waiting))
            for index in indexes:
                index.activate(rid)
            ref.activate(rid)
        elif op == "finish" and ref.active:
            rid = data.draw(st.sampled_from(ref.active))
            for index in indexes:
                index.finish(rid)
            ref.finish(rid)
        elif op == "remove" and (ref.waiting or ref.active):
            rid = data.draw(st.sampled_from(ref.waiting + ref.active))
            for index in indexes:
                index.remove(rid)
            ref.remove(rid)
        elif op == "error":
            for index in indexes:
                check_error_leaves_state(data, index, ref)
        for index in indexes:
            cand = check_against_reference(index, ref)
            check_one(index, ref, cand)
    # Drain everything, in a random order: no request may be lost or left behind.
    while ref.waiting or ref.active:
        rid = data.draw(st.sampled_from(ref.waiting + ref.active))
        how = "finish" if rid in ref.active and data.draw(st.booleans()) else "remove"
        for index in indexes:
            getattr(index, how)(rid)
        getattr(ref, how)(rid)
        for index in indexes:
            check_one(index, ref, check_against_reference(index, ref))
    for index in indexes:
        assert len(index) == 0 and index.best_candidate() is None
    return indexes


def check_error_leaves_state(data: st.DataObject, index, ref: ReferenceIndex) -> None:
    """A rejected call raises the documented error and changes nothing."""
    before = snapshot(index)
    kind = data.draw(st.sampled_from(["dup", "activate", "finish", "remove", "empty"]))
    if kind == "dup" and (ref.waiting or ref.active):
        with pytest.raises(DuplicateRequestError):
            index.insert(data.draw(st.sampled_from(ref.waiting + ref.active)), np.array([1, 2]))
    elif kind == "activate":
        bad = data.draw(st.sampled_from(ref.active + ["nope"]))
        with pytest.raises(UnknownRequestError):
            index.activate(bad)
    elif kind == "finish":
        bad = data.draw(st.sampled_from(ref.waiting + ["nope"]))
        with pytest.raises(UnknownRequestError):
            index.finish(bad)
    elif kind == "remove":
        with pytest.raises(UnknownRequestError):
            index.remove("nope")
    else:
        with pytest.raises(ValueError):
            index.insert("fresh-id", np.array([], dtype=np.int64))
        assert "fresh-id" not in index
    assert snapshot(index) == before


# --------------------------------------------------------------------------- properties


def _check_cht(index: ChunkedHashTree, ref: ReferenceIndex, cand: Candidate | None) -> None:
    index.check_consistency()
    for rid in ref.waiting:
        assert index.missing_count(rid) == ref.missing(rid)
    for rid in ref.active:
        assert index.missing_count(rid) == 0
    if cand is not None:
        assert cand.request_id == ref.best_cht()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=st.integers(1, 8), force_bsearch=st.booleans())
def test_cht_matches_reference(data: st.DataObject, chunk_size: int, force_bsearch: bool) -> None:
    # force_bsearch exercises the vectorized binary search that large groups take.
    limit = 0 if force_bsearch else cht_module._DENSE_GATHER_LIMIT
    with mock.patch.object(cht_module, "_DENSE_GATHER_LIMIT", limit):
        (index,) = run_workload(data, chunk_size, [ChunkedHashTree], _check_cht)
    assert index.num_keys == 0
    index.check_consistency()


def test_large_group_uses_exact_counts() -> None:
    """A group big enough for the binary-search path still gets exact missing counts."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 5, 120).tolist()
    index, ref = ChunkedHashTree(2), ReferenceIndex(2)
    for i in range(200):
        cut = int(rng.integers(0, 120))
        prompt = base[:cut] + rng.integers(0, 5, int(rng.integers(1, 10))).tolist()
        index.insert(f"r{i}", prompt)
        ref.insert(f"r{i}", prompt)
    for rid in ["r0", "r7", "r3"]:
        index.activate(rid)
        ref.activate(rid)
        index.check_consistency()
        for r in ref.waiting[::7]:
            assert index.missing_count(r) == ref.missing(r)
    index.finish("r7")
    ref.finish("r7")
    for r in ref.waiting[::7]:
        assert index.missing_count(r) == ref.missing(r)
    index.check_consistency()


# ---------------------------------------------------------------------- unit behaviour


def test_hash_vector_is_cumulative_per_chunk() -> None:
    index = ChunkedHashTree(chunk_size=4)
    index.insert("a", list(range(10)))  # chunks [0..3] [4..7] [8,9]
    index.insert("b", list(range(8)) + [7, 7])  # same first two chunks
    index.insert("c", list(range(8)))  # a prefix of a: two full chunks
    index.insert("d", list(range(10)))  # identical to a
    ha, hb, hc, hd = (index.hash_vector(r) for r in "abcd")
    assert len(ha) == 3 and len(hc) == 2
    assert ha.dtype == np.uint64
    assert list(ha[:2]) == list(hb[:2]) and ha[2] != hb[2]
    assert list(ha[:2]) == list(hc)
    assert list(ha) == list(hd)
    # A trailing partial chunk is its own key: 9 tokens do not share chunk 3 with 10.
    index.insert("e", list(range(9)))
    assert index.hash_vector("e")[2] != ha[2]


def test_empty_batch_picks_shortest_prompt_then_insertion_order() -> None:
    index = ChunkedHashTree(chunk_size=2)
    index.insert("long", [1] * 9)
    index.insert("short", [2] * 3)
    index.insert("short2", [3] * 4)  # same number of chunks as "short", inserted later
    cand = index.best_candidate()
    assert cand == Candidate("short", 0, 2, 0)
    assert cand.delta == -2


def test_candidate_after_activation() -> None:
    index = ChunkedHashTree(chunk_size=2)
    doc = [5, 6, 7, 8, 9, 10]
    index.insert("q1", doc + [1, 1])
    index.insert("q2", doc + [2, 2])
    index.insert("q3", doc + [3])
    index.insert("other", [9, 9, 9])
    index.activate("q1")
    assert index.shared_depth == 4
    # q2 misses only its last chunk; it keeps the 3 document chunks; q3 shares them too.
    assert index.missing_count("q2") == 1 and index.missing_count("q3") == 1
    assert index.best_candidate() == Candidate("q2", 4, 3, 1)
    index.activate("q2")
    assert index.shared_depth == 3
    index.finish("q1")
    assert index.shared_depth == 4 and index.missing_count("q3") == 1
    index.remove("q2")
    assert index.shared_depth == 0 and index.missing_count("q3") == 4
    index.remove("q3")
    index.remove("other")
    assert index.num_keys == 0


def test_insert_hashed_is_insert() -> None:
    """Inserting precomputed hashes (the environment's per-episode path) builds the same tree."""
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 50, 40).tolist()
    prompts = {f"r{i}": doc[: rng.integers(5, 40)] + rng.integers(0, 50, 6).tolist() for i in range(12)}
    by_tokens, by_hashes = ChunkedHashTree(chunk_size=4), ChunkedHashTree(chunk_size=4)
    for rid, prompt in prompts.items():
        by_tokens.insert(rid, prompt)
        by_hashes.insert_hashed(rid, by_hashes.hash_prompt(prompt))
    for _ in range(6):
        a, b = by_tokens.best_candidate(), by_hashes.best_candidate()
        assert a == b
        by_tokens.activate(a.request_id)
        by_hashes.activate(b.request_id)
    assert snapshot(by_tokens) == snapshot(by_hashes)
    by_hashes.check_consistency()


def test_errors_leave_state_unchanged() -> None:
    index = ChunkedHashTree(chunk_size=3)
    index.insert("a", [1, 2, 3, 4])
    index.insert("b", [1, 2, 3, 5])
    index.activate("a")
    before = snapshot(index)
    with pytest.raises(DuplicateRequestError):
        index.insert("a", [7])
    with pytest.raises(DuplicateRequestError):
        index.insert("b", [7])
    for call, rid in [
        (index.activate, "a"),
        (index.activate, "zz"),
        (index.finish, "b"),
        (index.finish, "zz"),
        (index.remove, "zz"),
        (index.missing_count, "zz"),
        (index.hash_vector, "zz"),
    ]:
        with pytest.raises(UnknownRequestError):
            call(rid)
    for bad in ([], [[1, 2]], [1.5, 2.0], [-1, 3], [2**31]):
        with pytest.raises(ValueError):
            index.insert("c", np.array(bad))
    for bad_hashes in (np.array([], np.uint64), np.array([1, 2]), [1, 2], np.ones((1, 2), np.uint64)):
        with pytest.raises(ValueError, match="hash_prompt"):
            index.insert_hashed("c", bad_hashes)
    with pytest.raises(DuplicateRequestError):
        index.insert_hashed("b", index.hash_prompt([7]))
    assert snapshot(index) == before
    assert "c" not in index
    index.check_consistency()
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(DuplicateRequestError, ValueError)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_chunk_size_is_validated(chunk_size) -> None:
    with pytest.raises(ValueError):
        ChunkedHashTree(chunk_size=chunk_size)


def test_reinsert_after_finish_and_slot_reuse() -> None:
    index = ChunkedHashTree(chunk_size=2)
    for round_ in range(3):
        for i in range(5):
            index.insert(f"r{i}", [1, 2, 3, 4, round_, i])
        while index.num_waiting:
            index.activate(index.best_candidate().request_id)
        for rid in index.active_ids():
            index.finish(rid)
        index.check_consistency()
        assert index.num_keys == 0


def test_a_32k_prompt_is_one_key_per_chunk_and_shared_in_full() -> None:
    """A 32K-token prompt at the default chunk size: 64 keys, shared whole by an equal prompt.

    (Its insert cost, docs/design.md's <= 2 ms target, is measured by benchmarks/cht_overhead.py.)
    """
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 8192, 32 * 1024)
    index = ChunkedHashTree()
    for i in range(3):
        index.insert(f"r{i}", prompt)
    assert index.num_keys == 32 * 1024 // index.chunk_size == 64
    index.activate("r0")
    cand = index.best_candidate()
    assert cand.depth_before == cand.depth_after == 64 and cand.w == 1  # r2, the other waiting one
    assert index.missing_count(cand.request_id) == 0
    index.check_consistency()
