"""Mooncake traces as a workload (``kind: custom, format: mooncake``): prompts made of a fixed block of
tokens per hash id, lengths scaled by ``block_tokens``, every malformed row named by file and line,
``episode.rate_scale``, a relative path found under the data root, the LRU-bounded prefix reuse, the
shipped ``mooncake-synthetic`` scenario and ``scenarios new --format mooncake``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.scenarios import EVALUATED_SCENARIOS, EpisodeConfig, load_scenario, main
from feather_env.workloads import DataNotFoundError, Request, Workload, WorkloadConfig, WorkloadError
from feather_env.workloads.custom import load_custom, model_info, resolve_custom_path
from feather_env.workloads.datadir import ENV_VAR, resolve_data_dir
from feather_env.workloads.workload import _common_prefix_len
from scheduler_runtime.config import ConfigError

#: Three requests: the first two share the blocks of ids 1 and 2, the third shares nothing.
ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [1, 2, 3]},
    {"timestamp": 250, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 9]},
    {"timestamp": 1250, "input_length": 10, "output_length": 40, "hash_ids": [7]},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mooncake_scenario(folder: Path, trace: str = "mc.jsonl", **episode) -> Path:
    path = folder / "mc.yaml"
    path.write_text(yaml.safe_dump({
        "workload": {"kind": "custom", "path": trace, "format": "mooncake", "block_tokens": 16,
                     "max_prompt_tokens": None},
        "episode": episode, "engine": {"kv_cache_gib": 0.02}}))
    return path


def _timed_rows(n: int) -> list[dict]:
    """``n`` requests 100 ms apart, in conversations of three that extend one another's prefix."""
    rows = []
    for i in range(n):
        conv, turn = divmod(i, 3)
        ids = [1000 * conv + k for k in range(2 + 2 * turn)]
        rows.append({"timestamp": 100 * i + (i % 7), "input_length": 512 * len(ids) - 100,
                     "output_length": 64 + i, "hash_ids": ids})
    return rows


# ----------------------------------------------------------------------------- reading the trace
def test_hash_ids_become_fixed_blocks_and_lengths_are_scaled(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    w = load_custom(path, format="mooncake", block_tokens=16)
    a, b, c = w
    assert [r.prompt_len for r in w] == [47, 35, 1]  # ceil(input_length * 16 / 512)
    assert [r.output_len for r in w] == [3, 1, 1]  # max(1, round(output_length * 16 / 512))
    assert [r.arrival_time for r in w] == [0.0, 0.25, 1.25] and w.arrivals == "trace"
    assert {r.source for r in w} == {"mooncake/mc"}
    assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == 2 * 16  # ids 1, 2 shared, then not
    vocab = model_info().vocab_size
    assert all(3 <= int(r.prompt_token_ids.min()) and int(r.prompt_token_ids.max()) < vocab for r in w)
    # an id is the same block wherever it is, in every load (another file: no cached pool)
    other = _write_jsonl(tmp_path / "other.jsonl", [{"timestamp": 5, "input_length": 2048, "output_length": 1,
                                                      "hash_ids": [3, 7, 1, 2]}])
    (d,) = load_custom(other, format="mooncake", block_tokens=16)
    blocks = d.prompt_token_ids.reshape(4, 16)
    assert np.array_equal(blocks[0][:15], a.prompt_token_ids[32:])  # id 3's block, cut to 15 tokens in a
    assert blocks[1][0] == c.prompt_token_ids[0]  # id 7's block, of which c keeps one token
    assert np.array_equal(blocks[2:].ravel(), a.prompt_token_ids[:32])
    assert len({blocks[i].tobytes() for i in range(4)}) == 4  # different ids, different blocks
    again = load_custom(_write_jsonl(tmp_path / "again.jsonl", ROWS), format="mooncake", block_tokens=16)
    assert [r.prompt_token_ids.tobytes() for r in again] == [r.prompt_token_ids.tobytes() for r in w]
    full = load_custom(path, format="mooncake")  # block_tokens 512: the trace's own lengths
    assert [r.prompt_len for r in full] == [1500, 1100, 10] and [r.output_len for r in full] == [100, 1, 40]
    assert _common_prefix_len(full[0].prompt_token_ids, full[1].prompt_token_ids) == 2 * 512
    alone = _write_jsonl(tmp_path / "b512.jsonl", [{"timestamp": 0, "input_length": 512, "output_length": 1,
                                                    "hash_ids": [2]}])
    assert np.array_equal(full[0].prompt_token_ids[512:1024], load_custom(alone, format="mooncake")[0]
                          .prompt_token_ids)  # id 2's block at 512 tokens, wherever it is


def test_the_request_checks_and_caps_apply_to_mooncake_rows(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    with pytest.raises(WorkloadError, match=r"mc.jsonl:1: 47 prompt \+ 3 output tokens can never fit the "
                                            r"KV cache of 40 tokens"):
        load_custom(path, format="mooncake", block_tokens=16, max_request_tokens=40)
    capped = load_custom(path, format="mooncake", block_tokens=16, max_prompt_tokens=20, max_output_tokens=2)
    assert [r.prompt_len for r in capped] == [20, 20, 1] and [r.output_len for r in capped] == [2, 1, 1]
    with pytest.raises(WorkloadError, match=r"mc.jsonl:1: prompt of 47 tokens > max_prompt_tokens=20"):
        load_custom(path, format="mooncake", block_tokens=16, max_prompt_tokens=20, overflow="error")
    huge = _write_jsonl(tmp_path / "huge.jsonl", [{"timestamp": 0, "input_length": 70_000, "output_length": 1,
                                                   "hash_ids": list(range(137))}])
    with pytest.raises(WorkloadError, match=r"huge.jsonl:1: 70000 prompt \+ 1 output tokens exceed the "
                                            r"model's context of 65536"):
        load_custom(huge, format="mooncake")
    assert load_custom(huge, format="mooncake", block_tokens=64)[0].prompt_len == 8750


_GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("line, message", [
    ('{"input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', r"needs .*no \['timestamp'\]"),
    ('{"timestamp": 0, "output_length": 5, "hash_ids": [1, 2]}', r"no \['input_length'\]"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5}', r"no \['hash_ids'\]"),
    ('{"timestamp": 0, "input_length": 600.5, "output_length": 5, "hash_ids": [1, 2]}',
     r"input_length must be an integer >= 1"),
    ('{"timestamp": 0, "input_length": "many", "output_length": 5, "hash_ids": [1, 2]}',
     r"input_length must be a number"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": [1, 2]}',
     r"input_length must be an integer >= 1"),
    ('{"timestamp": 0, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]}',
     r"output_length must be an integer >= 0"),
    ('{"timestamp": 0, "input_length": 600, "output_length": [5], "hash_ids": [1, 2]}',
     r"output_length must be a number"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     r"timestamp must be a finite time in milliseconds >= 0"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     r"timestamp must be a finite time in milliseconds"),
    ('{"timestamp": "soon", "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     r"timestamp must be a number"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": "1 2"}',
     r"hash_ids must be a list of integers"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2.0]}',
     r"hash_ids must be a list of integers"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, true]}',
     r"hash_ids must be a list of integers"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}',
     r"hash_ids must be integers >= 0, got -2"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 5, "hash_ids": [1, 2]}',
     r"input_length 1025 needs 3 hash_ids \(one per 512-token block\), got 2"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]', r"malformed JSON line"),
    ('[0, 600, 5, [1, 2]]', r"expected a JSON object"),
])
def test_every_malformed_mooncake_row_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "mc.jsonl"
    path.write_text(_GOOD + line + "\n" + _GOOD)
    with pytest.raises(WorkloadError, match=message) as info:
        load_custom(path, format="mooncake")
    assert f"{path}:2: " in str(info.value)


def test_format_and_block_tokens_are_checked(tmp_path):
    path = _write_jsonl(tmp_path / "mc.jsonl", ROWS)
    csv_file = tmp_path / "mc.csv"
    csv_file.write_text("timestamp,input_length,output_length,hash_ids\n0,10,1,[1]\n")
    with pytest.raises(WorkloadError, match=r"mc.csv: a Mooncake trace is JSON lines"):
        load_custom(csv_file, format="mooncake")
    with pytest.raises(WorkloadError, match=r"block_tokens .* is for format 'mooncake'"):
        load_custom(path, block_tokens=64)
    with pytest.raises(WorkloadError, match=r"format must be one of \['requests', 'mooncake'\]"):
        load_custom(path, format="vidur")
    with pytest.raises(WorkloadError, match=r"no prompt"):  # a Mooncake row read as requests
        load_custom(path)
    for bad, message in (({"format": "mooncake"}, r"workload.format is for kind custom"),
                         ({"kind": "custom", "path": "x.jsonl", "format": "csv"}, r"workload.format must be"),
                         ({"kind": "custom", "path": "x.jsonl", "block_tokens": 64},
                          r"workload.block_tokens .* is for format: mooncake"),
                         ({"kind": "custom", "path": "x.jsonl", "format": "mooncake", "block_tokens": 0},
                          r"workload.block_tokens must be an integer >= 1"),
                         ({"kind": "custom", "path": "x.jsonl", "format": "mooncake", "block_tokens": 1.5},
                          r"block_tokens: expected int")):
        with pytest.raises(ConfigError, match=message):
            WorkloadConfig.from_mapping(bad)
    assert WorkloadConfig(kind="custom", path="x.jsonl", block_tokens=512).block_tokens == 512  # the default


# ----------------------------------------------------------------------------- episodes
def test_rate_scale_divides_the_episodes_arrivals_and_one_leaves_them_untouched(tmp_path):
    _write_jsonl(tmp_path / "mc.jsonl", _timed_rows(30))
    plain = load_scenario(_mooncake_scenario(tmp_path))
    ep = plain.episode_workload(0)
    assert [r.arrival_time for r in ep] == [r.arrival_time for r in plain.pool]
    one = load_scenario(plain, {"episode": {"rate_scale": 1.0}}).episode_workload(0)
    assert one.fingerprint() == ep.fingerprint() and one.name == ep.name  # not a float changed
    for scale in (2, 3.7, 0.25):
        sc = load_scenario(plain, {"episode": {"rate_scale": scale}})
        fast = sc.episode_workload(0)
        assert [r.request_id for r in fast] == [r.request_id for r in ep]
        assert [r.arrival_time for r in fast] == [r.arrival_time / scale for r in ep]
        assert [r.prompt_token_ids.tobytes() for r in fast] == [r.prompt_token_ids.tobytes() for r in ep]
        assert fast.arrivals == "trace" and sc.max_episode_requests == plain.max_episode_requests == 30
    poisson = load_scenario(plain, {"episode": {"rate_scale": 2, "arrival": "poisson:5"}}).episode_workload(1)
    slow = load_scenario(plain, {"episode": {"arrival": "poisson:5"}}).episode_workload(1)
    assert [r.arrival_time for r in poisson] == [r.arrival_time / 2 for r in slow]  # any arrival process
    for bad in (0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ConfigError, match="episode.rate_scale must be a finite number > 0"):
            EpisodeConfig(rate_scale=bad)


def test_the_window_is_drawn_in_the_traces_seconds_then_rate_scaled(tmp_path):
    _write_jsonl(tmp_path / "mc.jsonl", _timed_rows(60))  # 6 s of trace
    windowed = load_scenario(_mooncake_scenario(tmp_path, window_s=2.0))
    fast = load_scenario(windowed, {"episode": {"rate_scale": 4}})
    assert fast.max_episode_requests == windowed.max_episode_requests <= 21
    for seed in range(4):
        win, quick = windowed.episode_workload(seed), fast.episode_workload(seed)
        assert [r.request_id for r in quick] == [r.request_id for r in win]  # the same window
        assert [r.arrival_time for r in quick] == [r.arrival_time / 4 for r in win]
        assert max(r.arrival_time for r in win) < 2.0 and max(r.arrival_time for r in quick) < 0.5
        assert 1 <= len(quick) <= fast.max_episode_requests


def test_a_relative_path_not_beside_the_scenario_is_found_under_the_data_root(tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "traces" / "mooncake").mkdir(parents=True)
    _write_jsonl(root / "traces" / "mooncake" / "t.jsonl", ROWS)
    folder = tmp_path / "scenarios"
    folder.mkdir()
    monkeypatch.setenv(ENV_VAR, str(root))
    sc = load_scenario(_mooncake_scenario(folder, "traces/mooncake/t.jsonl"))
    assert sc.workload.path == str((root / "traces" / "mooncake" / "t.jsonl").resolve())
    assert len(sc.pool) == 3
    monkeypatch.setenv(ENV_VAR, str(root / "traces"))  # the root may name the folder itself
    assert resolve_custom_path("traces/mooncake/t.jsonl") == root / "traces" / "mooncake" / "t.jsonl"
    assert len(load_custom("traces/mooncake/t.jsonl", format="mooncake")) == 3  # outside a scenario too
    (folder / "traces" / "mooncake").mkdir(parents=True)  # beside the scenario wins
    _write_jsonl(folder / "traces" / "mooncake" / "t.jsonl", ROWS[:2])
    assert len(load_scenario(_mooncake_scenario(folder, "traces/mooncake/t.jsonl")).pool) == 2
    explicit = WorkloadConfig(kind="custom", path="mooncake/t.jsonl", data_dir=str(root / "traces"),
                              format="mooncake")
    assert resolve_custom_path(explicit.path, data_dir=explicit.data_dir) == root / "traces/mooncake/t.jsonl"
    missing = load_scenario(_mooncake_scenario(folder, "traces/nope.jsonl"))
    with pytest.raises(DataNotFoundError, match=re.escape(str(folder / "traces" / "nope.jsonl"))):
        missing.pool  # noqa: B018


# ----------------------------------------------------------------------------- prefix reuse under LRU
def _lru_reference(prompts: list[list[int]], block: int, capacity_blocks: int | None) -> int:
    """A direct LRU of whole-block prefixes (keys: the prefix's tokens), requests one at a time."""
    cache: list[tuple[int, ...]] = []  # least recently used first
    total = 0
    for p in prompts:
        hitting = True
        for b in range(len(p) // block):
            key = tuple(p[: (b + 1) * block])
            found = key in cache
            if hitting and found and (b + 1) * block <= len(p) - 1:
                total += block
            else:
                hitting = False
            if found:
                cache.remove(key)
            cache.append(key)
            if capacity_blocks is not None and len(cache) > capacity_blocks:
                cache.pop(0)
    return total


def _workload(prompts: list[list[int]]) -> Workload:
    return Workload("w", tuple(Request(f"r{i}", np.array(p), -1, 1, 0.0) for i, p in enumerate(prompts)))


_PROMPTS = st.lists(st.lists(st.integers(3, 5), min_size=1, max_size=30), min_size=1, max_size=14)


@settings(max_examples=80, deadline=None)
@given(_PROMPTS, st.integers(1, 6), st.lists(st.integers(0, 40), min_size=2, max_size=5))
def test_an_lru_capacity_serves_what_an_lru_cache_of_that_size_would(prompts, block, capacities):
    w = _workload(prompts)
    unbounded = w.cached_prompt_tokens(block)
    assert unbounded == _lru_reference(prompts, block, None)
    served = []
    for blocks in sorted(capacities):
        got = w.cached_prompt_tokens(block, blocks * block + block - 1)  # a partial block holds nothing
        assert got == _lru_reference(prompts, block, blocks)
        served.append(got)
    assert served == sorted(served) and served[-1] <= unbounded  # monotone in the capacity, bounded
    every_block = sum(len(p) // block for p in prompts) * block
    assert w.cached_prompt_tokens(block, every_block) == unbounded
    assert w.cached_prompt_tokens(block, 0) == 0


def test_an_lru_cache_loses_the_reuse_it_cannot_hold():
    a, b = [3] * 8 + [4], [5] * 8 + [6]
    w = _workload([a, b, a, b])  # each prompt: two blocks of 4
    assert w.cached_prompt_tokens(4) == 16 and w.cached_prompt_tokens(4, 16) == 16
    assert w.cached_prompt_tokens(4, 12) == 0  # three blocks: each prompt evicts the other's
    with pytest.raises(WorkloadError, match="capacity_tokens must be >= 0"):
        w.cached_prompt_tokens(4, -1)


# ----------------------------------------------------------------------------- the shipped scenario
def _shipped_trace() -> Path:
    try:
        path = resolve_data_dir(None, "traces") / "mooncake" / "synthetic_trace.jsonl"
    except DataNotFoundError:
        pytest.skip("no data root")
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


def test_the_shipped_mooncake_scenario_reads_the_real_trace():
    trace = _shipped_trace()
    sc = load_scenario("mooncake-synthetic")
    assert "mooncake-synthetic" not in EVALUATED_SCENARIOS
    assert Path(sc.workload.path) == trace.resolve() and sc.workload.format == "mooncake"
    assert sc.workload.block_tokens == 64 and sc.episode.rate_scale == 4 and sc.episode.window_s == 300
    assert len(sc.pool) == 3993 and sc.pool.arrivals == "trace"
    ep = sc.episode_workload(0)
    times = [r.arrival_time for r in ep]
    assert 1 <= len(ep) <= sc.max_episode_requests and max(times) - min(times) <= 300 / 4
    assert all(r.peak_tokens <= sc.kv_capacity_tokens for r in ep)
    assert {r.source for r in ep} == {"mooncake/synthetic_trace"}


# ----------------------------------------------------------------------------- scenarios new
def test_scenarios_new_writes_a_mooncake_scenario_and_reports_the_reuse(tmp_path, capsys):
    trace = _write_jsonl(tmp_path / "mc.jsonl", _timed_rows(45))
    out = tmp_path / "cfg" / "mc.yaml"
    argv = ["new", "--trace", str(trace), "--format", "mooncake", "--block-tokens", "16", "--window-s", "2",
            "--rate-scale", "2", "--kv-cache-gib", "0.005", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "45 requests, timestamps over 4.4 s" in printed and "episodes replay it 2x as fast" in printed
    perfect = re.search(r"a perfect prefix cache \(blocks of 128 tokens, no eviction\) would serve "
                        r"(\d+\.\d)% of the [\d,]+ prompt tokens", printed)
    lru = re.search(r"prefix reuse: an LRU cache of the engine's ([\d,]+) tokens would serve (\d+\.\d)%",
                    printed)
    assert perfect and lru and float(lru.group(2)) <= float(perfect.group(1))
    assert "replayed 2x as fast" in printed
    saved = yaml.safe_load(out.read_text())
    assert saved["workload"]["format"] == "mooncake" and saved["workload"]["block_tokens"] == 16
    assert saved["episode"] == {"window_s": 2.0, "rate_scale": 2.0}
    sc = load_scenario(out)
    assert len(sc.pool) == 45 and int(lru.group(1).replace(",", "")) == sc.kv_capacity_tokens
    assert max(r.arrival_time for r in sc.episode_workload(0)) < 1.0
    bad = ["new", "--trace", str(trace), "--block-tokens", "16", "--out", str(tmp_path / "x.yaml")]
    assert main(bad) == 2  # block_tokens without --format mooncake
    assert "block_tokens" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()
