"""The ``goodput`` reward on the simulator: +1 per request finished within every latency SLO
(``vllm bench serve --goodput``'s definition), so an episode's return is its number of good requests,
the count ``request_goodput`` reports; the SLOs through the run config and ``train.py --goodput``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

import train
from agents.run_config import load_config, parse_config
from feather_env.env import REWARDS, FeatherEnv, GoodputReward, play_episode
from feather_env.serving_metrics import meets_slos, serving_metrics
from scheduler_runtime.config import ConfigError
from scheduler_runtime.policy import load_policy

#: A small leval-kv-pressure episode (tests/test_train.py's): a few milliseconds of simulation.
OVERRIDES = {"episode": {"groups": 5, "max_per_group": 4}, "workload": {"max_prompt_tokens": 2048},
             "engine": {"kv_cache_gib": 0.03}}
SEEDS = (0, 1, 2)
LOOSE = "ttft:1e9 tpot:1e9 e2el:1e9"


def make_env(**kw) -> FeatherEnv:
    return FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=OVERRIDES, **kw)


def serve(env: FeatherEnv, seed: int, *, random_actions: bool = False) -> tuple[float, dict]:
    """One episode through ``step()``: the summed reward and the final ``info["episode"]``."""
    if not random_actions:
        out = play_episode(env, episode_seed=seed)
        return out["return"], out
    rng = np.random.default_rng(seed)
    env.reset(seed=seed, options={"episode_seed": seed})
    total, info, done = 0.0, {}, env.terminated
    while not done:
        valid = np.flatnonzero(env.action_masks())
        _, reward, terminated, truncated, info = env.step(int(rng.choice(valid)))
        total += reward
        done = terminated or truncated
    return total, info["episode"]


def good_requests(env: FeatherEnv, slos: dict[str, float]) -> int:
    """The episode's requests meeting ``slos``, as ``vllm bench serve`` counts them: goodput x duration."""
    m = serving_metrics(env.backend.timelines(), goodput=slos)
    return round(m["request_goodput"] * m["duration"])


def split_slos(decision: str) -> dict[str, float]:
    """SLOs that some requests of the test episodes meet and others miss (from a latency-reward run)."""
    env = make_env(decision=decision)
    ttft, tpot = [], []
    for seed in SEEDS:
        play_episode(env, episode_seed=seed)
        ttft += [t.ttft for t in env.backend.timelines()]
        tpot += [t.tpot for t in env.backend.timelines() if t.tokens > 1]
    return {"ttft": float(np.median(ttft)) * 1000, "tpot": float(np.percentile(tpot, 90)) * 1000}


@pytest.mark.parametrize("decision", ["request", "group"])
@pytest.mark.parametrize("random_actions", [False, True])
def test_the_return_is_the_number_of_requests_meeting_the_slos(decision, random_actions):
    slos = split_slos(decision)
    spec = " ".join(f"{k}:{v!r}" for k, v in slos.items())
    env = make_env(decision=decision, reward="goodput", goodput_slos=spec)
    assert env.goodput_slos == slos and env.units == "good requests"
    counts = []
    for seed in SEEDS:
        total, episode = serve(env, seed, random_actions=random_actions)
        good = good_requests(env, slos)
        assert total == good, (seed, total, good)
        assert good == sum(t.completed and meets_slos(t, slos) for t in env.backend.timelines())
        assert episode["goodput_slos_ms"] == slos
        assert episode["request_goodput"] == pytest.approx(good / episode["duration"])
        counts.append((good, episode["completed"]))
    assert any(0 < good < n for good, n in counts), counts  # the SLOs tell requests apart


def test_a_mapping_of_slos_and_reward_scale():
    slos = split_slos("request")
    plain = make_env(reward="goodput", goodput_slos=slos)
    scaled = make_env(reward="goodput", goodput_slos=slos, reward_scale=0.5)
    for seed in SEEDS:
        assert serve(scaled, seed)[0] == 0.5 * serve(plain, seed)[0]


def test_loose_slos_count_every_request_and_ttft_0_none():
    loose, strict = make_env(reward="goodput", goodput_slos=LOOSE), make_env(reward="goodput",
                                                                            goodput_slos="ttft:0")
    for seed in SEEDS:
        total, episode = serve(loose, seed)
        assert total == episode["completed"] == episode["submitted"] == len(loose.backend.timelines()) > 0
        assert episode["request_goodput"] == pytest.approx(episode["request_throughput"])
        total, episode = serve(strict, seed)
        assert total == 0.0 and episode["request_goodput"] == 0.0


def test_slos_with_another_reward_are_only_reported():
    for reward in ("latency", "makespan", "decode_throughput"):
        plain, reported = make_env(reward=reward), make_env(reward=reward, goodput_slos="ttft:5000 tpot:50")
        for seed in SEEDS[:2]:
            total, episode = serve(plain, seed)
            total_slos, episode_slos = serve(reported, seed)
            assert total_slos == total  # the reward's numbers do not change
            assert episode["request_goodput"] is None and "goodput_slos_ms" not in episode
            assert episode_slos["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 50.0}
            assert episode_slos["request_goodput"] == pytest.approx(
                good_requests(reported, {"ttft": 5000.0, "tpot": 50.0}) / episode_slos["duration"])


def test_goodput_needs_slos_and_checks_them():
    assert REWARDS[0] == "latency" and REWARDS[-1] == "goodput"  # appended; the default is unchanged
    for missing in (None, "", {}):
        with pytest.raises(ConfigError, match="reward 'goodput' needs latency SLOs"):
            make_env(reward="goodput", goodput_slos=missing)
    with pytest.raises(ConfigError, match="reward 'goodput' needs latency SLOs"):
        GoodputReward()
    for bad, message in (("ttft=5", "NAME:MILLISECONDS"), ("itl:50", "unknown goodput SLO 'itl'"),
                         ("ttft:-1", "milliseconds >= 0"), ({"ttft": math.nan}, "finite milliseconds"),
                         ({"itl": 5.0}, "unknown goodput SLO"), ({"ttft": "5"}, "finite milliseconds")):
        with pytest.raises(ConfigError, match=message):
            make_env(reward="goodput", goodput_slos=bad)


# -- the run config and train.py ------------------------------------------------------------------
def small_config(agent: str, env: dict | None = None) -> dict:
    return {"scenario": {"name": "leval-kv-pressure", **OVERRIDES}, "agent": {"name": agent},
            "env": dict(env or {}),
            "train": {"timesteps": 200, "eval_every": 0, "eval_episodes": 2, "checkpoint_every": 0,
                      "progress_bar": False}}


def write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_run_config_takes_goodput():
    cfg = parse_config(small_config("qlearning", {"reward": "goodput", "goodput": "ttft:5000 tpot:50"}))
    assert cfg.env.goodput_slos == cfg.to_dict()["env"]["goodput_slos"] == "ttft:5000 tpot:50"
    assert parse_config(cfg.to_dict()).env == cfg.env  # the saved config reads back the same
    assert parse_config(small_config("ucb")).env.goodput_slos is None  # default: null
    with pytest.raises(ConfigError, match="env.reward 'goodput' needs latency SLOs"):
        parse_config(small_config("ucb", {"reward": "goodput"}))
    with pytest.raises(ConfigError, match="env.goodput_slos: unknown goodput SLO 'itl'"):
        parse_config(small_config("ucb", {"goodput": "itl:5"}))
    with pytest.raises(ConfigError, match="one key"):
        parse_config(small_config("ucb", {"goodput": "ttft:1", "goodput_slos": "ttft:2"}))
    with pytest.raises(ConfigError, match=r"env: unknown key\(s\) \['goodputs'\]"):
        parse_config(small_config("ucb", {"goodputs": "ttft:1"}))


def test_the_goodput_flag_overrides_the_config(tmp_path):
    path = write(tmp_path, small_config("ucb", {"goodput": "ttft:1"}))
    assert load_config(path).env.goodput_slos == "ttft:1"
    assert load_config(path, goodput="e2el:9").env.goodput_slos == "e2el:9"


def test_train_reward_goodput_without_slos_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", "qlearning", "--config", str(write(tmp_path, small_config("qlearning"))),
                    "--out", str(out), "--reward", "goodput", "--backend", "sim"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("train.py: ") and "--goodput" in err, err
    assert not out.exists()


def test_train_with_the_goodput_reward_end_to_end(tmp_path):
    out = tmp_path / "run"
    res = train.main(["--agent", "qlearning", "--config", str(write(tmp_path, small_config("qlearning"))),
                      "--out", str(out), "--reward", "goodput", "--goodput", "ttft:5000 tpot:50",
                      "--timesteps", "150", "--backend", "sim", "--no-progress"])
    assert res.num_timesteps == 150
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["env"]["reward"] == "goodput" and saved["env"]["goodput_slos"] == "ttft:5000 tpot:50"
    assert load_policy(out / "policy.feather").agent == "qlearning"
    assert res.final_eval["output_throughput"] > 0
