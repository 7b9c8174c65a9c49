"""Scenario files: loading, overrides, episodes as pure functions of their seed, clear errors."""

from __future__ import annotations

import pytest
import yaml

from feather_env.scenarios import SCENARIO_DIR, available_scenarios, load_scenario
from scheduler_runtime.config import ConfigError


def test_the_shipped_scenarios_load_and_describe_themselves():
    names = available_scenarios()
    assert {"leval-kv-pressure", "leval-ample-kv", "sharegpt"} <= set(names)
    for name in names:
        sc = load_scenario(name)
        assert sc.description and sc.source.endswith(f"{name}.yaml")
        episode = sc.episode_workload(0)
        assert 1 <= len(episode) <= sc.max_episode_requests
        assert all(r.peak_tokens <= sc.kv_capacity_tokens for r in episode)
        assert sc.engine_config().max_model_len > max(r.peak_tokens for r in sc.pool)


def test_kv_pressure_is_what_its_name_says():
    pressure, ample = load_scenario("leval-kv-pressure"), load_scenario("leval-ample-kv")
    ep = pressure.episode_workload(0)
    assert ep.unique_prompt_tokens() > 1.5 * pressure.kv_capacity_tokens  # documents do not all fit
    assert ample.episode_workload(0).unique_prompt_tokens() < ample.kv_capacity_tokens
    assert ep.num_groups == 16 and max(len(m) for m in ep.groups().values()) <= 8
    assert all(r.prompt_len <= 8192 for r in ep) and ep.arrivals == "burst"
    assert pressure.kv_capacity_tokens == 511 * 128  # 0.25 GiB, less vLLM's null block
    sharegpt = load_scenario("sharegpt").episode_workload(0)
    assert sharegpt.describe()["reuse_factor"] == pytest.approx(1.0, abs=0.01)  # no sharing


def test_an_episode_is_a_pure_function_of_its_seed():
    sc = load_scenario("leval-kv-pressure")
    again = load_scenario("leval-kv-pressure")
    assert sc.episode_workload(5).fingerprint() == again.episode_workload(5).fingerprint()
    assert sc.episode_workload(5).fingerprint() != sc.episode_workload(6).fingerprint()


def test_overrides_replace_keys_and_are_checked():
    sc = load_scenario("leval-kv-pressure", {"episode": {"groups": 3, "arrival": "poisson:2.0"},
                                             "engine": {"kv_cache_gib": 0.5}})
    ep = sc.episode_workload(1)
    assert ep.num_groups == 3 and ep.arrivals == "poisson:2"
    assert sc.engine.kv_cache_gib == 0.5 and sc.engine.max_num_seqs == 64  # the rest is the file's
    assert load_scenario(sc, {"episode": {"groups": 2}}).episode_workload(1).num_groups == 2
    with pytest.raises(ConfigError, match="episode: unknown key.*valid keys"):
        load_scenario("leval-kv-pressure", {"episode": {"docs": 3}})
    with pytest.raises(ConfigError, match="unknown section"):
        load_scenario("leval-kv-pressure", {"reward": {"x": 1}})
    with pytest.raises(ConfigError, match="positive integer"):
        load_scenario("leval-kv-pressure", {"episode": {"groups": 0}})
    with pytest.raises(ConfigError, match="arrival"):
        load_scenario("leval-kv-pressure", {"episode": {"arrival": "sometimes"}})


def test_unknown_scenarios_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown scenario 'nope'; available: \[.*leval-kv-pressure"):
        load_scenario("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"workload": {"kind": "leval"}, "episodes": {"groups": 2}}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['episodes'\]"):
        load_scenario(bad)
    bad.write_text(yaml.safe_dump({"workload": {"kind": "leval", "num_groups": 3}}))
    with pytest.raises(ConfigError, match="belongs in the 'episode' section"):
        load_scenario(bad)
    bad.write_text(yaml.safe_dump({"episode": {"groups": 3}}))
    with pytest.raises(ConfigError, match="needs a 'workload'"):
        load_scenario(bad)
    assert (SCENARIO_DIR / "leval-kv-pressure.yaml").is_file()


def test_a_request_that_can_never_fit_the_kv_cache_is_an_error_not_a_drop():
    sc = load_scenario("leval-kv-pressure", {"engine": {"kv_cache_gib": 0.01}})
    with pytest.raises(ConfigError, match=r"can never fit the KV cache of \d+ tokens"):
        sc.episode_workload(0)
