"""scripts/compare_policies.py: decisions of two policy files side by side on the simulator."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import compare_policies  # noqa: E402

from scheduler_runtime.decision import ADD, BASE_OBS_NAMES, STOP  # noqa: E402
from scheduler_runtime.policy import ConstantPolicy, ObservationSpec, write_policy  # noqa: E402


def _constant(tmp_path: Path, action: int) -> str:
    path = tmp_path / f"constant-{action}.feather"
    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    write_policy(path, ConstantPolicy(spec, action=action))
    return str(path)


def test_a_policy_agrees_with_itself():
    shipped = str(REPO / "policies" / "leval-kv-pressure-poisson.feather")
    res = compare_policies.compare(shipped, shipped, "leval-kv-pressure-poisson", episodes=2)
    assert res["decisions"] > 0 and res["differ"] == 0
    assert res["a_figures"] == res["b_figures"]


def test_policies_that_differ_are_counted_and_served_on_their_own(tmp_path, capsys):
    add, stop = _constant(tmp_path, ADD), _constant(tmp_path, STOP)
    res = compare_policies.main([add, stop, "--scenario", "leval-kv-pressure", "--episodes", "2",
                                 "--json", str(tmp_path / "cmp.json")])
    assert 0 < res["differ"] <= res["decisions"]
    # always-STOP defers every request it may: served on its own, it is slower than always-add
    assert res["b_figures"]["output_throughput"] < res["a_figures"]["output_throughput"]
    assert "decisions differ" in capsys.readouterr().out and (tmp_path / "cmp.json").is_file()
