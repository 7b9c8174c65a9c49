"""``benchmarks/drift_loopback.py`` end to end over paced stand-in workers (no engine): a closed loop of
fixed length, replica 1 slowed and recovered while it runs, what ours learns of it, the figures."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import drift_loopback as dl
from benchmarks import unequal_loopback as ul


def test_the_whole_benchmark_runs_on_stand_ins_and_ours_learns_the_slowdown(tmp_path, capsys):
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' may be there
    out = dl.main(["--standin", "--end", "9", "--slow-at", "3", "--recover-at", "6", "--window", "1.5",
                   "--poll", "0.25", "--repeats", "1", "--out", str(tmp_path / "runs"),
                   "--json", str(tmp_path / "d.json")], log=lambda m: None)
    assert json.loads((tmp_path / "d.json").read_text())["benchmark"] == "drift_loopback"
    assert [r["front_end"] for r in out["runs"]] == [dl.OURS, dl.TODAY]
    pool = ul.STANDIN_DOCS * ul.STANDIN_QUESTIONS
    for run in out["runs"]:
        # a closed loop of fixed length: the pool again and again, every request served in full
        assert run["completed"] == run["submitted"] > pool
        assert run["wall_s"] >= 9 and all(0 <= r["sent_s"] < 9 for r in run["requests"])
        # the slowdown and the recovery happened when asked, and the readings span the run
        changes = dict(run["changes"])
        assert 3 <= changes["slowed"] < 4 and 6 <= changes["after"] < 7
        assert run["readings"][0]["t"] < 1 and run["readings"][-1]["t"] > 8
        answered = run["readings"][-1]["answered"]
        assert sum(answered.values()) == run["completed"]
        for phase in dl.PHASES:
            assert 0 < run["phases"][phase]["share_1"] < 1 and run["phases"][phase]["attainment"] == 1.0
        assert all(w["share_1"] is None or 0 <= w["share_1"] <= 1 for w in run["windows"])
    ours, today = out["runs"]
    # ours learned replica 1 slower while its pace was 3x, and not before; ours as today learns nothing
    changes = dict(ours["changes"])
    slowed = [x for r in ours["readings"]
              if changes["slowed"] <= r["t"] < changes["after"] and (x := dl._ratio(r)) is not None]
    early = [x for r in ours["readings"] if r["t"] < changes["slowed"] and (x := dl._ratio(r)) is not None]
    assert slowed and min(slowed) < 0.8
    assert early and min(early) > 0.8
    assert all(r["prefill_tok_s"] is None for r in today["readings"]) and today["settle_s"] is None
    assert set(ours["settle_s"]) == {"slowed", "after"}
    text = capsys.readouterr().out
    assert dl.OURS in text and "learned prefill speed" in text
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before


@pytest.mark.parametrize("argv", [["--front-ends", "nginx"], ["--repeats", "0"], ["--slo", "ttft:x"],
                                  ["--slow-at", "5", "--recover-at", "4"], ["--recover-at", "300"],
                                  ["--documents", "31"], ["--window", "0"], ["--standin-factor", "0"]])
def test_bad_options_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        dl.main(["--standin", *argv])


def test_the_windows_and_phases_read_the_counters_between_readings():
    readings = [{"t": 0.5, "answered": {"0": 1, "1": 1}, "prefill_tok_s": None},
                {"t": 1.5, "answered": {"0": 5, "1": 3}, "prefill_tok_s": None},
                {"t": 2.5, "answered": {"0": 9, "1": 4}, "prefill_tok_s": None}]
    requests = [{"sent_s": 0.2, "ttft_s": 0.1, "e2e_s": 0.3, "tokens": 8, "completed": True},
                {"sent_s": 1.2, "ttft_s": 6.0, "e2e_s": 7.0, "tokens": 8, "completed": True},
                {"sent_s": 2.2, "ttft_s": 0.1, "e2e_s": 2.0, "tokens": 8, "completed": True}]
    run = {"readings": readings, "requests": requests, "wall_s": 3.0, "changes": [["slowed", 1.0],
                                                                                  ["after", 2.0]]}
    slo = {"ttft": 5000.0, "tpot": 50.0}
    w = dl.windows(run, 1.0, slo)
    assert [x["t"] for x in w] == [0.0, 1.0, 2.0]
    # the first window counts from zero; the later ones from the last reading before them
    assert w[0]["share_1"] == 0.5 and w[1]["share_1"] == 2 / 6 and w[2]["share_1"] == 1 / 5
    # TTFT over 5 s misses; 1.9 s over 7 tokens is a TPOT of 271 ms, which misses too
    assert [x["attainment"] for x in w] == [1.0, 0.0, 0.0]
    phases = dl.phase_figures(run, slo)
    assert phases["slowed"]["share_1"] == 2 / 6 and phases["after"]["sent"] == 1


def test_fresh_passes_are_new_documents_each_pass_sharing_within_it():
    pool = [("doc A question 1", 4), ("doc A question 2", 4), ("doc B question 1", 8)]
    fresh = dl.FreshPasses(pool, passes=3)
    assert len(fresh) == 9 and fresh[0] == ("Pass 0. doc A question 1", 4) and fresh[8][1] == 8
    assert fresh[3] == ("Pass 1. doc A question 1", 4)
    # within a pass a document's questions share its opening; across passes nothing does
    assert fresh[0][0][:12] == fresh[1][0][:12] and fresh[0][0][:8] != fresh[3][0][:8]
    with pytest.raises(IndexError):
        fresh[9]
    assert list(fresh)[-1] == ("Pass 2. doc B question 1", 8)
