"""Agents in the serving-loop environment (simulator): they train, decide, export and merge.

The scenario is a small episode of leval-kv-pressure (6 documents, up to 4 questions each), so
an episode is a few milliseconds of simulation. STOP delays admissions while the engine runs, so
a random policy that STOPs half the time serves the episode more slowly than always-add; every
learned agent must find a policy at least as good as random and close to always-add.
"""

from __future__ import annotations

import numpy as np
import pytest

from agents.base import ADD, STOP, AgentEnv, evaluate
from agents.registry import AGENTS, agent_class, make_agent
from agents.ucb import UCBAgent, UCBConfig
from feather_env.env import FeatherEnv

SCENARIO = "leval-kv-pressure"
OVERRIDES = {"episode": {"groups": 6, "max_per_group": 4}, "workload": {"max_prompt_tokens": 4096},
             "engine": {"kv_cache_gib": 0.06}}
EVAL_SEEDS = range(5000, 5010)


def make_env(**kw) -> FeatherEnv:
    return FeatherEnv(SCENARIO, "sim", scenario_overrides=OVERRIDES, **kw)


@pytest.fixture(scope="module")
def baselines():
    env = make_env()
    return {name: evaluate(make_agent(name, env=env, seed=1), env, EVAL_SEEDS)
            for name in ("always-add", "random", "heuristic")}


def test_stopping_at_random_serves_more_slowly(baselines):
    assert baselines["always-add"]["output_throughput"] > 1.05 * baselines["random"]["output_throughput"]
    assert baselines["always-add"]["mean_return"] > baselines["random"]["mean_return"]
    for res in baselines.values():
        assert len(res["episodes"]) == len(EVAL_SEEDS)
        assert all(ep["completed"] > 0 for ep in res["episodes"])


@pytest.mark.parametrize("name,steps", [("ucb", 3000), ("qlearning", 3000), ("ppo", 2048)])
def test_agent_learns_a_policy_near_always_add_and_better_than_random(name, steps, baselines):
    config = None
    kwargs = {}
    if name == "ppo":
        from agents.ppo import PPOConfig

        config = PPOConfig(n_steps=256)
        kwargs["extended_obs"] = True
    agent = make_agent(name, config, seed=0)
    agent.learn(make_env(**kwargs), steps)
    assert agent.num_timesteps >= steps
    res = evaluate(agent, make_env(**kwargs), EVAL_SEEDS)
    assert res["output_throughput"] > baselines["random"]["output_throughput"]
    if name != "qlearning":  # its TD targets are noisy here (see agents/qlearning.py)
        assert res["output_throughput"] >= 0.95 * baselines["always-add"]["output_throughput"]


def test_ucb_credits_every_arm_of_the_episode_with_its_throughput():
    agent = UCBAgent(UCBConfig(credit="episode"), seed=0)
    both = np.array([True, True])
    assert agent.explore(np.array([3, 0, 5]), both) == ADD and not agent._pending  # rule, not an arm
    a1 = agent.explore(np.array([1, 2, 5]), both)
    agent.observe(np.zeros(3), a1, -0.5, np.zeros(3), both, False, {})
    a2 = agent.explore(np.array([2, 3, 5]), both)
    assert len(agent._pending) == 2 and not agent.counts.any()  # nothing credited mid-episode
    agent.observe(np.zeros(3), a2, -1.0, np.zeros(3), both, True,
                  {"feather_episode": {"output_throughput": 42.0}})
    s1, s2 = agent.bins.index([1, 2, 5]), agent.bins.index([2, 3, 5])
    assert agent.counts[s1, a1] == 1 and agent.means[s1, a1] == 42.0
    assert agent.counts[s2, a2] == 1 and agent.means[s2, a2] == 42.0
    assert not agent._pending
    # return-to-go credit: each arm gets the rewards from its decision on
    rtg = UCBAgent(seed=0)  # the default credit
    b1 = rtg.explore(np.array([1, 2, 5]), both)
    rtg.observe(np.zeros(3), b1, -0.5, np.zeros(3), both, False, {})
    b2 = rtg.explore(np.array([2, 3, 5]), both)
    rtg.observe(np.zeros(3), b2, -1.0, np.zeros(3), both, True, {})
    assert rtg.means[s1, b1] == pytest.approx(-1.5) and rtg.means[s2, b2] == pytest.approx(-1.0)


def test_tabular_merge_is_count_weighted():
    from agents.qlearning import QLearningAgent

    base = UCBAgent().state_dict()
    w1, w2 = UCBAgent().state_dict(), UCBAgent().state_dict()
    w1["counts"][0, 1], w1["means"][0, 1] = 3, 100.0
    w2["counts"][0, 1], w2["means"][0, 1] = 1, 200.0
    merged = UCBAgent.merge(base, [w1, w2])
    assert merged["counts"][0, 1] == 4 and merged["means"][0, 1] == pytest.approx(125.0)
    # from a non-empty base: only what each worker added counts
    base2 = {"counts": merged["counts"].copy(), "means": merged["means"].copy()}
    w3 = {"counts": base2["counts"].copy(), "means": base2["means"].copy()}
    w3["counts"][0, 1] += 4
    w3["means"][0, 1] = (125.0 * 4 + 25.0 * 4) / 8
    again = UCBAgent.merge(base2, [w3, {k: v.copy() for k, v in base2.items()}])
    assert again["counts"][0, 1] == 8 and again["means"][0, 1] == pytest.approx(75.0)

    qa = QLearningAgent().state_dict()
    q1, q2 = QLearningAgent().state_dict(), QLearningAgent().state_dict()
    q1["visits"][5, 0], q1["q"][5, 0] = 3, -1.0
    q2["visits"][5, 0], q2["q"][5, 0] = 1, -3.0
    mq = QLearningAgent.merge(qa, [q1, q2])
    assert mq["visits"][5, 0] == 4 and mq["q"][5, 0] == pytest.approx(-1.5)
    assert mq["q"][6, 0] == 0.0  # nobody visited: unchanged


def test_checkpoint_round_trip(tmp_path):
    env = make_env()
    for name in ("ucb", "qlearning", "heuristic"):
        agent = make_agent(name, seed=3)
        agent.learn(env, 300)
        path = agent.save(tmp_path / f"{name}.npz")
        again = agent_class(name).load(path)
        assert again.num_timesteps == agent.num_timesteps >= 300
        for key, value in agent.state_dict().items():
            np.testing.assert_array_equal(value, again.state_dict()[key])
        assert again.rng.random() == agent.rng.random()


def test_registry_and_oracle_keep_one_document_in_the_batch():
    assert {"always-add", "oracle", "random", "heuristic", "ucb", "qlearning", "ppo"} <= set(AGENTS)
    with pytest.raises(KeyError, match="known agents"):
        agent_class("nope")
    env = make_env()
    oracle = make_agent("oracle", env=env)
    obs, _ = env.reset(seed=1)
    adds = stops = 0
    done = False
    while not done:
        batch, cand = env.batch_requests, env.candidate_request
        action = oracle.act(obs, env.action_masks())
        if action == ADD:
            assert cand.prefix_group == batch[0].prefix_group
            adds += 1
        else:
            assert cand.prefix_group != batch[0].prefix_group
            stops += 1
        obs, _, done, _, info = env.step(action)
    assert adds and stops and info["episode"]["completed"] == info["episode"]["submitted"]


def test_agent_env_scales_and_keeps_episode_stats():
    env = AgentEnv(make_env(extended_obs=True), scale_obs=True)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs) and np.all(np.abs(obs) <= 1)
    info = {}
    done = False
    while not done:
        obs, _, done, _, info = env.step(ADD if env.action_masks()[ADD] else STOP)
    assert "feather_episode" in info and "episode" not in info
    assert info["feather_episode"]["output_throughput"] > 0
    assert "mean_delta" in info["feather_episode"]
