"""FeatherEnv on the simulator and on the real engine."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import feather_env  # noqa: F401  (registers feather/Batching-v0)
from feather_env.env import ADD, STOP, FeatherEnv, InvalidActionError
from feather_env.workloads import synthetic_workload
from scheduler_runtime.config import ConfigError

SMALL = synthetic_workload(num_groups=6, per_group="uniform:3:8", prefix_len="uniform:600:1500",
                           suffix_len="uniform:5:20", output_len="uniform:4:10", seed=3, name="small")


def _run_episode(env: FeatherEnv, policy, seed: int):
    obs, info = env.reset(seed=seed)
    total, steps, batches = 0.0, 0, []
    while True:
        action = policy(obs, env.action_masks())
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs)
        total += reward
        steps += 1
        if "batch" in info:
            batches.append(info["batch"])
        if terminated or truncated:
            return total, steps, batches, info


def always_add(obs, mask):
    return ADD if mask[ADD] else STOP


def test_check_env_sim():
    env = gym.make("feather/Batching-v0", backend="sim", workload=SMALL, waiting=20,
                   max_batch_size=8)
    check_env(env.unwrapped, skip_render_check=True)


def test_sim_episode_serves_everyone_once_and_is_reproducible():
    env = FeatherEnv("sim", SMALL, waiting=24, max_batch_size=8)
    r1 = _run_episode(env, always_add, seed=11)
    r2 = _run_episode(env, always_add, seed=11)
    assert r1[0] == r2[0] and r1[1] == r2[1]
    info = r1[3]["episode"]
    assert info["served"] == info["requests"] == 24
    assert len(env.served_ids) == 24
    assert sum(b["batch_size"] for b in r1[2]) == 24
    assert all(b["batch_size"] <= 8 for b in r1[2])
    assert r1[0] < 0  # makespan reward: minus seconds


def test_masks_and_invalid_actions():
    env = FeatherEnv("sim", SMALL, waiting=10, max_batch_size=2)
    env.reset(seed=0)
    assert env.batch and len(env.batch) == 1  # the seed request is admitted by the env
    assert env.action_masks().tolist() == [True, True]
    env.step(ADD)
    assert env.action_masks().tolist() == [True, False]  # batch full
    with pytest.raises(InvalidActionError, match="max_batch_size"):
        env.step(ADD)
    with pytest.raises(InvalidActionError):
        env.step(5)
    _, reward, terminated, _, info = env.step(STOP)
    assert info["batch"]["batch_size"] == 2 and not terminated and reward < 0


def test_kv_capacity_masks_add():
    longest = max(r.peak_tokens for r in SMALL)
    env = FeatherEnv("sim", SMALL, waiting=10, max_batch_size=8, kv_capacity_tokens=longest + 10)
    env.reset(seed=1)
    # with room for only about one request, ADD of another group's candidate never fits
    for _ in range(30):
        mask = env.action_masks()
        if not mask[ADD]:
            break
        env.step(ADD)
    assert not env.action_masks()[ADD]


def test_homogeneous_batches_beat_mixed_ones_on_the_sim():
    """The fitted model must carry the paper's effect: one group per batch decodes faster."""
    wl = synthetic_workload(num_groups=8, per_group=32, prefix_len=12000, suffix_len=20,
                            output_len=32, seed=5, name="eight")
    env = FeatherEnv("sim", wl, waiting=256, max_batch_size=256)
    by_group = {}
    for r in wl:
        by_group.setdefault(r.prefix_group, []).append(r)
    hom = [env.backend.run_batch(g) for g in by_group.values()]
    het = env.backend.run_batch(list(np.random.default_rng(0).permutation(list(wl))))
    hom_tput = sum(r.decode_tokens for r in hom) / sum(r.decode_seconds for r in hom)
    assert hom_tput > 1.5 * het.decode_tok_s


def test_config_validation():
    with pytest.raises(ConfigError, match="reward"):
        FeatherEnv("sim", SMALL, reward="latency")
    with pytest.raises(ConfigError, match="waiting"):
        FeatherEnv("sim", SMALL, waiting=10_000)
    with pytest.raises(ConfigError, match="backend"):
        FeatherEnv("gpu", SMALL, waiting=10)
    with pytest.raises(ConfigError, match="valid keys"):
        FeatherEnv("sim", {"kind": "synthetic", "num_groupz": 3}, waiting=10)


@pytest.mark.engine
def test_check_env_and_full_episode_on_the_real_engine(vllm_backend):
    env = FeatherEnv(vllm_backend, SMALL, waiting=12, max_batch_size=6)
    assert env.spec is not None and env.spec.nondeterministic
    check_env(env, skip_render_check=True)
    total, steps, batches, info = _run_episode(env, always_add, seed=4)
    ep = info["episode"]
    assert ep["served"] == ep["requests"] == 12
    assert sorted(env.served_ids) == sorted(r.request_id for r in env._requests.values())
    assert sum(b["batch_size"] for b in batches) == 12
    assert ep["decode_tok_s"] > 0


@pytest.mark.engine
def test_engine_failure_mid_episode_is_a_clear_error(vllm_backend, monkeypatch):
    from feather_env.engine import EngineError, engine_core_of

    executor = engine_core_of(vllm_backend.llm).model_executor
    real_execute = executor.execute_model
    calls = {"n": 0}

    def failing_execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected worker failure")
        return real_execute(*args, **kwargs)

    env = FeatherEnv(vllm_backend, SMALL, waiting=12, max_batch_size=4)
    env.reset(seed=0)
    monkeypatch.setattr(executor, "execute_model", failing_execute)
    with pytest.raises(EngineError, match="injected worker failure"):
        for _ in range(100):
            env.step(STOP)
    monkeypatch.setattr(executor, "execute_model", real_execute)
    assert not vllm_backend.llm.llm_engine.has_unfinished_requests()
    # a new environment in the same process serves a whole episode
    env2 = FeatherEnv(vllm_backend, SMALL, waiting=6, max_batch_size=6)
    _, _, _, info = _run_episode(env2, always_add, seed=1)
    assert info["episode"]["served"] == 6
