"""benchmarks.across_commits without an engine: its arms, another commit's policy file, the summary
of alternating rounds, a finished run's folder read back, and the busy neighbour's lifetime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import across_commits as ac


def test_an_arm_is_a_label_a_revision_and_maybe_its_own_schedulers():
    assert ac.parse_arm("old=abc123", "fcfs") == ("old", "abc123", "fcfs")
    assert ac.parse_arm("x=HEAD:fcfs,feather:p.feather", "lpm") == ("x", "HEAD", "fcfs,feather:p.feather")
    for bad in ("noequals", "=HEAD", "label="):
        with pytest.raises(SystemExit, match="expected LABEL=REV"):
            ac.parse_arm(bad, "fcfs")


def test_a_policy_path_at_another_revision_is_that_revisions_file(tmp_path):
    out = ac.resolve_files("fcfs,fcfs@256,feather:@HEAD:policies/leval-high-load.feather", tmp_path)
    names = out.split(",")
    assert names[:2] == ["fcfs", "fcfs@256"]  # a token budget is not a revision
    path = Path(names[2].removeprefix("feather:"))
    assert path.parent == tmp_path
    head = subprocess.run(["git", "show", "HEAD:policies/leval-high-load.feather"], cwd=ac.ROOT,
                          check=True, capture_output=True).stdout
    assert path.read_bytes() == head


def _run(tput: float, steps: int = 100, share: float | None = None) -> dict:
    return {"output_throughput": tput, "scheduler_overhead_frac": share, "engine_steps": steps,
            "preemptions": 0, "prefix_hit_rate": 0.5, "ms_per_step": 1000.0 / tput}


def test_the_summary_is_the_median_of_each_rounds_ratio_to_the_first_scheduler():
    rounds = [{"a": {"fcfs": _run(100), "f": _run(160, share=0.01)}},
              {"a": {"fcfs": _run(50), "f": _run(100, share=0.02)}},
              {"a": {"fcfs": _run(100), "f": _run(150, share=0.03)}}]
    s = ac.summarize(rounds)["a"]
    assert s["f"]["ratio_to_fcfs"] == [1.6, 2.0, 1.5]
    assert s["f"]["median_ratio_to_fcfs"] == 1.6  # per round, not the ratio of medians (150 / 100)
    assert s["f"]["median_scheduler_share"] == 0.02 and s["fcfs"]["median_scheduler_share"] is None
    assert s["fcfs"]["median_output_throughput"] == 100 and s["f"]["engine_steps"] == [100] * 3


def test_a_finished_runs_folder_is_read_back_and_a_lost_request_stops_it(tmp_path):
    run = {"completed": 3, "submitted": 3, "output_throughput": 10.0, "scheduler_overhead_frac": 0.01,
           "engine_steps": 40, "step_seconds": 2.0, "preemptions": 1, "prefix_hit_rate": 0.25}
    (tmp_path / "results.json").write_text(json.dumps({"runs": {"fcfs": run}}))
    got = ac.read_runs(tmp_path)["fcfs"]
    assert got["ms_per_step"] == 50.0 and got["engine_steps"] == 40 and got["preemptions"] == 1
    (tmp_path / "results.json").write_text(json.dumps({"runs": {"fcfs": {**run, "completed": 2}}}))
    with pytest.raises(SystemExit, match="served 2 of 3"):
        ac.read_runs(tmp_path)


def test_the_neighbour_runs_only_inside_its_block_and_the_lock_is_released(tmp_path):
    with ac.neighbour("0", sys.executable):
        busy = subprocess.run(["pgrep", "-f", "a = \\(a @ a\\)"], capture_output=True, text=True).stdout
        assert busy.strip()
    after = subprocess.run(["pgrep", "-f", "a = \\(a @ a\\)"], capture_output=True, text=True).stdout
    assert not after.strip()
    lock = tmp_path / "lock"
    for _ in range(2):  # a second hold would block forever if the first were not released
        with ac.held(lock):
            pass
