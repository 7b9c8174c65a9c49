"""Every policy file shipped in ``policies/`` loads and decides inside the real vLLM scheduler.

Each file is served as ``feather:policies/...`` on the session engine (leval-kv-pressure's, 0.25
GiB of KV) over a small episode of its own scenario's kind: the scheduler answers its own
decisions with the policy, as under ``feather-serve``. Every request must be served once with its
tokens (``VLLMBackend.serve`` checks it), the policy must have been asked, and no fault may have
switched it off. One file of each form is served (a table, an MLP, a cap, a lifted cap, the hold
rule: files of one form run the same code with other numbers); every file is loaded and checked
against its scenario.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feather_env.scenarios import load_scenario
from scheduler_runtime.decision import observation_kind
from scheduler_runtime.policy import load_policy
from scheduler_runtime.schedulers import SchedulerConfig

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"
SHIPPED = sorted(POLICIES.rglob("*.feather"))


def _form(path: Path) -> tuple[str, ...]:
    policy = load_policy(path)
    params = policy.params() if policy.kind == "group-cap" else {}
    return (policy.kind, observation_kind(policy), str(params.get("cap") is None), str("lift_at" in params))


#: One path per form of policy file.
SERVED = list({_form(p): p for p in reversed(SHIPPED)}.values())[::-1]
#: A small episode that still has choices to make: 4 documents x 3 questions, short answers.
EPISODE = {"episode": {"groups": 4, "max_per_group": 3}, "workload": {"max_output_tokens": 8}}


def test_every_scenario_has_its_shipped_files():
    build = json.loads((POLICIES / "build.json").read_text())
    assert build["scenarios"], "policies/build.json lists no scenario"
    for scenario in build["scenarios"]:
        assert (POLICIES / f"{scenario}.feather").is_file(), scenario
        assert (POLICIES / "heuristic-tuned" / f"{scenario}.feather").is_file(), scenario
    assert (POLICIES / "general.feather").is_file()
    readme = (POLICIES / "README.md").read_text()
    for path in SHIPPED:
        assert path.name in readme, f"{path} is not described in policies/README.md"


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(POLICIES)) for p in SHIPPED])
def test_every_shipped_file_loads_for_its_scenario(path):
    policy = load_policy(path)  # a corrupted or unversioned file fails here, with its name
    if path.stem != "general":
        assert policy.obs_spec.chunk_size == load_scenario(path.stem).scheduler.chunk_size


@pytest.mark.parametrize("path", SERVED, ids=[str(p.relative_to(POLICIES)) for p in SERVED])
def test_shipped_policy_serves_through_the_real_scheduler(env_backend, path):
    policy = load_policy(path)  # a corrupted or unversioned file fails here, with its name
    scenario = load_scenario("leval-kv-pressure", EPISODE)
    workload = scenario.episode_workload(5)
    config = SchedulerConfig.for_name(f"feather:{path}", trust_client_hints=True)
    timelines = env_backend.serve(workload, config)
    served = {t.request_id: t.tokens for t in timelines}
    assert len(served) == len(timelines) == len(workload)
    assert served == {r.request_id: r.output_len for r in workload}
    stats = env_backend.scheduler.feather_stats()
    assert not stats["faults"] and not stats["disabled"], stats
    assert stats["decisions"] > 0, stats
    assert policy.obs_spec.chunk_size == scenario.scheduler.chunk_size
