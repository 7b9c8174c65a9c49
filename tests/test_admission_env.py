"""feather/Admission-v0 (feather_env.admission_env): the admit/reject decision as an environment.

Checked against the plain serving loop (FeatherEnv with the base setting, and with its ``~slo:F``
rule), request by request, on one 100-s window of the overload scenario.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import feather_env  # noqa: F401 - registers the ids
from feather_env.admission_env import ADMIT, DEFAULT_PROFILE, REJECT, AdmissionEnv, rule_action
from feather_env.env import FeatherEnv, play_episode
from scheduler_runtime.config import ConfigError

SCENARIO = "mooncake-overload-3l"
SLOS = {"ttft": 5000.0, "tpot": 50.0}
BASE = "group-cap-8@256"
SEED = 35  # the window [101, 201) s of the trace


@pytest.fixture(scope="module")
def env() -> AdmissionEnv:
    return AdmissionEnv(SCENARIO, setting=BASE, profile=DEFAULT_PROFILE, slos=SLOS)


def _play(env: AdmissionEnv, policy, seed: int = SEED) -> tuple[dict, float]:
    obs, _ = env.reset(options={"episode_seed": seed})
    total, done = 0.0, False
    while not done:
        assert env.observation_space.contains(obs)
        obs, reward, done, truncated, info = env.step(policy(obs))
        assert not truncated
        total += reward
    return info["episode"], total


def _plain(setting: str, seed: int = SEED) -> tuple[dict, list]:
    plain = FeatherEnv(SCENARIO, "sim", scheduler=setting, profile=DEFAULT_PROFILE, goodput_slos=SLOS)
    ep = play_episode(plain, episode_seed=seed)
    return ep, plain.backend.timelines()


def test_registered_and_env_checker(env: AdmissionEnv) -> None:
    made = gym.make("feather/Admission-v0", episode_seeds=[SEED])
    assert isinstance(made.unwrapped, AdmissionEnv)
    made.close()
    check_env(env, skip_render_check=True)
    assert env.action_masks().tolist() == [True, True]
    with pytest.raises(ConfigError):
        AdmissionEnv(SCENARIO, setting=f"{BASE}~slo:1", profile=DEFAULT_PROFILE)


def test_always_admit_is_the_plain_serving_loop(env: AdmissionEnv) -> None:
    ep, ret = _play(env, lambda obs: ADMIT)
    plain, plain_tl = _plain(BASE)
    assert ep["submitted"] == plain["submitted"] and ep["rejected"] == 0
    assert ep["slo_attainment"] == pytest.approx(plain["slo_attainment"], abs=1e-12)
    assert ret == ep["good"] == round(plain["slo_attainment"] * plain["submitted"])
    # request by request: the same first tokens and finishes on the same clock
    mine = {t.request_id: t for t in env.timelines()}
    assert set(mine) == {t.request_id for t in plain_tl}
    for t in plain_tl:
        m = mine[t.request_id]
        assert math.isclose(m.first_token, t.first_token, abs_tol=1e-9)
        assert math.isclose(m.finish, t.finish, abs_tol=1e-9)


def test_always_reject_counts_every_request(env: AdmissionEnv) -> None:
    ep, ret = _play(env, lambda obs: REJECT)
    assert ret == 0 and ep["slo_attainment"] == 0.0
    assert ep["submitted"] == ep["rejected"] == len(env.timelines()) > 100
    assert all(t.outcome == "rejected" for t in env.timelines())


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_rule_as_policy_matches_the_serving_rule(env: AdmissionEnv, factor: float) -> None:
    """``rule_action(obs, F)`` decides as the backend's own ``~slo:F`` controller: identical runs."""
    ep, ret = _play(env, lambda obs: rule_action(obs, factor))
    plain, plain_tl = _plain(f"{BASE}~slo:{factor:g}")
    assert ep["rejected"] == plain["rejected"] > 0
    assert ep["slo_attainment"] == pytest.approx(plain["slo_attainment"], abs=1e-12)
    assert ret == ep["good"]
    rejected = {t.request_id for t in env.timelines() if t.outcome == "rejected"}
    assert rejected == {t.request_id for t in plain_tl if t.outcome == "rejected"}


def test_reward_is_credited_at_finish(env: AdmissionEnv) -> None:
    """The first decision earns nothing (no request has finished yet); the return is the good count."""
    obs, info = env.reset(options={"episode_seed": SEED})
    assert info["episode_seed"] == SEED and obs.dtype == np.float32
    _, reward, done, _, step_info = env.step(ADMIT)
    assert reward == 0.0 and not done and step_info["decisions"] == 1
