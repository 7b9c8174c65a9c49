"""Fault injection against the real server on loopback: nothing a client sends, and no fault in
the scheduler's own code, takes ``feather-serve`` down.

The server is the installed ``feather-serve`` console script with
``feather:py:fault_policies:RaisesOnFiftiethDecision+oracle-svf`` (a plug-in policy, loaded from
``tests/`` through ``PYTHONPATH`` as a user's own package would be: the authors' heuristic,
except that its 50th decision raises) and trusted client hints, so the oracle lengths come from
``feather_output_len``. Requests share 8 documents of 1,024 tokens (64-token chunks), so the
heuristic STOPs and holds requests back.

1. Six requests with malformed hints (``"abc"``, ``[1]``, ``"nan"``, ``"inf"``, ``-5``, ``1e12``)
   beside six well-formed ones, before the policy's 50th decision: each is served with the
   fallback (HTTP 200, its full token count; the hint was clamped or replaced by
   ``max_tokens``, and counted), never a 4xx: vLLM's API accepts any JSON scalar or list in
   ``vllm_xargs``, and the scheduler, which reads them, cannot answer HTTP.
2. 200 concurrent completions: 150 well-formed, 30 with malformed hints, 20 streaming clients
   that disconnect after their first chunks. The policy raises on its 50th decision meanwhile.
3. The server is still healthy and serves a follow-up batch, as vLLM's fcfs.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
from serving import (
    SMALL_SERVER,
    TESTS,
    Prompts,
    feather_serve_command,
    get,
    metric,
    run_completions,
    running_server,
    wait_until_idle,
)

pytestmark = pytest.mark.engine

NAME = "feather:py:fault_policies:RaisesOnFiftiethDecision+oracle-svf"
MALFORMED = ["abc", [1], "nan", "inf", -5, 1e12]
WELL_FORMED, DISCONNECTING, FOLLOW_UP = 150, 20, 20
STREAM_TOKENS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    config = tmp / "scheduler.yaml"
    config.write_text("chunk_size: 64\nmax_wait: 20\ntrust_client_hints: true\n")
    log_path = tmp / "server.log"
    cmd = [*feather_serve_command(), "--scheduler", NAME, "--scheduler-config", str(config), *SMALL_SERVER]
    with running_server(cmd, log_path, pythonpath=[TESTS]) as (base, proc):
        yield base, proc, log_path


def _successes(text: str, reason: str) -> float:
    return metric(text, "vllm:request_success_total", finished_reason=reason)


def test_malformed_hints_disconnects_and_a_policy_fault_do_not_take_the_server_down(server):
    base, proc, log_path = server
    prompts = Prompts()
    rng = np.random.default_rng(1)
    start = get(base + "/metrics")

    # 1. malformed hints reach Feather (before its 50th decision) and are served with the fallback
    jobs = [("complete", f"hint-{i}", prompts.next(), int(rng.integers(2, 17)), hint)
            for i, hint in enumerate(MALFORMED)]
    jobs += [("complete", f"warm-{i}", prompts.next(), n, n)
             for i, n in enumerate(rng.integers(2, 17, len(MALFORMED)).tolist())]
    wanted = {rid: n for _, rid, _, n, _ in jobs}
    first = asyncio.run(run_completions(base, jobs))
    after_first = get(base + "/metrics")
    assert metric(after_first, "feather_scheduler_faults_total", scheduler=NAME) == 0  # still Feather's
    assert metric(after_first, "feather_scheduler_invalid_hints_total", scheduler=NAME) == len(MALFORMED)

    # 2. the load: 200 concurrent completions, the policy fault in the middle of it
    jobs = [("complete", f"good-{i}", prompts.next(), n, n)
            for i, n in enumerate(rng.integers(2, 17, WELL_FORMED).tolist())]
    jobs += [("complete", f"bad-{i}", prompts.next(), int(rng.integers(2, 17)), MALFORMED[i % len(MALFORMED)])
             for i in range(5 * len(MALFORMED))]
    jobs += [("disconnect", f"gone-{i}", prompts.next(), STREAM_TOKENS, STREAM_TOKENS)
             for i in range(DISCONNECTING)]
    order = np.random.default_rng(2).permutation(len(jobs))
    jobs = [jobs[i] for i in order]
    assert len(jobs) == 200
    wanted.update({rid: n for kind, rid, _, n, _ in jobs if kind == "complete"})
    second = asyncio.run(run_completions(base, jobs))

    assert get(base + "/health", timeout=5.0) == ""  # healthy (vLLM's /health: 200, empty body)
    loaded = wait_until_idle(base)  # nothing stuck: handed-over and aborted requests are all gone
    outcomes = {**first, **second}
    completed = {rid: o for rid, o in outcomes.items() if o[0] == "ok"}
    failed = {rid: o for rid, o in outcomes.items() if rid in wanted and o[0] != "ok"}
    assert set(completed) == set(wanted), failed
    for rid, (_, _, tokens, reason) in completed.items():
        assert tokens == wanted[rid] and reason == "length", (rid, tokens, reason)
    assert len({o[1] for o in completed.values()}) == len(completed)  # one completion each
    gone = [o for rid, o in outcomes.items() if rid.startswith("gone-")]
    assert len(gone) == DISCONNECTING and all(o == ("disconnected", 2) for o in gone)  # really mid-stream
    # the engine finished each completed request exactly once, and none of the disconnected ones
    # (their 200 tokens would count here); being gone from the engine too, they were aborted
    assert _successes(loaded, "length") - _successes(start, "length") == len(wanted)

    # the policy's fault: counted once, logged once, and the held requests went to vLLM
    assert metric(loaded, "feather_scheduler_faults_total", scheduler=NAME, stage="plan") == 1
    assert metric(loaded, "feather_scheduler_faults_total", scheduler=NAME) == 1
    log = log_path.read_text()
    faults = re.findall(r"PolicyFault in plan; (\d+) held request\(s\) go to vLLM's queue; running as "
                        r"vLLM's fcfs scheduler", log)
    assert len(faults) == 1 and int(faults[0]) > 0, faults
    assert log.count("deliberate fault at decision 50") == 1  # the traceback, once
    assert metric(loaded, "feather_scheduler_held_requests", scheduler=NAME) == 0

    # 3. it serves on, as vLLM's fcfs: Feather no longer releases anything
    jobs = [("complete", f"after-{i}", prompts.next(), n, n)
            for i, n in enumerate(rng.integers(2, 17, FOLLOW_UP).tolist())]
    third = asyncio.run(run_completions(base, jobs))
    assert all(o[0] == "ok" and o[2] == n for (_, _, _, n, _), o in zip(jobs, third.values(), strict=True))
    end = wait_until_idle(base)
    released = "feather_scheduler_released_total"
    assert metric(end, released, scheduler=NAME) == metric(loaded, released, scheduler=NAME)
    assert _successes(end, "length") - _successes(loaded, "length") == FOLLOW_UP
    assert get(base + "/health", timeout=5.0) == ""
    assert proc.poll() is None
