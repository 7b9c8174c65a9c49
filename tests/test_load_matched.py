"""The load-matched benchmark: its speed estimate (the engine's lone prefills against the simulator's) and
its results file of several runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load_matched import (
    MIN_PROBE_TOKENS,
    _poisson_rate,
    machine_slowdown,
    merge_runs,
    render,
    render_headline,
    runs_of,
)
from feather_env.engines.sim_backend import SimBackend
from feather_env.scenarios import load_scenario
from feather_env.step_model import features_from_columns

REPO = Path(__file__).resolve().parents[1]


def _profile_prefill(engine: object, prompt: int) -> float:
    model = SimBackend(engine).model
    return float(model.predict_features(features_from_columns([prompt], [0], [0], [0], [True],
                                                              model.cache_tokens)))


@pytest.mark.parametrize("k", [0.5, 1.0, 2.25])
def test_an_engine_k_times_slower_than_the_profile_measures_k(k: float) -> None:
    engine = load_scenario("leval-kv-pressure-poisson").engine_config()
    lens = [256, 4096, 8192]
    # the short probe is off by another factor: its time is the step's fixed cost, not the prefill
    ttft = [3.0 * k * _profile_prefill(engine, lens[0])] + [k * _profile_prefill(engine, p) for p in lens[1:]]
    speed = machine_slowdown({"prompt_lens": lens, "ttft_s": ttft})
    assert speed["slowdown"] == pytest.approx(k)
    assert [q["prompt_tokens"] for q in speed["probes"]] == lens
    assert speed["probes"][0]["ratio"] == pytest.approx(3.0 * k)


def test_with_only_short_probes_every_probe_counts() -> None:
    engine = load_scenario("leval-kv-pressure-poisson").engine_config()
    lens = [64, 128, MIN_PROBE_TOKENS // 2]
    ttft = [2.0 * _profile_prefill(engine, p) for p in lens]
    assert machine_slowdown({"prompt_lens": lens, "ttft_s": ttft})["slowdown"] == pytest.approx(2.0)


def test_only_poisson_arrivals_are_rescaled() -> None:
    assert _poisson_rate("poisson:3.0") == 3.0
    for arrival in ("burst", "trace:data/x.csv:2", "poisson"):
        with pytest.raises(SystemExit, match="poisson:RATE"):
            _poisson_rate(arrival)


def _run(cpu: str, arrival: str, date: str, tput: float) -> dict:
    return {"scenario": "leval-kv-pressure-poisson", "arrival": arrival,
            "machine": {"cpu": cpu, "date": date}, "tput": tput}


def test_merging_replaces_the_run_of_the_same_machine_and_rate_and_keeps_the_others() -> None:
    earlier = [_run("AMD EPYC", "poisson:1.33", "2026-12-02 08:25 UTC", 1.0),
               _run("AMD EPYC", "poisson:1.5", "2026-12-02 09:44 UTC", 2.0)]
    merged = merge_runs(earlier, _run("AMD EPYC", "poisson:1.33", "2026-12-02 12:00 UTC", 3.0))
    assert [(r["arrival"], r["tput"]) for r in merged] == [("poisson:1.5", 2.0), ("poisson:1.33", 3.0)]
    merged = merge_runs(merged, _run("Intel Xeon", "poisson:1.33", "2026-12-02 13:00 UTC", 4.0))
    assert [(r["machine"]["cpu"], r["tput"]) for r in merged] == [
        ("AMD EPYC", 2.0), ("AMD EPYC", 3.0), ("Intel Xeon", 4.0)]


def test_a_results_file_of_the_first_version_is_one_run() -> None:
    one = _run("AMD EPYC", "poisson:1.33", "2026-12-02 08:25 UTC", 1.0)
    assert runs_of(one) == [one]
    assert runs_of({"benchmark": "load_matched", "runs": [one, one]}) == [one, one]


def test_the_shipped_results_render_a_row_per_run() -> None:
    doc = json.loads((REPO / "results" / "load_matched.json").read_text())
    runs = runs_of(doc)
    table = [line for line in render_headline(doc).splitlines() if line.startswith("| leval-")]
    assert len(table) == len(runs) >= 2
    for run, row in zip(runs, table, strict=True):
        assert f"`{run['arrival']}`" in row and run["machine"]["cpu"].split("(")[0].split()[0] in row
    assert render(doc).count("Episode 0:") == len(runs)


def test_a_results_file_of_several_machines_names_each_machines_scenarios() -> None:
    """The evaluation merges one scenario at a time; when the scenarios ran on different hosts, the
    tables' caption must say which ran where (ratios are per scenario, so per host)."""
    from benchmarks import measured

    amd = {"date": "2026-12-02 09:04 UTC", "cpu": "AMD EPYC", "cores": 2}
    intel = {"date": "2026-12-02 15:00 UTC", "cpu": "Intel Xeon", "cores": 2}
    one = {"machine": amd, "scenarios": {"a": {"machine": amd}, "b": {"machine": amd}}}
    assert measured(one) == "measured 2026-12-02 09:04 UTC on AMD EPYC, 2 cores"
    two = {"machine": intel,
           "scenarios": {"a": {"machine": intel}, "b": {"machine": amd}, "c": {"machine": intel}}}
    assert measured(two) == ("measured 2026-12-02 09:04 UTC to 2026-12-02 15:00 UTC on Intel Xeon (a, c) and "
                             "AMD EPYC (b), 2 cores")
