"""A value table with a baseline rule (scheduler_runtime.rules.trusted_states, TablePolicy's
``baseline``, Q-learning's ``baseline``): the table departs from the rule only where its values
are significantly apart, a table with no such state serves episodes exactly as the rule, and the
file carries all of it."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.qlearning import QLearningAgent, QLearningConfig
from agents.run_config import ConfigError, load_config
from agents.tuning import TUNE_SEED, search_caps
from feather_env.env import FeatherEnv, play_episode
from scheduler_runtime.decision import ADD, GROUP_OBS_NAMES, STOP, ObservationSpec, PolicyFormatError
from scheduler_runtime.policy import TablePolicy, _canonical, load_policy, write_policy
from scheduler_runtime.rules import GroupBins, GroupCapRule, table_decision, trusted_states

SMALL = {"episode": {"groups": 6, "max_per_group": 4}}
OBS = {name: i for i, name in enumerate(GROUP_OBS_NAMES)}
SPEC = ObservationSpec(names=GROUP_OBS_NAMES, low=(0.0,) * 9, high=(64.0,) * 9, scale=(64.0,) * 9,
                       chunk_size=256)


@pytest.fixture(scope="module")
def env() -> FeatherEnv:
    return FeatherEnv("leval-kv-pressure-poisson", "sim", scenario_overrides=SMALL, decision="group")


pairs = st.tuples(st.floats(-10, 10), st.floats(-10, 10), st.integers(0, 60), st.integers(0, 60),
                  st.floats(0, 3), st.floats(0, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(pairs, min_size=1, max_size=20), st.floats(0, 4), st.integers(1, 40))
def test_a_state_is_trusted_exactly_when_both_values_are_seen_and_apart(states, z, min_visits):
    values = [v for s in states for v in s[:2]]
    visits = [n for s in states for n in s[2:4]]
    stderr = [e for s in states for e in s[4:]]
    trusted = trusted_states(values, visits, stderr, z, min_visits)
    assert len(trusted) == len(states)
    for t, (v0, v1, n0, n1, e0, e1) in zip(trusted, states, strict=True):
        assert t == (min(n0, n1) >= min_visits and abs(v0 - v1) > z * math.hypot(e0, e1))


def _group_obs(groups: int, waiting_in_flight: int, cached: float, batch: int = 2,
               kv: float = 0.5) -> list[float]:
    obs = [0.0] * len(GROUP_OBS_NAMES)
    obs[0] = batch
    obs[OBS["kv_usage"]] = kv
    obs[OBS["groups_in_flight"]] = groups
    obs[OBS["waiting_in_flight"]] = waiting_in_flight
    obs[OBS["cached_fraction"]] = cached
    return obs


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10), st.integers(0, 4), st.sampled_from([0.0, 1.0]), st.integers(0, 4),
       st.lists(st.booleans(), min_size=2, max_size=2), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 0.05, 0.1, 0.5, 1.0]))
def test_untrusted_states_answer_as_the_baseline_and_trusted_ones_by_value(groups, waiting, cached, batch,
                                                                           mask, seed, kv):
    bins = GroupBins()
    rng = np.random.default_rng(seed)
    values = rng.normal(size=2 * bins.num_states).tolist()
    visits = rng.integers(1, 5, size=2 * bins.num_states).tolist()
    trusted = rng.random(bins.num_states) < 0.5
    rule = GroupCapRule(cap=3)
    obs = _group_obs(groups, waiting, cached, batch, kv)
    got = table_decision(bins, values, visits, False, obs, mask, rule, trusted.tolist())
    if kv < rule.kv_min and mask[ADD]:  # nothing to evict: the rule admits, and so does its table
        assert got == ADD
    elif trusted[bins.index(obs)] and all(mask) and batch > 0:  # an open choice the table trusts itself on
        assert got == table_decision(bins, values, visits, False, obs, mask)
    else:
        assert got == rule.act(obs, mask)


def _table(bins: GroupBins, gap_state: int | None, gap: float, se: float, visits: int = 100) -> TablePolicy:
    """Values tied everywhere except ``gap_state``, where ADD's value is ``gap`` above STOP's."""
    n = bins.num_states
    values = [-3.0] * (2 * n)
    if gap_state is not None:
        values[2 * gap_state + ADD] += gap
    return TablePolicy(SPEC, bins, values, [visits] * (2 * n), False, baseline=GroupCapRule(cap=1),
                       stderr=[se] * (2 * n), z=2.0, min_visits=30)


def test_a_departure_needs_a_gap_of_z_standard_errors_and_the_visits():
    bins = GroupBins()
    obs = _group_obs(groups=2, waiting_in_flight=0, cached=1.0)  # cap 1 holds here
    s = bins.index(obs)
    mask = [True, True]
    assert _table(bins, s, gap=0.5, se=0.1).act(obs, mask) == ADD  # 0.5 > 2 * hypot(0.1, 0.1)
    assert _table(bins, s, gap=0.2, se=0.1).act(obs, mask) == STOP  # 0.2 < 0.28: the cap's answer
    assert _table(bins, s, gap=0.5, se=0.1, visits=29).act(obs, mask) == STOP  # too few visits
    # only open choices are the table's: ADD invalid is STOP, and an empty batch is the rule's answer
    assert _table(bins, s, gap=0.5, se=0.1).act(obs, [True, False]) == STOP
    assert _table(bins, s, gap=0.5, se=0.1).act(_group_obs(2, 0, 1.0, batch=0), mask) == STOP


def test_a_table_with_no_trusted_state_serves_episodes_exactly_as_its_baseline(env):
    bins = GroupBins()
    for cap in (1, 3):
        table = _table(bins, None, 0.0, 1.0)
        table.baseline = GroupCapRule(cap=cap)
        for seed in (2_000_000, 2_000_001):
            ref = play_episode(env, GroupCapRule(cap=cap), episode_seed=seed)
            got = play_episode(env, table, episode_seed=seed)
            assert got["decisions"] == ref["decisions"] > 0
            keys = ("adds", "stops", "duration", "completed")
            assert [got[k] for k in keys] == [ref[k] for k in keys]


def test_the_file_carries_the_baseline_and_refuses_bad_ones(tmp_path):
    bins = GroupBins()
    s = bins.index(_group_obs(2, 0, 1.0))
    path = write_policy(tmp_path / "t.feather", _table(bins, s, gap=0.5, se=0.1))
    loaded = load_policy(path)
    assert loaded.baseline == GroupCapRule(cap=1) and loaded.z == 2.0 and loaded.min_visits == 30
    assert loaded.trusted == _table(bins, s, gap=0.5, se=0.1).trusted and sum(loaded.trusted) == 1

    def broken(edit, message):
        doc = json.loads(path.read_text())
        edit(doc["params"])
        doc.pop("sha256")
        doc["sha256"] = hashlib.sha256(_canonical(doc)).hexdigest()
        bad = tmp_path / "bad.feather"
        bad.write_text(json.dumps(doc))
        with pytest.raises(PolicyFormatError, match=message):
            load_policy(bad)

    broken(lambda p: p["stderr"].pop(), "'stderr' must hold")
    broken(lambda p: p["stderr"].__setitem__(0, -1.0), "'stderr' must hold")
    broken(lambda p: p.update(z=-1), "'z' must be")
    broken(lambda p: p.update(min_visits=0), "'min_visits' must be")
    broken(lambda p: p["baseline"].update(cap=0), "cap must be")
    broken(lambda p: p["baseline"].update(kv_min=1.5), "kv_min must be")
    broken(lambda p: p.pop("baseline"), "go with a 'baseline' rule")

    # a file written before kv_min existed keeps its meaning: the rule holds at any KV usage
    doc = json.loads(path.read_text())
    assert doc["params"]["baseline"]["kv_min"] == GroupCapRule().kv_min
    del doc["params"]["baseline"]["kv_min"]
    doc.pop("sha256")
    doc["sha256"] = hashlib.sha256(_canonical(doc)).hexdigest()
    (tmp_path / "old.feather").write_text(json.dumps(doc))
    assert load_policy(tmp_path / "old.feather").baseline == GroupCapRule(cap=1, kv_min=0.0)


def test_qlearning_tracks_each_values_standard_error():
    """In the sample-average phase (step 1/n) a value is the mean of its targets and its error
    sqrt(var / n); once the step is constant, sqrt(var a / (2 - a))."""
    agent = QLearningAgent(QLearningConfig(learning_rate=0.01), seed=0)
    agent._use_bins(GroupBins())
    obs = np.array(_group_obs(2, 0, 1.0), dtype=np.float32)
    s = agent.bins.index(obs)
    targets = np.random.default_rng(0).normal(-3.0, 0.5, size=100)
    for r in targets:
        agent.observe(obs, ADD, float(r), obs, np.array([True, True]), True, {})
    assert agent.q[s, ADD] == pytest.approx(targets.mean())
    assert agent.var[s, ADD] == pytest.approx(targets.var())
    assert agent.stderr()[s, ADD] == pytest.approx(math.sqrt(targets.var() / 100))
    assert agent.stderr()[s, STOP] == 0.0 and agent.visits[s, STOP] == 0
    for r in np.random.default_rng(1).normal(-3.0, 0.5, size=2000):
        agent.observe(obs, ADD, float(r), obs, np.array([True, True]), True, {})
    assert agent.var[s, ADD] == pytest.approx(0.25, rel=0.3)
    assert agent.stderr()[s, ADD] == pytest.approx(math.sqrt(agent.var[s, ADD] * 0.01 / 1.99))


def test_a_tuned_baseline_is_the_cap_search_and_survives_export_and_checkpoint(env, tmp_path):
    agent = QLearningAgent(QLearningConfig(baseline="tuned"), seed=0)
    agent.prepare(None, env)
    expected, _ = search_caps(env, [TUNE_SEED + i for i in range(8)])
    assert agent.baseline_rule == expected
    agent.learn(env, 1500)
    policy = load_policy(agent.export(tmp_path / "q.feather"))
    assert policy.baseline == expected and policy.meta["baseline"] == "tuned"
    assert policy.trusted == agent._trusted()
    obs_rng = np.random.default_rng(3)
    for _ in range(300):
        obs = [float(obs_rng.integers(0, 9)) for _ in GROUP_OBS_NAMES]
        obs[OBS["cached_fraction"]] = float(obs_rng.random())
        obs[OBS["kv_usage"]] = float(obs_rng.random())
        mask = np.array([True, True])
        assert policy.act(obs, mask) == agent.act(np.array(obs), mask)
    restored = QLearningAgent.load(agent.save(tmp_path / "ckpt.npz"), env)
    assert restored.baseline_rule == expected
    assert np.array_equal(restored.var, agent.var)


def test_a_named_baseline_and_bad_ones_in_a_run_config(tmp_path):
    assert QLearningAgent(QLearningConfig(baseline="group-cap-2")).baseline_rule == GroupCapRule(cap=2)
    assert QLearningAgent(QLearningConfig(baseline="group-hold")).baseline_rule == GroupCapRule(cap=None)
    base = (tmp_path / "run.yaml")
    for key, value, decision, message in (
            ("baseline", "cap-3", "group", "qlearning.baseline must be"),
            ("baseline", "group-cap-0", "group", "group-cap"),
            ("baseline_z", -1.0, "group", "baseline_z"),
            ("baseline", "group-cap-3", "request", "agent.baseline is a rule of the group decision")):
        base.write_text(f"scenario: leval-kv-pressure\nagent:\n  name: qlearning\n  {key}: {value}\n"
                        f"env:\n  decision: {decision}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(base, "qlearning")
    # a baseline answers the group decision: a table of the request decision cannot have one
    request = FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=SMALL)
    with pytest.raises(ValueError, match="a group-decision rule"):
        QLearningAgent(QLearningConfig(baseline="group-cap-3")).bind(request)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 8), st.integers(0, 3), st.integers(1, 16), st.integers(1, 4))
def test_every_state_has_a_representative_observation(in_flight_max, waiting_max, div, kv_levels):
    bins = GroupBins(in_flight_max=in_flight_max, waiting_groups_div=div, waiting_groups_max=waiting_max,
                     kv_levels=kv_levels)
    states = range(bins.num_states)
    assert [bins.index(bins.representative(s)) for s in states] == list(states)
    for kv_min in (0.0, 0.1, 0.3, 1.0):
        reps = [bins.representative(s, kv_min) for s in states]
        assert [bins.index(r) for r in reps] == list(states)
        # the KV entry reaches kv_min wherever the state's bin does
        kv = GROUP_OBS_NAMES.index("kv_usage")
        for s, r in zip(states, reps, strict=True):
            level = int(np.unravel_index(s, bins.shape)[-1])
            reaches = kv_min < (level + 1) / kv_levels or level == kv_levels - 1
            assert (r[kv] >= kv_min) == reaches


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([None, 1, 2, 3, 5, 8]), st.integers(0, 10), st.integers(0, 4), st.floats(0, 1),
       st.integers(1, 6), st.floats(0, 1), st.floats(0, 1))
def test_below_kv_min_the_rule_admits_and_above_it_kv_usage_changes_nothing(cap, groups, waiting, cached,
                                                                            batch, kv, kv_min):
    rule = GroupCapRule(cap=cap, kv_min=kv_min)
    both = [True, True]
    got = rule.act(_group_obs(groups, waiting, cached, batch, kv), both)
    if kv < kv_min:
        assert got == ADD
    else:  # the rule of kv_min = 0, whatever the usage
        full = _group_obs(groups, waiting, cached, batch, 1.0)
        assert got == GroupCapRule(cap=cap, kv_min=0.0).act(full, both)
    no_add = [True, True]
    no_add[ADD] = False
    assert rule.act(_group_obs(groups, waiting, cached, batch, kv), no_add) == STOP  # masks win


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 3, 5, 8]), st.integers(1, 32), st.integers(0, 10), st.integers(0, 40),
       st.integers(0, 4), st.floats(0, 1), st.floats(0, 1))
def test_a_lifted_cap_gives_way_exactly_while_enough_groups_wait(cap, lift_at, groups, waiting_groups,
                                                                 waiting, cached, kv):
    """``lift_at``: with at least that many groups waiting the rule answers as ``group-hold``, below
    it as ``group-cap-K``; the guard, the hold and the masks are the same either way."""
    rule = GroupCapRule(cap=cap, lift_at=lift_at)
    obs = _group_obs(groups, waiting, cached, kv=kv)
    obs[OBS["waiting_groups"]] = waiting_groups
    both = [True, True]
    same_as = GroupCapRule(cap=None) if waiting_groups >= lift_at else GroupCapRule(cap=cap)
    assert rule.act(obs, both) == same_as.act(obs, both)
    assert rule.lifted(obs) == (waiting_groups >= lift_at)


def test_a_lifted_cap_is_carried_by_its_file_and_checked(tmp_path):
    from scheduler_runtime.policy import GroupCapPolicy

    rule = GroupCapRule(cap=5, lift_at=16)
    assert rule.name == "group-cap-5-lift-16" and rule.params()["lift_at"] == 16
    assert "lift_at" not in GroupCapRule(cap=5).params()  # a file without it is the file of before
    path = write_policy(tmp_path / "lifted.feather", GroupCapPolicy(SPEC, rule))
    assert load_policy(path).rule == rule
    for bad in (0, -1, 2.5, "16", True):
        with pytest.raises(ValueError, match="lift_at must be an integer >= 1"):
            GroupCapRule(cap=5, lift_at=bad)


def test_a_lifted_cap_serves_as_the_hold_in_a_crowd_and_as_the_cap_without_one():
    """On ``leval-high-load`` (128 documents at once) a cap lifted at 16 waiting groups binds only in
    the episode's tail; with a lift above any crowd it is the plain cap, exactly."""
    env = FeatherEnv("leval-high-load", "sim", decision="group",
                     scenario_overrides={"episode": {"groups": 40}})
    seed = 2_000_000
    try:
        plain = play_episode(env, GroupCapRule(cap=2), episode_seed=seed)
        never = play_episode(env, GroupCapRule(cap=2, lift_at=10_000), episode_seed=seed)
        lifted = play_episode(env, GroupCapRule(cap=2, lift_at=16), episode_seed=seed)
        hold = play_episode(env, GroupCapRule(cap=None), episode_seed=seed)
    finally:
        env.close()
    assert never["duration"] == plain["duration"] and never["stops"] == plain["stops"]
    assert lifted["completed"] == lifted["submitted"] == plain["submitted"]
    assert hold["stops"] <= lifted["stops"] < plain["stops"]


def test_a_rule_by_name():
    assert GroupCapRule.from_name("group-cap-4") == GroupCapRule(cap=4)
    assert GroupCapRule.from_name("group-hold") == GroupCapRule(cap=None)
    assert GroupCapRule.from_name("lpm") is None
    with pytest.raises(ConfigError, match="K of group-cap-K"):
        GroupCapRule.from_name("group-cap-0")


def test_a_trusted_hold_is_no_departure_where_the_cache_is_nearly_empty():
    """Below ``kv_min`` the baseline admits whatever the table says; a bin wholly below it has no
    departure, a bin that reaches it is compared where it does."""
    bins = GroupBins(kv_levels=4)
    low = _group_obs(groups=0, waiting_in_flight=0, cached=1.0, kv=0.05)  # cap 1 opens here
    high = _group_obs(groups=0, waiting_in_flight=0, cached=1.0, kv=0.6)
    for obs, departs in ((low, False), (high, True)):
        table = _table(bins, bins.index(obs), gap=-0.5, se=0.1)  # STOP trusted where the cap opens
        for kv_min, expect in ((0.0, True), (0.3, departs)):
            table.baseline = GroupCapRule(cap=1, kv_min=kv_min)
            assert (table.departures() == [bins.index(obs)]) == expect
            assert (table.act(obs, [True, True]) == STOP) == expect


def test_departures_are_the_trusted_states_answered_otherwise_than_the_baseline(env):
    bins = GroupBins()
    holds = bins.index(_group_obs(groups=2, waiting_in_flight=0, cached=1.0))  # cap 1 holds here
    opens = bins.index(_group_obs(groups=0, waiting_in_flight=0, cached=1.0))  # cap 1 opens here
    assert _table(bins, holds, gap=0.5, se=0.1).departures() == [holds]  # ADD trusted where the cap holds
    agrees = _table(bins, opens, gap=0.5, se=0.1)  # ADD trusted where the cap opens too
    assert sum(agrees.trusted) == 1 and agrees.departures() == []
    for seed in (2_000_000, 2_000_001):  # no departure: the rule's episodes, exactly
        ref = play_episode(env, GroupCapRule(cap=1), episode_seed=seed)
        got = play_episode(env, agrees, episode_seed=seed)
        keys = ("adds", "stops", "duration")
        assert [got[k] for k in keys] == [ref[k] for k in keys]
    above = _table(bins, holds, gap=0.5, se=0.1)
    above.baseline = GroupCapRule(cap=12)  # a cap past the bins' in_flight_max: no answer per bin
    assert above.departures() is None
    assert TablePolicy(SPEC, bins, [0.0] * (2 * bins.num_states), [0] * (2 * bins.num_states),
                       False).departures() is None


def test_the_evaluation_serves_a_table_that_answers_as_heuristic_tuned_once(tmp_path):
    """A shipped table that departs nowhere from its baseline is the tuned cap, answer for answer: the
    evaluation serves it once, under heuristic-tuned; a table that departs somewhere is served."""
    from benchmarks.evaluation import scheduler_set
    from scheduler_runtime.policy import GroupCapPolicy

    scenario = "leval-kv-pressure-poisson"
    bins = GroupBins()
    holds = bins.index(_group_obs(groups=2, waiting_in_flight=0, cached=1.0))
    (tmp_path / "heuristic-tuned").mkdir()
    tuned = GroupCapPolicy(SPEC, GroupCapRule(cap=1))
    write_policy(tmp_path / "heuristic-tuned" / f"{scenario}.feather", tuned)
    write_policy(tmp_path / f"{scenario}.feather", _table(bins, None, 0.0, 1.0))  # no departure
    write_policy(tmp_path / "general.feather", _table(bins, holds, gap=0.5, se=0.1))  # one departure
    names, same = scheduler_set(scenario, tmp_path)
    assert "shipped" not in names and same["shipped"][0] == "heuristic-tuned"
    assert "group-cap-1" in same["shipped"][1]
    assert names["general"].endswith("general.feather") and "general" not in same
    assert names["shipped+svf"] == f"feather:{tmp_path / f'{scenario}.feather'}+svf"


def test_a_mix_is_tuned_for_its_worst_member():
    """``agents.tuning`` on a mix: every candidate (plain caps, then each cap lifted at each of
    ``LIFTS``) is scored by its worst ratio to each member's best plain candidate, and the best worst
    ratio wins. A member that never asks the decision (ShareGPT) is 1.0 for every rule."""
    from agents.tuning import CAPS, LIFTS, group_env, search_worst_ratio

    mix = group_env("leval-kv-pressure-poisson+leval-high-load+sharegpt")
    try:
        rule, tried = search_worst_ratio(mix.envs, [TUNE_SEED])
    finally:
        mix.close()
    assert len(tried) == len(CAPS) + 1 + len(CAPS) * len(LIFTS)
    plain = tried[:len(CAPS) + 1]
    assert all("lift_at" not in t for t in plain) and all("lift_at" in t for t in tried[len(plain):])
    for name in ("leval-kv-pressure-poisson", "leval-high-load"):
        assert max(t["ratio"][name] for t in plain) == pytest.approx(1.0)
        assert len({round(t["output_throughput"][name], 6) for t in tried}) > 1  # the rules differ on it
    assert all(t["ratio"]["sharegpt"] == pytest.approx(1.0) for t in tried)
    for t in tried:
        assert t["worst_ratio"] == min(t["ratio"].values())
    best = max(t["worst_ratio"] for t in tried)
    first = next(t for t in tried if t["worst_ratio"] > best - 1e-9)  # ties: the earlier
    assert rule == GroupCapRule(**{k: v for k, v in first.items()
                                   if k in ("cap", "hold", "cached_min", "kv_min", "lift_at")})


def test_the_tuning_command_on_a_mix_writes_one_rule_for_all_and_refuses_unknown_names(tmp_path, capsys):
    from agents.tuning import group_env, main
    from scheduler_runtime.policy import GroupCapPolicy

    out = tmp_path / "general.feather"
    assert main(["--scenario", "leval-kv-pressure-poisson+no-such-scenario", "--out", str(out)]) == 2
    assert "no-such-scenario" in capsys.readouterr().err and not out.exists()
    mix = "leval-kv-pressure-poisson+leval-kv-pressure"
    assert main(["--scenario", mix, "--out", str(out), "--episodes", "1"]) == 0
    policy = load_policy(out)
    assert isinstance(policy, GroupCapPolicy) and policy.agent == "heuristic-tuned"
    assert policy.meta["search"]["best"] == policy.rule.name
    env = group_env(mix)  # the members observe with the mix's one bound, as the file records
    try:
        assert policy.obs_spec == ObservationSpec.from_env(env)
    finally:
        env.close()
