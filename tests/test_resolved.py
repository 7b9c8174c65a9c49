"""An environment resolved once (feather_env.resolved): every default applied there and only there,
every bad value a clear error before anything is built, and environments (a run's, evaluate.py's)
built from the resolved object without reading a scenario again."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import feather_env.resolved as resolved_module
import feather_env.scenarios as scenarios_module
from agents.envs import make_env
from agents.run_config import parse_config
from feather_env.env import FeatherEnv, ScenarioMix, play_episode
from feather_env.resolved import (
    DEFAULT_GROUP_SCHEDULER,
    SETTING_DEFAULTS,
    ResolvedEnv,
    resolve_env,
    resolve_envs,
)
from feather_env.scenarios import load_scenario
from scheduler_runtime.config import ConfigError

#: A small leval-kv-pressure episode: a few milliseconds of simulation.
OVERRIDES = {"episode": {"groups": 4, "max_per_group": 3}, "workload": {"max_prompt_tokens": 2048},
             "engine": {"kv_cache_gib": 0.03}}


def small(**settings) -> ResolvedEnv:
    return resolve_env("leval-kv-pressure", scenario_overrides=OVERRIDES, **settings)


def test_every_default_is_applied_in_the_resolved_object():
    r = small()
    scenario = load_scenario("leval-kv-pressure", OVERRIDES)
    assert r.scheduler.name == "feather-heuristic" and r.scheduler.decision == "request"
    assert r.obs_kind == "base" and r.delta_clip == 64 and r.max_episode_seconds is None
    assert (r.reward.kind, r.reward.scale, r.reward.goodput_slos) == ("latency", 1.0, None)
    assert (r.backend.kind, r.backend.profile) == ("sim", None)
    assert r.engine == scenario.engine_config()  # max_model_len fitted to the pool
    assert r.obs_max_requests == scenario.max_episode_requests
    assert r.episode == scenario.episode and r.engine_slowdown == (1.0, 1.0)
    # the scenario's knobs reach the scheduler
    assert (r.scheduler.chunk_size, r.scheduler.max_wait) == (scenario.scheduler.chunk_size,
                                                              scenario.scheduler.max_wait)
    group = small(decision="group")
    assert group.scheduler.name == DEFAULT_GROUP_SCHEDULER and group.obs_kind == "group"
    assert small(goodput_slos="ttft:5000 tpot:50").reward.goodput_slos == {"ttft": 5000.0, "tpot": 50.0}


@pytest.mark.parametrize(("settings", "message"), [
    ({"reward": "speed"}, "reward must be one of"),
    ({"reward_scale": 0.0}, "reward_scale must be a finite number > 0"),
    ({"reward": "goodput"}, "reward 'goodput' needs latency SLOs"),
    ({"goodput_slos": "itl:5"}, "unknown goodput SLO 'itl'"),
    ({"delta_clip": 0}, "delta_clip must be an integer >= 1"),
    ({"max_episode_seconds": -1.0}, "max_episode_seconds must be a finite number > 0"),
    ({"obs_max_requests": 0}, "obs_max_requests must be an integer >= 1"),
    ({"decision": "batch"}, "decision must be 'request' or 'group'"),
    ({"scheduler": "fastest"}, "unknown scheduler 'fastest'"),
    ({"scheduler": "lpm", "decision": "group"}, "the group decision needs the feather ordering"),
    ({"decision": "group", "extended_obs": True}, "extended_obs is for the request decision"),
    ({"engine_slowdown": [2.0, 1.0]}, "engine_slowdown must be a factor > 0"),
    ({"scenario_overrides": {"episode": {"groupz": 2}}}, r"unknown key\(s\) \['groupz'\]"),
    ({"scenario_overrides": {"engines": {}}}, "unknown section 'engines'"),
])
def test_bad_settings_are_clear_errors(settings, message):
    base = {"scenario_overrides": OVERRIDES, **settings}
    with pytest.raises(ConfigError, match=message):
        resolve_env("leval-kv-pressure", **base)


def test_bad_backend_and_scenario():
    with pytest.raises(ConfigError, match="backend must be 'sim', 'vllm'"):
        resolve_env("leval-kv-pressure", "gpu", scenario_overrides=OVERRIDES)
    with pytest.raises(ConfigError, match="unknown scenario 'nowhere'"):
        resolve_env("nowhere")


def test_the_environment_takes_every_setting_the_resolution_takes():
    params = inspect.signature(FeatherEnv.__init__).parameters
    assert set(SETTING_DEFAULTS) == set(params) - {"self", "scenario", "backend", "llm"}
    assert all(SETTING_DEFAULTS[k] == params[k].default for k in SETTING_DEFAULTS)


def test_an_environment_from_the_resolved_object_is_the_same_environment():
    r = small(scheduler="group-cap-2")
    by_name = FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=OVERRIDES, scheduler="group-cap-2")
    resolved = FeatherEnv.from_resolved(r)
    assert resolved.resolved is r and resolved.observation_space == by_name.observation_space
    assert play_episode(resolved, episode_seed=7) == play_episode(by_name, episode_seed=7)
    with pytest.raises(ConfigError, match=r"carries its settings: give none of \['reward'\]"):
        FeatherEnv(r, reward="makespan")
    assert FeatherEnv(r).scheduler_name == "group-cap-2"


def test_derived_environments_change_one_thing():
    r = small(extended_obs=True, reward="makespan")
    ref = r.with_scheduler("group-cap-3")
    assert ref.scheduler.name == "group-cap-3" and ref.obs_kind == "group"  # its own decision
    assert ref.reward == r.reward and ref.engine == r.engine and ref.scenario is r.scenario
    assert r.with_scheduler("fcfs").obs_kind == "base"  # a reference's observation is the base one
    assert r.on("vllm").backend.kind == "vllm" and r.on("vllm").scheduler == r.scheduler
    with pytest.raises(ConfigError, match="backend must be"):
        r.on("tpu")


def test_a_mix_shares_one_bound():
    envs = resolve_envs(["leval-kv-pressure", "leval-kv-pressure-poisson"], scenario_overrides=OVERRIDES,
                        obs_max_requests=3)
    alone = [resolve_env(s, scenario_overrides=OVERRIDES) for s in ("leval-kv-pressure",
                                                                      "leval-kv-pressure-poisson")]
    assert {e.obs_max_requests for e in envs} == {max(a.obs_max_requests for a in alone)}
    mix = ScenarioMix.from_resolved(envs)
    assert mix.names == ["leval-kv-pressure", "leval-kv-pressure-poisson"]
    assert ScenarioMix.from_resolved(envs, names=["a", "b"]).names == ["a", "b"]  # as the run named them
    with pytest.raises(ConfigError, match="at least one scenario"):
        resolve_envs([])


def run_config(**env) -> dict:
    return {"scenario": {"name": "leval-kv-pressure", **OVERRIDES}, "agent": {"name": "ucb"}, "env": env,
            "train": {"timesteps": 100, "progress_bar": False}}


def test_a_run_resolves_once_and_never_reads_its_scenario_again(monkeypatch):
    cfg = parse_config(run_config(decision="group"))
    assert [e.scheduler.name for e in cfg.envs] == ["group-cap-3"]
    assert cfg.env.scheduler == "group-cap-3" and cfg.to_dict()["env"]["scheduler"] == "group-cap-3"

    def no_reading(*args, **kwargs):
        raise AssertionError("a scenario was read again")

    monkeypatch.setattr(scenarios_module, "load_scenario", no_reading)
    monkeypatch.setattr(resolved_module, "load_scenario", no_reading)
    for env in (make_env(cfg), make_env(cfg, "sim", scheduler="fcfs")):
        assert env.scenario is cfg.envs[0].scenario
        play_episode(env, episode_seed=1)
        env.close()


def test_a_run_config_with_bad_env_values_names_them():
    with pytest.raises(ConfigError, match="env.delta_clip must be an integer >= 1"):
        parse_config(run_config(delta_clip=0))
    with pytest.raises(ConfigError, match=r"env: unknown key\(s\) \['rewards'\]"):
        parse_config(run_config(rewards="latency"))
    with pytest.raises(ConfigError, match="unknown scheduler 'fastest'"):
        parse_config(run_config(scheduler="fastest"))


def test_the_resolved_object_is_frozen():
    r = small()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.delta_clip = 3  # type: ignore[misc]
