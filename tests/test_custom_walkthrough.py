"""The README's "Your own workload" walkthrough, end to end, on a small support-chatbot trace kept in
``tests/data/support-small.jsonl`` (``scripts/make_support_trace.py``: one shared system prompt, four
knowledge-base articles, timestamps):

1. ``python -m feather_env.scenarios new --trace ... --out mine.yaml`` (a scenario from the trace);
2. ``python -m feather_env.calibrate --scenario mine.yaml --out profile.json`` (on the engine);
3. ``python train.py --agent ucb --config configs/runs/ucb.yaml --scenario mine.yaml --profile ...``;
4. ``python evaluate.py --scenario mine.yaml --backend sim --schedulers ...,feather:POLICY``;
5. ``python evaluate.py --scenario mine.yaml --schedulers fcfs,feather:POLICY`` (the real engine);
6. ``feather-serve --scheduler feather:POLICY``, replayed with ``evaluate.py --endpoint URL``.

Each step is the command's own ``main`` (the engine steps on the session's engine, the serve step a
server of its own, as a user runs it); every step must exit 0 and lose no request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import evaluate
import train
from feather_env import calibrate
from feather_env.scenarios import main as scenarios_main

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "support-small.jsonl"


def _runs(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())["runs"]


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> dict:
    """Steps 1, 3 and 4 (engine-free); the engine steps are tests of their own."""
    root = tmp_path_factory.mktemp("walkthrough")
    scenario = root / "mine.yaml"
    assert scenarios_main(["new", "--trace", str(TRACE), "--kv-cache-gib", "0.01",
                           "--out", str(scenario)]) == 0
    result = train.main(["--agent", "ucb", "--config", str(REPO / "configs" / "runs" / "ucb.yaml"),
                         "--scenario", str(scenario), "--out", str(root / "run"), "--timesteps", "400",
                         "--no-progress"])
    policy = f"feather:{result.policy_path}"
    assert evaluate.main(["--scenario", str(scenario), "--backend", "sim", "--schedulers",
                          f"fcfs,lpm,feather-heuristic,{policy}", "--out", str(root / "sim"),
                          "--no-plots"]) == 0
    return {"root": root, "scenario": scenario, "policy": policy, "train": result}


def test_trace_to_scenario_to_policy_to_simulated_evaluation(walk):
    summary = json.loads((walk["root"] / "run" / "summary.json").read_text())
    assert walk["train"].num_timesteps >= 400 and summary["scenario"] == str(walk["scenario"])
    runs = _runs(walk["root"] / "sim")
    assert len(runs) == 4
    for m in runs.values():
        assert m["completed"] == m["submitted"] == 24 and m["failed"] == 0  # nothing lost
        assert m["prefix_hit_rate"] > 0.5  # the system prompt and the articles, found in the text


@pytest.mark.engine
def test_calibrate_on_the_engine_for_the_trace(walk, env_backend, tmp_path):
    profile = tmp_path / "profile.json"
    # every episode counts, whatever else runs on the machine (a test of the plumbing, not of the fit)
    steps = tmp_path / "steps.json"
    assert calibrate.main(["--scenario", str(walk["scenario"]), "--out", str(profile), "--max-foreign", "1",
                           "--steps-out", str(steps)], backend=env_backend) == 0
    fitted = json.loads(profile.read_text())
    assert fitted["fit"]["steps"] >= 6 and [e["scheduler"] for e in fitted["fit"]["episodes"]] == [
        "fcfs", "lpm", "feather-heuristic"]
    # every step with the queue it started with, and the file fits again without an engine
    recorded = json.loads(steps.read_text())["steps"]
    assert len(recorded) == fitted["fit"]["steps"]
    assert all(isinstance(s["waiting"], int) and s["waiting"] >= 0 for s in recorded)
    assert calibrate.main(["--out", str(tmp_path / "again.json"), "--from-steps", str(steps)]) == 0
    # the fit's error on the batches the trained policy forms (fresh seeds, the policy's own answers)
    validation = tmp_path / "validation.json"
    assert calibrate.main(["--scenario", str(walk["scenario"]), "--validate", str(profile), "--schedulers",
                           f"feather-heuristic,{walk['policy']}", "--json", str(validation),
                           "--max-foreign", "1"], backend=env_backend) == 0
    rows = json.loads(validation.read_text())["episodes"]
    assert [r["scheduler"] for r in rows] == ["feather-heuristic", walk["policy"]]
    assert all(r["requests"] == 24 and r["sim_duration_s"] > 0 for r in rows)
    out = tmp_path / "sim"
    assert evaluate.main(["--scenario", str(walk["scenario"]), "--backend", "sim", "--profile", str(profile),
                          "--schedulers", f"fcfs,{walk['policy']}", "--out", str(out), "--no-plots"]) == 0
    assert all(m["completed"] == 24 for m in _runs(out).values())


@pytest.mark.engine
def test_the_trained_policy_on_the_engine_and_served(walk, env_backend):
    from feather_env.evaluation.server import LocalServer
    from feather_env.scenarios import load_scenario

    root = walk["root"]
    assert evaluate.main(["--scenario", str(walk["scenario"]), "--schedulers", f"fcfs,{walk['policy']}",
                          "--no-isolated", "--out", str(root / "engine"), "--no-plots"],
                         backend=env_backend) == 0
    engine_runs = _runs(root / "engine")
    for m in engine_runs.values():
        assert m["kind"] == "in-process" and m["completed"] == m["submitted"] == 24 and m["failed"] == 0
    sim_runs = _runs(root / "sim")
    assert set(engine_runs["fcfs"]) == set(sim_runs["fcfs"])  # one vocabulary for both backends
    engine = load_scenario(walk["scenario"]).engine_config()
    with LocalServer(walk["policy"], engine, log_path=root / "serve.log") as server:
        rc = evaluate.main(["--scenario", str(walk["scenario"]), "--endpoint", server.url, "--out",
                            str(root / "served"), "--no-plots"])
        assert rc == 0, server.log_tail()
    (served,) = _runs(root / "served").values()
    assert served["completed"] == served["submitted"] == 24 and served["failed"] == 0
