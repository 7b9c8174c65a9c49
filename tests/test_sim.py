"""The simulator backend and its step-time model: features, the fit, fast-forward, profiles."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.calibrate import (
    DEFAULT_PROFILE,
    PROFILE_VERSION,
    fit_profile,
    load_profile,
    load_steps,
    load_steps_files,
)
from feather_env.engines.sim_backend import SimBackend, _steps_to_reach
from feather_env.env import FeatherEnv, play_episode
from feather_env.records import StepRequest
from feather_env.reporting import write_json
from feather_env.step_model import FEATURE_NAMES, StepCostModel, fit_step_model, step_features
from scheduler_runtime.config import ConfigError

SCENARIO = "leval-kv-pressure"


def decode(c: int, group: int, shared: int) -> StepRequest:
    return StepRequest(num_tokens=1, num_computed=c, group=group, shared_tokens=shared, is_prefill=False)


def test_features_count_tokens_contexts_prefill_work_and_misses():
    batch = [decode(1000, 7, 896), decode(1010, 7, 896),
             StepRequest(num_tokens=512, num_computed=256, group=9, shared_tokens=0, is_prefill=True)]
    const, reqs, tokens, kv, miss, attn = step_features(batch, cache_tokens=10**9)
    assert (const, reqs, tokens) == (1.0, 3, 514)
    assert kv == 1001 + 1011  # each decode reads its context and the new token
    # the shared prefix is read once (the second read hits), own tokens always miss
    assert miss == 896 + (1001 - 896) + (1011 - 896)
    assert attn == 512 * (256 + 513 / 2)


def test_batch_order_decides_locality_under_a_small_cache():
    """Two documents of 4K tokens: sorted by document, each prefix stays cached between its
    readers; interleaved, the other document pushes it out of a 6K-token cache."""
    a = [decode(4100, 1, 4096), decode(4100, 1, 4096), decode(4100, 2, 4096), decode(4100, 2, 4096)]
    interleaved = [a[0], a[2], a[1], a[3]]
    sorted_miss = step_features(a, cache_tokens=6000)[4]
    mixed_miss = step_features(interleaved, cache_tokens=6000)[4]
    assert sorted_miss == 2 * 4096 + 4 * 5
    assert mixed_miss == 4 * 4096 + 4 * 5
    assert step_features(interleaved, cache_tokens=10**9)[4] == sorted_miss  # a big cache holds both


def test_fit_recovers_a_known_model():
    rng = np.random.default_rng(0)
    truth = StepCostModel((1.5e-3, 2e-5, 2e-5, 1e-7, 3e-7, 2.5e-8), cache_tokens=16384.0)
    steps = []
    for _ in range(400):
        batch = [decode(int(rng.integers(500, 8000)), int(rng.integers(0, 4)), int(rng.integers(0, 4)) * 128)
                 for _ in range(int(rng.integers(1, 40)))]
        if rng.random() < 0.3:
            q = int(rng.integers(64, 4096))
            batch.append(StepRequest(q, int(rng.integers(0, 4096)), 99, 0, True))
        steps.append((batch, truth.predict(batch) * float(rng.normal(1.0, 0.01))))
    model, mape = fit_step_model(steps)
    assert mape < 0.03
    assert model.cache_tokens == pytest.approx(16384, rel=0.5)
    for got, want in zip(model.coef[3:], truth.coef[3:], strict=True):
        assert got == pytest.approx(want, rel=0.25)


def test_fit_profile_round_trips_through_a_steps_file(tmp_path):
    rng = np.random.default_rng(1)
    truth = StepCostModel((1e-3, 1e-5, 2e-5, 1e-7, 2e-7, 2e-8), cache_tokens=32768.0)
    steps = [([decode(int(rng.integers(100, 3000)), 1, 0)], 0.0) for _ in range(50)]
    steps = [(b, truth.predict(b)) for b, _ in steps]
    path = tmp_path / "steps.json"
    write_json(path, {"episodes": [{"label": "x", "steps": 50}], "steps": [
        {"seconds": t, "batch": [[r.num_tokens, r.num_computed, r.group, r.shared_tokens, int(r.is_prefill)]
                                 for r in b]} for b, t in steps]})
    loaded, episodes = load_steps(path)
    assert [t for _, t in loaded] == [t for _, t in steps] and episodes[0]["label"] == "x"
    profile = fit_profile(loaded, episodes)
    assert profile["version"] == PROFILE_VERSION and profile["fit"]["steps"] == 50
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(profile))
    assert load_profile(out)["step_model"]["features"] == list(FEATURE_NAMES)
    # several runs fit as one (whole windows served by different schedulers), in the order named
    other = tmp_path / "other.json"
    first_ten = json.loads(path.read_text())["steps"][:10]
    write_json(other, {"episodes": [{"label": "y", "steps": 10}], "steps": first_ten})
    both, eps = load_steps_files(f"{path}, {other}")
    assert len(both) == 60 and [e["label"] for e in eps] == ["x", "y"]
    assert fit_profile(both, eps)["fit"]["steps"] == 60
    for bad in (f"{path},{path}", f"{path},", str(tmp_path / "missing.json")):
        with pytest.raises(ConfigError):
            load_steps_files(bad)


@settings(max_examples=200, deadline=None)
@given(room=st.floats(1e-4, 50.0), t1=st.floats(1e-4, 0.2), g=st.floats(0.0, 1e-3), cap=st.integers(1, 3000))
def test_fast_forward_takes_the_fewest_steps_that_reach_the_deadline(room, t1, g, cap):
    m = _steps_to_reach(room, t1, g, cap)

    def total(k: int) -> float:
        return k * t1 + g * k * (k - 1) / 2.0

    assert 1 <= m <= cap
    if m < cap:
        assert total(m) >= room
    if m > 1:
        assert total(m - 1) < room
    assert _steps_to_reach(math.inf, t1, g, cap) == cap


@pytest.mark.parametrize("scheduler,overrides", [
    ("feather-heuristic", {}),
    ("fcfs", {"episode": {"groups": 8, "arrival": "poisson:2.0"}}),
    ("lpm", {"engine": {"kv_cache_gib": 0.1, "max_num_batched_tokens": 2048}}),
])
def test_fast_forward_equals_stepping_every_step(scheduler, overrides, monkeypatch):
    """Taking stretches of decode steps at once changes nothing but the speed."""
    env = FeatherEnv(SCENARIO, "sim", scheduler=scheduler, scenario_overrides=overrides)
    fast = play_episode(env, episode_seed=4)
    fast_timelines = [(t.request_id, t.first_token, t.finish) for t in env.backend.timelines()]
    monkeypatch.setattr(type(env.backend.engine), "decode_horizon", lambda self: 0)
    slow = play_episode(env, episode_seed=4)
    slow_timelines = [(t.request_id, t.first_token, t.finish) for t in env.backend.timelines()]
    assert fast["engine_steps"] == slow["engine_steps"] and fast["decisions"] == slow["decisions"]
    assert fast["duration"] == pytest.approx(slow["duration"], rel=1e-7)  # summation order only
    for (r1, ft1, f1), (r2, ft2, f2) in zip(fast_timelines, slow_timelines, strict=True):
        assert r1 == r2 and ft1 == pytest.approx(ft2, rel=1e-7) and f1 == pytest.approx(f2, rel=1e-7)


def test_the_shipped_profile_loads_and_predicts_prefill_costlier_than_decode():
    profile = load_profile(DEFAULT_PROFILE)
    assert profile["measured_on"]["cores"] and profile["fit"]["steps"] > 1000
    model = StepCostModel.from_dict(profile["step_model"])
    prefill = model.predict([StepRequest(8192, 0, 1, 0, True)])
    decodes = model.predict([decode(8192, i, 0) for i in range(16)])
    assert prefill > decodes > 0
    backend = SimBackend(FeatherEnv(SCENARIO, "sim").engine_config)
    assert backend.kv_capacity_tokens == (backend.sim_config.num_blocks - 1) * 128


def test_bad_profiles_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found.*calibrate --out"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(bad)
    bad.write_text(json.dumps({"version": 1, "model": {}}))
    with pytest.raises(ConfigError, match="version 1"):
        load_profile(bad)
    bad.write_text(json.dumps({"version": PROFILE_VERSION, "step_model": {"coef": [1.0], "cache_tokens": 5}}))
    with pytest.raises(ConfigError, match="step_model"):
        load_profile(bad)
    bad.write_text(json.dumps({"version": PROFILE_VERSION, "step_model": {
        "coef": [1.0, -1.0, 0, 0, 0, 0], "cache_tokens": 5}}))
    with pytest.raises(ConfigError, match=">= 0"):
        load_profile(bad)
    with pytest.raises(ConfigError):
        FeatherEnv(SCENARIO, "sim", profile=str(bad))


def test_a_slower_engine_stretches_a_burst_episode_by_its_factor():
    """``engine_slowdown`` multiplies every predicted step: a burst episode (no arrival to wait for)
    takes exactly that many times longer, with the same decisions; a range draws one per episode."""
    small = {"episode": {"groups": 3, "max_per_group": 3}}
    base = play_episode(FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=small), episode_seed=4)
    slow = play_episode(FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=small, engine_slowdown=2.5),
                        episode_seed=4)
    assert slow["duration"] == pytest.approx(2.5 * base["duration"], rel=1e-9)
    assert slow["decisions"] == base["decisions"] and slow["completed"] == base["completed"]
    ranged = FeatherEnv("leval-kv-pressure", "sim", scenario_overrides=small, engine_slowdown=[1.0, 3.0])
    durations = {round(play_episode(ranged, seed=s, episode_seed=4)["duration"] / base["duration"], 6)
                 for s in range(4)}
    assert len(durations) > 1 and all(1.0 <= d <= 3.0 for d in durations)
    for bad in (0, -1.0, [2.0, 1.0], "fast", float("nan")):
        with pytest.raises(ConfigError, match="engine_slowdown"):
            FeatherEnv("leval-kv-pressure", "sim", engine_slowdown=bad)


def test_a_scenario_plan_serves_the_schedulers_asked_for():
    from feather_env.calibrate import scenario_plan

    plan = scenario_plan("leval-kv-pressure-poisson", 2, validation=True,
                         schedulers=["feather-heuristic", "group-cap-3"])
    assert [(s.scheduler, s.seed) for s in plan] == [("feather-heuristic", 1000), ("group-cap-3", 1001),
                                                      ("feather-heuristic", 1002), ("group-cap-3", 1003)]
    assert [s.scheduler for s in scenario_plan("sharegpt", validation=True)] == [
        "fcfs", "lpm", "feather-heuristic", "dfs-weight"]


@pytest.mark.parametrize(("args", "message"), [
    (["--schedulers", "group-cap-3"], "--schedulers goes with --scenario"),
    (["--scenario", SCENARIO, "--schedulers", "group-cap-3,nope"], "unknown scheduler 'nope'"),
    (["--scenario", SCENARIO, "--schedulers", "lpm,,fcfs"], "distinct comma-separated names"),
    (["--scenario", SCENARIO, "--schedulers", "lpm,lpm"], "distinct comma-separated names"),
    (["--scenario", SCENARIO, "--schedulers", "group-cap-99"], "group-cap-K must be an integer"),
    (["--scenario", SCENARIO, "--schedulers", "feather:missing.feather"], "no such file"),
])
def test_calibration_refuses_bad_schedulers_before_an_engine_starts(args, message, capsys):
    from feather_env import calibrate

    assert calibrate.main(["--validate", str(DEFAULT_PROFILE), *args]) == 2  # no backend: none is built
    assert message in capsys.readouterr().err


def test_a_traces_warm_up_episode_is_a_short_window_and_an_episode_scenarios_is_whole():
    from feather_env.calibrate import WARM_UP_WINDOW_S, EpisodeSpec, _warm_up

    trace = EpisodeSpec("mooncake-synthetic", "fcfs", 1, {"engine": {"kv_cache_gib": 0.5}})
    warm = _warm_up(trace)
    assert warm["episode"]["window_s"] == WARM_UP_WINDOW_S and warm["engine"] == {"kv_cache_gib": 0.5}
    assert trace.overrides == {"engine": {"kv_cache_gib": 0.5}}  # the measured episode keeps its window
    short = EpisodeSpec("mooncake-synthetic", "fcfs", 1, {"episode": {"window_s": 6}})
    assert _warm_up(short) == short.overrides
    episodes = EpisodeSpec("leval-kv-pressure", "fcfs", 1)
    assert _warm_up(episodes) == {}


def test_rescore_reproduces_the_recorded_figures_and_scores_another_profile(tmp_path):
    """A recording whose 'engine' figures are the simulator's own under one profile: rescored with
    that profile every error is 0; with another the errors are those of a direct comparison."""
    from feather_env.calibrate import EpisodeSpec, _serve, rescore
    from feather_env.serving_metrics import serving_metrics

    scenario = str(tmp_path / "short.yaml")
    (tmp_path / "short.yaml").write_text(
        "workload: {kind: custom, path: traces/mooncake/synthetic_trace.jsonl, format: mooncake, "
        "block_tokens: 64, max_prompt_tokens: 2048}\nepisode: {window_s: 8, rate_scale: 1}\n"
        "engine: {kv_cache_gib: 0.25, max_num_seqs: 16, max_num_batched_tokens: 2048}\n")
    other = str(next(p for p in DEFAULT_PROFILE.parent.glob("*.json") if p != DEFAULT_PROFILE))
    episodes = []
    for scheduler, seed in (("fcfs", 1000), ("group-cap-2@256", 1001)):
        spec = EpisodeSpec(scenario, scheduler, seed, {}, f"short-{scheduler}")
        m, env, _ = _serve(spec, SimBackend(spec.load().engine_config(), DEFAULT_PROFILE), record=False)
        sm = serving_metrics(env.backend.timelines())
        episodes.append({"label": spec.label, "scheduler": scheduler, "seed": seed,
                         "requests": m["completed"],
                         "real_mean_ttft_ms": sm["mean_ttft_ms"], "real_mean_tpot_ms": sm["mean_tpot_ms"],
                         "real_duration_s": m["duration"], "real_hit_rate": m["prefix_hit_rate"],
                         "real_output_throughput": m["output_throughput"]})
    recording = {"plan": {"scenario": scenario}, "episodes": episodes, "command": "test"}
    same = rescore(DEFAULT_PROFILE, recording)
    assert same["n"] == 2 and same["makespan_mape"] == 0 and same["mean_ttft_mape"] == 0
    assert same["mean_tpot_mape"] == 0 and same["hit_rate_abs_err"] == 0
    moved = rescore(other, recording)
    assert moved["makespan_mape"] > 0
    for row in moved["episodes"]:
        assert row["makespan_ape"] == pytest.approx(abs(row["sim_duration_s"] - row["real_duration_s"])
                                                    / row["real_duration_s"])


def test_a_profile_of_another_kind_of_machine_gets_a_note_naming_this_ones(tmp_path):
    from feather_env.step_model import profile_note, same_machine

    here = {"cpu": "AMD EPYC", "isa": "avx512_bf16"}
    assert same_machine(here, dict(here)) and not same_machine(here, {**here, "isa": "avx2"})
    assert not same_machine({"cpu": "AMD EPYC", "isa": None}, {"cpu": "AMD EPYC", "isa": None})
    profiles = {p.name: json.loads(p.read_text()) for p in DEFAULT_PROFILE.parent.glob("*.json")}
    mine = [n for n, d in profiles.items() if same_machine(d.get("measured_on") or {}, here)]
    assert mine == ["cpu-tiny-llama-epyc-avx512.json"]
    assert profile_note(DEFAULT_PROFILE.parent / mine[0], here) is None
    note = profile_note(DEFAULT_PROFILE, here)
    assert note is not None and "cpu-tiny-llama-epyc-avx512.json" in note and "off several-fold" in note
    unknown = profile_note(DEFAULT_PROFILE, {"cpu": "Some ARM", "isa": "other"})
    assert unknown is not None and "calibrate --validate" in unknown
