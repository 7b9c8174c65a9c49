"""The replica routers (scheduler_runtime/router.py): properties over random prompts, loads and sequences."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.router import (
    ROUTERS,
    PowerOfTwoRouter,
    PrefixAffinityRouter,
    PrefixHasher,
    PrefixHashRouter,
    RoundRobinRouter,
    make_router,
)

CHUNK = 8
HASHER = PrefixHasher(CHUNK)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

replica_names = st.lists(st.sampled_from([f"r{i}" for i in range(12)]), min_size=1, max_size=12, unique=True)


@st.composite
def loads_st(draw, min_size: int = 1):
    names = draw(replica_names.filter(lambda n: len(n) >= min_size))
    return {n: draw(st.integers(0, 40)) for n in names}


@st.composite
def prompt_st(draw):
    """A prompt: one of 6 documents (2-5 chunks) and a question (1-12 tokens)."""
    doc = draw(st.integers(0, 5))
    rng = np.random.default_rng(doc)
    body = rng.integers(3, 500, CHUNK * (2 + doc % 4))
    question = draw(st.lists(st.integers(3, 500), min_size=1, max_size=12))
    return doc, np.concatenate([body, np.array(question)])


def hashes_of(tokens) -> np.ndarray:
    return HASHER.hash(np.asarray(tokens))


# ------------------------------------------------------------------------------------------ keys


@given(a=st.lists(st.integers(0, 99), min_size=1, max_size=40), b=st.lists(st.integers(0, 99), min_size=1,
                                                                            max_size=40))
@SETTINGS
def test_keys_are_the_chts_and_shared_exactly_with_the_chunks(a, b):
    ha, hb = hashes_of(a), hashes_of(b)
    assert np.array_equal(ha, ChunkedHashTree(CHUNK).hash_prompt(a))
    for k in range(min(len(ha), len(hb))):
        same = a[: (k + 1) * CHUNK] == b[: (k + 1) * CHUNK]
        assert (ha[k] == hb[k]) == same


# -------------------------------------------------------------------------------- every router


@pytest.mark.parametrize("name", sorted(ROUTERS))
@given(loads=loads_st(), prompt=prompt_st(), data=st.data())
@SETTINGS
def test_choice_is_a_candidate_outside_avoid(name, loads, prompt, data):
    router = make_router(name)
    avoid = set(data.draw(st.lists(st.sampled_from(sorted(loads)), unique=True)))
    hashes = hashes_of(prompt[1])
    choice = router.choose(hashes, loads, avoid)
    assert choice in loads
    if set(loads) - avoid:
        assert choice not in avoid


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_no_replica_is_an_error(name):
    with pytest.raises(ValueError, match="no replica"):
        make_router(name).choose(hashes_of([1, 2, 3]), {})


def test_unknown_router_and_bad_arguments():
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        make_router("nope")
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinityRouter(load_factor=1.0)
    with pytest.raises(ValueError, match="new_prefix"):
        PrefixAffinityRouter(new_prefix="random")
    with pytest.raises(ValueError, match="key_chunks"):
        PrefixHashRouter(key_chunks=0)


# ---------------------------------------------------------------------------- the baselines


@given(names=replica_names, rounds=st.integers(1, 5))
@SETTINGS
def test_round_robin_takes_turns(names, rounds):
    router = RoundRobinRouter()
    loads = dict.fromkeys(names, 0)
    picks = Counter(router.choose(None, loads) for _ in range(rounds * len(names)))
    assert picks == dict.fromkeys(names, rounds)


@given(loads=loads_st(min_size=2), seed=st.integers(0, 1000))
@SETTINGS
def test_pow2_never_picks_the_unique_busiest(loads, seed):
    router = PowerOfTwoRouter(seed=seed)
    busiest = max(loads.values())
    unique_max = [r for r, v in loads.items() if v == busiest]
    for _ in range(20):
        choice = router.choose(None, loads)
        if len(unique_max) == 1:
            assert choice != unique_max[0]


@given(loads=loads_st(), prompt=prompt_st(), other=loads_st())
@SETTINGS
def test_prefix_hash_ignores_load(loads, prompt, other):
    router = PrefixHashRouter()
    hashes = hashes_of(prompt[1])
    first = router.choose(hashes, loads)
    again = router.choose(hashes, {r: other.get(r, 0) for r in loads})
    assert first == again


@given(prompts=st.lists(prompt_st(), min_size=1, max_size=30),
       names=replica_names.filter(lambda n: len(n) >= 2))
@SETTINGS
def test_prefix_hash_is_consistent_when_a_replica_leaves(prompts, names):
    """Consistent hashing: only the keys the leaving replica held move."""
    router = PrefixHashRouter()
    loads = dict.fromkeys(names, 0)
    gone = names[0]
    fewer = {r: 0 for r in names[1:]}
    for _, tokens in prompts:
        hashes = hashes_of(tokens)
        before = router.choose(hashes, loads)
        after = router.choose(hashes, fewer)
        if before != gone:
            assert after == before


# ----------------------------------------------------------------------------------- ours


@given(loads=loads_st(), prompt=prompt_st(), seen=st.lists(prompt_st(), max_size=20), data=st.data())
@SETTINGS
def test_prefix_router_respects_the_bound(loads, prompt, seen, data):
    """The chosen replica is below the bound (there always is one: the least loaded is)."""
    router = PrefixAffinityRouter()
    for _, tokens in seen:  # some history: owners anywhere
        router.routed(hashes_of(tokens), data.draw(st.sampled_from(sorted(loads))))
    choice = router.choose(hashes_of(prompt[1]), loads)
    cap = router.bound(sum(loads.values()), len(loads))
    assert loads[choice] < cap
    assert cap >= math.ceil(router.load_factor * (sum(loads.values()) + 1) / len(loads))


@given(prompt=prompt_st(), question=st.lists(st.integers(3, 500), min_size=1, max_size=12),
       loads=loads_st(min_size=2))
@SETTINGS
def test_prefix_router_keeps_a_document_where_it_went(prompt, question, loads):
    """A request sharing at least one full chunk with an earlier one goes to the same replica, while
    that replica is under the bound."""
    router = PrefixAffinityRouter()
    doc, tokens = prompt
    first = hashes_of(tokens)
    owner = router.choose(first, loads)
    router.routed(first, owner)
    n_doc = CHUNK * (2 + doc % 4)
    follow = hashes_of(np.concatenate([tokens[:n_doc], np.array(question)]))
    cap = router.bound(sum(loads.values()), len(loads))
    choice = router.choose(follow, loads)
    if loads[owner] < cap:
        assert choice == owner
    else:
        assert choice != owner and loads[choice] < cap


def test_prefix_router_follows_the_longest_match():
    router = PrefixAffinityRouter()
    rng = np.random.default_rng(0)
    doc = rng.integers(3, 500, 6 * CHUNK)
    router.routed(hashes_of(doc[: 2 * CHUNK]), "a")  # a holds the first 2 chunks
    router.routed(hashes_of(doc[: 5 * CHUNK]), "b")  # b holds 5 (and is now the owner of 0-4)
    router.routed(hashes_of(doc[: 2 * CHUNK]), "a")  # a again holds 0-1
    loads = {"a": 0, "b": 0, "c": 0}
    probe = hashes_of(np.concatenate([doc[: 5 * CHUNK], [7, 7, 7]]))
    assert router.owner(probe) == (4, "b")
    assert router.choose(probe, loads) == "b"
    assert router.longest_match(hashes_of(doc[:CHUNK])) == 0
    assert router.longest_match(hashes_of(rng.integers(3, 500, 3 * CHUNK))) == -1


def test_prefix_router_spills_a_hot_document_to_one_second_replica():
    router = PrefixAffinityRouter(load_factor=1.25, slack=0)
    rng = np.random.default_rng(1)
    doc = rng.integers(3, 500, 4 * CHUNK)
    hashes = hashes_of(doc)
    names = [f"r{i}" for i in range(8)]
    loads = dict.fromkeys(names, 1)
    owner = router.choose(hashes, loads)
    router.routed(hashes, owner)
    hot = {**loads, owner: 50}  # the owner is far past the bound
    spill = {router.choose(hashes, hot) for _ in range(5)}
    assert len(spill) == 1 and owner not in spill
    assert router.state()["spilled"] == 5


def test_the_imbalance_bound_spills_only_a_hot_prefix():
    rng = np.random.default_rng(2)
    names = [f"r{i}" for i in range(4)]
    loads = dict.fromkeys(names, 2)
    hot_doc, cold_doc = (hashes_of(rng.integers(3, 500, 4 * CHUNK)) for _ in range(2))
    router = PrefixAffinityRouter(balance_abs=4, balance_rel=1.5, hot_window=8, hot_min=3)
    owners = {}
    for doc in (hot_doc, cold_doc):
        owners[id(doc)] = router.choose(doc, loads)
        router.routed(doc, owners[id(doc)])
    piled = {**loads, owners[id(cold_doc)]: 7}  # 7 > max(2 + 4, 1.5 x 2): imbalanced
    assert router.choose(cold_doc, piled) == owners[id(cold_doc)]  # seen twice in 8: not hot, followed
    piled = {**loads, owners[id(hot_doc)]: 7}
    for _ in range(2):  # its 1st and 2nd matches of the last 8: not hot yet
        assert router.choose(hot_doc, piled) == owners[id(hot_doc)]
    spill = {router.choose(hot_doc, piled) for _ in range(3)}  # hot now: one second replica
    assert len(spill) == 1 and owners[id(hot_doc)] not in spill
    assert router.choose(hot_doc, {**loads, owners[id(hot_doc)]: 6}) == owners[id(hot_doc)]  # within it
    everything = PrefixAffinityRouter(balance_abs=4, balance_rel=1.5, hot_window=0)  # every prefix
    owner = everything.choose(cold_doc, loads)
    everything.routed(cold_doc, owner)
    assert everything.choose(cold_doc, {**loads, owner: 7}) != owner
    for bad in ({"balance_abs": -1}, {"balance_rel": 0.5}, {"hot_window": -1}, {"hot_min": -1},
                {"hot_share": -1}, {"hot_share": 0, "hot_min": 0}):
        with pytest.raises(ValueError):
            PrefixAffinityRouter(**bad)


def test_hot_share_scales_the_hot_threshold_with_the_cluster():
    """hot_share x hot_window / n matches make a prefix hot: 8 x 1 / 4 = 2 of the last 8 on 4 replicas,
    8 x 1 / 2 = 4 on 2."""
    rng = np.random.default_rng(3)
    doc = hashes_of(rng.integers(3, 500, 4 * CHUNK))
    for names, spills_at in ((["a", "b", "c", "d"], 2), (["a", "b"], 4)):
        router = PrefixAffinityRouter(balance_abs=1, balance_rel=1.5, hot_window=8)  # hot_share 1
        owner = router.choose(doc, dict.fromkeys(names, 0))
        router.routed(doc, owner)
        piled = {**dict.fromkeys(names, 0), owner: 5}  # 5 > max(0 + 1, 0): imbalanced
        picks = [router.choose(doc, piled) for _ in range(spills_at)]
        assert picks[:-1] == [owner] * (spills_at - 1) and picks[-1] != owner  # hot at the n-th match
    assert (PrefixAffinityRouter().hot_share, PrefixAffinityRouter().hot_min) == (1.0, 0)  # by share


@given(events=st.lists(st.tuples(st.booleans(), prompt_st()), min_size=1, max_size=120),
       n=st.integers(1, 8))
@SETTINGS
def test_prefix_router_load_invariant_over_a_run(events, n):
    """Requests arrive (routed with the current loads) or finish: no replica ever holds more than
    the bound it was checked against, so max load <= ceil(c * total / n) or mean + slack."""
    router = PrefixAffinityRouter()
    names = [f"r{i}" for i in range(n)]
    loads = dict.fromkeys(names, 0)
    held: list[str] = []
    for arrive, (_, tokens) in events:
        if arrive or not held:
            hashes = hashes_of(tokens)
            cap = router.bound(sum(loads.values()), n)
            choice = router.choose(hashes, loads)
            router.routed(hashes, choice)
            loads[choice] += 1
            held.append(choice)
            assert loads[choice] <= cap
        else:
            loads[held.pop(len(held) // 2)] -= 1


def test_prefix_router_forgets_a_dead_replica_and_bounds_its_table():
    router = PrefixAffinityRouter(max_keys=10)
    rng = np.random.default_rng(2)
    docs = [rng.integers(3, 500, 3 * CHUNK) for _ in range(6)]
    for i, doc in enumerate(docs):
        router.routed(hashes_of(doc), "a" if i % 2 else "b")
        assert router.state()["table_keys"] <= 10
    last = hashes_of(docs[-1])
    assert router.owner(last)[1] == "a"
    router.forget("a")
    assert router.owner(last) == (-1, None)
    assert router.choose(last, {"b": 0, "c": 0}) in {"b", "c"}


def test_prefix_router_goes_elsewhere_when_the_owner_is_gone_or_avoided():
    router = PrefixAffinityRouter()
    doc = np.random.default_rng(3).integers(3, 500, 3 * CHUNK)
    hashes = hashes_of(doc)
    router.routed(hashes, "a")
    assert router.choose(hashes, {"a": 0, "b": 0}) == "a"
    assert router.choose(hashes, {"a": 0, "b": 0}, avoid={"a"}) == "b"
    assert router.choose(hashes, {"b": 3, "c": 0}) in {"b", "c"}  # a left the candidates
    assert router.choose(None, {"b": 3, "c": 0}) == "c"  # no prompt: the least loaded
