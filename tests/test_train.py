"""train.py end to end on the simulator (config, TensorBoard logs, checkpoints, export, --resume,
--n-envs, --scenario), config validation, every bad input as one line and exit status 2 before the run
folder is touched, low-traffic runs, and one short run on the session's real engine."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

import train
from agents.run_config import EnvSection, load_config, parse_config
from agents.training import run
from agents.ucb import UCBConfig
from scheduler_runtime.config import ConfigError
from scheduler_runtime.hardware import online_cores
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
    assert saved["agent"] == {"name": "ucb", **asdict(UCBConfig())}  # every knob, defaults included
    assert saved["agent"]["c"] == 2.0 and saved["agent"]["credit"] == "return_to_go"
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
    ("{not json", "latest.json: malformed JSON"),
    ('["ucb_150_steps.npz"]', "latest.json: expected a mapping"),
    ('{"num_timesteps": 150}', "'path' must name a checkpoint file in"),
    ('{"path": "/etc/passwd"}', "'path' must name a checkpoint file in"),
    ('{"path": "../config.yaml"}', "'path' must name a checkpoint file in"),
    ('{"path": "ucb_999_steps.npz"}', "ucb_999_steps.npz does not exist"),
])
def test_resume_refuses_a_bad_pointer_before_loading_anything(resumable, capsys, pointer, message):
    """--resume once followed pointer["path"] unchecked into the agent's loader (SB3's
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


# ----------------------------------------------------------------------------- bad input: one line, exit 2
TRACE = REPO / "tests" / "data" / "support-small.jsonl"


def _trace(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "t.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


GOOD_ROW = '{"prompt": "Hello there, how do I reset my password?", "output_tokens": 4, "timestamp": 0}\n'
BAD_INPUTS = [
    ("malformed JSON line", {"trace": GOOD_ROW + '{"prompt": "x", \n'}, "t.jsonl:2: malformed JSON line"),
    ("missing output length", {"trace": GOOD_ROW + '{"prompt": "x", "timestamp": 1}\n'},
     "t.jsonl:2: no output length"),
    ("missing prompt", {"trace": '{"output_tokens": 3}\n'}, "t.jsonl:1: no prompt"),
    ("non-UTF-8", {"trace": GOOD_ROW.encode() + b'{"prompt": "caf\xe9", "output_tokens": 2}\n'},
     "t.jsonl:2: not UTF-8"),
    ("empty file", {"trace": ""}, "no requests (the file is empty)"),
    ("negative timestamp", {"trace": GOOD_ROW + '{"prompt": "x", "output_tokens": 2, "timestamp": -1}\n'},
     "t.jsonl:2: timestamp must be a finite time in seconds >= 0, got -1"),
    ("NaN timestamp", {"trace": GOOD_ROW + '{"prompt": "x", "output_tokens": 2, "timestamp": NaN}\n'},
     "t.jsonl:2: timestamp must be a finite time in seconds >= 0, got nan"),
    ("token id outside the vocabulary", {"trace": '{"prompt_token_ids": [1, 8192], "output_tokens": 2}\n'},
     "t.jsonl:1: token id 8192 is outside the model's vocabulary"),
    ("request larger than the KV cache",
     {"trace": '{"prompt_token_ids": [' + ", ".join(["5"] * 6000) + '], "output_tokens": 2}\n'},
     "can never fit the KV cache"),
    ("kv_cache_gib .nan", {"scenario": {"engine": {"kv_cache_gib": math.nan}}},
     "kv_cache_gib must be a finite"),
    ("kv_cache_gib .inf", {"scenario": {"engine": {"kv_cache_gib": math.inf}}},
     "kv_cache_gib must be a finite"),
    ("cpu_cores that names no core", {"scenario": {"engine": {"cpu_cores": "1-0"}}},
     "cpu_cores must be cores like '1', '0-1' or '0,2', got '1-0'"),
    ("a core this machine does not give the run, on the real engine",
     {"scenario": {"engine": {"cpu_cores": str(max(online_cores()) + 1)}},
      "argv": ["--backend", "vllm"]},
     "are not among this machine's cores"),
    ("dtype vLLM does not take", {"scenario": {"engine": {"dtype": "bf16"}}},
     "dtype must be one of ['auto', 'half', 'float16', 'bfloat16', 'float', 'float32']"),
    ("negative Poisson rate", {"scenario": {"episode": {"arrival": "poisson:-1"}}}, "rate must be a finite"),
    ("max_wait .nan", {"scenario": {"scheduler": {"max_wait": math.nan}}}, "max_wait must be a finite"),
    ("window_s .inf", {"scenario": {"episode": {"window_s": math.inf}}},
     "window_s must be a finite"),
    ("--seed -1", {"argv": ["--seed", "-1"]},
     "train.seed must be >= 0, got -1"),
    ("reward_scale .nan", {"env": {"reward_scale": math.nan}},
     "env.reward_scale must be a finite number > 0"),
    ("reward_scale 0", {"env": {"reward_scale": 0}}, "env.reward_scale must be a finite number > 0"),
    ("max_episode_seconds .nan", {"env": {"max_episode_seconds": math.nan}}, "max_episode_seconds must be"),
    ("negative learning rate", {"agent": "ppo", "agent_kw": {"learning_rate": -1e-3}},
     "agent.learning_rate must be > 0"),
    ("infinite exploration constant", {"agent_kw": {"c": math.inf}},
     "agent.c must be a finite number"),
    ("output length spec that overflows",
     {"base": "leval-kv-pressure",
      "scenario": {"workload": {"kind": "synthetic", "output_len": "uniform:1:1e30"}}},
     "longer than any length"),
    ("one request per episode", {"scenario": {"episode": {"requests": 1}}}, "never asks a decision"),
    ("max_num_seqs 1", {"scenario": {"engine": {"max_num_seqs": 1}}}, "engine.max_num_seqs is 1"),
]


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("case, given, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_every_bad_input_is_one_line_and_exit_2_before_the_run_folder(tmp_path, capsys, case, given, message,
                                                                     check):
    """The run refuses it before its folder exists; ``--check`` refuses it with the same line."""
    scenario: dict = {"name": given.get("base", str(REPO / "tests" / "data" / "support-small.yaml"))}
    if "trace" in given:
        scenario["workload"] = {"path": _trace(tmp_path, given["trace"])}
    for section, values in given.get("scenario", {}).items():
        scenario[section] = {**scenario.get(section, {}), **values}
    agent = given.get("agent", "ucb")
    cfg = {"scenario": scenario, "agent": {"name": agent, **given.get("agent_kw", {})},
           "env": given.get("env", {}), "train": {"timesteps": 64, "eval_every": 0, "eval_episodes": 1,
                                                  "checkpoint_every": 0, "progress_bar": False}}
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", agent, "--config", str(write(tmp_path, cfg)), "--out", str(out),
                    *given.get("argv", []), *(["--check"] if check else [])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("train.py: ") and message in err, err
    assert not out.exists()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("agent, damage, why", [
    ("ucb", "truncate", "BadZipFile"),
    ("ucb", "empty", "EOFError"),
    ("ucb", "no-meta", "KeyError: '__meta__"),
    ("ppo", "no-sidecar", "FileNotFoundError"),
])
def test_resume_checks_the_checkpoint_before_touching_the_run_and_offers_an_earlier_one(
        tmp_path, capsys, agent, damage, why):
    import numpy as np

    cfg = small_config(agent, timesteps=192, eval_every=0, eval_episodes=1, checkpoint_every=64)
    path = write(tmp_path, cfg)
    out = tmp_path / "run"
    train.main(["--agent", agent, "--config", str(path), "--out", str(out), "--no-progress"])
    ckpt = out / "checkpoints" / json.loads((out / "checkpoints" / "latest.json").read_text())["path"]
    if damage == "truncate":
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    elif damage == "empty":
        ckpt.write_bytes(b"")
    elif damage == "no-meta":
        with ckpt.open("wb") as fh:
            np.savez(fh, q=np.zeros(3))
    else:
        ckpt.with_suffix(".json").unlink()
    before = {p.name: _sha(p) for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", agent, "--config", str(path), "--out", str(out), "--resume",
                    "--timesteps", "300", "--check"])
    checked = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"checkpoint {ckpt} does not load ({why}" in checked, checked
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--agent", agent, "--config", str(path), "--out", str(out), "--resume",
                    "--timesteps", "300", "--no-progress"])
    err = capsys.readouterr().err
    assert err == checked  # --check says what the run says
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    earlier = f"{agent}_128_steps{ckpt.suffix}"
    assert f"checkpoint {ckpt} does not load ({why}" in err, err
    assert f"the latest earlier checkpoint that loads is {ckpt.parent / earlier} (128 timesteps)" in err, err
    after = {p.name: _sha(p) for p in out.rglob("*") if p.is_file()}
    assert after == before  # nothing written, config.yaml included
    pointer = json.loads(err.split("write ", 1)[1].split(" to ", 1)[0])
    (out / "checkpoints" / "latest.json").write_text(json.dumps(pointer))  # as the message says
    res = train.main(["--agent", agent, "--config", str(path), "--out", str(out), "--resume",
                      "--timesteps", "256", "--no-progress"])
    assert res.num_timesteps >= 256


def test_check_prints_the_run_resolved_and_writes_nothing(resumable, tmp_path, capsys):
    """``train.py --check``: the effective config and every stage's environment as resolved (each
    reference's own scheduler and decision, the engine fitted to the pool), and nothing written: no
    new run folder, and a finished run's folder unchanged by ``--check --resume``."""
    cfg = small_config("ucb", compare_with=["always-add", "fcfs"], eval_backend="sim")
    cfg["env"] = {"reward": "goodput", "goodput": "e2el:9000"}
    out, path = tmp_path / "fresh", write(tmp_path, cfg, "c.yaml")
    assert train.main(["--agent", "ucb", "--config", str(path), "--out", str(out), "--check"]) is None
    printed = capsys.readouterr().out
    assert not out.exists()
    saved = yaml.safe_load(printed.split("\n", 1)[1].split("\n| stage |", 1)[0])
    assert saved["env"]["goodput_slos"] == "e2el:9000"
    assert saved["train"]["compare_with"] == ["always-add", "fcfs"]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in printed.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")}
    assert list(rows) == ["probe", "training", "evaluation", "reference always-add", "reference fcfs"]
    assert rows["reference fcfs"][5] == "fcfs (request)" and rows["training"][5] != "fcfs (request)"
    assert {r[6] for r in rows.values()} == {"goodput"}
    from agents.run_config import load_config

    engine = load_config(path, "ucb").envs[0].engine
    assert rows["training"][4] == (f"{engine.kv_cache_tokens:,} / {engine.max_num_seqs} / "
                                   f"{engine.max_num_batched_tokens:,} / {engine.max_model_len:,}")
    cfg_path, done = resumable
    before = {p.relative_to(done): _sha(p) for p in done.rglob("*") if p.is_file()}
    train.main(["--agent", "ucb", "--config", str(cfg_path), "--out", str(done), "--resume",
                "--timesteps", "300", "--check"])
    assert "checked, nothing written" in capsys.readouterr().out
    assert {p.relative_to(done): _sha(p) for p in done.rglob("*") if p.is_file()} == before


def test_low_traffic_trains_to_the_end_skipping_episodes_without_a_decision(tmp_path, capsys):
    """Poisson arrivals at 0.05 requests/s: most episodes never ask a decision (each request is served
    alone); they are skipped and counted, and the run trains to the end."""
    cfg = small_config("ucb", timesteps=120, eval_every=0, eval_episodes=2, checkpoint_every=0)
    cfg["scenario"]["episode"] = {**cfg["scenario"]["episode"], "arrival": "poisson:0.05"}
    res = train.main(["--agent", "ucb", "--config", str(write(tmp_path, cfg)), "--out", str(tmp_path / "run"),
                      "--no-progress"])
    assert res.num_timesteps == 120
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_episodes"] > 0 and summary["final_eval"]["output_throughput"] > 0
    assert f"{summary['skipped_episodes']} training episodes needed no decision" in capsys.readouterr().out


def test_the_run_config_accepts_every_argument_of_the_environment():
    """EnvSection is FeatherEnv's keyword arguments less those a run sets itself: an argument the
    environment gains (``decision``) is a key a run config accepts and passes through."""
    from feather_env.env import FeatherEnv

    params = inspect.signature(FeatherEnv.__init__).parameters
    run_sets = {"self", "scenario", "backend", "scenario_overrides", "llm"}
    assert {f.name for f in dataclasses.fields(EnvSection)} == set(params) - run_sets
    cfg = parse_config({**small_config("ucb"), "env": {"decision": "group"}})
    assert cfg.env.decision == "group" and cfg.env.scheduler == "group-cap-3"  # the env's default for it


def test_files_a_config_names_are_relative_to_it(tmp_path):
    folder = tmp_path / "proj+1"
    (folder / "scen").mkdir(parents=True)
    (folder / "scen" / "mine+v2.yaml").write_text(yaml.safe_dump({
        "workload": {"kind": "custom", "path": str(TRACE)}, "engine": {"kv_cache_gib": 0.01}}))
    (folder / "traces").mkdir()
    (folder / "traces" / "other.jsonl").write_bytes(TRACE.read_bytes())
    profile = REPO / "configs" / "profiles" / "cpu-tiny-llama.json"
    (folder / "profile.json").write_bytes(profile.read_bytes())
    cfg_path = folder / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "scenario": {"name": "scen/mine+v2.yaml", "workload": {"path": "traces/other.jsonl"}},
        "env": {"profile": "profile.json"}, "agent": {"name": "ucb"}}))
    cfg = load_config(cfg_path)
    assert cfg.scenario["name"] == str(folder / "scen" / "mine+v2.yaml")  # one scenario, not a mix
    assert cfg.scenario["workload"]["path"] == str(folder / "traces" / "other.jsonl")
    assert cfg.env.profile == str(folder / "profile.json")
    mix = folder / "mix.yaml"
    mix.write_text(yaml.safe_dump({"scenario": "leval-kv-pressure+sharegpt", "agent": {"name": "ucb"}}))
    assert load_config(mix).scenario["name"] == ["leval-kv-pressure", "sharegpt"]  # names: a mix
