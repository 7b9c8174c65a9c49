"""The schedulers inside the real vLLM engine: every name serves a shared-prefix workload exactly once.

One engine with :class:`~scheduler_runtime.vllm_scheduler.FeatherScheduler` and a small KV cache
(64 blocks of 128 tokens) is built for the module; each test switches the scheduler's
configuration between workloads (``feather_configure``), so every name runs in the same engine.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from feather_env.engine import EngineConfig, build_llm, engine_core_of, forced_length_params, tokens_prompt
from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN, EXTRA_SOURCE, engine_overrides

pytestmark = pytest.mark.engine

KV_GIB = 1 / 32  # 8192 tokens: small enough to force preemption
TEST_CHUNK = 64  # CHT chunk for the Feather names: the 600-token documents span ~10 chunks
NAMES = ["fcfs", "sjf", "oracle-sjf", "svf", "svf-1bit", "oracle-svf", "lpm", "dfs-weight",
         "feather-heuristic", "feather-heuristic+svf", "feather-heuristic+svf-1bit"]


@pytest.fixture(scope="module")
def feather_llm():
    config = EngineConfig(kv_cache_gib=KV_GIB, max_num_seqs=32, max_model_len=2048,
                          max_num_batched_tokens=2048)
    llm = build_llm(config, **engine_overrides("feather-heuristic+svf"))
    yield llm
    engine_core_of(llm).shutdown()


@pytest.fixture
def sched(feather_llm):
    scheduler = engine_core_of(feather_llm).scheduler
    yield scheduler
    # leave the engine empty and consistent for the next test
    assert not feather_llm.llm_engine.has_unfinished_requests()
    assert not scheduler._feather_held and not scheduler.requests
    if scheduler.feather is not None:
        core = scheduler.feather.core
        core.check_consistency()
        assert len(core) == 0 and core.cht.num_keys == 0


def workload(tag: str, groups: int, per_group: int, prefix: int, out: tuple[int, int], seed: int):
    """(id, prompt, output tokens) with ``groups`` shared documents, interleaved."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, 8000, prefix) for _ in range(groups)]
    return [(f"{tag}-{i}", np.concatenate([docs[i % groups], rng.integers(3, 8000, 20)]).tolist(),
             int(rng.integers(out[0], out[1] + 1))) for i in range(groups * per_group)]


def add(engine, rid: str, prompt: list[int], out: int) -> None:
    params = forced_length_params(out, extra_args={EXTRA_OUTPUT_LEN: out, EXTRA_SOURCE: "leval/quality"})
    engine.add_request(rid, tokens_prompt(prompt), params)


def drain(engine, sched, on_step=None, max_steps: int = 20_000) -> dict[str, int]:
    """Step until idle; the generated token count of every finished request (each exactly once)."""
    done: dict[str, int] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = len(out.outputs[0].token_ids)
        if sched.feather is not None:
            # held requests are waiting requests for the engine
            assert sched.get_request_counts()[1] >= len(sched._feather_held)
        if on_step is not None:
            on_step()
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("name", NAMES + ["feather:CKPT+svf"])
def test_every_scheduler_serves_each_request_once_with_its_tokens(sched, feather_llm, name, tmp_path):
    overrides = {}
    if name.startswith("feather:"):
        policy = pytest.importorskip("scheduler_runtime.policy")
        spec = policy.ObservationSpec(names=policy.BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64),
                                      scale=(64, 64, 64), chunk_size=TEST_CHUNK)
        rule = policy.HeuristicPolicy(spec, policy.HeuristicRule())
        name = name.replace("CKPT", str(policy.write_policy(tmp_path / "heuristic.feather", rule)))
    elif name.startswith("feather"):
        overrides["chunk_size"] = TEST_CHUNK
    sched.feather_configure({"name": name, **overrides})
    engine = feather_llm.llm_engine
    reqs = workload(name[:12], groups=4, per_group=6, prefix=600, out=(2, 12), seed=1)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    if name != "fcfs":
        assert sched.get_request_counts() == (0, len(reqs))  # all held, all counted
        assert engine.has_unfinished_requests()
    done = drain(engine, sched)
    assert done == {rid: out for rid, _, out in reqs}
    stats = sched.feather_stats()
    if name != "fcfs":
        assert stats["finished"] == len(reqs) and sum(stats["released"].values()) == len(reqs)
        assert stats["held"] == 0 and stats["plan_calls"] > 0
    if name.startswith("feather"):
        assert stats["decisions"] == stats["adds"] + stats["stops"] > 0


def test_stop_holds_requests_and_they_still_count_as_waiting(sched, feather_llm):
    sched.feather_configure({"name": "feather-heuristic", "chunk_size": TEST_CHUNK, "max_wait": None})
    engine = feather_llm.llm_engine
    reqs = workload("hold", groups=8, per_group=2, prefix=640, out=(4, 4), seed=2)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    engine.step()
    held = len(sched._feather_held)
    assert held > 0, "the heuristic should STOP before other documents"
    running, waiting = sched.get_request_counts()
    assert waiting >= held and running + waiting == len(reqs)
    stats = sched.make_stats()
    assert stats.num_waiting_reqs + stats.num_skipped_waiting_reqs >= held
    assert sched.feather_stats()["stops"] >= 1
    assert drain(engine, sched) == {rid: out for rid, _, out in reqs}


@pytest.mark.parametrize("name", ["feather-heuristic", "lpm"])
def test_preemption_keeps_the_state_consistent(sched, feather_llm, name):
    """16 distinct 500-token prompts growing by 150 tokens each overflow 8K KV tokens.

    Default chunks (512 tokens): each prompt is one chunk, so the heuristic ADDs them all
    (delta 1) and only the engine's KV cache limits the batch.
    """
    sched.feather_configure(name)
    engine = feather_llm.llm_engine
    reqs = workload("pre", groups=16, per_group=1, prefix=480, out=(150, 150), seed=3)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    core = sched.feather.core

    def consistent():
        core.check_consistency()
        in_engine = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
        # the formed batch is exactly what vLLM runs or queues (preempted ones included)
        assert set(core.active_ids()) == in_engine
        assert set(core.waiting_ids()) == set(sched._feather_held)

    done = drain(engine, sched, on_step=consistent)
    assert done == {rid: out for rid, _, out in reqs}
    assert sched.feather_stats()["preempted"] > 0, "the workload did not force a preemption"


def test_aborts_leave_nothing_behind(sched, feather_llm):
    sched.feather_configure({"name": "feather-heuristic+svf", "chunk_size": TEST_CHUNK})
    engine = feather_llm.llm_engine
    reqs = workload("abort", groups=4, per_group=4, prefix=600, out=(20, 20), seed=4)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    for _ in range(3):
        engine.step()
    # the scheduler sees vLLM's internal ids (the caller's id + a suffix)
    held = list(sched._feather_held)[:2]
    running = [r.request_id for r in sched.running][:2]
    aborted = set(held + running)
    assert len(held) == 2 and len(running) == 2
    engine.abort_request(list(aborted), internal=True)
    core = sched.feather.core
    core.check_consistency()
    assert not aborted & set(core.waiting_ids() + core.active_ids())
    done = drain(engine, sched)
    assert len(done) == len(reqs) - len(aborted)
    assert all(out == 20 for out in done.values())
    assert sched.feather_stats()["aborted"] == len(aborted)


def test_max_wait_releases_what_the_policy_holds(sched, feather_llm, tmp_path):
    """A policy that always STOPs would serve one request per batch; max_wait bounds every wait."""
    policy = pytest.importorskip("scheduler_runtime.policy")
    spec = policy.ObservationSpec(names=policy.BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64),
                                  scale=(64, 64, 64), chunk_size=TEST_CHUNK)
    path = policy.write_policy(tmp_path / "stop.feather", policy.ConstantPolicy(spec, policy.STOP))
    max_wait = 0.3
    sched.feather_configure({"name": f"feather:{path}", "max_wait": max_wait})
    engine = feather_llm.llm_engine
    reqs = workload("wait", groups=4, per_group=3, prefix=300, out=(40, 40), seed=5)
    added = time.monotonic()
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    started: dict[str, float] = {}
    finished_at: dict[str, float] = {}

    def watch():
        now = time.monotonic()
        for r in sched.running:
            started.setdefault(r.request_id, now)
        for rid in set(started) - {r.request_id for r in sched.running} - set(finished_at):
            finished_at[rid] = now

    done = drain(engine, sched, on_step=watch)
    assert done == {rid: out for rid, _, out in reqs}
    stats = sched.feather_stats()
    assert stats["released"]["max_wait"] > 0 and stats["adds"] == 0
    one_batch = max(finished_at[r] - started[r] for r in finished_at)
    worst = max(started[r] - added for r in started)
    assert worst <= max_wait + one_batch + 0.25, (worst, one_batch)
