"""Exported policies: every agent round-trips through the versioned file, PPO's numpy MLP matches
stable-baselines3, and damaged or mismatched files are clear errors (scheduler_runtime.policy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.base import NotExportableError
from agents.registry import make_agent
from feather_env.env import FeatherEnv
from scheduler_runtime.decision import ObservationSpec, PolicyFormatError
from scheduler_runtime.policy import FORMAT_VERSION, TablePolicy, load_policy, write_policy

REPO = Path(__file__).resolve().parent.parent
#: A small leval-kv-pressure episode on the simulator (milliseconds per episode).
OVERRIDES = {"episode": {"groups": 6, "max_per_group": 4}, "workload": {"max_prompt_tokens": 4096},
             "engine": {"kv_cache_gib": 0.06}}


def make_env(**kw) -> FeatherEnv:
    return FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=OVERRIDES, **kw)


def random_observations(env: FeatherEnv, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Observations over the whole space (integers, as the environment emits) and random masks."""
    rng = np.random.default_rng(seed)
    low, high = env.observation_space.low, env.observation_space.high
    obs = rng.integers(low.astype(int), high.astype(int) + 1, size=(n, len(low))).astype(np.float32)
    masks = np.ones((n, 2), dtype=bool)
    masks[rng.random(n) < 0.1, 1] = False  # ADD invalid now and then
    return obs, masks


@pytest.fixture(scope="module")
def ppo_agent():
    from agents.ppo import PPOConfig

    agent = make_agent("ppo", PPOConfig(n_steps=128, batch_size=64, n_epochs=2), seed=0)
    agent.learn(make_env(), 512)
    return agent


@pytest.fixture(scope="module")
def trained():
    env = make_env()
    agents = {}
    for name, steps in (("ucb", 2000), ("qlearning", 2000), ("heuristic", 100), ("always-add", 0)):
        agent = make_agent(name, seed=1, env=env)
        if steps:
            agent.learn(env, steps)
        agents[name] = agent
    return agents


@pytest.mark.parametrize("name", ["ucb", "qlearning", "always-add"])
def test_stateless_round_trip(name, trained, tmp_path):
    agent = trained[name]
    path = agent.export(tmp_path / "policy.feather")
    policy = load_policy(path)
    obs, masks = random_observations(make_env(), 5000, seed=2)
    agent_actions = [agent.act(o, m) for o, m in zip(obs, masks, strict=True)]
    policy_actions = [policy.act(o, m) for o, m in zip(obs, masks, strict=True)]
    assert agent_actions == policy_actions
    if name != "always-add":
        assert 0 < sum(agent_actions) < len(agent_actions)  # a table that says both things
    # states the env actually visits, too
    env = make_env()
    o, _ = env.reset(seed=9)
    for _ in range(300):
        m = env.action_masks()
        a = agent.act(o, m)
        assert policy.act(o, m) == a
        o, _, done, _, _ = env.step(a)
        if done:
            o, _ = env.reset()


def test_heuristic_round_trip_is_stateful(trained, tmp_path):
    agent = trained["heuristic"]
    policy = load_policy(agent.export(tmp_path / "h.feather"))
    obs, masks = random_observations(make_env(), 3000, seed=3)
    agent.reset()
    policy.reset()
    for i, (o, m) in enumerate(zip(obs, masks, strict=True)):
        if i % 200 == 0:  # episodes of 200 decisions
            agent.reset()
            policy.reset()
        assert agent.act(o, m) == policy.act(o, m)
    assert policy.rule.floor == agent.rule.floor


@pytest.fixture
def balanced_ppo(ppo_agent):
    """The trained PPO agent with its ADD logit's bias moved so that it answers STOP and ADD
    about equally often on the test observations (briefly trained, it ADDs nearly everywhere,
    and agreeing on one answer everywhere proves little about the export). Restored after."""
    import torch

    obs, _ = random_observations(make_env(), 10_000, seed=4)
    policy = ppo_agent.model.policy
    scaled = torch.as_tensor(obs / make_env().obs_scale, dtype=torch.float32)
    with torch.no_grad():
        logits = policy.action_net(policy.mlp_extractor.forward_actor(scaled)).numpy()
        shift = float(np.median(logits[:, 1] - logits[:, 0]))
        policy.action_net.bias[1] -= shift
    try:
        yield ppo_agent
    finally:
        with torch.no_grad():
            policy.action_net.bias[1] += shift


def test_ppo_export_matches_sb3_on_10000_observations(balanced_ppo, tmp_path):
    path = balanced_ppo.export(tmp_path / "ppo.feather")
    policy = load_policy(path)
    obs, masks = random_observations(make_env(), 10_000, seed=4)
    sb3 = balanced_ppo.predict_batch(obs, masks)
    mine = np.array([policy.act(o, m) for o, m in zip(obs, masks, strict=True)])
    assert (mine == sb3).all(), f"{int((mine != sb3).sum())} of 10000 decisions differ"
    # both actions occur often among the unmasked decisions, so the comparison covers both
    both = masks.all(axis=1)
    assert 0.2 < sb3[both].mean() < 0.8, sb3[both].mean()
    # and the logits themselves agree with torch
    import torch

    scaled = torch.as_tensor(obs[:100] / make_env().obs_scale, dtype=torch.float32)
    with torch.no_grad():
        latent = balanced_ppo.model.policy.mlp_extractor.forward_actor(scaled)
        logits = balanced_ppo.model.policy.action_net(latent).numpy()
    np.testing.assert_allclose(np.array([policy.logits(o) for o in obs[:100]]), logits, rtol=1e-4, atol=1e-5)


def test_loading_needs_neither_torch_nor_sb3(trained, ppo_agent, tmp_path):
    paths = [trained[n].export(tmp_path / f"{n}.feather") for n in ("ucb", "heuristic")]
    paths.append(ppo_agent.export(tmp_path / "ppo.feather"))
    code = (
        "import sys\n"
        "from scheduler_runtime.policy import load_policy\n"
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    pol = load_policy(p)\n"
        "    assert pol.act([4, 2, 3], [True, True]) in (0, 1)\n"
        "bad = [m for m in ('torch', 'stable_baselines3', 'sb3_contrib', 'gymnasium') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_oracle_and_random_are_not_exportable(tmp_path):
    env = make_env()
    for name in ("oracle", "random"):
        with pytest.raises(NotExportableError):
            make_agent(name, env=env).export(tmp_path / "x.feather")


# -- damaged and mismatched files --------------------------------------------------------------
@pytest.fixture
def good_file(trained, tmp_path) -> Path:
    return trained["ucb"].export(tmp_path / "good.feather")


def _rewrite(path: Path, edit) -> None:
    """Edit the document and re-sign it, so that only the edited problem remains."""
    import hashlib

    from scheduler_runtime.policy import _canonical

    doc = json.loads(path.read_text())
    edit(doc)
    body = {k: v for k, v in doc.items() if k != "sha256"}
    doc["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    path.write_text(json.dumps(doc))


def test_truncated_file(good_file):
    raw = good_file.read_bytes()
    good_file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(PolicyFormatError, match="truncated or corrupted") as err:
        load_policy(good_file)
    assert str(good_file) in str(err.value)


def test_corrupted_value_fails_the_checksum(good_file):
    doc = json.loads(good_file.read_text())
    doc["params"]["values"][7] += 1.0
    good_file.write_text(json.dumps(doc))
    with pytest.raises(PolicyFormatError, match="checksum"):
        load_policy(good_file)


def test_empty_missing_and_foreign_files(tmp_path):
    with pytest.raises(PolicyFormatError, match="no such file"):
        load_policy(tmp_path / "missing.feather")
    (tmp_path / "empty.feather").write_text("")
    with pytest.raises(PolicyFormatError, match="empty"):
        load_policy(tmp_path / "empty.feather")
    (tmp_path / "other.feather").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(PolicyFormatError, match="not a feather-policy file"):
        load_policy(tmp_path / "other.feather")
    (tmp_path / "list.feather").write_text("[1, 2]")
    with pytest.raises(PolicyFormatError, match="JSON object"):
        load_policy(tmp_path / "list.feather")


def test_wrong_version(good_file):
    _rewrite(good_file, lambda d: d.update(version=FORMAT_VERSION + 1))
    expected = f"version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"
    with pytest.raises(PolicyFormatError, match=expected):
        load_policy(good_file)


def test_wrong_observation_spec(good_file):
    _rewrite(good_file, lambda d: d["observation"].update(names=["batch_size", "w", "delta"]))
    with pytest.raises(PolicyFormatError, match="observation names"):
        load_policy(good_file)


def test_observation_spec_mismatch_with_the_caller(good_file):
    env_spec = ObservationSpec.from_env(make_env())
    assert load_policy(good_file, obs_spec=env_spec).obs_spec == env_spec
    other_scale = ObservationSpec.from_env(make_env(delta_clip=32))
    with pytest.raises(PolicyFormatError, match="observation spec mismatch: observation scale"):
        load_policy(good_file, obs_spec=other_scale)
    chunk = env_spec.chunk_size
    other_chunks = ObservationSpec.from_env(FeatherEnv("leval-kv-pressure", "sim", scenario_overrides={
        **OVERRIDES, "scheduler": {"chunk_size": 2 * chunk}}))
    with pytest.raises(PolicyFormatError, match=f"chunks of {chunk} tokens, expected {2 * chunk}"):
        load_policy(good_file, obs_spec=other_chunks)
    extended = ObservationSpec.from_env(make_env(extended_obs=True))
    with pytest.raises(PolicyFormatError, match="names"):
        load_policy(good_file, obs_spec=extended)


def test_wrong_action_spec(good_file):
    _rewrite(good_file, lambda d: d["action"].update(names=["ADD", "STOP"]))
    with pytest.raises(PolicyFormatError, match="action spec"):
        load_policy(good_file)


def test_bad_parameters(good_file):
    _rewrite(good_file, lambda d: d["params"]["values"].pop())
    with pytest.raises(PolicyFormatError, match="bad 'table' parameters: 'values' must hold"):
        load_policy(good_file)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(delta_max="5"), "delta_max must be a finite number, got '5'"),
    (lambda p: p.update(w_shared=None), "w_shared must be a finite number"),
    (lambda p: p.update(floor_cap=2.5), "floor_cap must be an integer >= 0"),
    (lambda p: p.update(floor_init=True), "floor_init must be an integer >= 0"),
    (lambda p: p.update(floor_init=11), "floor_init 11 exceeds floor_cap 10"),
])
def test_resigned_heuristic_with_bad_param_types_fails_at_load_not_at_the_first_decision(
        trained, tmp_path, edit, message):
    """``HeuristicRule(**params)`` once checked no types, so such a file loaded and the
    scheduler raised at its first decision, inside the engine's busy loop."""
    path = trained["heuristic"].export(tmp_path / "h.feather")
    _rewrite(path, lambda d: edit(d["params"]))
    with pytest.raises(PolicyFormatError, match=f"bad 'heuristic' parameters: {message}"):
        load_policy(path)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["bins"].update(w_div="4"), "bins.w_div must be an integer >= 1"),
    (lambda p: p["visits"].__setitem__(0, True), "'visits' must be non-negative integers"),
    (lambda p: p["values"].__setitem__(0, False), "'values' must be finite numbers"),
    (lambda p: p.update(add_if_delta_zero="no"), "'add_if_delta_zero' must be true or false"),
])
def test_table_params_of_the_wrong_type_are_load_errors(good_file, edit, message):
    _rewrite(good_file, lambda d: edit(d["params"]))
    with pytest.raises(PolicyFormatError, match=f"bad 'table' parameters: {message}"):
        load_policy(good_file)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["layers"][0]["bias"].__setitem__(0, "0.1"), "layer 0: weights must be finite numbers"),
    (lambda p: p["layers"][1]["weight"][0].__setitem__(0, None), "layer 1: weights must be finite numbers"),
    (lambda p: p.update(activation="gelu"), "'activation' must be 'tanh' or 'relu'"),
    (lambda p: p["layers"][0].update(scale=2), "layer 0: must be"),
])
def test_mlp_params_of_the_wrong_type_are_load_errors(ppo_agent, tmp_path, edit, message):
    path = ppo_agent.export(tmp_path / "ppo.feather")
    _rewrite(path, lambda d: edit(d["params"]))
    with pytest.raises(PolicyFormatError, match=f"bad 'mlp' parameters: {message}"):
        load_policy(path)


def test_unknown_kind(good_file):
    _rewrite(good_file, lambda d: d.update(kind="transformer"))
    with pytest.raises(PolicyFormatError, match="unknown policy kind 'transformer'"):
        load_policy(good_file)


def test_bad_mlp_shapes(ppo_agent, tmp_path):
    path = ppo_agent.export(tmp_path / "ppo.feather")
    _rewrite(path, lambda d: d["params"]["layers"][1]["weight"].pop())
    with pytest.raises(PolicyFormatError, match="layer 1"):
        load_policy(path)


def test_write_rejects_non_finite(trained, tmp_path):
    policy = trained["ucb"].to_policy()
    assert isinstance(policy, TablePolicy)
    policy.values[0] = float("nan")
    with pytest.raises(PolicyFormatError, match="cannot serialize"):
        write_policy(tmp_path / "nan.feather", policy)
    assert not (tmp_path / "nan.feather").exists()
