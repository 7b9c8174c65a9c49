"""benchmarks.frontend_overhead's summary over alternating rounds: each front end's median CPU per request,
and its ratio to the first front end's paired within each round."""

from __future__ import annotations

from benchmarks.frontend_overhead import render, summary


def run(front_end: str, rnd: int, cpu_ms: float) -> dict:
    return {"front_end": front_end, "round": rnd, "requests": 100, "failures": 0, "requests_per_s": 50.0,
            "cpu_ms_per_request": cpu_ms, "affinity": 1.0, "per_replica": [50, 50]}


def test_the_ratio_is_paired_within_a_round_and_the_order_does_not_matter():
    # round 1 is fast for both (0.5 / 0.6), round 2 slow for both (1.0 / 1.1), round 3 in between:
    # unpaired medians would give 0.8 / 0.9; paired, proxy-learned is 1.1-1.2x proxy in every round
    runs = [run("proxy", 0, 0.5), run("proxy-learned", 0, 0.6),
            run("proxy-learned", 1, 1.1), run("proxy", 1, 1.0),
            run("proxy", 2, 0.8), run("proxy-learned", 2, 0.9)]
    rows = {r[0]: r[1:] for r in summary({"runs": runs})}
    assert rows["proxy"][:2] == [3, 0.8]
    assert rows["proxy-learned"][:2] == [3, 0.9]
    assert rows["proxy-learned"][2] == "1.125 (1.100-1.200)"
    assert rows["proxy"][2] == "1.000 (1.000-1.000)"
    text = render({"runs": runs, "rounds": 3, "clients": 8, "command": "x",
                   "machine": {"date": "d", "cpu": "c", "cores": 2}})
    assert "Over 3 rounds" in text and "1.125 (1.100-1.200)" in text


def test_a_single_round_has_no_summary_and_a_missing_pair_gives_no_ratio():
    text = render({"runs": [run("proxy", 0, 0.5), run("proxy-learned", 0, 0.6)], "rounds": 1, "clients": 8,
                   "command": "x", "machine": {"date": "d", "cpu": "c", "cores": 2}})
    assert "Over" not in text
    rows = {r[0]: r[1:] for r in summary({"runs": [run("proxy", 0, 0.0), run("proxy-learned", 0, 0.6)]})}
    assert rows["proxy-learned"][2] == "-"  # the first front end's CPU was 0: no ratio to take
