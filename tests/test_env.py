"""FeatherEnv: the serving loop as an environment, on the simulator and on the real engine.

The real-engine tests share one engine per session (``env_backend``: leval-kv-pressure's engine,
0.25 GiB of KV, FeatherScheduler in its loop).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import feather_env  # noqa: F401  (registers feather/Batching-v0)
from feather_env.engines.vllm_engine import EngineError
from feather_env.env import ADD, STOP, FeatherEnv, InvalidActionError, play_episode
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import AlwaysAdd
from scheduler_runtime.rules import HeuristicRule

SCENARIO = "leval-kv-pressure"
#: A small episode of the scenario, still under KV pressure: 10 documents of up to 8K tokens
#: against a KV cache of 64K tokens.
SMALL = {"episode": {"groups": 10, "max_per_group": 3}}


class Recorder:
    """Wraps a policy and records every (obs, mask) it is asked."""

    def __init__(self, inner, extended: bool = True):
        self.inner = inner
        self.calls: list[tuple[list[float], list[bool]]] = []
        if extended:
            from scheduler_runtime.decision import EXTENDED_OBS_NAMES

            self.obs_spec = type("Spec", (), {"names": EXTENDED_OBS_NAMES})()

    def reset(self):
        self.inner.reset()

    def act(self, obs, mask):
        self.calls.append((np.asarray(obs, dtype=np.float64).tolist(), np.asarray(mask).tolist()))
        return self.inner.act(obs, mask)


# ---------------------------------------------------------------------------- the simulator


def test_check_env_sim():
    env = gym.make("feather/Batching-v0", scenario=SCENARIO, backend="sim")
    check_env(env.unwrapped, skip_render_check=True)
    env = gym.make("feather/Batching-v0", scenario=SCENARIO, backend="sim", extended_obs=True,
                   reward="latency")
    check_env(env.unwrapped, skip_render_check=True)


@pytest.mark.parametrize("scheduler", ["feather-heuristic", "fcfs", "lpm", "dfs-weight", "svf"])
def test_sim_episode_serves_everyone_once_and_is_reproducible(scheduler):
    env = FeatherEnv(SCENARIO, "sim", scheduler=scheduler, reward="makespan")
    first = play_episode(env, episode_seed=3)
    again = play_episode(env, episode_seed=3)
    assert first == again  # the simulator is deterministic
    n = len(env.scenario.episode_workload(3))
    assert first["completed"] == first["submitted"] == n
    timelines = env.backend.timelines()
    assert all(t.finished_count == 1 and t.tokens == t.output_len for t in timelines)
    assert first["return"] == pytest.approx(-max(t.finish for t in timelines))  # makespan reward
    assert first["duration"] > 0 and 0 < first["prefix_hit_rate"] < 1


def test_rewards_sum_to_what_their_names_say():
    by_reward = {}
    for reward in ("makespan", "latency", "decode_throughput"):
        env = FeatherEnv(SCENARIO, "sim", reward=reward)
        by_reward[reward] = (play_episode(env, AlwaysAdd(), episode_seed=5), env.backend.timelines())
    ep, timelines = by_reward["makespan"]
    assert ep["return"] == pytest.approx(-max(t.finish for t in timelines))
    ep, timelines = by_reward["latency"]
    assert ep["return"] == pytest.approx(-np.mean([t.e2el for t in timelines]), rel=1e-9)
    ep, _ = by_reward["decode_throughput"]
    assert ep["return"] > 0  # kilotokens/s of the decode-only steps between decisions


def test_masks_invalid_actions_and_the_end_of_an_episode():
    env = FeatherEnv(SCENARIO, "sim")
    with pytest.raises(RuntimeError, match="reset"):
        env.step(ADD)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs) and info["episode_requests"] > 1
    assert env.action_masks().tolist() == [True, True]  # a pending decision has both
    assert obs[0] >= 1  # the empty batch was seeded without asking
    with pytest.raises(InvalidActionError):
        env.step(5)
    with pytest.raises(InvalidActionError):
        env.step("ADD")
    terminated = False
    while not terminated:
        obs, reward, terminated, truncated, info = env.step(STOP)
        assert reward <= 0 and not truncated
    assert not obs.any() and env.action_masks().tolist() == [True, False]
    assert info["episode"]["completed"] == info["episode"]["submitted"]
    with pytest.raises(RuntimeError, match="terminated"):
        env.step(ADD)


def test_truncation_after_max_episode_seconds():
    env = FeatherEnv(SCENARIO, "sim", max_episode_seconds=2.0)
    env.reset(seed=1)
    truncated = terminated = False
    steps = 0
    while not (truncated or terminated):
        _, _, terminated, truncated, info = env.step(ADD)
        steps += 1
    assert truncated and not terminated and info["clock"] >= 2.0


def test_reference_orderings_rank_as_the_real_engine_did():
    """Under KV pressure the prefix-aware orderings prefill each document about once: fcfs
    interleaves documents and prefills them again (as measured on the real engine)."""
    tput = {}
    for scheduler in ("fcfs", "lpm", "feather-heuristic"):
        env = FeatherEnv(SCENARIO, "sim", scheduler=scheduler)
        eps = [play_episode(env, episode_seed=s) for s in (11, 12)]
        tput[scheduler] = (sum(e["total_output_tokens"] for e in eps) / sum(e["duration"] for e in eps),
                           np.mean([e["prefix_hit_rate"] for e in eps]))
    assert tput["feather-heuristic"][0] > 1.4 * tput["fcfs"][0]
    assert tput["lpm"][0] > 1.4 * tput["fcfs"][0]
    assert tput["feather-heuristic"][1] > tput["fcfs"][1] + 0.2


def test_configuration_errors_are_clear():
    with pytest.raises(ConfigError, match="available"):
        FeatherEnv("no-such-scenario", "sim")
    with pytest.raises(ConfigError, match="reward"):
        FeatherEnv(SCENARIO, "sim", reward="speed")
    with pytest.raises(ConfigError, match="backend"):
        FeatherEnv(SCENARIO, "gpu")
    with pytest.raises(ConfigError, match="unknown scheduler"):
        FeatherEnv(SCENARIO, "sim", scheduler="fastest")
    with pytest.raises(ConfigError, match="valid keys"):
        FeatherEnv(SCENARIO, "sim", scenario_overrides={"episode": {"grups": 3}})
    with pytest.raises(ConfigError, match="can never fit"):
        FeatherEnv(SCENARIO, "sim", scenario_overrides={"engine": {"kv_cache_gib": 0.01}}).reset(seed=0)


# ---------------------------------------------------------------------------- the real engine


def test_scenario_mix_serves_a_held_out_episode_alike_for_every_agent():
    from feather_env.env import ScenarioMix

    names = [SCENARIO, "leval-summaries"]
    mix = ScenarioMix(names, "sim")
    check_env(mix, skip_render_check=True)
    fresh = ScenarioMix(names, "sim")
    # the first mix has drawn training episodes before; a held-out episode is the same episode
    for seed in (0, 1, 7):
        a = play_episode(mix, AlwaysAdd(), episode_seed=seed)
        b = play_episode(fresh, AlwaysAdd(), episode_seed=seed)
        assert mix.current.scenario.name == names[seed % 2] == fresh.current.scenario.name
        assert a["duration"] == b["duration"] and a["completed"] == b["completed"] > 0
    _, info = mix.reset(options={"scenario": "leval-summaries"})
    assert info["scenario"] == "leval-summaries"
    with pytest.raises(ConfigError, match="not in this mix"):
        mix.reset(options={"scenario": "sharegpt"})
    with pytest.raises(ConfigError, match="at least one"):
        ScenarioMix([], "sim")


def test_check_env_on_the_real_engine(env_backend):
    env = FeatherEnv(SCENARIO, env_backend)
    assert env.spec is None or env.spec.nondeterministic
    check_env(env, skip_render_check=True)


def test_real_episode_under_kv_pressure_serves_every_request_once(env_backend):
    """The real engine evicts and prefills documents again; the simulator takes the same
    scheduling decisions (its admission and prefix cache are vLLM's, exactly)."""
    # fcfs interleaves the documents, so the cache evicts some before all their questions ran
    real_env = FeatherEnv(SCENARIO, env_backend, scenario_overrides=SMALL, scheduler="fcfs")
    real = play_episode(real_env, episode_seed=22)
    timelines = real_env.backend.timelines()
    assert real["completed"] == real["submitted"] == len(timelines) > 20
    assert all(t.finished_count == 1 and t.tokens == t.output_len for t in timelines)
    sim_env = FeatherEnv(SCENARIO, "sim", scenario_overrides=SMALL, scheduler="fcfs")
    sim = play_episode(sim_env, episode_seed=22)
    ample = play_episode(FeatherEnv(SCENARIO, "sim", scheduler="fcfs", scenario_overrides={
        **SMALL, "engine": {"kv_cache_gib": 1.0}}), episode_seed=22)
    assert real["prefix_hit_rate"] < ample["prefix_hit_rate"] - 0.05  # KV pressure cost hits
    assert sim["prefix_hit_rate"] == pytest.approx(real["prefix_hit_rate"], abs=1e-9)
    assert sim["engine_steps"] == real["engine_steps"]
    assert sim["preemptions"] == real["preemptions"]
    assert sim["decisions"] == real["decisions"]


def test_env_observations_are_what_the_serving_scheduler_sees(env_backend):
    """The environment answers the decisions that FeatherScheduler asks its policy when it serves:
    the same observations and masks, in the same order, for the same arrivals and finishes."""
    from feather_env.engines.vllm_engine import forced_length_params, tokens_prompt
    from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN

    overrides = {"episode": {"groups": 4, "max_per_group": 3}}
    env = FeatherEnv(SCENARIO, env_backend, scenario_overrides=overrides, extended_obs=True)
    in_env = Recorder(HeuristicRule())
    play_episode(env, in_env, episode_seed=31)
    # the same episode served as in production: the scheduler plans before every step itself
    episode = env.scenario.episode_workload(31)
    sched = env_backend.scheduler
    engine = env_backend.llm.llm_engine
    assert not engine.has_unfinished_requests() and env_backend.llm.reset_prefix_cache()
    serving = Recorder(HeuristicRule())
    sched.feather_configure(env.scheduler_config, policy=serving)
    answered, sched.feather_planner = sched.feather_planner, None  # the policy answers, as it serves
    try:
        for r in sorted(episode, key=lambda r: r.arrival_time):
            params = forced_length_params(r.output_len, extra_args={EXTRA_OUTPUT_LEN: r.output_len})
            engine.add_request(f"s-{r.request_id}", tokens_prompt(r.prompt_token_ids), params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        sched.feather_planner = answered
    assert in_env.calls, "no decision was asked"
    assert serving.calls == in_env.calls


def test_engine_failure_mid_episode_is_a_clear_error_and_reset_recovers(env_backend, monkeypatch):
    env = FeatherEnv(SCENARIO, env_backend, scenario_overrides=SMALL)
    env.reset(seed=0)
    engine = env_backend.llm.llm_engine
    calls = {"n": 0}
    real_step = engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected engine fault")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(EngineError, match="injected engine fault"):
        while True:
            env.step(STOP)
    with pytest.raises(RuntimeError, match="engine failure"):
        env.step(ADD)
    monkeypatch.setattr(engine, "step", real_step)
    episode = play_episode(env, episode_seed=7)  # reset starts a clean engine state
    assert episode["completed"] == episode["submitted"]
