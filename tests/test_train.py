"""train.py end to end on the simulator (config, TensorBoard logs, checkpoints, export, --resume,
--n-envs), config validation, and one short run on the session's real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import train
from scheduler_runtime.config import ConfigError
from scheduler_runtime.policy import load_policy

REPO = Path(__file__).resolve().parent.parent
SMALL_WORKLOAD = {"kind": "synthetic", "num_groups": 6, "per_group": "uniform:3:8",
                  "prefix_len": "uniform:600:1500", "suffix_len": "uniform:5:20",
                  "output_len": "uniform:4:10", "seed": 3}


def small_config(agent: str, **train_kw) -> dict:
    cfg = {
        "env": {"waiting": 16, "max_batch_size": 8},
        "workload": SMALL_WORKLOAD,
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
    cfg = write(tmp_path, small_config("ucb"))
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), "--agent", "ucb", "--config", str(cfg), "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "c: 200.0" in first.stdout  # the effective config is printed
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["agent"] == {"name": "ucb", "c": 200.0, "credit": "decode_tok_s", "batch_div": 4,
                              "batch_max": 10, "delta_clip": 5, "w_div": 4, "w_max": 10}
    assert saved["train"]["timesteps"] == 300
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert pointer["num_timesteps"] == 300 and (out / "checkpoints" / pointer["path"]).is_file()
    assert (out / "checkpoints" / "ucb_150_steps.npz").is_file()
    policy = load_policy(out / "policy.feather")
    assert policy.agent == "ucb" and policy.meta["num_timesteps"] == 300
    scalars = tb_scalars(out / "tb")
    for tag in ("rollout/ep_return", "rollout/decode_tok_s", "rollout/batch_size", "rollout/mean_delta",
                "rollout/ep_len", "train/credit_abs_error", "eval/decode_tok_s"):
        assert scalars.get(tag), f"{tag} not logged; have {sorted(scalars)}"
    assert [s for s, _ in scalars["eval/decode_tok_s"]] == [150, 300]

    resumed = subprocess.run(cmd + ["--resume", "--timesteps", "450"], capture_output=True, text=True,
                             cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "at 300 timesteps" in resumed.stdout
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["num_timesteps"] == 450
    assert load_policy(out / "policy.feather").meta["num_timesteps"] == 450
    steps = [s for s, _ in tb_scalars(out / "tb")["eval/decode_tok_s"]]
    assert steps == [150, 300, 450]  # logging continues where the first run stopped
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_timesteps"] == 450

    changed = subprocess.run(cmd + ["--resume", "--seed", "5"], capture_output=True, text=True, cwd=REPO)
    assert changed.returncode == 2 and "train.seed: 0 -> 5" in changed.stderr


def test_ppo_in_process_with_resume(tmp_path):
    cfg = train.parse_config(small_config("ppo", timesteps=128, eval_every=64, checkpoint_every=64))
    res = train.run(cfg, tmp_path / "ppo", verbose=False)
    assert res.num_timesteps == 128 and res.checkpoint.suffix == ".zip"
    assert load_policy(res.policy_path).kind == "mlp"
    scalars = tb_scalars(tmp_path / "ppo" / "tb")
    assert scalars.get("train/policy_gradient_loss") and scalars.get("rollout/decode_tok_s")
    longer = train.parse_config(small_config("ppo", timesteps=192, eval_every=64, checkpoint_every=64))
    res2 = train.run(longer, tmp_path / "ppo", resume=True, verbose=False)
    assert res2.num_timesteps == 192


@pytest.mark.parametrize("agent", ["qlearning", "ppo"])
def test_n_envs_runs_separate_processes(agent, tmp_path):
    cfg = train.parse_config(small_config(agent, timesteps=256, n_envs=2, sync_every=64, eval_every=128,
                                          checkpoint_every=0))
    res = train.run(cfg, tmp_path / agent, verbose=False)
    assert res.num_timesteps >= 256
    assert load_policy(res.policy_path).agent == agent
    assert res.final_eval["decode_tok_s"] > 0


def test_config_errors_name_the_problem(tmp_path):
    bad_key = small_config("ucb")
    bad_key["agent"]["exploration"] = 3
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['exploration'\]; valid keys are .*'c'"):
        train.parse_config(bad_key)
    bad_env = small_config("ucb")
    bad_env["env"]["max_batch"] = 3
    with pytest.raises(ConfigError, match="env: unknown key.*max_batch_size"):
        train.parse_config(bad_env)
    with pytest.raises(ConfigError, match="unknown section"):
        train.parse_config({**small_config("ucb"), "optimizer": {}})
    with pytest.raises(ConfigError, match="--agent ppo but the config's agent section is for 'ucb'"):
        train.parse_config(small_config("ucb"), "ppo")
    with pytest.raises(ConfigError, match="credit"):
        train.parse_config({**small_config("ucb"), "agent": {"name": "ucb", "credit": "latency"}})
    with pytest.raises(ConfigError, match="workload"):
        train.parse_config({**small_config("ucb"), "workload": {"kind": "synthetic", "groups": 3}})
    path = write(tmp_path, bad_key)
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--agent", "ucb", "--config", str(path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "exploration" in proc.stderr


def test_shipped_configs_are_valid():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert {f.name for f in files} >= {"ppo-leval.yaml", "ucb-leval.yaml", "qlearning-leval.yaml",
                                       "heuristic-leval.yaml", "ppo-sharegpt.yaml", "demo.yaml"}
    for f in files:
        cfg = train.load_config(f)
        assert cfg.agent_name in f.name or f.name == "demo.yaml"


@pytest.mark.engine
def test_short_run_on_the_session_engine(vllm_backend, tmp_path):
    """train.py's functions on the real engine, reusing the test session's one engine."""
    cfg = train.parse_config({**small_config("ucb", timesteps=30, eval_every=0, eval_episodes=1,
                                             checkpoint_every=0, backend="vllm",
                                             compare_with=["always-add"]),
                              "env": {"waiting": 8, "max_batch_size": 4}})
    res = train.run(cfg, tmp_path / "vllm", backend=vllm_backend, verbose=False)
    assert res.num_timesteps == 30
    assert res.final_eval["decode_tok_s"] > 0
    summary = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    assert set(summary["comparison"]) == {"ucb", "always-add"}
    assert load_policy(res.policy_path).agent == "ucb"


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
    cfg["workload"] = {"kind": "leval", "data_dir": str(tmp_path / "nowhere")}
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", "ucb", "--config", str(write(tmp_path, cfg)), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: ") and "nowhere" in err and "OpenLMLab/LEval" in err
