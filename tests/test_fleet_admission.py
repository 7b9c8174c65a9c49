"""benchmarks/fleet_admission.py: admission on every replica of an unequal fleet, under every router."""

from __future__ import annotations

import json

import pytest

from benchmarks import fleet_admission
from benchmarks.unequal_replicas import OURS_LEARNED, PEERS


def test_the_quick_run_measures_every_router_with_each_rule_and_the_placebo(tmp_path, data_dir):
    out = tmp_path / "fa.json"
    res = fleet_admission.main(["--quick", "--fleets", "speed", "--slo", "ttft:1000 tpot:50",
                                   "--json", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "fleet_admission"
    (cell,) = res["cells"]
    routers = cell["routers"]
    assert set(routers) == {OURS_LEARNED, *PEERS}
    tuning = res["tuning"]["speed"]
    for name, by_rule in routers.items():
        assert set(by_rule) == {"none", *fleet_admission.DEFAULT_RULES, "slo tuned", "vllm caps"}
        assert by_rule["none"]["rejected"] == 0.0
        best = tuning[name]["best"]
        assert by_rule["slo tuned"]["rules"] == [best["slo"]]
        assert by_rule["vllm caps"]["rules"] == [tuning[name]["vllm_caps"]]
        assert tuning[name]["vllm_caps"] in (best["queued-tokens"], best["queued-reqs"])
        # the tuned rule is the family's best on the tuning draws
        means = tuning[name]["means"]
        assert means[best["slo"]] == max(means[r] for r in fleet_admission.FAMILIES["slo"])
        for r in by_rule.values():
            assert 0.0 <= r["attainment"] <= 1.0 - r["rejected"] + 1e-12
    # at three times the capacity and a 1-s TTFT ours' rules shed; each placebo removes as many at random
    for label in fleet_admission.DEFAULT_RULES:
        ours = routers[OURS_LEARNED][label]
        assert ours["rejected"] > 0
        one = 1.0 / cell["requests"]
        assert cell["placebos"][label]["rejected"] == pytest.approx(ours["rejected"], abs=one)
    assert cell["placebo"] == cell["placebos"]["slo"]
    text = fleet_admission.render(res)
    assert "/ best peer, vLLM caps tuned" in text and "placebo (ours learned)" in text


def test_unknown_fleets_are_refused(capsys):
    with pytest.raises(SystemExit):
        fleet_admission.main(["--quick", "--fleets", "drift"])
    assert "unknown fleets" in capsys.readouterr().err


def test_the_mooncake_workload_runs_windows_of_the_trace_at_the_load(data_dir):
    """``--workload mooncake``: each held-out run is a window of the trace (as ``benchmarks.unequal_replicas
    --workload mooncake`` draws it), its timestamps scaled to the load, not Poisson arrivals."""
    from benchmarks.unequal_replicas import fleet_mooncake_pool, mooncake_workload
    from feather_env.scenarios import load_scenario

    res = fleet_admission.main(["--quick", "--workload", "mooncake", "--fleets", "kv", "--no-reroute",
                                "--loads", "2"])
    assert res["workload"] == "mooncake" and not res["reroute_shed"]
    (cell,) = res["cells"]
    window = mooncake_workload(fleet_mooncake_pool("leval-kv-pressure",
                                                   load_scenario("leval-kv-pressure").engine_config()),
                               res["replicas"], seed=res["seeds"][0])
    assert cell["requests"] == len(window)
    assert cell["routers"][OURS_LEARNED]["none"]["rejected"] == 0.0
    assert "windows of the Mooncake trace" in fleet_admission.render(res)
