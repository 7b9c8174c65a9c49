"""A scheduler name's per-step token budget (``NAME@TOKENS``): parsed and refused like any name, served
by the simulator as vLLM serves it, and passed to vLLM by ``feather-serve``. The engine side (no
step over the budget inside the real vLLM scheduler) is in ``tests/test_vllm_scheduler.py``."""

from __future__ import annotations

import pytest

from feather_env.env import FeatherEnv, play_episode
from feather_env.evaluation.simulated import SimConfig, evaluate_simulated
from feather_env.scenarios import load_scenario
from scheduler_runtime.config import ConfigError
from scheduler_runtime.schedulers import SchedulerConfig, split_budget, with_budget
from scheduler_runtime.serving.serve import vllm_arguments


@pytest.mark.parametrize("name, base, budget", [
    ("fcfs@512", "fcfs", 512), ("group-cap-3@256", "group-cap-3", 256), ("lpm", "lpm", None),
    ("feather:/x/a@b.feather@1024", "feather:/x/a@b.feather", 1024), ("feather:/x/a@b.feather", None, None),
])
def test_a_budget_is_the_names_last_at_number(name, base, budget):
    if base is None:  # an '@' inside a path is not a budget
        assert split_budget(name) == (name, None)
        return
    assert split_budget(name) == (base, budget)
    assert with_budget(base, budget) == name and with_budget(name, None) == base


def test_the_budget_keeps_the_rest_of_the_names_configuration():
    for base in ("fcfs", "lpm", "group-cap-3", "group-hold+svf", "feather-heuristic+svf"):
        plain, budgeted = SchedulerConfig.for_name(base), SchedulerConfig.for_name(f"{base}@512")
        assert budgeted.max_num_batched_tokens == 512 and plain.max_num_batched_tokens is None
        assert {**plain.to_dict(), "name": None, "max_num_batched_tokens": None} == {
            **budgeted.to_dict(), "name": None, "max_num_batched_tokens": None}


@pytest.mark.parametrize("name, message", [
    ("fcfs@8", r"token budget after '@' must be in \[16"), ("fcfs@0", "must be in"),
    ("nosuch@512", "unknown scheduler 'nosuch'"), ("group-cap-99@512", "K of group-cap-K must be"),
])
def test_bad_budgets_are_refused_naming_the_name(name, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.for_name(name)


def test_the_simulator_serves_a_budget_as_vllm_does():
    """The budget bounds the simulated scheduler's tokens per step; at the engine's own budget the
    episode is identical to the plain name's, below it the prefills are chunked (more steps) and
    every request is still served."""
    scenario = load_scenario("leval-kv-pressure", {"episode": {"groups": 4, "max_per_group": 3}})
    assert scenario.engine.max_num_batched_tokens == 8192
    figures = {}
    for name in ("fcfs", "fcfs@8192", "fcfs@512"):
        env = FeatherEnv(scenario, "sim", scheduler=name)
        figures[name] = play_episode(env, episode_seed=0)
        budget = SchedulerConfig.for_name(name).max_num_batched_tokens or 8192
        assert env.backend.engine.scheduler.max_num_scheduled_tokens == budget
        env.close()
    assert {**figures["fcfs@8192"], "scheduler": "fcfs"} == figures["fcfs"]
    served = figures["fcfs"]["submitted"]
    assert figures["fcfs@512"]["completed"] == figures["fcfs"]["completed"] == served > 0
    assert figures["fcfs@512"]["engine_steps"] > figures["fcfs"]["engine_steps"]


def test_evaluate_sim_reports_budgeted_names_side_by_side():
    scenario = load_scenario("leval-kv-pressure", {"episode": {"groups": 3, "max_per_group": 2}})
    runs = evaluate_simulated(scenario, SimConfig(("group-cap-2", "group-cap-2@256")), log=None)
    assert [r.label for r in runs] == ["group-cap-2", "group-cap-2@256"]
    assert len(runs[0].timelines) == len(runs[1].timelines) == len(scenario.episode_workload(0)) > 0
    assert runs[1].extra["engine_steps"] > runs[0].extra["engine_steps"]


def test_feather_serve_passes_the_budget_to_vllm(capsys):
    args, config = vllm_arguments(["--scheduler", "group-cap-3@512"])
    assert args[args.index("--max-num-batched-tokens") + 1] == "512"
    assert config == {"name": "group-cap-3@512"}
    args, _ = vllm_arguments(["--scheduler", "fcfs@512", "--max-num-batched-tokens", "512"])
    assert args.count("--max-num-batched-tokens") == 1
    assert "--max-num-batched-tokens" not in vllm_arguments(["--scheduler", "fcfs"])[0]
    with pytest.raises(SystemExit) as exit_info:
        vllm_arguments(["--scheduler", "fcfs@512", "--max-num-batched-tokens", "1024"])
    assert exit_info.value.code == 2
    assert "budget of 512 tokens per step" in capsys.readouterr().err
