"""``evaluate.py --backend sim``: any scheduler or policy file on a scenario's episodes in the simulator, in
the real engine's tables and JSON keys, merged with real-engine folders by ``compare``; and the errors
of ``evaluate.py compare``, each one line and exit status 2 before anything is written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import evaluate
from feather_env.evaluation.simulated import _NOT_MEASURED

REPO = Path(__file__).resolve().parent.parent
#: The README's real-engine evaluation of leval-kv-pressure, episode 0 (benchmarks/evaluation.py).
REAL = REPO / "results" / "eval" / "leval-kv-pressure"
#: What benchmarks/evaluation.py adds to an in-process run (the bounds, the repeats).
BENCHMARK_ONLY = {"vs_bound", "vs_bound_episode", "vs_bound_arrival", "repeats"}
#: The admission rules' outcome keys (scheduler_runtime.admission), newer than the real folder.
ADMISSION_KEYS = {"rejected", "aborted", "rejected_fraction", "slo_attainment", "false_admit_fraction"}


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evsim") / "sim"
    t0 = time.perf_counter()
    rc = evaluate.main(["--scenario", "leval-kv-pressure", "--backend", "sim", "--schedulers",
                        "fcfs,lpm,feather-heuristic", "--goodput", "ttft:10801.5", "e2el:11238.6",
                        "--out", str(out), "--no-plots"])
    wall = time.perf_counter() - t0
    assert rc == 0
    return out, json.loads((out / "results.json").read_text()), wall


def test_the_simulator_serves_every_request_fast_and_reports_as_the_real_engine(sim_run):
    out, payload, wall = sim_run
    assert wall < 30
    runs = payload["runs"]
    assert list(runs) == ["fcfs", "lpm", "feather-heuristic"]
    for m in runs.values():
        assert m["kind"] == "simulator" and m["completed"] == m["submitted"] == 71 and m["failed"] == 0
        assert all(m[k] is None for k in _NOT_MEASURED)
    real = json.loads((REAL / "results.json").read_text())
    assert payload["workload"]["fingerprint"] == real["workload"]["fingerprint"]  # the very same episode
    real_keys = set(next(iter(real["runs"].values()))) - BENCHMARK_ONLY
    assert set(runs["fcfs"]) - ADMISSION_KEYS == real_keys
    assert all(runs["fcfs"][k] == 0 for k in ("rejected", "aborted")) and runs["fcfs"]["slo_attainment"] > 0
    assert set(payload) >= {"runs", "workload", "scenario", "engine", "machine", "definitions", "simulator"}
    assert runs["fcfs"]["output_throughput"] < runs["lpm"]["output_throughput"]
    assert runs["fcfs"]["prefix_hit_rate"] < runs["feather-heuristic"]["prefix_hit_rate"]
    assert (out / "results.md").read_text().count("| simulator |") == 3


def test_compare_merges_simulated_and_real_runs_of_one_episode(sim_run, tmp_path, capsys):
    out, _, _ = sim_run
    assert evaluate.main(["compare", str(REAL), str(out), "--out", str(tmp_path / "both"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "both" / "results.json").read_text())
    assert merged["same_workload"] is True
    assert {"fcfs", "fcfs (sim)", "feather-heuristic (sim)"} <= set(merged["runs"])
    assert "| fcfs (sim) | simulator |" in capsys.readouterr().out


def test_policy_files_and_several_episodes_in_the_simulator(exported_policies, tmp_path):
    out = tmp_path / "eps"
    name = f"feather:{exported_policies['table']}"
    common = ["--scenario", "leval-kv-pressure", "--backend", "sim", "--num-groups", "3", "--no-plots"]
    assert evaluate.main([*common, "--schedulers", f"fcfs,{name}", "--episodes", "3", "--seed", "5",
                          "--label", "s", "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    assert list(payload["runs"]) == ["s/fcfs", f"s/{name}"]
    assert payload["simulator"]["seeds"] == [5, 6, 7]
    for s in (5, 6, 7):
        assert evaluate.main([*common, "--schedulers", "fcfs", "--seed", str(s),
                              "--out", str(tmp_path / f"1-{s}")]) == 0
    one = [json.loads((tmp_path / f"1-{s}" / "results.json").read_text())["runs"]["fcfs"] for s in (5, 6, 7)]
    fcfs = payload["runs"]["s/fcfs"]
    assert fcfs["completed"] == sum(m["completed"] for m in one) == payload["workload"]["requests"]
    assert fcfs["duration"] == pytest.approx(sum(m["duration"] for m in one))  # back to back
    assert fcfs["output_throughput"] == pytest.approx(sum(m["total_output_tokens"] for m in one)
                                                      / sum(m["duration"] for m in one))


SIM = ["--scenario", "leval-kv-pressure", "--backend", "sim"]


def test_a_slower_machine_in_the_simulator(tmp_path):
    """``--engine-slowdown 2``: every step takes twice as long, so the same episode (all requests
    present at once) takes about twice as long and serves every request all the same."""
    common = [*SIM, "--schedulers", "feather-heuristic", "--num-groups", "3", "--no-plots"]
    runs = {}
    for factor in ("1", "2"):
        assert evaluate.main([*common, "--engine-slowdown", factor, "--out", str(tmp_path / factor)]) == 0
        payload = json.loads((tmp_path / factor / "results.json").read_text())
        runs[factor] = payload["runs"]["feather-heuristic"]
    assert runs["1"]["completed"] == runs["2"]["completed"] == runs["1"]["submitted"]
    assert 1.8 < runs["2"]["duration"] / runs["1"]["duration"] < 2.2


def test_rate_scale_replays_a_trace_scenario_faster(tmp_path):
    """``--rate-scale R`` replaces the scenario's ``episode.rate_scale``: the same window's requests
    arrive over 1/R of the trace's time."""
    spans = {}
    for scale in ("0.5", "1"):
        out = tmp_path / scale
        assert evaluate.main(["--scenario", "mooncake-overload-l", "--seed", "3", "--backend", "sim",
                              "--rate-scale", scale, "--schedulers", "fcfs", "--out", str(out),
                              "--no-plots"]) == 0
        payload = json.loads((out / "results.json").read_text())
        assert payload["scenario"]["episode"]["rate_scale"] == float(scale)
        run = payload["runs"]["fcfs"]
        assert run["completed"] == run["submitted"] > 0
        spans[scale] = payload["workload"]
    assert "rate0.5x" in spans["0.5"]["name"] and "rate1x" not in spans["1"]["name"]


@pytest.mark.parametrize("argv, message", [
    (["--workload", "leval", "--backend", "sim"], "--backend sim serves a scenario's episodes"),
    ([*SIM, "--episodes", "0"], "--episodes must be >= 1"),
    ([*SIM, "--seed", "-1"], "--seed must be >= 0"),
    ([*SIM, "--schedulers", "fcfs,fifo"], "unknown scheduler"),
    ([*SIM, "--profile", "nope.json"], "profile not found"),
    (["--scenario", "leval-kv-pressure", "--episodes", "2"], "are for --backend sim"),
    ([*SIM, "--kv-cache-gib", "nan"], "kv_cache_gib"),
    ([*SIM, "--engine-slowdown", "0"], "engine_slowdown must be a factor > 0"),
    ([*SIM, "--engine-slowdown", "nan"], "engine_slowdown must be a factor > 0"),
    ([*SIM, "--rate-scale", "0"], "rate_scale must be a finite number > 0"),
    (["--scenario", "leval-kv-pressure", "--engine-slowdown", "2"], "are for --backend sim"),
])
@pytest.mark.parametrize("check", [[], ["--check"]], ids=["run", "check"])
def test_bad_simulator_input_is_one_line_before_anything_is_written(argv, message, check, tmp_path, capsys):
    assert evaluate.main([*argv, *check, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_check_prints_the_schedulers_the_simulator_serves_and_serves_nothing(tmp_path, capsys, monkeypatch):
    def no_serving(*a, **kw):
        raise AssertionError("the simulator served")

    monkeypatch.setattr(evaluate, "evaluate_simulated", no_serving)
    out = tmp_path / "o"
    assert evaluate.main([*SIM, "--schedulers", "fcfs,group-hold@1024,lpm", "--episodes", "2",
                          "--kv-cache-gib", "0.125", "--check", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "simulator: KV cache 0.125 GiB (32,768 tokens)" in text and "episode(s) 0, 1" in text
    rows = [r.strip("| ").split(" | ") for r in text.splitlines() if r.startswith("| ")][1:]
    # inside the environment fcfs is the core's fcfs ordering, admitting every arrival (vLLM's queue)
    assert [r[:4] for r in rows] == [["fcfs", "fcfs", "-", "8,192"],
                                     ["group-hold@1024", "feather", "group, no cap", "1,024"],
                                     ["lpm", "lpm", "-", "8,192"]]
    assert not out.exists()


def test_bad_compare_input_is_one_line_before_anything_is_written(sim_run, tmp_path, capsys):
    out, _, _ = sim_run
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text("{not json")
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "results.json").write_text((out / "results.json").read_text())
    (rows / "requests.csv").write_text("run,request_id,prompt_len\nfcfs,r1,abc\n")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "results.json").write_bytes(b'{"runs": {"caf\xe9": {}}}')
    for dirs, message in (([str(tmp_path / "none")], "is not a results folder"),
                          ([str(broken)], f"{broken / 'results.json'}: malformed JSON"),
                          ([str(rows)], f"{rows / 'requests.csv'}:2: not a request row"),
                          ([str(latin)], "not UTF-8"),
                          ([str(out), str(tmp_path)], "is not a results folder")):
        assert evaluate.main(["compare", *dirs, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "c").exists()
    assert evaluate.main(["compare", str(out), "--out", str(out)]) == 2
    assert "would be overwritten" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert evaluate.main(["compare", str(out), "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
