"""agents.agreement: decisions of two policy files side by side, on the simulator and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents import agreement
from scheduler_runtime.decision import ADD, BASE_OBS_NAMES, STOP, ObservationSpec
from scheduler_runtime.policy import ConstantPolicy, write_policy
from scheduler_runtime.rules import GroupCapRule, HeuristicRule

REPO = Path(__file__).resolve().parent.parent


def _constant(tmp_path: Path, action: int) -> str:
    path = tmp_path / f"constant-{action}.feather"
    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    write_policy(path, ConstantPolicy(spec, action=action))
    return str(path)


def test_a_policy_agrees_with_itself():
    shipped = str(REPO / "policies" / "leval-kv-pressure-poisson.feather")
    res = agreement.compare(shipped, shipped, "leval-kv-pressure-poisson", episodes=2)
    assert res["decisions"] > 0 and res["differ"] == 0
    assert res["a_figures"] == res["b_figures"]


def test_policies_that_differ_are_counted_and_served_on_their_own(tmp_path, capsys):
    add, stop = _constant(tmp_path, ADD), _constant(tmp_path, STOP)
    res = agreement.main([add, stop, "--scenario", "leval-kv-pressure", "--episodes", "2",
                                 "--json", str(tmp_path / "cmp.json")])
    assert 0 < res["differ"] <= res["decisions"]
    # always-STOP defers every request it may: served on its own, it is slower than always-add
    assert res["b_figures"]["output_throughput"] < res["a_figures"]["output_throughput"]
    assert "decisions differ" in capsys.readouterr().out and (tmp_path / "cmp.json").is_file()


def test_a_loaded_rule_is_compared_too():
    """The hand-made rule as an object, against the file that holds the same cap."""
    tuned = str(REPO / "policies" / "heuristic-tuned" / "leval-kv-pressure-poisson.feather")
    res = agreement.compare(GroupCapRule(cap=3), tuned, "leval-kv-pressure-poisson", episodes=1)
    assert res["decisions"] > 0 and res["differ"] == 0
    other = agreement.compare(GroupCapRule(cap=1), tuned, "leval-kv-pressure-poisson", episodes=1)
    assert 0 < other["differ"] <= other["decisions"]


def test_a_group_policy_and_a_request_policy_are_not_compared():
    with pytest.raises(ValueError, match="group decision"):
        agreement.compare(HeuristicRule(), GroupCapRule(), "leval-kv-pressure-poisson", episodes=1)


def test_the_benchmark_compares_every_pair_on_both_sets_of_episodes():
    from benchmarks.policy_agreement import PAIRS, run

    res = run("leval-kv-pressure-poisson", 1, REPO / "policies")
    assert set(res) == {f"{a} / {b}" for a, b in PAIRS}
    for r in res.values():
        for where in ("held_out", "evaluation_episode"):
            assert 0 <= r[where]["differ"] <= r[where]["decisions"] and r[where]["decisions"] > 0


@pytest.mark.engine
def test_on_the_real_engine(env_backend, tmp_path):
    """The same comparison with the episodes served by the session's engine."""
    from feather_env.scenarios import load_scenario

    small = load_scenario("leval-kv-pressure", {"episode": {"groups": 3, "max_per_group": 2}})
    add, stop = _constant(tmp_path, ADD), _constant(tmp_path, STOP)
    res = agreement.compare(add, stop, small, seeds=[0], backend=env_backend)
    assert 0 < res["differ"] <= res["decisions"]
    assert res["a_figures"]["output_throughput"] > 0 and res["b_figures"]["output_throughput"] > 0


def test_bad_input_is_a_usage_error(capsys):
    shipped = str(REPO / "policies" / "sharegpt.feather")
    for argv, message in (
        (["nope.feather", shipped, "--scenario", "sharegpt"], "no such file"),
        ([shipped, shipped, "--scenario", "nope"], "unknown scenario 'nope'"),
        ([shipped, shipped, "--scenario", "sharegpt", "--seeds", "x"], "comma-separated integers"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            agreement.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
