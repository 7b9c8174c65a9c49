"""The field's routers (scheduler_runtime/router.py): SGLang's cache_aware, Ray Serve's prefix affinity,
LMetric and Dynamo's KV router on hand-made situations, their shared state (the per-replica prefix
history, the request ledger), ours with token loads, and properties over random runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_runtime.router import (
    PEERS,
    ROUTERS,
    DynamoKvRouter,
    LMetricRouter,
    PrefixAffinityRouter,
    PrefixHasher,
    PrefixHistory,
    RayPrefixAffinityRouter,
    RequestLedger,
    SGLangCacheAwareRouter,
    make_router,
)

CHUNK = 8
HASHER = PrefixHasher(CHUNK)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RNG = np.random.default_rng(7)
DOC = RNG.integers(3, 500, 4 * CHUNK)  # a 4-chunk document
OTHER = RNG.integers(3, 500, 4 * CHUNK)


def h(tokens) -> np.ndarray:
    return HASHER.hash(np.asarray(tokens))


def with_question(doc, n_chunks: int, question=(7, 8, 9)) -> np.ndarray:
    """The first ``n_chunks`` chunks of ``doc`` and a question (a partial chunk)."""
    return np.concatenate([doc[: n_chunks * CHUNK], np.array(question)])


# ------------------------------------------------------------------------------ shared state


def test_history_matches_whole_chunks_per_replica_and_sizes_trees():
    hist = PrefixHistory(CHUNK)
    hist.insert(h(DOC), "a")  # 4 chunks
    hist.insert(h(DOC[: 2 * CHUNK]), "b")  # the first 2
    assert hist.match(h(with_question(DOC, 4))) == {"a": 4, "b": 2}
    assert hist.match(h(with_question(DOC, 1))) == {"a": 1, "b": 1}
    assert hist.match(h(OTHER)) == {}
    assert hist.size == {"a": 4 * CHUNK, "b": 2 * CHUNK}
    hist.insert(h(DOC[:CHUNK + 3]), "c", tokens=CHUNK + 3)  # a partial last chunk counts its tokens
    assert hist.size["c"] == CHUNK + 3
    hist.forget("a")
    assert hist.match(h(DOC)) == {"b": 2, "c": 1}


def test_history_evicts_least_recent_deepest_first():
    hist = PrefixHistory(CHUNK, max_tokens=5 * CHUNK)
    hist.insert(h(DOC), "a")  # 4 chunks
    hist.insert(h(OTHER[:2 * CHUNK]), "a")  # 2 more: 6 > 5, the oldest leaf goes (DOC's 4th chunk)
    assert hist.size["a"] == 5 * CHUNK
    assert hist.match(h(DOC)) == {"a": 3}
    assert hist.match(h(OTHER)) == {"a": 2}


@SETTINGS
@given(ops=st.lists(st.tuples(st.sampled_from("insert forget limit".split()), st.sampled_from("abc"),
                              st.integers(0, 3), st.integers(1, 4), st.integers(1, 12)), max_size=40))
def test_history_without_holders_keeps_the_same_sizes_and_depths(ops):
    """``holders=False`` (the learned router's counting LRUs) evicts as the full history does, and one
    replica's ``depth`` is its ``match``; ``match`` itself is refused there."""
    docs = [RNG.integers(3, 500, 4 * CHUNK) for _ in range(2)] + [DOC, OTHER]
    full, lean = PrefixHistory(CHUNK, max_tokens=9 * CHUNK), PrefixHistory(CHUNK, 9 * CHUNK, holders=False)
    for op, replica, d, n_chunks, limit in ops:
        for hist in (full, lean):
            if op == "insert":
                hist.insert(h(docs[d][: n_chunks * CHUNK]), replica)
            elif op == "forget":
                hist.forget(replica)
            else:
                hist.set_limit(replica, limit * CHUNK)
        assert +full.size == +lean.size
        for doc in docs:
            held = full.match(h(doc))
            assert {r: lean.depth(h(doc), r) for r in "abc"} == {r: held.get(r, 0) for r in "abc"}
    assert not lean.holders
    with pytest.raises(RuntimeError, match="holders"):
        lean.match(h(DOC))


def test_ledger_keeps_prefill_and_kv_tokens_until_the_request_is_done():
    ledger = RequestLedger()
    keys = h(DOC).tolist()
    ledger.add("q1", "a", 32, keys, [CHUNK] * 4)
    ledger.add("q2", "a", 8, keys, [CHUNK] * 4)  # the same document: its KV counted once
    assert (ledger.pending["a"], ledger.kv["a"]) == (40, 32)
    ledger.prefilled("q1")
    ledger.prefilled("q1")  # twice is once
    assert (ledger.pending["a"], ledger.kv["a"], ledger.load("a")) == (8, 32, 40)
    ledger.finished("q1")
    assert ledger.kv["a"] == 32  # q2 still holds the document
    assert ledger.active_overlap(keys[:2], [CHUNK, CHUNK]) == {"a": 16}
    ledger.finished("q2")  # never prefilled: its pending tokens go with it
    assert ledger.pending["a"] == 0 and ledger.kv["a"] == 0
    ledger.finished("unknown")
    ledger.add("q3", "a", 32, keys, [CHUNK] * 4)
    ledger.add("q3", "b", 32, keys, [CHUNK] * 4)  # routed again (a retry): only the second counts
    assert (ledger.load("a"), ledger.load("b")) == (0, 64)
    ledger.forget("b")
    assert ledger.load("b") == 0 and not ledger._requests


@SETTINGS
@given(ops=st.lists(st.tuples(st.sampled_from("add prefilled finished forget".split()), st.integers(0, 5),
                              st.sampled_from("abc"), st.integers(0, 3), st.integers(1, 4)), max_size=40))
def test_ledger_match_is_the_prefix_its_requests_in_flight_hold(ops):
    """``match``: per replica, the leading chunks of a prompt whose keys some request in flight there
    holds, whatever the order of routings, retries, prefills, finishes and restarts."""
    docs = [RNG.integers(3, 500, 4 * CHUNK) for _ in range(2)] + [DOC, OTHER]
    ledger = RequestLedger()
    live: dict[str, tuple[str, list[int]]] = {}
    for op, rid, replica, d, n_chunks in ops:
        name = f"q{rid}"
        if op == "add":
            keys = h(docs[d][: n_chunks * CHUNK]).tolist()
            ledger.add(name, replica, 0, keys, [CHUNK] * len(keys))
            live[name] = (replica, keys)
        elif op == "prefilled":
            ledger.prefilled(name)
        elif op == "finished":
            ledger.finished(name)
            live.pop(name, None)
        else:
            ledger.forget(replica)
            live = {q: e for q, e in live.items() if e[0] != replica}
        for doc in docs:
            keys = h(doc).tolist()
            expected = {}
            for r in "abc":
                held = {k for who, ks in live.values() if who == r for k in ks}
                depth = next((i for i, k in enumerate(keys) if k not in held), len(keys))
                if depth:
                    expected[r] = depth
            assert ledger.match(h(doc)) == expected


# ------------------------------------------------------------------------------ SGLang cache_aware


def test_sglang_defaults_are_the_0_3_router_args():
    r = SGLangCacheAwareRouter()
    assert (r.cache_threshold, r.balance_abs_threshold, r.balance_rel_threshold) == (0.3, 64, 1.5)


def test_sglang_imbalance_goes_to_the_shortest_queue():
    r = SGLangCacheAwareRouter(chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    follow = h(with_question(DOC, 4))
    assert r.choose(follow, {"a": 100, "b": 0, "c": 50}) == "b"  # 100 - 0 > 64 and 100 > 1.5 * 0
    assert r.choose(follow, {"a": 100, "b": 70, "c": 90}) == "a"  # 30 <= 64: balanced, cache
    assert r.choose(follow, {"a": 130, "b": 100, "c": 90}) == "a"  # 40 <= 64
    assert r.choose(follow, {"a": 200, "b": 134, "c": 140}) == "a"  # 66 > 64 but 200 < 1.5 * 134
    assert r.state()["shortest_queue"] == 1


def test_sglang_match_above_threshold_goes_to_the_matched_worker():
    r = SGLangCacheAwareRouter(cache_threshold=0.5, miss="smallest", chunk_size=CHUNK)
    r.routed(h(DOC), "a")  # a's tree: 4 chunks
    r.routed(h(DOC[:CHUNK]), "b")  # b's: the first chunk
    loads = {"a": 3, "b": 0, "c": 1}
    prompt = with_question(DOC, 3)  # 24 of its 27 tokens are in a's tree, 8 in b's
    assert r.choose(h(prompt), loads, tokens=len(prompt)) == "a"
    # without a: b's 8 of 27 tokens <= 0.5, so the smallest tree, c's (empty)
    assert r.choose(h(prompt), loads, tokens=len(prompt), avoid={"a"}) == "c"
    r.routed(h(DOC[:CHUNK]), "c")  # now b and c both hold one chunk; c was sent it last
    short = with_question(DOC, 1)  # a, b and c hold its first chunk: 8 of 11 tokens, 0.73 > 0.5
    assert r.choose(h(short), loads, tokens=len(short)) == "c"  # the one sent it last


def test_sglang_low_match_goes_to_the_least_loaded_by_default():
    """sglang-router 0.3: a miss goes to the replica serving the fewest requests (the first in worker
    order among equals: here by name), whatever the trees' sizes."""
    r = SGLangCacheAwareRouter(cache_threshold=0.5, chunk_size=CHUNK)
    assert r.miss == "least"
    r.routed(h(DOC), "a")
    r.routed(h(OTHER[:CHUNK]), "b")
    long_question = tuple(range(20, 20 + 2 * CHUNK))
    low = h(with_question(DOC, 1, long_question))  # 8 of 24 tokens: 0.33 <= 0.5
    assert r.choose(low, {"a": 3, "b": 0, "c": 1}) == "b"  # the shortest queue, though c's tree is empty
    assert r.choose(low, {"a": 0, "b": 0, "c": 0}) == "a"  # equals: the first, a's tree the largest
    assert r.choose(h(DOC[:CHUNK * 2]), {"a": 3, "b": 0, "c": 1}) == "a"  # 16 of 16 = 1.0 > 0.5
    assert r.state() == {"least_loaded": 2, "cache_hit": 1}
    with pytest.raises(ValueError, match="miss"):
        SGLangCacheAwareRouter(miss="ring")


def test_sglang_low_match_goes_to_the_smallest_tree_with_miss_smallest():
    r = SGLangCacheAwareRouter(cache_threshold=0.5, miss="smallest", chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    r.routed(h(OTHER[:CHUNK]), "b")
    loads = {"a": 3, "b": 0, "c": 1}
    long_question = tuple(range(20, 20 + 2 * CHUNK))
    low = h(with_question(DOC, 1, long_question))  # 8 of 24 tokens: 0.33 <= 0.5
    assert r.choose(low, loads) == "c"  # the empty tree, though b's queue is shorter
    assert r.choose(low, loads, avoid={"c"}) == "b"  # then the next smallest
    exact = h(DOC[:CHUNK * 2])  # 16 of 16 = 1.0 > 0.5
    assert r.choose(exact, loads) == "a"
    assert r.state() == {"smallest_tree": 2, "cache_hit": 1}


# ------------------------------------------------------------------------------ Ray Serve


def test_ray_defaults_are_ray_2_60s():
    r = RayPrefixAffinityRouter()
    assert (r.imbalanced_threshold, r.match_rate_threshold) == (math.inf, 0.1)


def test_ray_match_tier_takes_the_shortest_queue_among_the_best_matches():
    r = RayPrefixAffinityRouter(chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    r.routed(h(DOC), "b")
    r.routed(h(DOC[:CHUNK]), "c")  # c holds less of it
    follow = h(with_question(DOC, 4))
    assert r.choose(follow, {"a": 5, "b": 2, "c": 0, "d": 0}) == "b"
    assert r.choose(follow, {"a": 2, "b": 2, "c": 0, "d": 0}) == "a"  # a tie: the first
    assert r.choose(follow, {"a": 500, "b": 2, "c": 0, "d": 0}) == "b"  # imbalance is never checked at inf


def test_ray_low_match_tier_takes_the_smallest_trees_then_the_shortest_queue():
    r = RayPrefixAffinityRouter(match_rate_threshold=0.5, chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    r.routed(h(OTHER[:CHUNK]), "b")
    loads = {"a": 0, "b": 0, "c": 4, "d": 3}
    new = h(RNG.integers(3, 500, 3 * CHUNK))
    assert r.choose(new, loads) == "d"  # c and d have empty trees; d's queue is shorter
    low = h(with_question(DOC, 1, tuple(range(20, 20 + 2 * CHUNK))))  # 8 of 24 tokens < 0.5
    assert r.choose(low, loads) == "d"
    high = h(DOC[:3 * CHUNK])  # 24 of 24
    assert r.choose(high, loads) == "a"
    assert r.state() == {"smallest_tree": 2, "match": 1}


def test_ray_imbalance_falls_back_to_power_of_two():
    r = RayPrefixAffinityRouter(imbalanced_threshold=4, chunk_size=CHUNK, seed=0)
    r.routed(h(DOC), "a")
    follow = h(with_question(DOC, 4))
    assert {r.choose(follow, {"a": 10, "b": 0}) for _ in range(10)} == {"b"}  # 10 - 0 > 4: pow2
    assert r.choose(follow, {"a": 4, "b": 0}) == "a"  # 4 - 0 <= 4: the prefix
    assert r.state()["pow2"] == 10


# ------------------------------------------------------------------------------ LMetric


def test_lmetric_picks_the_smallest_product():
    r = LMetricRouter(chunk_size=CHUNK)
    r.routed(h(DOC[:3 * CHUNK]), "a")  # a holds 3 of the prompt's 4 chunks
    prompt = h(DOC)  # 32 tokens: 8 new on a, 32 elsewhere
    assert r.choose(prompt, {"a": 5, "b": 0}) == "b"  # 8 x 6 = 48 > 32 x 1
    assert r.choose(prompt, {"a": 2, "b": 0}) == "a"  # 8 x 3 = 24 < 32
    assert r.choose(prompt, {"a": 3, "b": 0}) == "b"  # 32 = 32: the less loaded
    assert r.choose(prompt, {"a": 2, "b": 0}, avoid={"a"}) == "b"


@given(loads=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 30), min_size=1),
       sent=st.lists(st.tuples(st.integers(1, 4), st.sampled_from("abcdef")), max_size=8))
@SETTINGS
def test_lmetric_choice_minimises_its_score(loads, sent):
    r = LMetricRouter(chunk_size=CHUNK)
    for chunks, replica in sent:
        r.routed(h(DOC[:chunks * CHUNK]), replica)
    prompt = h(with_question(DOC, 4))
    n, held = r._match(prompt, None)
    choice = r.choose(prompt, loads)
    assert r.score(choice, n, held, loads) == min(r.score(x, n, held, loads) for x in loads)


# ------------------------------------------------------------------------------ Dynamo


def test_dynamo_picks_the_lowest_cost_through_the_requests_life():
    r = DynamoKvRouter(chunk_size=CHUNK, block_size=CHUNK, seed=0)
    r.routed(h(DOC), "a", tokens=32, request_id="q1")  # a: 32 pending prefill tokens, 32 KV tokens
    prompt = with_question(DOC, 3, tuple(range(20, 28)))  # 32 tokens, 24 of them a's
    hashes, loads = h(prompt), {"a": 1, "b": 0}
    # a: 1.0 x (32 + 8) / 8 + (32 + 8) / 8 = 10;  b: 32 / 8 + 32 / 8 = 8
    assert r.costs(hashes, loads, loads, 32) == {"a": 10.0, "b": 8.0}
    assert r.choose(hashes, loads, tokens=32) == "b"
    r.prefilled("q1")  # a: 8 / 8 + 40 / 8 = 6
    assert r.costs(hashes, loads, loads, 32)["a"] == 6.0
    assert r.choose(hashes, loads, tokens=32) == "a"
    r.finished("q1")  # a: 1 + 32 / 8 = 5 (its cache stays in the history)
    assert r.costs(hashes, loads, loads, 32)["a"] == 5.0
    heavy = DynamoKvRouter(overlap_score_weight=0.0, chunk_size=CHUNK, block_size=CHUNK)
    heavy.routed(h(DOC), "a", tokens=32, request_id="q1")
    assert heavy.choose(hashes, loads, tokens=32) == "b"  # weight 0: the KV in flight alone (5 > 4)


@given(loads=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 30), min_size=1),
       sent=st.lists(st.tuples(st.integers(1, 4), st.sampled_from("abcdef"), st.booleans()), max_size=8),
       weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
@SETTINGS
def test_dynamo_choice_minimises_its_cost(loads, sent, weight):
    r = DynamoKvRouter(overlap_score_weight=weight, chunk_size=CHUNK, seed=1)
    for i, (chunks, replica, done) in enumerate(sent):
        r.routed(h(DOC[:chunks * CHUNK]), replica, tokens=chunks * CHUNK, request_id=str(i))
        if done:
            r.prefilled(str(i))
    prompt = with_question(DOC, 4)
    costs = r.costs(h(prompt), loads, loads, len(prompt))
    assert costs[r.choose(h(prompt), loads, tokens=len(prompt))] == pytest.approx(min(costs.values()))


# ------------------------------------------------------------------------------ ours, new options


def test_ours_smallest_sends_a_new_document_to_the_replica_sent_the_fewest_tokens():
    r = PrefixAffinityRouter(load_factor=1.25, new_prefix="smallest", chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    r.routed(h(OTHER[:CHUNK]), "b")
    new = h(RNG.integers(3, 500, 2 * CHUNK))
    assert r.choose(new, {"a": 0, "b": 0, "c": 2}) == "c"  # under the bound, 3
    assert r.choose(new, {"a": 0, "b": 0, "c": 50}) == "b"  # c is past the bound
    assert r.sent_tokens == {"a": 32, "b": 8}


def test_ours_defaults_are_the_tuned_setting():
    r = PrefixAffinityRouter()
    assert (r.load_factor, r.slack, r.new_prefix, r.min_match) == (20.0, 2, "least", 0.1)
    assert (r.cache_factor, r.cache_keep) == (1.25, 0.5)
    assert (r.balance_abs, r.balance_rel, r.hot_window, r.hot_share, r.hot_min) == (8.0, 1.5, 64, 1.0, 0)
    assert not r.spread
    assert r.cached is None  # no KV size given: the cache model is off
    assert not r.tracks_requests  # what the Ray Serve router can feed it: hashes and requests in flight


def test_ours_defaults_are_what_router_peers_tuned():
    """The shipped defaults equal the setting benchmarks.router_peers tuned (results/router_peers.json)."""
    import json
    from pathlib import Path

    from benchmarks.router_peers import OURS, make

    res = json.loads((Path(__file__).resolve().parents[1] / "results" / "router_peers.json").read_text())
    knobs = res["tuned"][OURS]
    tuned, shipped = make(OURS, knobs, seed=0), PrefixAffinityRouter()
    assert {k: getattr(tuned, k) for k in knobs} == {k: getattr(shipped, k) for k in knobs}


def test_ours_cache_model_sends_an_evicted_document_to_the_least_loaded_replica():
    # each replica keeps 1.0 x 5 chunks: a's LRU model holds DOC (4 chunks); 4 more leave 1 of them
    r = PrefixAffinityRouter(kv_tokens=5 * CHUNK, cache_factor=1.0, min_match=0.0, chunk_size=CHUNK)
    r.routed(h(DOC), "a", tokens=4 * CHUNK)
    loads = {"a": 2, "b": 0, "c": 1}
    follow = with_question(DOC, 4)
    assert r.choose(h(follow), loads, tokens=len(follow)) == "a"  # still held: affinity
    r.routed(h(OTHER), "a", tokens=4 * CHUNK)  # 8 chunks sent to a: 1 of DOC's 4 left, < cache_keep
    assert r.choose(h(follow), loads, tokens=len(follow)) == "b"  # a new prefix: the least loaded
    assert r.state()["evicted"] == 1 and r.state()["affinity"] == 1
    r.routed(h(follow), "b", tokens=len(follow))
    assert r.choose(h(follow), {"a": 0, "b": 3, "c": 0}, tokens=len(follow)) == "b"  # it moved with it
    off = PrefixAffinityRouter(kv_tokens=6 * CHUNK, cache_factor=0, min_match=0.0, chunk_size=CHUNK)
    for prompt in (DOC, OTHER):
        off.routed(h(prompt), "a", tokens=4 * CHUNK)
    assert off.cached is None and off.choose(h(follow), loads, tokens=len(follow)) == "a"
    r.forget("b")
    assert r.cached.match(h(follow)) == {"a": 1}  # b's copy gone, a's first chunk left
    with pytest.raises(ValueError, match="cache_factor"):
        PrefixAffinityRouter(cache_factor=-1)
    with pytest.raises(ValueError, match="kv_tokens"):
        PrefixAffinityRouter(kv_tokens=0)


def test_ours_spread_takes_the_least_loaded_replica_holding_the_prefix():
    # a and b both hold DOC (a hot document spilled to b); c holds only its first chunk
    def router(spread: bool) -> PrefixAffinityRouter:
        r = PrefixAffinityRouter(kv_tokens=100 * CHUNK, spread=spread, min_match=0.0, chunk_size=CHUNK)
        r.routed(h(DOC[:CHUNK]), "c", tokens=CHUNK)
        r.routed(h(DOC), "b", tokens=4 * CHUNK)
        r.routed(h(DOC), "a", tokens=4 * CHUNK)  # a was sent it last: the table's owner
        return r

    follow = with_question(DOC, 4)
    loads = {"a": 5, "b": 2, "c": 0}
    assert router(False).choose(h(follow), loads, tokens=len(follow)) == "a"  # the owner only
    assert router(True).choose(h(follow), loads, tokens=len(follow)) == "b"  # the least loaded holder
    assert router(True).choose(h(follow), {"a": 2, "b": 2, "c": 0}, tokens=len(follow)) == "a"  # tie: owner
    assert router(True).choose(h(follow), loads, {"b"}, tokens=len(follow)) == "a"  # b avoided
    no_model = PrefixAffinityRouter(spread=True, min_match=0.0, chunk_size=CHUNK)  # no kv_tokens: off
    for replica in ("b", "a"):
        no_model.routed(h(DOC), replica, tokens=4 * CHUNK)
    assert no_model.choose(h(follow), loads, tokens=len(follow)) == "a"
    assert PrefixAffinityRouter().spread is False


def test_ours_least_smallest_breaks_ties_of_load_by_tokens_sent():
    r = PrefixAffinityRouter(new_prefix="least-smallest", chunk_size=CHUNK)
    r.routed(h(DOC), "a", tokens=4 * CHUNK)
    r.routed(h(OTHER[:CHUNK]), "b", tokens=CHUNK)
    assert r.sent_tokens == {"a": 4 * CHUNK, "b": CHUNK}
    third = RNG.integers(3, 500, 2 * CHUNK)
    assert r.choose(h(third), {"a": 0, "b": 0, "c": 0}) == "c"  # all idle: c was sent nothing
    assert r.choose(h(third), {"a": 0, "b": 0, "c": 1}) == "b"  # of the idle, b was sent fewer tokens
    assert r.choose(h(third), {"a": 0, "b": 1, "c": 1}) == "a"  # load first
    with pytest.raises(ValueError, match="new_prefix"):
        PrefixAffinityRouter(new_prefix="fewest")


def test_ours_min_match_does_not_follow_a_shared_preamble():
    r = PrefixAffinityRouter(min_match=0.3, new_prefix="smallest", chunk_size=CHUNK)
    r.routed(h(DOC), "a")
    loads = {"a": 0, "b": 0}
    sibling = np.concatenate([DOC[:CHUNK], OTHER[:3 * CHUNK]])  # another document, the same first chunk
    assert r.choose(h(sibling), loads, tokens=32) == "b"  # 8 of 32 tokens known < 0.3: a new prefix
    follow = with_question(DOC, 4)
    assert r.choose(h(follow), loads, tokens=len(follow)) == "a"  # 32 of 35
    plain = PrefixAffinityRouter(min_match=0.0, chunk_size=CHUNK)
    plain.routed(h(DOC), "a")
    assert plain.choose(h(sibling), loads) == "a"  # min_match=0: any known prefix is followed
    assert r.state()["new"] == 1
    with pytest.raises(ValueError, match="min_match"):
        PrefixAffinityRouter(min_match=1.5)


# ------------------------------------------------------------------------------ every router


@pytest.mark.parametrize("name", sorted(ROUTERS))
@given(events=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 40),
                                 st.lists(st.sampled_from("abcdefgh"), max_size=3)), min_size=1, max_size=40),
       names=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True))
@SETTINGS
def test_every_router_returns_an_allowed_replica_over_a_run(name, events, names):
    """Requests arrive (chosen, routed with their length and id), are prefilled or finish, in any
    order: every choice is a candidate, outside ``avoid`` unless nothing else is left."""
    router = make_router(name, **({"chunk_size": CHUNK} if name in PEERS else {}))
    loads = dict.fromkeys(names, 0)
    live: list[tuple[str, str]] = []
    for i, (kind, doc, question, avoid) in enumerate(events):
        if kind == 1 and live:
            router.prefilled(live[0][0])
            continue
        if kind == 2 and live:
            rid, replica = live.pop()
            router.finished(rid)
            loads[replica] -= 1
            continue
        prompt = np.concatenate([np.random.default_rng(doc).integers(3, 500, CHUNK * (1 + doc % 3)),
                                 np.arange(question) + 600])
        hashes = h(prompt)
        choice = router.choose(hashes, loads, set(avoid), tokens=len(prompt))
        assert choice in loads
        if set(loads) - set(avoid):
            assert choice not in avoid
        router.routed(hashes, choice, tokens=len(prompt), request_id=str(i))
        loads[choice] += 1
        live.append((str(i), choice))


@pytest.mark.parametrize("name", PEERS)
def test_a_peer_forgets_a_dead_replica(name):
    router = make_router(name, chunk_size=CHUNK)
    router.routed(h(DOC), "a", tokens=32, request_id="q1")
    router.forget("a")
    assert router.history.match(h(DOC)) == {} and router.ledger.load("a") == 0
    assert router.choose(h(DOC), {"b": 0, "c": 0}) in {"b", "c"}


# ------------------------------------------------------------------------------ in the simulator

SMALL = {"episode": {"groups": 6, "max_per_group": 4, "arrival": "poisson:4"},
         "workload": {"max_prompt_tokens": 2048}, "engine": {"kv_cache_gib": 0.03}}


@pytest.mark.parametrize("name", PEERS)
def test_the_simulator_tells_a_router_every_first_token_and_finish(data_dir, name):
    from feather_env.cluster_sim import ClusterSim
    from feather_env.scenarios import load_scenario

    scenario = load_scenario("leval-kv-pressure", SMALL)
    workload = scenario.episode_workload(0)
    router = make_router(name)
    result = ClusterSim(3, scenario.engine_config()).run(workload, router)
    assert result.metrics["completed"] == len(workload)
    ledger = router.ledger
    assert not ledger._requests and not ledger._active  # every request routed, prefilled and finished
    assert set(ledger.pending.values()) <= {0} and set(ledger.kv.values()) <= {0}


def test_zipf_documents_skews_popularity_over_the_same_documents(data_dir):
    from feather_env.cluster_sim import distinct_documents, zipf_documents
    from feather_env.scenarios import load_scenario

    pool = load_scenario("leval-kv-pressure", SMALL).pool
    uniform = distinct_documents(pool, 40, seed=3)
    zipf = zipf_documents(pool, 40, 400, 1.1, seed=3)
    assert len(zipf) == 400 and len({r.request_id for r in zipf}) == 400
    assert {r.prefix_group for r in zipf} <= {r.prefix_group for r in uniform}
    counts = sorted(np.unique([r.prefix_group for r in zipf], return_counts=True)[1], reverse=True)
    assert counts[0] > 400 * 0.1 > counts[len(counts) // 2]  # the hottest ~1/H(40, 1.1) of them
    with pytest.raises(ValueError):
        zipf_documents(pool, 4, 0, 1.1, seed=0)


def test_router_peers_scales_a_trace_to_a_rate_and_reads_mooncake_windows(data_dir):
    from benchmarks.router_peers import at_rate, mooncake_windows

    windows = mooncake_windows(20.0, [0, 1])
    assert len(windows) == 2 and all(len(w) > 10 for w in windows)
    assert [r.request_id for r in windows[0]] != [r.request_id for r in windows[1]]
    w = at_rate(windows[0], 50.0)
    times = [r.arrival_time for r in w]
    assert times[0] == 0 and times == sorted(times)
    assert (len(w) - 1) / times[-1] == pytest.approx(50.0)
    ratios = np.diff([r.arrival_time for r in windows[0]])[1:] / np.maximum(np.diff(times)[1:], 1e-12)
    assert np.allclose(ratios[np.diff(times)[1:] > 0], ratios[np.diff(times)[1:] > 0][0])  # shape kept


def test_router_peers_bound_is_above_every_router(data_dir):
    from benchmarks.router_peers import throughput_bound
    from feather_env.cluster_sim import ClusterSim
    from feather_env.scenarios import load_scenario

    scenario = load_scenario("leval-kv-pressure", SMALL)
    workload = scenario.episode_workload(0)
    engine = scenario.engine_config()
    floors: dict[str, float] = {}
    bound = throughput_bound(ClusterSim(1, engine), workload, floors)
    assert floors and all(f > 0 for f in floors.values())
    for name in ("prefix", "sglang-cache-aware", "round-robin"):
        served = ClusterSim(2, engine).run(workload, make_router(name)).metrics["output_throughput"]
        assert served <= bound * (1 + 1e-9)
