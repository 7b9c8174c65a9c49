"""The rollout over a base rule (agents.rollout): the lookahead never ends an episode later than the rule,
the advantages are what the copies measure, and the distilled policy deviates only where they are
significant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agents.base import ADD, STOP
from agents.rollout import Advantages, DeviationPolicy, advantages, distill, lookahead_episode
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
