"""benchmarks/tpot_term.py: slo+tpot against slo alone for a window of the term, on one engine and a fleet."""

from __future__ import annotations

import json

from benchmarks import tpot_term
from scheduler_runtime import admission


def test_the_term_lifts_the_mooncake_fleet_past_capacity_and_the_window_is_restored(tmp_path, data_dir):
    """On the speed fleet at 1.5x its capacity the misses are TPOT misses that ``slo`` alone cannot see
    (it sheds nothing); its ``tpot`` term sheds and more requests meet the SLO."""
    with open("results/admission_headroom.json") as f:
        headroom = json.load(f)
    headroom["loads"] = {"4": headroom["loads"]["4"]}
    headroom["eval_seeds"] = headroom["eval_seeds"][:1]
    small = tmp_path / "headroom.json"
    small.write_text(json.dumps(headroom))
    default = admission.TPOT_WINDOW_S
    res = tpot_term.main(["--windows", "1", "--headroom", str(small), "--fleet-seeds", "20000",
                          "--json", str(tmp_path / "t.json")])
    assert admission.TPOT_WINDOW_S == default
    fleet = {r["rule"]: r for r in res["runs"] if r["cell"].startswith("speed fleet")}
    assert fleet["slo"]["rejected"] < 0.01 and fleet["slo"]["tpot_missed"] > 0.3
    assert fleet["slo+tpot"]["rejected"] > fleet["slo"]["rejected"]
    assert fleet["slo+tpot"]["attainment"] > fleet["slo"]["attainment"] + 0.2
    single = [r for r in res["runs"] if r["cell"] == "one engine, 4x"]
    assert {r["rule"] for r in single} == set(tpot_term.rules(res["tuned"]["one engine, 4x"]))
    assert "window 1 s" in tpot_term.render(res)
