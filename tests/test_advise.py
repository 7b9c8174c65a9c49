"""``evaluate.py advise``: the search over schedulers x token budgets for the goodput under SLOs, its
recommendation rule, its files, its refusals, and (engine) the probe that picks the simulator's profile
and the confirmation on the real engine. The search of admission rules: tests/test_advise_admission.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import evaluate
from feather_env.evaluation import advise as advise_module
from feather_env.evaluation.advise import (
    AdviseConfig,
    advise,
    candidate_names,
    confirm,
    plan,
)
from feather_env.evaluation.probe import check_profile, probe_overrides
from feather_env.evaluation.recommend import confirm_names, engine_choice, recommend
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import serving_metrics
from scheduler_runtime.config import ConfigError
from scheduler_runtime.hardware import online_cores
from scheduler_runtime.serving.serve import vllm_arguments

REPO = Path(__file__).resolve().parent.parent
SLOS = {"ttft": 5000.0, "tpot": 50.0}
PROFILE = str(REPO / "configs" / "profiles" / "cpu-tiny-llama.json")


@pytest.fixture(scope="module")
def small():
    """The Mooncake synthetic trace's scenario, 20-s windows replayed at 4x (5 s, ~80 requests)."""
    return load_scenario("mooncake-synthetic", {"episode": {"window_s": 20}})


def test_candidates_are_every_base_at_every_budget_up_to_the_engines(small):
    config = AdviseConfig(SLOS, schedulers=("fcfs", "group-cap-2"), budgets=(512, 8192, 16384))
    names = candidate_names(small, config)
    assert names == ["fcfs@512", "fcfs", "group-cap-2@512", "group-cap-2"]  # 8192 is the engine's own
    with pytest.raises(ConfigError, match="names its own budget"):
        candidate_names(small, AdviseConfig(SLOS, schedulers=("fcfs@512",)))
    with pytest.raises(ConfigError, match="unknown scheduler"):
        candidate_names(small, AdviseConfig(SLOS, schedulers=("nosuch",)))
    with pytest.raises(ConfigError, match="needs the SLOs"):
        AdviseConfig({})


def _row(name: str, goodputs: list[float]) -> dict:
    return {"scheduler": name, "stage": "every window", "request_goodput": sum(goodputs) / len(goodputs),
            "windows": [{"seed": i, "request_goodput": g} for i, g in enumerate(goodputs)]}


def test_the_recommendation_needs_a_win_beyond_noise_in_the_median_window_and_no_loss():
    reuse = {"perfect_cache": 0.6, "engine_sized_cache": 0.5}
    rows = {"group-cap-2@512": _row("group-cap-2@512", [2.0, 2.2, 1.9, 2.1]),
            "fcfs": _row("fcfs", [1.0, 1.0, 1.0, 1.0])}
    rec = recommend(rows, "fcfs", 0.03, offered=10.0, reuse=reuse)
    assert rec["scheduler"] == "group-cap-2@512" and rec["max_num_batched_tokens"] == 512
    assert rec["predicted_goodput_ratio"] == pytest.approx(2.05) and rec["ratio_range"] == [1.9, 2.2]
    # a median win within noise: the default, and why
    rows = {"lpm": _row("lpm", [1.02, 1.01, 1.02, 1.0]), "fcfs": _row("fcfs", [1.0, 1.0, 1.0, 1.0])}
    rec = recommend(rows, "fcfs", 0.03, offered=10.0, reuse=reuse)
    assert rec["scheduler"] == "fcfs" and "beyond noise" in rec["why"] and rec["predicted_goodput_ratio"] == 1
    # a big median win that loses one window badly: not trustworthy
    rows = {"lpm": _row("lpm", [2.0, 2.0, 2.0, 0.5]), "fcfs": _row("fcfs", [1.0, 1.0, 1.0, 1.0])}
    assert recommend(rows, "fcfs", 0.03, offered=10.0, reuse=reuse)["scheduler"] == "fcfs"
    # the default already serves what arrives
    rows = {"lpm": _row("lpm", [4.0, 4.0]), "fcfs": _row("fcfs", [4.0, 4.0])}
    assert "arrival-bound" in recommend(rows, "fcfs", 0.03, offered=4.0, reuse=reuse)["why"]
    # the reuse lives beyond the cache
    far = {"perfect_cache": 0.6, "engine_sized_cache": 0.1}
    assert "beyond the cache" in recommend(rows, "fcfs", 0.03, offered=9.0, reuse=far)["why"]
    # settings as good as the best (within 0.5%): the simplest, vLLM's own fcfs with the budget
    rows = {"group-cap-1@512": _row("group-cap-1@512", [2.004, 2.0]), "lpm@512": _row("lpm@512", [2.0, 2.0]),
            "fcfs@512": _row("fcfs@512", [1.999, 2.0]), "fcfs@256": _row("fcfs@256", [2.0, 2.0]),
            "fcfs": _row("fcfs", [1.0, 1.0])}
    assert recommend(rows, "fcfs", 0.03, offered=9.0, reuse=reuse)["scheduler"] == "fcfs@512"


def test_the_serve_command_carries_the_scenarios_knobs_where_the_name_would_not(small):
    from feather_env.evaluation.advise import serve_command

    tuned = load_scenario("mooncake-synthetic", {"scheduler": {"max_wait": 10, "chunk_size": 256}})
    for scenario, knobs in ((small, {}), (tuned, {"max_wait": 10.0, "chunk_size": 256})):
        for name in ("fcfs", "fcfs@512", "lpm", "group-cap-3@512"):
            args, config = vllm_arguments(serve_command(scenario, name).split()[1:])
            own = {} if name.startswith("fcfs") else knobs  # vLLM's own fcfs takes none
            assert {k: v for k, v in config.items() if k != "name"} == own, (scenario.name, name)


def test_advise_on_the_simulator_writes_what_scripts_read(small, tmp_path):
    config = AdviseConfig(SLOS, windows=3, search_windows=1, schedulers=("fcfs", "lpm", "group-cap-2"),
                          budgets=(512,), shortlist=2, profile=PROFILE, what_if=False, admission=False)
    out = tmp_path / "advice"
    payload = advise(small, config, out, progress=False, log=lambda _: None)
    saved = json.loads((out / "advice.json").read_text())
    assert saved["recommendation"] == json.loads(json.dumps(payload["recommendation"]))
    rec, rows = saved["recommendation"], saved["candidates"]
    assert set(rows) == {"fcfs", "fcfs@512", "lpm", "lpm@512", "group-cap-2", "group-cap-2@512"}
    assert saved["default"]["scheduler"] == "fcfs" and saved["default"]["max_num_batched_tokens"] == 8192
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    assert len(full) == 3 and "fcfs" in full and all(len(rows[n]["windows"]) == 3 for n in full)
    assert rec["scheduler"] in full and rec["predicted_goodput"] == rows[rec["scheduler"]]["request_goodput"]
    assert rec["predicted_goodput_ratio"] == pytest.approx(
        rows[rec["scheduler"]]["request_goodput"] / rows["fcfs"]["request_goodput"])
    # the figures are the windows' own: one window served again gives the same goodput
    w = rows[rec["scheduler"]]["windows"][0]
    from feather_env.env import FeatherEnv, play_episode

    env = FeatherEnv(small, "sim", scheduler=rec["scheduler"], profile=PROFILE)
    play_episode(env, episode_seed=w["seed"])
    assert serving_metrics(env.backend.timelines(), goodput=SLOS)["request_goodput"] == w["request_goodput"]
    # the serve command is one feather-serve accepts, with the recommended budget
    args, cfg = vllm_arguments(rec["serve_command"].split()[1:])
    budget = rec["max_num_batched_tokens"] or 8192
    assert cfg["name"] == rec["scheduler"] and args[args.index("--max-num-batched-tokens") + 1] == str(budget)
    assert 0 < saved["prefix_reuse_available"]["engine_sized_cache"] <= saved["prefix_reuse_available"][
        "perfect_cache"]
    assert saved["hindsight"]["mean_gain"] >= 1.0
    md = (out / "advice.md").read_text()
    assert "TTFT <= 5000 ms" in md and rec["scheduler"] in md and (out / "goodput.png").stat().st_size > 0
    # what advise --check said it would serve is what it served
    served = sum(len(r["windows"]) for r in rows.values())
    assert (f"search: 6 settings on window(s) 100, then the best 2 and the default on held-out window(s) "
            f"101, 102: {served} simulated windows") in plan(small, config)
    # the figures reported are the held-out windows' (the tuning window chose the shortlist)
    r = rows[rec["scheduler"]]
    assert [w["held_out"] for w in r["windows"]] == [False, True, True]
    assert r["request_goodput"] == pytest.approx((r["windows"][1]["request_goodput"]
                                                  + r["windows"][2]["request_goodput"]) / 2)
    assert saved["windows"]["held_out"] == [101, 102] and "nothing was held out" not in md


def test_the_what_ifs_serve_more_kv_and_more_replicas(small, tmp_path):
    config = AdviseConfig(SLOS, windows=1, search_windows=1, schedulers=("fcfs",), budgets=(512,),
                          shortlist=1, profile=PROFILE, admission=False)
    payload = advise(small, config, tmp_path / "w", progress=False, log=lambda _: None)
    for what in payload["what_if"].values():
        assert set(what) == {"2x_kv_cache", "2_replicas", "4_replicas", "replicas_without_rule"}
        # 4 replicas serve the same arrivals with a quarter of the load each: at least as many good
        assert what["4_replicas"]["request_goodput"] >= what["2_replicas"]["request_goodput"] * 0.95


@pytest.mark.parametrize("args, message", [
    (["--scenario", "mooncake-synthetic", "--out", "{out}"], "--goodput"),
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--budgets", "a,b", "--out", "{out}"],
     "--budgets must be comma-separated integers"),
    (["--scenario", "mooncake-synthetic", "--goodput", "itl:5", "--out", "{out}"], "unknown goodput SLO"),
    (["--scenario", "nosuch", "--goodput", "ttft:5000", "--out", "{out}"], "unknown scenario"),
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--schedulers", "fcfs@512",
      "--out", "{out}"], "names its own budget"),
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--confirm-top", "0", "--out", "{out}"],
     "confirm_top must be >= 1"),
    # a policy file or a name found bad only when the search reached it, after minutes of engine probe
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--policies", "/nonexistent.feather",
      "--out", "{out}"], "does not exist"),
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--policies", "{policy}",
      "--out", "{out}"], "in chunks of 256 tokens"),
    (["--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "--schedulers", "fcfs,lpm,lpm",
      "--out", "{out}"], "listed twice"),
])
@pytest.mark.parametrize("check", [[], ["--check"]], ids=["run", "check"])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(tmp_path, capsys, monkeypatch, args,
                                                                     message, check):
    from scheduler_runtime.decision import BASE_OBS_NAMES, ObservationSpec
    from scheduler_runtime.policy import ConstantPolicy, write_policy

    def no_engine(*a, **kw):
        raise AssertionError("the engine probe started")

    monkeypatch.setattr(advise_module, "check_profile", no_engine)
    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    policy = write_policy(tmp_path / "add256.feather", ConstantPolicy(spec))
    args = [a.format(out=tmp_path / "never", policy=policy) for a in args]
    out = tmp_path / "never"
    try:
        code = evaluate.main(["advise", *args, *check])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err and not out.exists()


def test_the_engine_is_checked_where_the_probe_or_the_confirmation_will_start_it():

    from feather_env.evaluation.advise import checked_names

    beyond = str(max(online_cores()) + 1)
    scenario = load_scenario("mooncake-synthetic", {"engine": {"cpu_cores": beyond}})
    for config in (AdviseConfig(SLOS), AdviseConfig(SLOS, profile=PROFILE, confirm=True)):
        with pytest.raises(ConfigError, match="are not among this machine's cores"):
            checked_names(scenario, config)
    assert "fcfs" in checked_names(scenario, AdviseConfig(SLOS, profile=PROFILE))  # the simulator alone


def test_check_prints_the_plan_and_starts_no_probe(tmp_path, capsys, monkeypatch):
    def no_engine(*a, **kw):
        raise AssertionError("the engine probe started")

    monkeypatch.setattr(advise_module, "check_profile", no_engine)
    out = tmp_path / "advice"
    assert evaluate.main(["advise", "--scenario", "mooncake-synthetic", "--goodput", "ttft:5000", "tpot:50",
                          "--schedulers", "fcfs,group-cap-2", "--budgets", "512", "--confirm-top", "2",
                          "--out", str(out), "--check"]) == 0
    text = capsys.readouterr().out
    assert "goodput SLOs ttft 5000 ms, tpot 50 ms" in text
    assert ("probe on the real engine first (episode seed 99, a 20 s window; fcfs, fcfs@512, "
            "group-cap-8@256)") in text
    assert "settings: 2 schedulers (fcfs, group-cap-2) x 2 per-step token budgets (512, 8192" in text
    assert "confirm: on the real engine, window 102: the default and the simulator's best 2" in text
    assert ("admission: queued-tokens, queued-reqs, slo, deadline, slo+deadline, slo+tpot over 8 "
            "thresholds") in text
    assert text.rstrip().endswith("nothing served") and not out.exists()


def test_without_out_the_advice_goes_to_a_dated_runs_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert evaluate.main(["advise", "--scenario", "mooncake-synthetic", "--goodput", "ttft:5000",
                          "--schedulers", "fcfs", "--budgets", "512", "--profile", PROFILE, "--check"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert re.search(r"nothing was written to runs/advise-\d{8}-\d{6},", last), last
    assert not (tmp_path / "runs").exists()


# -- the real engine: the probe that picks the profile, and the confirmation ------------------------
@pytest.fixture(scope="module")
def on_test_engine():
    """Short Mooncake windows on the test session's environment engine (leval-kv-pressure's)."""
    return load_scenario("mooncake-synthetic", {
        "workload": {"max_prompt_tokens": 2048},
        "episode": {"window_s": 6, "rate_scale": 1},
        "engine": load_scenario("leval-kv-pressure").engine.to_dict()})


@pytest.mark.engine
def test_the_probe_scores_every_profile_on_the_engine_and_picks_the_best(on_test_engine, env_backend,
                                                                         tmp_path):
    config = AdviseConfig(SLOS, probe_window_s=6)
    info = check_profile(on_test_engine, tmp_path, seed=config.first_seed - 1, window_s=config.probe_window_s,
                         backend=env_backend, log=lambda _: None)
    shipped = {str(p) for p in (REPO / "configs" / "profiles").glob("*.json")}
    scored = {c["profile"]: c["error"] for c in info["candidates"]}
    assert shipped <= set(scored)
    assert info["error"] == min(scored.values()) and info["profile"] in scored
    assert info["probe"]["schedulers"] == ["fcfs", "fcfs@512", "group-cap-8@256"]
    assert info["probe"]["steps"] > 0
    for name in ("fcfs", "fcfs@512", "group-cap-8@256"):
        assert info["probe"]["real"][name]["completed"] > 0
    if info["refitted"]:  # refitted on the probe's own steps: a profile the simulator loads
        assert Path(info["profile"]).is_file() and info["profile"].startswith(str(tmp_path))


@pytest.mark.engine
def test_confirm_serves_both_settings_on_the_engine_with_every_request(on_test_engine, env_backend):
    config = AdviseConfig(SLOS, repeats=1)
    measured = confirm(on_test_engine, ["group-cap-2@512", "fcfs"], config, backend=env_backend,
                       log=lambda _: None)
    n = len(on_test_engine.episode_workload(config.seeds[0]))
    for name in ("group-cap-2@512", "fcfs"):
        run = measured["runs"][name]
        assert run["completed"] == n and len(run["request_goodput_per_run"]) == 1
        assert run["request_goodput"] >= 0


@pytest.mark.engine
def test_confirm_serves_an_admission_rule_on_the_engine_with_the_slos(on_test_engine, env_backend):
    """The SLOs reach the in-process engine's serving loop: a rule that reads the TTFT SLO is served
    (without them its controller refuses to start), and every request is completed, rejected or aborted."""
    config = AdviseConfig(SLOS, repeats=1)
    name = "fcfs~slo:0.5+deadline"
    measured = confirm(on_test_engine, [name], config, backend=env_backend, log=lambda _: None)
    run = measured["runs"][name]
    n = len(on_test_engine.episode_workload(config.seeds[0]))
    rejected = round(run["rejected_fraction"] * n)
    assert run["submitted"] == n and run["completed"] + run["aborted"] + rejected == n
    assert 0 <= run["slo_attainment"] <= 1 and run["false_admit_fraction"] is not None


# -- the engine's last word among the simulator's best (--confirm-top) -------------------------------
def test_engine_choice_takes_the_simplest_within_noise_of_the_best_measured():
    runs = {"fcfs": {"request_goodput": 1.0}, "group-cap-8@512": {"request_goodput": 1.30},
            "lpm": {"request_goodput": 1.28}, "feather:/p.feather": {"request_goodput": 1.31}}
    name, why = engine_choice(runs, "fcfs", 0.03)
    assert name == "lpm" and "measured on the engine" in why and "1.28x" in why


def test_engine_choice_keeps_the_default_unless_beaten_beyond_noise():
    runs = {"fcfs": {"request_goodput": 1.0}, "lpm": {"request_goodput": 1.02}}
    assert engine_choice(runs, "fcfs", 0.03)[0] == "fcfs"
    runs["lpm"]["request_goodput"] = 1.05
    assert engine_choice(runs, "fcfs", 0.03)[0] == "lpm"
    # a default that meets the SLOs for no request: any goodput beats it
    assert engine_choice({"fcfs": {"request_goodput": 0.0}, "lpm": {"request_goodput": 0.1}},
                         "fcfs", 0.03)[0] == "lpm"
    assert engine_choice({"fcfs": {"request_goodput": 0.0}, "lpm": {"request_goodput": 0.0}},
                         "fcfs", 0.03)[0] == "fcfs"


def test_confirm_names_are_the_simulators_best_distinct_the_recommendation_and_the_default():
    def row(g: float, stage: str = "every window") -> dict:
        return {"stage": stage, "request_goodput": g, "windows": [{"request_goodput": g, "mean_ttft_ms": g}]}

    rows = {"fcfs": row(1.0), "lpm": row(3.0), "fcfs@512": row(2.0), "group-cap-2": row(2.5)}
    rows["group-cap-3"] = row(9.0, "first windows")  # not served on every window
    assert confirm_names(rows, "fcfs@512", "fcfs", 2) == ["fcfs@512", "lpm", "group-cap-2", "fcfs"]
    assert confirm_names(rows, "lpm", "fcfs", 1) == ["lpm", "fcfs"]
    assert confirm_names(rows, "fcfs", "fcfs", 1) == ["fcfs", "lpm"]
    # settings served alike count once, by the simplest name: the next distinct one is served instead
    rows.update({"group-cap-8@256": row(4.0), "group-cap-1@256": row(4.0), "lpm@256": row(4.0)})
    assert confirm_names(rows, "lpm@256", "fcfs", 2) == ["lpm@256", "lpm", "fcfs"]


def test_the_probe_shortens_a_traces_window_and_serves_an_episode_scenario_whole():
    trace = load_scenario("mooncake-synthetic")
    assert probe_overrides(trace, 20) == {"episode": {"window_s": 20}}
    episodes = load_scenario("leval-kv-pressure")
    assert probe_overrides(episodes, 20) == {}
    load_scenario("leval-kv-pressure", probe_overrides(episodes, 20))  # loads: no window on a non-trace
