"""train.py end to end on the simulator (config, TensorBoard logs, checkpoints, export, --resume,
--n-envs, --scenario), config validation, and one short run on the session's real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import train
from agents.training import load_config, parse_config, run
from scheduler_runtime.config import ConfigError
from scheduler_runtime.policy import load_policy

REPO = Path(__file__).resolve().parent.parent
#: A small leval-kv-pressure episode: a few milliseconds of simulation.
SMALL_SCENARIO = {"name": "leval-kv-pressure", "episode": {"groups": 4, "max_per_group": 3},
                  "workload": {"max_prompt_tokens": 2048}, "engine": {"kv_cache_gib": 0.03}}


def small_config(agent: str, **train_kw) -> dict:
    cfg = {
        "scenario": dict(SMALL_SCENARIO),
        "agent": {"name": agent},
        "train": {"timesteps": 300, "eval_every": 150, "eval_episodes": 2, "checkpoint_every": 150,
                  "progress_bar": False, **train_kw},
    }
    if agent == "ppo":
        cfg["agent"].update(n_steps=64, batch_size=32, n_epochs=2)
    return cfg


def write(tmp_path: Path, cfg: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for event_file in sorted(tb_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(event_file))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_cli_end_to_end_and_resume(tmp_path):
    cfg = write(tmp_path, small_config("ucb", compare_with=["always-add", "fcfs"]))
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), "--agent", "ucb", "--config", str(cfg), "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stderr
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["agent"] == {"name": "ucb", "c": 2.0, "credit": "return_to_go", "batch_div": 4,
                              "batch_max": 10, "delta_clip": 5, "w_div": 4, "w_max": 10}
    assert saved["scenario"]["name"] == "leval-kv-pressure" and saved["train"]["timesteps"] == 300
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert pointer["num_timesteps"] == 300 and (out / "checkpoints" / pointer["path"]).is_file()
    assert (out / "checkpoints" / "ucb_150_steps.npz").is_file()
    policy = load_policy(out / "policy.feather")
    assert policy.agent == "ucb" and policy.meta["num_timesteps"] == 300
    scalars = tb_scalars(out / "tb")
    for tag in ("rollout/ep_return", "rollout/output_throughput", "rollout/mean_e2el_ms",
                "rollout/prefix_hit_rate", "rollout/mean_delta", "rollout/ep_len", "train/credit_abs_error",
                "eval/output_throughput", "eval/mean_e2el_s"):
        assert scalars.get(tag), f"{tag} not logged; have {sorted(scalars)}"
    assert [s for s, _ in scalars["eval/output_throughput"]] == [150, 300]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["comparison"]) == {"ucb", "always-add", "fcfs"}
    assert "| fcfs |" in first.stdout and "vs fcfs" in first.stdout  # the comparison table

    resumed = subprocess.run(cmd + ["--resume", "--timesteps", "450"], capture_output=True, text=True,
                             cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "at 300 timesteps" in resumed.stdout
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["num_timesteps"] == 450
    assert load_policy(out / "policy.feather").meta["num_timesteps"] == 450
    steps = [s for s, _ in tb_scalars(out / "tb")["eval/output_throughput"]]
    assert steps == [150, 300, 450]  # logging continues where the first run stopped

    changed = subprocess.run(cmd + ["--resume", "--seed", "5"], capture_output=True, text=True, cwd=REPO)
    assert changed.returncode == 2 and "train.seed: 0 -> 5" in changed.stderr


def test_scenario_flag_replaces_the_configs(tmp_path):
    cfg = load_config(write(tmp_path, small_config("heuristic")), scenario="sharegpt")
    assert cfg.scenario_name == "sharegpt"
    with pytest.raises(ConfigError, match="unknown scenario 'nope'; available"):
        load_config(write(tmp_path, small_config("heuristic")), scenario="nope")


def test_ppo_in_process_with_resume(tmp_path):
    cfg = parse_config(small_config("ppo", timesteps=128, eval_every=64, checkpoint_every=64))
    res = run(cfg, tmp_path / "ppo", verbose=False)
    assert res.num_timesteps == 128 and res.checkpoint.suffix == ".zip"
    assert load_policy(res.policy_path).kind == "mlp"
    scalars = tb_scalars(tmp_path / "ppo" / "tb")
    assert scalars.get("train/policy_gradient_loss") and scalars.get("rollout/output_throughput")
    longer = parse_config(small_config("ppo", timesteps=192, eval_every=64, checkpoint_every=64))
    res2 = run(longer, tmp_path / "ppo", resume=True, verbose=False)
    assert res2.num_timesteps == 192


@pytest.mark.parametrize("agent", ["qlearning", "ppo"])
def test_n_envs_runs_separate_processes(agent, tmp_path):
    cfg = parse_config(small_config(agent, timesteps=256, n_envs=2, sync_every=64, eval_every=128,
                                    checkpoint_every=0))
    res = run(cfg, tmp_path / agent, verbose=False)
    assert res.num_timesteps >= 256
    assert load_policy(res.policy_path).agent == agent
    assert res.final_eval["output_throughput"] > 0


def test_config_errors_name_the_problem(tmp_path):
    bad_key = small_config("ucb")
    bad_key["agent"]["exploration"] = 3
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['exploration'\]; valid keys are .*'c'"):
        parse_config(bad_key)
    bad_env = {**small_config("ucb"), "env": {"max_batch": 3}}
    with pytest.raises(ConfigError, match="env: unknown key.*scheduler"):
        parse_config(bad_env)
    with pytest.raises(ConfigError, match="unknown section"):
        parse_config({**small_config("ucb"), "optimizer": {}})
    with pytest.raises(ConfigError, match="--agent ppo but the config's agent section is for 'ucb'"):
        parse_config(small_config("ucb"), "ppo")
    with pytest.raises(ConfigError, match="credit"):
        parse_config({**small_config("ucb"), "agent": {"name": "ucb", "credit": "latency"}})
    with pytest.raises(ConfigError, match="episode: unknown key"):
        parse_config({**small_config("ucb"), "scenario": {"name": "leval-kv-pressure", "episode": {"n": 3}}})
    with pytest.raises(ConfigError, match="compare_with"):
        parse_config(small_config("ucb", compare_with=["best"]))
    path = write(tmp_path, bad_key)
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--agent", "ucb", "--config", str(path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "exploration" in proc.stderr


def test_shipped_configs_are_valid():
    files = sorted((REPO / "configs" / "runs").glob("*.yaml")) + [REPO / "configs" / "demo.yaml"]
    assert {f.stem for f in files} >= {"ppo", "ucb", "qlearning", "heuristic", "demo"}
    for f in files:
        cfg = load_config(f)
        assert cfg.agent_name == f.stem or f.stem == "demo"


@pytest.mark.engine
def test_short_run_on_the_session_engine(env_backend, tmp_path):
    """agents.training on the real engine (the session's), evaluated there too."""
    cfg = parse_config({**small_config("ucb", timesteps=20, eval_every=0, eval_episodes=1,
                                       checkpoint_every=0, backend="vllm", compare_with=["fcfs"]),
                        "scenario": {"name": "leval-kv-pressure",
                                     "episode": {"groups": 3, "max_per_group": 2}}})
    res = run(cfg, tmp_path / "vllm", backend=env_backend, verbose=False)
    assert res.num_timesteps >= 20
    assert res.final_eval["output_throughput"] > 0
    summary = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    assert set(summary["comparison"]) == {"ucb", "fcfs"}
    assert load_policy(res.policy_path).agent == "ucb"


@pytest.mark.engine
def test_a_simulator_run_fine_tuned_on_the_session_engine(env_backend, tmp_path):
    """Fine-tuning: a run trained on the simulator, resumed with ``backend: vllm``, continues from
    its checkpoint on real-engine episodes (its table keeps counting), evaluates where it is told,
    and its summary and exported policy record where it came from."""
    base = {**small_config("ucb", timesteps=40, eval_every=0, eval_episodes=1, checkpoint_every=0),
            "scenario": {"name": "leval-kv-pressure", "episode": {"groups": 3, "max_per_group": 2}}}
    first = run(parse_config(base), tmp_path / "ft", verbose=False)
    on_sim = load_policy(first.policy_path)
    tuned = parse_config({**base, "train": {**base["train"], "timesteps": first.num_timesteps + 15,
                                            "backend": "vllm", "eval_backend": "sim"}})
    res = run(tuned, tmp_path / "ft", resume=True, backend=env_backend, verbose=False)
    assert res.num_timesteps >= first.num_timesteps + 15
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["eval_backend"] == "sim"
    assert summary["resumed_from"] == {"backend": "sim", "timesteps": first.num_timesteps}
    policy = load_policy(res.policy_path)
    assert policy.meta["resumed_from"] == summary["resumed_from"]
    assert sum(policy.visits) > sum(on_sim.visits)  # credited with the engine's episodes too
    other = parse_config({**base, "train": {**base["train"], "seed": 3, "backend": "vllm"}})
    with pytest.raises(ConfigError, match="train.seed: 0 -> 3"):  # learning's own knobs stay fixed
        run(other, tmp_path / "ft", resume=True, backend=env_backend, verbose=False)


@pytest.fixture
def resumable(tmp_path):
    """A run folder --resume accepts: the saved config, and a real checkpoint beside latest.json."""
    cfg_path = write(tmp_path, small_config("ucb", timesteps=150, eval_every=0, checkpoint_every=0))
    out = tmp_path / "run"
    train.main(["--agent", "ucb", "--config", str(cfg_path), "--out", str(out), "--no-progress"])
    return cfg_path, out


@pytest.mark.parametrize("pointer, message", [
    (None, "latest.json not found"),
    ("{not json", "latest.json is not a JSON object"),
    ('["ucb_150_steps.npz"]', "latest.json is not a JSON object"),
    ('{"num_timesteps": 150}', "'path' must name a checkpoint file in"),
    ('{"path": "/etc/passwd"}', "'path' must name a checkpoint file in"),
    ('{"path": "../config.yaml"}', "'path' must name a checkpoint file in"),
    ('{"path": "ucb_999_steps.npz"}', "ucb_999_steps.npz does not exist"),
])
def test_resume_refuses_a_bad_pointer_before_loading_anything(resumable, capsys, pointer, message):
    """Issue 12: --resume followed pointer["path"] unchecked into the agent's loader (SB3's
    cloudpickle for PPO), absolute paths and ../ included; a missing latest.json was a traceback."""
    cfg_path, out = resumable
    latest = out / "checkpoints" / "latest.json"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", "ucb", "--config", str(cfg_path), "--out", str(out), "--resume",
                    "--timesteps", "300", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: --resume: ") and message in err, err


def test_resume_refuses_a_checkpoint_link_that_leaves_the_folder(resumable, capsys):
    cfg_path, out = resumable
    outside = out.parent / "elsewhere.npz"
    outside.write_bytes((out / "checkpoints" / "ucb_150_steps.npz").read_bytes())
    (out / "checkpoints" / "link.npz").symlink_to(outside)
    (out / "checkpoints" / "latest.json").write_text('{"path": "link.npz"}')
    with pytest.raises(SystemExit):
        train.main(["--agent", "ucb", "--config", str(cfg_path), "--out", str(out), "--resume",
                    "--timesteps", "300", "--no-progress"])
    assert "'path' must name a checkpoint file in" in capsys.readouterr().err


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    cfg = small_config("ucb")
    cfg["scenario"]["workload"] = {"max_prompt_tokens": 2048, "data_dir": str(tmp_path / "nowhere")}
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", "ucb", "--config", str(write(tmp_path, cfg)), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: ") and "nowhere" in err and "OpenLMLab/LEval" in err
