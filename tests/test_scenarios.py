"""Scenario files: loading, overrides, episodes as pure functions of their seed, clear errors, paths
relative to the file, synthetic episodes of episode.groups, and ``scenarios new`` for a trace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from feather_env.scenarios import SCENARIO_DIR, available_scenarios, load_scenario
from feather_env.workloads import WorkloadError
from scheduler_runtime.config import ConfigError


def test_the_shipped_scenarios_load_and_describe_themselves():
    names = available_scenarios()
    assert {"leval-kv-pressure", "leval-ample-kv", "sharegpt"} <= set(names)
    for name in names:
        sc = load_scenario(name)
        assert sc.description and sc.source.endswith(f"{name}.yaml")
        episode = sc.episode_workload(0)
        assert 1 <= len(episode) <= sc.max_episode_requests
        assert all(r.peak_tokens <= sc.kv_capacity_tokens for r in episode)
        assert sc.engine_config().max_model_len > max(r.peak_tokens for r in sc.pool)


def test_kv_pressure_is_what_its_name_says():
    pressure, ample = load_scenario("leval-kv-pressure"), load_scenario("leval-ample-kv")
    ep = pressure.episode_workload(0)
    assert ep.unique_prompt_tokens() > 1.5 * pressure.kv_capacity_tokens  # documents do not all fit
    assert ample.episode_workload(0).unique_prompt_tokens() < ample.kv_capacity_tokens
    assert ep.num_groups == 16 and max(len(m) for m in ep.groups().values()) <= 8
    assert all(r.prompt_len <= 8192 for r in ep) and ep.arrivals == "burst"
    assert pressure.kv_capacity_tokens == 511 * 128  # 0.25 GiB, less vLLM's null block
    sharegpt = load_scenario("sharegpt").episode_workload(0)
    assert sharegpt.describe()["reuse_factor"] == pytest.approx(1.0, abs=0.01)  # no sharing


def test_an_episode_is_a_pure_function_of_its_seed():
    sc = load_scenario("leval-kv-pressure")
    again = load_scenario("leval-kv-pressure")
    assert sc.episode_workload(5).fingerprint() == again.episode_workload(5).fingerprint()
    assert sc.episode_workload(5).fingerprint() != sc.episode_workload(6).fingerprint()


def test_overrides_replace_keys_and_are_checked():
    sc = load_scenario("leval-kv-pressure", {"episode": {"groups": 3, "arrival": "poisson:2.0"},
                                             "engine": {"kv_cache_gib": 0.5}})
    ep = sc.episode_workload(1)
    assert ep.num_groups == 3 and ep.arrivals == "poisson:2"
    assert sc.engine.kv_cache_gib == 0.5 and sc.engine.max_num_seqs == 64  # the rest is the file's
    assert load_scenario(sc, {"episode": {"groups": 2}}).episode_workload(1).num_groups == 2
    with pytest.raises(ConfigError, match="episode: unknown key.*valid keys"):
        load_scenario("leval-kv-pressure", {"episode": {"docs": 3}})
    with pytest.raises(ConfigError, match="unknown section"):
        load_scenario("leval-kv-pressure", {"reward": {"x": 1}})
    with pytest.raises(ConfigError, match="positive integer"):
        load_scenario("leval-kv-pressure", {"episode": {"groups": 0}})
    with pytest.raises(ConfigError, match="arrival"):
        load_scenario("leval-kv-pressure", {"episode": {"arrival": "sometimes"}})


def test_unknown_scenarios_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown scenario 'nope'; available: \[.*leval-kv-pressure"):
        load_scenario("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"workload": {"kind": "leval"}, "episodes": {"groups": 2}}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['episodes'\]"):
        load_scenario(bad)
    bad.write_text(yaml.safe_dump({"workload": {"kind": "leval", "num_groups": 3}}))
    with pytest.raises(ConfigError, match="belongs in the 'episode' section"):
        load_scenario(bad)
    bad.write_text(yaml.safe_dump({"episode": {"groups": 3}}))
    with pytest.raises(ConfigError, match="needs a 'workload'"):
        load_scenario(bad)
    assert (SCENARIO_DIR / "leval-kv-pressure.yaml").is_file()


def test_a_request_that_can_never_fit_the_kv_cache_is_an_error_not_a_drop():
    sc = load_scenario("leval-kv-pressure", {"engine": {"kv_cache_gib": 0.01}})
    with pytest.raises(ConfigError, match=r"can never fit the KV cache of \d+ tokens"):
        sc.episode_workload(0)


def test_synthetic_scenarios_draw_episode_groups_and_bound_observations_by_them():
    sc = load_scenario("leval-kv-pressure", {"workload": {"kind": "synthetic", "prefix_len": 600,
                                                          "per_group": 5, "max_prompt_tokens": None},
                                             "episode": {"groups": 3, "max_per_group": 2}})
    episodes = [sc.episode_workload(s) for s in range(4)]
    assert all(ep.num_groups == 3 and len(ep) == 6 for ep in episodes)
    assert len({frozenset(ep.groups()) for ep in episodes}) > 1  # other groups per seed
    assert sc.max_episode_requests == 6
    many = load_scenario(sc, {"episode": {"groups": 12, "max_per_group": None}})
    assert many.episode_workload(0).num_groups == 12 and many.max_episode_requests == 60


def test_a_huge_synthetic_prefix_is_refused_before_any_token_is_drawn():
    """A prefix of 50M tokens per group once built a 22 GB pool; now refused from the lengths alone."""
    import resource
    import time

    sc = load_scenario("leval-kv-pressure", {"workload": {"kind": "synthetic", "prefix_len": 50_000_000,
                                                          "max_prompt_tokens": None}})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(WorkloadError, match=r"synthetic group 0, request 0: 50000020 prompt \+ 128 output "
                                            r"tokens can never fit the KV cache of 65408 tokens"):
        sc.pool  # noqa: B018
    assert time.perf_counter() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB
    for spec, why in (("uniform:1:1e30", "longer than any length"), ("lognormal:1e300:3", "MEAN > 0")):
        with pytest.raises(ConfigError, match=why):
            load_scenario("leval-kv-pressure", {"workload": {"kind": "synthetic", "output_len": spec}})


def test_paths_in_a_scenario_are_relative_to_it_and_a_plus_is_part_of_a_name(tmp_path):
    folder = tmp_path / "a+b"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "t.jsonl").write_text('{"prompt": "hi there", "output_tokens": 2, "timestamp": 1}\n'
                                             '{"prompt": "hi you", "output_tokens": 2, "timestamp": 3}\n')
    path = folder / "mine+2.yaml"
    path.write_text(yaml.safe_dump({"workload": {"kind": "custom", "path": "data/t.jsonl"},
                                    "episode": {"arrival": "trace:data/t.jsonl:2"}}))
    sc = load_scenario(str(path))
    assert sc.workload.path == str((folder / "data" / "t.jsonl").resolve())
    assert [r.arrival_time for r in sc.episode_workload(0)] == [0.0, 0.5]  # the trace's gaps at 2 req/s
    with pytest.raises(ConfigError, match="scenario file not found"):
        load_scenario(str(folder / "other.yaml"))
    without = folder / "plain.yaml"
    without.write_text(yaml.safe_dump({"workload": {"kind": "custom", "path": "data/t.jsonl"}}))
    assert [r.arrival_time for r in load_scenario(without).episode_workload(0)] == [0.0, 2.0]  # its own


def test_scenarios_new_describes_a_trace_and_writes_a_scenario_that_loads(tmp_path, capsys):
    from feather_env.scenarios import main

    trace = Path(__file__).resolve().parent / "data" / "support-small.jsonl"
    out = tmp_path / "cfg" / "mine.yaml"
    out.parent.mkdir()
    assert main(["new", "--trace", str(trace), "--kv-cache-gib", "0.02", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "24 requests, timestamps over 1.1 s, a mean rate of 20.00 requests/s" in printed
    assert re.search(r"a perfect prefix cache .* would serve \d+\.\d% of the [\d,]+ prompt tokens; 4 prefix "
                     r"groups", printed)
    saved = yaml.safe_load(out.read_text())
    assert saved["workload"]["kind"] == "custom" and saved["workload"]["max_prompt_tokens"] is None
    assert (out.parent / saved["workload"]["path"]).resolve() == trace.resolve()  # relative to the file
    sc = load_scenario(out)
    assert len(sc.pool) == 24 and sc.engine.kv_cache_gib == 0.02
    assert main(["new", "--trace", str(trace), "--out", str(out)]) == 2  # exists: not replaced
    assert "exists" in capsys.readouterr().err
    for argv, message in (([str(tmp_path / "none.jsonl")], "trace file not found"),
                          ([str(trace), "--kv-cache-gib", "nan"], "kv_cache_gib must be a finite number"),
                          ([str(trace), "--kv-cache-gib", "0.001"], "can never fit the KV cache")):
        assert main(["new", "--trace", *argv, "--out", str(tmp_path / "x.yaml")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x.yaml").exists()
    # an --out that cannot be written: once a raw FileExistsError, after the trace was read
    (tmp_path / "d.yaml").mkdir()
    for where, message in (("/dev/null/x.yaml", "--out's folder /dev/null exists and is not a folder"),
                           (str(tmp_path / "d.yaml"), "is a folder: give the path of a .yaml file")):
        assert main(["new", "--trace", str(trace), "--force", "--out", where]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
