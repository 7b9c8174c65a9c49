"""``evaluate.py advise`` with admission rules: the thresholds each rule is searched over, their
extension past an edge, the ranking by SLO attainment, the windows held out (or not), and the fields
``advice.json`` adds (the recommendation's rule and attainment, the light-load price, the engine's
confirmation by role). No engine: the confirmation's engine run is replaced by recorded figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from feather_env.evaluation import advise as advise_module
from feather_env.evaluation.advise import (
    MAX_EXTENSIONS,
    AdviseConfig,
    _rule_search,
    advise,
    plan,
    prefill_tokens_per_s,
    rule_kind,
    split_windows,
    threshold_ladder,
)
from feather_env.evaluation.recommend import recommend, roles, simplicity
from feather_env.scenarios import load_scenario
from scheduler_runtime.admission import AdmissionRule, split_admission
from scheduler_runtime.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
SLOS = {"ttft": 5000.0, "tpot": 50.0}
PROFILE = str(REPO / "configs" / "profiles" / "cpu-tiny-llama.json")
REUSE = {"perfect_cache": 0.6, "engine_sized_cache": 0.5}


@pytest.fixture(scope="module")
def small():
    """The Mooncake synthetic trace's scenario, 20-s windows replayed at 4x (5 s, ~80 requests)."""
    return load_scenario("mooncake-synthetic", {"episode": {"window_s": 20}})


@pytest.fixture(scope="module")
def one_window():
    """A 24-request trace served whole: every seed is the same window."""
    return load_scenario(str(REPO / "tests" / "data" / "support-small.yaml"))


def _log_spaced(values: list) -> bool:
    ratios = np.diff(np.log(np.asarray(values, dtype=float)))
    return bool(np.all(ratios > 0) and np.ptp(ratios) < 0.1)


def test_each_rule_has_at_least_8_log_spaced_thresholds_around_its_centre(small):
    config = AdviseConfig(SLOS)
    tokens = threshold_ladder(small, config, PROFILE, "queued-tokens")
    centre = 5.0 * prefill_tokens_per_s(small, PROFILE)  # the TTFT SLO x the prefill throughput
    assert len(tokens) >= 8 and _log_spaced(tokens)
    assert tokens[0] == pytest.approx(centre / 8, rel=0.01)
    assert tokens[-1] == pytest.approx(centre * 8, rel=0.01)
    reqs = threshold_ladder(small, config, PROFILE, "queued-reqs")
    seqs = small.engine.max_num_seqs
    assert len(reqs) >= 8 and reqs[0] == seqs // 4 and reqs[-1] == 16 * seqs and _log_spaced(reqs)
    for rule in ("slo", "slo+deadline", "slo+tpot"):
        factors = threshold_ladder(small, config, PROFILE, rule)
        assert len(factors) >= 8 and factors[0] == 0.125 and factors[-1] == 4.0 and _log_spaced(factors)
    assert threshold_ladder(small, config, PROFILE, "deadline") == [None]
    assert len(threshold_ladder(small, AdviseConfig(SLOS, thresholds=12), PROFILE, "slo")) == 12


def test_admission_is_searched_by_default_with_a_ttft_slo_and_ranked_by_attainment():
    assert AdviseConfig(SLOS).rules == ("queued-tokens", "queued-reqs", "slo", "deadline", "slo+deadline",
                                        "slo+tpot")
    # the tpot term needs a TPOT SLO beside the TTFT one
    assert AdviseConfig({"ttft": 5000.0}).rules == ("queued-tokens", "queued-reqs", "slo", "deadline",
                                                    "slo+deadline")
    assert AdviseConfig(SLOS).rank_by == "slo_attainment"
    assert AdviseConfig(SLOS, admission=False).rules == () and AdviseConfig(
        SLOS, admission=False).rank_by == "request_goodput"
    # without a TTFT SLO: off by default; asked for, only vLLM's caps (slo and deadline read the TTFT)
    assert AdviseConfig({"e2el": 1e9}).rules == ()
    assert AdviseConfig({"e2el": 1e9}, admission=True).rules == ("queued-tokens", "queued-reqs")
    with pytest.raises(ConfigError, match="unknown admission rule"):
        AdviseConfig(SLOS, admission_rules=("queued-tokens", "nosuch"))


class _FakeServer:
    """Serves a rule's thresholds with a made-up attainment per threshold (``curve``: value -> attainment)."""

    def __init__(self, curve):
        self.curve, self.names = curve, []

    def windows(self, name, seeds, held_out):
        self.names.append(name)
        rule = AdmissionRule.parse(split_admission(name)[1])
        value = rule.slo_factor if rule.slo_factor is not None else (rule.queued_reqs or rule.queued_tokens)
        return [{"seed": s, "held_out": held_out, "slo_attainment": self.curve(value), "request_goodput": 1.0}
                for s in seeds]


@pytest.mark.parametrize("curve, edge", [
    (lambda f: min(f, 100.0), "upper"),  # better and better the looser: look beyond the largest factor
    (lambda f: 1.0 / f, "lower"),  # better and better the tighter: look below the smallest
])
def test_a_best_threshold_at_an_edge_extends_the_search_beyond_it(curve, edge):
    ladder = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    server, rows = _FakeServer(curve), {}
    searched = _rule_search(server, rows, "fcfs", "slo", ladder, [100], "slo_attainment")
    values = searched["thresholds"]
    assert searched["extended"] == MAX_EXTENSIONS and len(values) == len(ladder) + MAX_EXTENSIONS
    beyond = values[len(ladder):] if edge == "upper" else values[:MAX_EXTENSIONS]
    assert beyond == ([32.0, 64.0, 128.0] if edge == "upper" else [0.0156, 0.0312, 0.0625])
    assert searched["best"] == f"fcfs~slo:{(values[-1] if edge == 'upper' else values[0]):g}"
    assert len(server.names) == len(values) and all(rows[n]["stage"] == "thresholds" for n in server.names)


def test_a_best_threshold_inside_the_ladder_or_no_better_than_its_neighbour_is_not_extended():
    ladder = [16, 32, 64, 128, 256, 512, 1024, 2048]
    peaked = _rule_search(_FakeServer(lambda n: -abs(math.log2(n) - 7)), {}, "lpm", "queued-reqs", ladder,
                          [100], "slo_attainment")
    assert peaked["extended"] == 0 and peaked["best"] == "lpm~queued-reqs:128"
    flat = _rule_search(_FakeServer(lambda n: 0.5), {}, "lpm", "queued-reqs", ladder, [100], "slo_attainment")
    # all alike: the simplest (the largest cap, holding back the fewest), and nothing to look for beyond it
    assert flat["extended"] == 0 and flat["best"] == "lpm~queued-reqs:2048"


def _row(name: str, attainment: list[float], goodput: list[float] | None = None) -> dict:
    goodput = goodput or [10 * a for a in attainment]
    windows = [{"seed": i, "held_out": True, "slo_attainment": a, "request_goodput": g}
               for i, (a, g) in enumerate(zip(attainment, goodput, strict=True))]
    mean = {"slo_attainment": float(np.mean(attainment)), "request_goodput": float(np.mean(goodput))}
    return {"scheduler": name, "stage": "every window", **mean, "tuning": dict(mean), "windows": windows}


def _recommend(rows: dict) -> dict:
    return recommend(rows, "fcfs", 0.03, offered=100.0, reuse=REUSE, key="slo_attainment")


def test_a_rule_is_recommended_only_when_its_attainment_beats_the_best_setting_without_one_beyond_noise():
    rows = {"fcfs": _row("fcfs", [0.2, 0.2]), "lpm@512": _row("lpm@512", [0.5, 0.5]),
            "lpm@512~slo:0.5": _row("lpm@512~slo:0.5", [0.8, 0.7])}
    rec = _recommend(rows)
    assert rec["scheduler"] == "lpm@512~slo:0.5" and rec["admission"] == "slo:0.5"
    assert rec["predicted_attainment"] == pytest.approx(0.75) and rec["best_without_admission"] == "lpm@512"
    assert rec["ranked_by"] == "slo_attainment" and "best setting without admission (lpm@512)" in rec["why"]
    # within the noise of the best setting without a rule: that setting, and why not the rule
    rows["lpm@512~slo:0.5"] = _row("lpm@512~slo:0.5", [0.51, 0.505])
    rec = _recommend(rows)
    assert rec["scheduler"] == "lpm@512" and rec["admission"] == "none"
    assert "no admission rule wins beyond noise" in rec["why"]
    # more goodput by shedding, less attainment: ranked by attainment, the rule loses
    rows["lpm@512~queued-reqs:8"] = _row("lpm@512~queued-reqs:8", [0.4, 0.4], goodput=[30.0, 30.0])
    assert _recommend(rows)["scheduler"] == "lpm@512"


def test_equal_attainment_goes_to_the_simpler_rule():
    names = ["fcfs@512~slo:0.5+deadline", "fcfs@512~slo:0.5", "fcfs@512~queued-tokens:4096",
             "fcfs@512~queued-tokens:8192", "fcfs@512"]
    assert sorted(names, key=simplicity) == ["fcfs@512", "fcfs@512~queued-tokens:8192",
                                              "fcfs@512~queued-tokens:4096", "fcfs@512~slo:0.5",
                                              "fcfs@512~slo:0.5+deadline"]
    rows = {"fcfs": _row("fcfs", [0.2, 0.2]), "fcfs@512": _row("fcfs@512", [0.3, 0.3])}
    rows.update({n: _row(n, [0.9, 0.9]) for n in names[:4]})
    assert _recommend(rows)["scheduler"] == "fcfs@512~queued-tokens:8192"
    assert [rule_kind(n) for n in names] == ["slo+deadline", "slo", "queued-tokens", "queued-tokens", "none"]
    assert rule_kind("fcfs@512~slo:0.5+tpot") == "slo+tpot"


def test_roles_name_the_best_vllm_caps_of_fcfs_and_of_ours():
    rows = {n: _row(n, [a, a]) for n, a in (("fcfs", 0.1), ("lpm", 0.3), ("fcfs@512~queued-reqs:64", 0.4),
                                            ("fcfs~queued-tokens:9000", 0.45), ("lpm~queued-reqs:32", 0.6),
                                            ("lpm~slo:0.5", 0.9))}
    assert roles(rows, "lpm~slo:0.5", "fcfs", "lpm", "slo_attainment") == {
        "recommendation": "lpm~slo:0.5", "default": "fcfs", "no-admission": "lpm",
        "vllm-queue-cap": "fcfs~queued-tokens:9000", "ours-with-vllm-cap": "lpm~queued-reqs:32"}


def test_a_trace_of_one_window_says_nothing_was_held_out(one_window, tmp_path):
    config = AdviseConfig(SLOS, schedulers=("fcfs",), budgets=(512,), profile=PROFILE, what_if=False,
                          admission_rules=("slo",))
    assert split_windows(one_window, config) == ((100,), ())
    assert "nothing was held out" in plan(one_window, config)
    payload = advise(one_window, config, tmp_path / "one", progress=False, log=lambda _: None)
    assert payload["windows"]["held_out"] == [] and "nothing was held out" in payload["windows"]["note"]
    assert "only 1 distinct window(s) for 4 seed(s)" in payload["windows"]["note"]
    md = (tmp_path / "one" / "advice.md").read_text()
    assert "nothing was held out" in md and "held-out windows" not in md
    assert all(len(r["windows"]) == 1 for r in payload["candidates"].values())


def _fake_confirm(scenario, names, config, *, backend=None, log=print, seed=None):
    """What :func:`confirm` returns, with made-up figures (no engine)."""
    runs = {}
    for i, name in enumerate(names):
        runs[name] = {"request_goodput_per_run": [1.0 + i] * config.repeats,
                      "slo_attainment_per_run": [0.1 * (i + 1)] * config.repeats,
                      "output_throughput_per_run": [10.0] * config.repeats, "request_goodput": 1.0 + i,
                      "slo_attainment": 0.1 * (i + 1), "rejected_fraction": 0.05 * i,
                      "false_admit_fraction": 0.01 * i, "output_throughput": 10.0, "mean_ttft_ms": 100.0,
                      "mean_tpot_ms": 10.0, "completed": 10}
    return {"seed": seed, "repeats": config.repeats, "runs": runs}


def test_advice_json_names_the_rule_the_attainment_and_the_confirmed_roles(small, tmp_path, monkeypatch):
    monkeypatch.setattr(advise_module, "confirm", _fake_confirm)
    monkeypatch.setattr(advise_module, "checked_names", advise_module.candidate_names)  # no engine check
    config = AdviseConfig(SLOS, windows=3, search_windows=1, schedulers=("fcfs", "group-cap-2"),
                          budgets=(512,), shortlist=2, profile=PROFILE, what_if=False, confirm=True,
                          repeats=2)
    out = tmp_path / "advice"
    advise(small, config, out, progress=False, log=lambda _: None)
    saved = json.loads((out / "advice.json").read_text())
    rec, rows = saved["recommendation"], saved["candidates"]
    assert rec["admission"] == (split_admission(rec["scheduler"])[1] or "none")
    assert rec["predicted_attainment"] == rows[rec["scheduler"]]["slo_attainment"]
    assert 0 <= rec["predicted_attainment"] <= 1 and rec["ranked_by"] == "slo_attainment"
    # every rule searched, each over at least 8 thresholds, on fcfs at each budget and the best setting
    searched = saved["admission_search"]["searched"]
    assert {e["rule"] for e in searched} == set(config.rules)
    assert all(len(e["thresholds"]) >= 8 for e in searched if e["rule"] != "deadline")
    assert {"fcfs", "fcfs@512"} <= {e["base"] for e in searched}
    # the rules' best settings met the held-out windows too
    full = {n for n, r in rows.items() if r["stage"] == "every window"}
    assert {rule_kind(n) for n in full} >= {"none", *config.rules}
    assert saved["windows"] == {"tuning": [100], "held_out": [101, 102],
                                "note": "tuned on window(s) 100, reported on 2 held-out window(s) 101, 102"}
    light = saved["light_load"]
    assert light["setting"] in (rec["scheduler"], rec["best_with_admission"])
    assert light["rate_scale"] == pytest.approx(small.episode.rate_scale / 3)
    assert 0 <= light["rejected_fraction"] <= 1 and light["attainment_ratio"] is not None
    # --confirm: one entry per role, with what the engine measured
    settings = saved["confirm"]["settings"]
    assert [s["role"] for s in settings] == ["recommendation", "default", "no-admission", "vllm-queue-cap",
                                             "ours-with-vllm-cap"]
    by_role = {s["role"]: s for s in settings}
    assert by_role["default"]["name"] == "fcfs" and by_role["recommendation"]["name"] == rec["scheduler"]
    assert by_role["no-admission"]["name"] == rec["best_without_admission"]
    assert split_admission(by_role["no-admission"]["name"])[1] is None
    assert split_admission(by_role["vllm-queue-cap"]["name"])[0].startswith("fcfs")
    assert AdmissionRule.parse(split_admission(by_role["vllm-queue-cap"]["name"])[1]).vllm_caps
    assert not split_admission(by_role["ours-with-vllm-cap"]["name"])[0].startswith("fcfs")
    runs = saved["confirm"]["runs"]
    for s in settings:
        assert set(s) == {"role", "name", "measured_attainment", "measured_goodput", "rejected_fraction",
                          "false_admit_fraction", "runs"}
        assert s["measured_attainment"] == runs[s["name"]]["slo_attainment"] and s["runs"] == 2
    md = (out / "advice.md").read_text()
    assert "## Admission rules" in md and "At light load" in md and "vllm-queue-cap" in md


def test_the_serve_command_of_a_rule_is_one_feather_serve_accepts_with_the_slos_it_reads(small):
    import shlex

    from feather_env.evaluation.advise import serve_command
    from scheduler_runtime.serving.serve import vllm_arguments

    for name in ("group-cap-3@256~deadline", "lpm~slo:0.5", "fcfs@512~queued-tokens:2287"):
        command = serve_command(small, name, SLOS)
        assert ("--slo" in command) == AdmissionRule.parse(split_admission(name)[1]).needs_slos
        args, config = vllm_arguments(shlex.split(command)[1:])
        assert config["name"] == name
    assert "--max-num-queued-tokens" in vllm_arguments(
        shlex.split(serve_command(small, "fcfs@512~queued-tokens:2287", SLOS))[1:])[0]
