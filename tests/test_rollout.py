"""The rollout over a base rule (agents.rollout): the lookahead never ends an episode later than the rule,
the advantages are what the copies measure, and the distilled policy deviates only where they are
significant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.base import ADD, STOP
from agents.rollout import (
    Advantages,
    AdvantageTree,
    DeviationPolicy,
    _best_split,
    advantages,
    distill,
    distill_tree,
    lookahead_episode,
    placebo_episode,
)
from feather_env.env import FeatherEnv, play_episode
from scheduler_runtime.decision import GROUP_OBS_NAMES
from scheduler_runtime.rules import GroupBins, GroupCapRule

SMALL = {"episode": {"groups": 6, "max_per_group": 4}}
SEEDS = (2_000_000, 2_000_001)


@pytest.fixture(scope="module")
def env() -> FeatherEnv:
    return FeatherEnv("leval-kv-pressure-poisson", "sim", scenario_overrides=SMALL, decision="group")


@pytest.mark.parametrize("cap", [1, 3])
def test_the_lookahead_never_ends_an_episode_later_than_its_base_rule(env: FeatherEnv, cap: int) -> None:
    base = GroupCapRule(cap=cap, kv_min=0.0)  # holds at any KV usage: decisions to own
    for seed in SEEDS:
        ref = play_episode(env, base, episode_seed=seed)
        look = lookahead_episode(env, base, seed)
        assert look["completed"] == look["submitted"] == ref["submitted"]
        assert look["duration"] <= ref["duration"] + 1e-9
        assert 0 <= look["changed"] <= look["decisions_owned"]
        if look["changed"] == 0:  # the same answers: the same episode, exactly
            assert look["duration"] == ref["duration"]


def test_the_placebo_answers_as_its_base_rule_and_never_ends_an_episode_later() -> None:
    """The lookahead's control changes no answer: it only slows the engine, where its copies say
    that ends the episode sooner; so it never ends later than the rule, a slowdown of 0 serves the
    rule's episode exactly, and the environment's own speed is back after the episode."""
    env = FeatherEnv("leval-kv-pressure-poisson", "sim", decision="group",
                     scenario_overrides={"episode": {"groups": 8, "max_per_group": 6}})
    base = GroupCapRule(cap=2, kv_min=0.0)
    slowed = 0
    for seed in SEEDS:
        ref = play_episode(env, base, episode_seed=seed)
        same = placebo_episode(env, base, seed, slowdown=0.0)
        assert same["slowed"] == 0 and same["duration"] == ref["duration"]
        assert same["decisions"] == ref["decisions"] and same["decisions_owned"] > 0
        placebo = placebo_episode(env, base, seed, slowdown=0.3)
        assert placebo["completed"] == placebo["submitted"] == ref["submitted"]
        assert placebo["duration"] <= ref["duration"] + 1e-9
        if placebo["slowed"] == 0:
            assert placebo["duration"] == ref["duration"]
        slowed += placebo["slowed"]
        assert env.backend.time_scale == 1.0
        assert play_episode(env, base, episode_seed=seed)["duration"] == ref["duration"]
    # a slower interval does end some episode sooner: the timing effect the placebo measures
    assert slowed > 0


def test_a_cap_of_one_leaves_the_lookahead_something_to_change(env: FeatherEnv) -> None:
    base = GroupCapRule(cap=1, kv_min=0.0)
    looks = [lookahead_episode(env, base, s) for s in SEEDS]
    refs = [play_episode(env, base, episode_seed=s) for s in SEEDS]
    assert sum(look["changed"] for look in looks) > 0
    assert sum(look["duration"] for look in looks) < sum(r["duration"] for r in refs)


def test_a_shipped_cap_file_serves_as_the_base(env: FeatherEnv) -> None:
    """The rollout benchmark's base is a loaded ``heuristic-tuned`` file, not a bare rule: the
    lookahead over it owns exactly the decisions the rule would, and serves every request."""
    from pathlib import Path

    from scheduler_runtime.policy import GroupCapPolicy, load_policy

    base = load_policy(Path(__file__).resolve().parent.parent / "policies" / "heuristic-tuned"
                       / "leval-kv-pressure-poisson.feather")
    assert isinstance(base, GroupCapPolicy)
    look = lookahead_episode(env, base, SEEDS[0])
    same = lookahead_episode(env, base.rule, SEEDS[0])
    assert look["completed"] == look["submitted"] and look["decisions_owned"] > 0
    assert (look["decisions_owned"], look["changed"], look["duration"]) == (
        same["decisions_owned"], same["changed"], same["duration"])


def test_advantages_are_collected_on_the_base_rules_own_trajectory(env: FeatherEnv) -> None:
    base = GroupCapRule(cap=2, kv_min=0.0)
    adv = advantages(env, base, SEEDS[:1])
    ref = play_episode(env, base, episode_seed=SEEDS[0])
    owned = sum(len(v) for v in adv.samples.values())
    assert 0 < owned <= ref["decisions"]
    assert all(math.isfinite(x) for v in adv.samples.values() for x in v)
    # the base's answers recorded per bin are the cap's: STOP exactly where groups in flight >= 2
    bins = adv.bins
    for s, actions in adv.base_actions.items():
        groups, waiting, cached = (int(i) for i in _unravel(bins, s)[:3])
        if groups >= 2:
            assert set(actions) == {STOP}
        elif cached or waiting == 0:
            assert set(actions) == {ADD}


def _unravel(bins: GroupBins, s: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(s, bins.shape))


def _obs(groups: int, waiting: int, cached: float) -> list[float]:
    obs = [0.0] * len(GROUP_OBS_NAMES)
    obs[0] = 2.0  # a batch under way
    obs[GROUP_OBS_NAMES.index("groups_in_flight")] = groups
    obs[GROUP_OBS_NAMES.index("waiting_in_flight")] = waiting
    obs[GROUP_OBS_NAMES.index("cached_fraction")] = cached
    obs[GROUP_OBS_NAMES.index("kv_usage")] = 0.5  # a cache in use: the rule's holds apply
    return obs


def test_distill_deviates_only_where_the_advantage_is_significant() -> None:
    base = GroupCapRule(cap=3)
    adv = Advantages(GroupBins())
    both = [True, True]
    # g=1: the cap ADDs; a clear advantage of STOP (mean -1, tiny spread): deviate
    for x in (-1.0, -1.01, -0.99, -1.02):
        adv.add(_obs(1, 0, 1.0), x, base.act(_obs(1, 0, 1.0), both))
    # g=4: the cap STOPs; a noisy advantage of ADD (mean > 0 within two standard errors): keep STOP
    for x in (2.0, -1.5, 1.8, -1.9):
        adv.add(_obs(4, 0, 1.0), x, base.act(_obs(4, 0, 1.0), both))
    # g=5: one sample only (no standard error): keep the cap's answer
    adv.add(_obs(5, 0, 1.0), 3.0, STOP)
    policy, report = distill(adv, base, z=2.0)
    assert isinstance(policy, DeviationPolicy)
    assert policy.act(_obs(1, 0, 1.0), both) == STOP
    assert policy.act(_obs(4, 0, 1.0), both) == STOP
    assert policy.act(_obs(5, 0, 1.0), both) == STOP
    assert policy.act(_obs(2, 0, 1.0), both) == ADD  # never seen: the cap's answer
    assert policy.act(_obs(1, 0, 1.0), [False, True]) == ADD  # a forced decision is not owned
    assert [(r["base"], r["policy"]) for r in report] == [(ADD, STOP), (STOP, STOP), (STOP, STOP)]
    assert report[0]["mean_advantage_s"] == pytest.approx(-1.005)


def test_the_regimes_benchmark_applies_each_regime_and_scores_lifted_caps_on_the_same_episodes() -> None:
    """``benchmarks.hindsight_regimes``: a regime's overrides reach its episodes (a faster arrival
    rate ends the same documents sooner), the hindsight K is the best constant K's episodes' best,
    and a cap lifted at more groups than can ever wait serves exactly as the plain cap (the two
    paths, a scheduler name and a rule on the group decision, play the same episodes)."""
    from benchmarks.hindsight_regimes import regime

    few = {"groups": 5, "max_per_group": 4}
    slow = regime("leval-kv-pressure-poisson", {"episode": {**few, "arrival": "poisson:1"}}, SEEDS, None)
    fast = regime("leval-kv-pressure-poisson", {"episode": {**few, "arrival": "poisson:8"}}, SEEDS, None)
    assert fast["heuristic"] > slow["heuristic"]
    for r in (slow, fast):
        per_k = r["per_k"]
        assert r["hindsight_mean"] >= r["best_constant_mean"] - 1e-9
        assert r["hindsight_mean"] == pytest.approx(
            sum(max(v[i] for v in per_k.values()) for i in range(len(SEEDS))) / len(SEEDS))
        for cap in (1, 3, 5):  # 5 documents: never 8 groups waiting, so lift-8 never lifts
            assert r["lifted"][f"group-cap-{cap}-lift-8"] == pytest.approx(
                sum(per_k[str(cap)]) / len(SEEDS), rel=1e-12)


def _sse(y: np.ndarray) -> float:
    return float(((y - y.mean()) ** 2).sum()) if len(y) else 0.0


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=2), min_size=n, max_size=n),
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n))),
    st.integers(1, 8))
def test_the_trees_split_is_the_least_squared_error_of_every_allowed_cut(
        data: tuple[list[list[int]], list[float]], min_leaf: int) -> None:
    x, y = np.array(data[0], dtype=float), np.array(data[1])
    split = _best_split(x, y, min_leaf)
    cuts = [(f, t) for f in range(2) for t in sorted(set(x[:, f]))[:-1]
            if min_leaf <= int((x[:, f] <= t).sum()) <= len(y) - min_leaf]
    errors = {(f, t): _sse(y[x[:, f] <= t]) + _sse(y[x[:, f] > t]) for f, t in cuts}
    best = min(errors.values(), default=math.inf)
    if split is None:
        assert not cuts or best >= _sse(y) - 1e-9
    else:
        f, threshold = split
        left = x[:, f] <= threshold
        assert min_leaf <= left.sum() <= len(y) - min_leaf
        assert _sse(y[left]) + _sse(y[~left]) == pytest.approx(best, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.floats(-3, 3, allow_nan=False)),
                min_size=1, max_size=200),
       st.integers(0, 4), st.integers(1, 20))
def test_a_tree_partitions_its_samples_into_leaves_of_at_least_min_leaf(
        rows: list[tuple[int, int, float]], depth: int, min_leaf: int) -> None:
    x = np.array([r[:2] for r in rows], dtype=float)
    y = np.array([r[2] for r in rows])
    tree = AdvantageTree(x, y, depth=depth, min_leaf=min_leaf)
    leaves = [tree.index(row) for row in x]
    counts = np.bincount(leaves, minlength=tree.num_leaves)
    assert tree.shape == (tree.num_leaves,) and 1 <= tree.num_leaves <= 2 ** depth
    assert len(counts) == tree.num_leaves and counts.min() >= min(min_leaf, len(y))
    within = sum(_sse(y[np.array(leaves) == leaf]) for leaf in range(tree.num_leaves))
    assert within <= _sse(y) + 1e-9  # every cut lowers the squared error


def test_the_distilled_tree_deviates_where_the_advantage_changes_sign_across_a_cut() -> None:
    """STOP everywhere, but ADD ends episodes sooner wherever groups_in_flight is at most 2: the tree
    cuts there, and its policy adds in that leaf alone."""
    rng = np.random.default_rng(0)
    base = GroupCapRule(cap=1, kv_min=0.0)
    adv = Advantages(GroupBins())
    for _ in range(400):
        obs = [1.0, 0.0, 3.0, float(rng.integers(1, 7)), 0.0, 0.0, 4.0, 0.5, 1.0]
        adv.add(obs, (0.5 if obs[3] <= 2 else -0.5) + float(rng.normal(0, 0.1)), STOP)
    policy, leaves = distill_tree(adv, base, depth=1, min_leaf=20)
    assert len(leaves) == 2 and sum(leaf["policy"] != leaf["base"] for leaf in leaves) == 1
    low, high = policy.bins.index([0, 0, 0, 2, 0, 0, 0, 0, 0]), policy.bins.index([0, 0, 0, 5, 0, 0, 0, 0, 0])
    assert policy.deviations == {low: ADD} and high != low
