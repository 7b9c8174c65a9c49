"""``arrival: trace:FILE[:RATE]``: a real trace's gaps for any workload, rescaled, per seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from feather_env.scenarios import load_scenario
from feather_env.workloads.arrivals import TraceFileArrivals, parse_arrival
from scheduler_runtime.config import ConfigError


class _Workload:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _csv(path, times):
    rows = "".join(f"{t},10,5\n" for t in times)
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows)
    return path


def test_a_window_of_the_trace_gaps_rescaled_to_the_rate(tmp_path):
    times = np.cumsum(np.r_[0.0, np.random.default_rng(0).exponential(0.5, 999)])  # 2 req/s
    trace = _csv(tmp_path / "t.csv", times)
    process = parse_arrival(f"trace:{trace}:4")
    assert isinstance(process, TraceFileArrivals) and process.rate == 4.0
    assert process.trace_rate == pytest.approx(999 / times[-1])
    a = process.arrival_times(_Workload(50), seed=7)
    b = process.arrival_times(_Workload(50), seed=7)
    assert np.array_equal(a, b) and a[0] == 0.0 and np.all(np.diff(a) >= 0)
    # the gaps are a window of the trace's, scaled by trace rate / 4
    gaps = np.diff(a) * 4 / process.trace_rate
    trace_gaps = np.diff(times)
    start = int(np.argmin([np.abs(trace_gaps[i:i + 49] - gaps).max() for i in range(len(trace_gaps) - 48)]))
    assert np.allclose(trace_gaps[start:start + 49], gaps)
    assert not np.array_equal(a, process.arrival_times(_Workload(50), seed=8))
    # no rate: the trace's own gaps
    raw = parse_arrival(f"trace:{trace}").arrival_times(_Workload(20), seed=1)
    assert np.isin(np.round(np.diff(raw), 9), np.round(trace_gaps, 9)).all()


def test_json_lines_traces_and_errors(tmp_path):
    lines = tmp_path / "t.jsonl"
    lines.write_text("".join(json.dumps({"timestamp": t}) + "\n" for t in (0.0, 1.0, 3.0)))
    # a mean rate of 2/3 req/s made 1 req/s: the gaps 1 and 2 become 2/3 and 4/3
    got = parse_arrival(f"trace:{lines}:1").arrival_times(_Workload(2), 0)
    assert np.allclose(got, [0.0, 2 / 3]) or np.allclose(got, [0.0, 4 / 3])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n{"time": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        parse_arrival(f"trace:{bad}")
    neg = _csv(tmp_path / "neg.csv", [0.0, -1.0])
    with pytest.raises(ConfigError, match="finite seconds >= 0"):
        parse_arrival(f"trace:{neg}")
    with pytest.raises(ConfigError, match="not found"):
        parse_arrival("trace:no-such-trace.csv")
    with pytest.raises(ConfigError, match="rate"):
        parse_arrival(f"trace:{lines}:0")


def test_a_scenario_finds_its_trace_beside_it(tmp_path):
    _csv(tmp_path / "mine.csv", np.arange(0.0, 100.0, 0.5))
    (tmp_path / "s.yaml").write_text(
        "workload:\n  kind: leval\n  max_prompt_tokens: 1024\nepisode:\n  groups: 2\n  max_per_group: 3\n"
        "  arrival: trace:mine.csv:1\n")
    scenario = load_scenario(tmp_path / "s.yaml")
    assert scenario.episode.arrival == f"trace:{tmp_path / 'mine.csv'}:1"
    times = sorted(r.arrival_time for r in scenario.episode_workload(3))
    assert times[0] == 0.0 and np.allclose(np.diff(times), 1.0)  # 2 req/s rescaled to 1 req/s
