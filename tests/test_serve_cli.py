"""``feather-serve``'s own checks: a bad option is a usage error (exit 2, one line naming the
problem) before vLLM is imported, so no model loads for a command line that cannot work.

An unknown ``--scheduler-config`` key and ``max_wait: "10"`` were raw TypeErrors,
a bad ``feather:PATH`` was found only at engine-core init (after the model had loaded), and a
bad ``--additional-config`` was a raw JSONDecodeError. No engine starts here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_runtime.serving.serve import vllm_arguments

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        vllm_arguments(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: feather-serve"), err
    return err.strip().splitlines()[-1]


@pytest.fixture
def files(tmp_path):
    """Config, policy and predictor files, good and bad."""
    from scheduler_runtime.decision import BASE_OBS_NAMES, ObservationSpec
    from scheduler_runtime.policy import ConstantPolicy, write_policy

    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    out = {"policy": write_policy(tmp_path / "add.feather", ConstantPolicy(spec))}
    out["corrupt"] = tmp_path / "corrupt.feather"
    out["corrupt"].write_text(out["policy"].read_text()[:100])
    out["predictor"] = tmp_path / "predictor.json"
    out["predictor"].write_text(json.dumps({"format": "feather-output-length-predictor", "version": 1}))
    for name, text in (("typo", "max_wiat: 10\n"), ("string", 'max_wait: "10"\n'),
                       ("nan", "max_wait: .nan\n"), ("chunk", "chunk_size: 512\n"),
                       ("bad_predictor", f"predictor: {out['predictor']}\n"), ("ok", "max_wait: 30\n")):
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text)
    out["latin1"] = tmp_path / "latin1.yaml"
    out["latin1"].write_bytes(b"max_wait: 10 # \xe9\n")
    return out


@pytest.mark.parametrize("args, message", [
    (["--scheduler", "nosuch"], "unknown scheduler 'nosuch'"),
    (["--scheduler-config", "{typo}"], r"unknown key\(s\) \['max_wiat'\]"),
    (["--scheduler-config", "{string}"], "max_wait: expected float, got '10'"),
    (["--scheduler-config", "{nan}"], "max_wait must be a finite number"),
    (["--scheduler-config", "{latin1}"], "not UTF-8"),
    (["--scheduler-config", "/nonexistent/sched.yaml"], "config file not found"),
    (["--scheduler", "feather:/nonexistent/p.feather"], "no such file"),
    (["--scheduler", "feather:{corrupt}+svf"], "truncated or corrupted"),
    (["--scheduler", "feather:py:no_such_module_xyz:P"], "cannot import module 'no_such_module_xyz'"),
    (["--scheduler", "feather:{policy}", "--scheduler-config", "{chunk}"], "in chunks of 256 tokens"),
    (["--scheduler", "svf", "--scheduler-config", "{bad_predictor}"], "predictor file.*missing field"),
    (["--additional-config", "{{not json"], "--additional-config is not valid JSON"),
    (["--additional-config", "[1]"], "--additional-config must be a JSON object"),
    (["--additional-config", '{{"feather_scheduler": {{"max_wait": 1}}}}'], "--scheduler-config"),
    (["--scheduler", "lpm", "--max-wait", "soon"], "--max-wait must be seconds or 'none', got 'soon'"),
    (["--scheduler", "lpm", "--max-wait", "-1"], "max_wait must be a finite number"),
    (["--scheduler", "feather:{policy}", "--chunk-size", "512"], "in chunks of 256 tokens"),
])
def test_bad_options_are_usage_errors_naming_the_problem(files, capsys, args, message):
    argv = [a.format(**files) for a in args]
    line = usage_error(argv, capsys)
    assert line.startswith("feather-serve: error: ") and re.search(message, line), line


def test_good_options_reach_vllm(files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        vllm_arguments(["--scheduler", f"feather:{files['policy']}+svf",
                        "--scheduler-config", str(files["ok"]),
                        "--additional-config", '{"x": 1}', "--port", "8123", "--print-command"])
    assert exit_info.value.code == 0
    command = capsys.readouterr().out
    assert "--scheduler-cls scheduler_runtime.serving.vllm_scheduler.FeatherScheduler" in command
    assert "--port 8123" in command and '"max_wait": 30.0' in command and '"x": 1' in command
    args, config = vllm_arguments(["--scheduler", "svf", "--scheduler-config", str(files["ok"])])
    assert config == {"name": "svf", "max_wait": 30.0}
    additional = json.loads(args[args.index("--additional-config") + 1])
    assert additional == {"feather_scheduler": {"name": "svf", "max_wait": 30.0}}
    # the core's two knobs as flags, as evaluate.py names them, over the file's
    _, config = vllm_arguments(["--scheduler", "group-cap-3", "--scheduler-config", str(files["ok"]),
                                "--max-wait", "none", "--chunk-size", "256"])
    assert config == {"name": "group-cap-3", "max_wait": None, "chunk_size": 256}


def test_the_console_script_refuses_a_bad_policy_before_importing_vllm(tmp_path):
    """``feather-serve`` itself (the installed console script), then ``main`` in a fresh interpreter:
    the error comes before vLLM (and so any model) is imported."""
    script = shutil.which("feather-serve", path=str(Path(sys.executable).parent))
    assert script, "the feather-serve console script is not installed next to this Python"
    run = subprocess.run([script, "--scheduler", "feather:/nonexistent/p.feather"], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2 and "feather-serve: error: " in run.stderr and "no such file" in run.stderr
    code = ("import sys\nfrom scheduler_runtime.serving.serve import main\n"
            "try:\n    main(['--scheduler', 'feather:py:fault_policies:FailsToBuild'])\n"
            "except SystemExit as e:\n    print(e.code, 'vllm' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(TESTS)}, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert "could not be built: RuntimeError: missing weights" in run.stderr
