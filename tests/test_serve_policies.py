"""Policies exported by ``train.py`` served by ``feather-serve``: a Q-learning table alone, and a
PPO MLP with SVF admission, each in a server of its own (the installed console script).

The policy file is loaded in vLLM's engine-core process; the test sees its decisions on
``/metrics`` and checks that every request is served once with its tokens.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serving import SMALL_SERVER, Prompts, feather_serve_command, get, metric, run_completions, running_server

from scheduler_runtime.policy import load_policy

pytestmark = pytest.mark.engine

NUM_REQUESTS = 40


@pytest.fixture(scope="module", params=[("table", ""), ("mlp", "+svf")], ids=["table", "mlp+svf"])
def policy_server(request, exported_policies, tmp_path_factory):
    kind, suffix = request.param
    path = exported_policies[kind]
    name = f"feather:{path}{suffix}"
    log_path = tmp_path_factory.mktemp(f"serve-{kind}") / "server.log"
    command = [*feather_serve_command(), "--scheduler", name, *SMALL_SERVER]
    with running_server(command, log_path) as (base, _):
        yield kind, path, name, base


def test_an_exported_policy_decides_inside_the_server(policy_server):
    kind, path, name, base = policy_server
    assert load_policy(path).kind == kind
    prompts, rng = Prompts(seed=3), np.random.default_rng(3)
    jobs = [("complete", f"{kind}-{i}", prompts.next(), n, n)
            for i, n in enumerate(rng.integers(2, 17, NUM_REQUESTS).tolist())]
    before = get(base + "/metrics")
    outcomes = asyncio.run(run_completions(base, jobs))
    after = get(base + "/metrics")
    for _, rid, _, n, _ in jobs:
        assert outcomes[rid][0] == "ok" and outcomes[rid][2] == n, (rid, outcomes[rid])
    assert len({o[1] for o in outcomes.values()}) == NUM_REQUESTS
    served = metric(after, "vllm:request_success_total") - metric(before, "vllm:request_success_total")
    assert served == NUM_REQUESTS
    assert metric(after, "feather_scheduler_released_total", scheduler=name) == NUM_REQUESTS
    decisions = metric(after, "feather_scheduler_decisions_total", scheduler=name)
    adds = metric(after, "feather_scheduler_add_total", scheduler=name)
    stops = metric(after, "feather_scheduler_stop_total", scheduler=name)
    assert decisions == adds + stops and adds > 0  # the policy was asked, and admitted requests
    assert metric(after, "feather_scheduler_faults_total", scheduler=name) == 0
