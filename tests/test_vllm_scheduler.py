"""The schedulers inside the real vLLM engine: every name serves a shared-prefix workload exactly once.

One engine with :class:`~scheduler_runtime.serving.vllm_scheduler.FeatherScheduler` and a small KV cache
(64 blocks of 128 tokens) is built for the module; each test switches the scheduler's
configuration between workloads (``feather_configure``), so every name runs in the same engine.
The fault-isolation tests make Feather's own code raise inside that engine (a plug-in policy
that raises, or a hook made to raise) and check that the engine serves on. The last test
builds a second engine with :class:`~scheduler_runtime.serving.vllm_scheduler.FeatherAsyncScheduler`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import prometheus_client
import pytest

from feather_env.engines.vllm_engine import (
    EngineConfig,
    build_llm,
    engine_core_of,
    forced_length_params,
    tokens_prompt,
)
from scheduler_runtime.decision import BASE_OBS_NAMES, GROUP_OBS_NAMES, STOP, ObservationSpec
from scheduler_runtime.policy import ConstantPolicy, GroupCapPolicy, HeuristicPolicy, write_policy
from scheduler_runtime.rules import GroupCapRule, HeuristicRule
from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN, EXTRA_SOURCE, engine_overrides

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # tests/fault_policies.py, loaded as feather:py:fault_policies:...
    sys.path.insert(0, str(HERE))

pytestmark = pytest.mark.engine

KV_GIB = 1 / 32  # 8192 tokens: small enough to force preemption
TEST_CHUNK = 64  # CHT chunk for the Feather names: the 600-token documents span ~10 chunks
NAMES = ["fcfs", "sjf", "oracle-sjf", "svf", "svf-1bit", "oracle-svf", "lpm", "dfs-weight",
         "feather-heuristic", "feather-heuristic+svf", "feather-heuristic+svf-1bit", "group-cap-2",
         "group-hold+svf"]


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
    assert not scheduler.feather_held and not scheduler.requests
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


def add(engine, rid: str, prompt: list[int], out: int, hint: object = None) -> None:
    params = forced_length_params(out, extra_args={EXTRA_OUTPUT_LEN: out if hint is None else hint,
                                                   EXTRA_SOURCE: "leval/quality"})
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
        # what the scheduler reports to vLLM (has_requests(), the waiting gauge) covers every
        # request the engine's front end still waits on, held ones included
        assert sum(sched.get_request_counts()) == engine.get_num_unfinished_requests()
        if on_step is not None:
            on_step()
    raise AssertionError("engine did not drain")


def fault_count(name: str, stage: str) -> float:
    """``feather_scheduler_faults_total`` in this process's Prometheus registry."""
    value = prometheus_client.REGISTRY.get_sample_value(
        "feather_scheduler_faults_total", {"scheduler": name, "stage": stage})
    return value or 0.0


@pytest.mark.parametrize("name", NAMES + ["feather:CKPT+svf"])
def test_every_scheduler_serves_each_request_once_with_its_tokens(sched, feather_llm, name, tmp_path):
    overrides = {}
    if name.startswith("feather:"):
        spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64),
                                      scale=(64, 64, 64), chunk_size=TEST_CHUNK)
        rule = HeuristicPolicy(spec, HeuristicRule())
        name = name.replace("CKPT", str(write_policy(tmp_path / "heuristic.feather", rule)))
    elif name.startswith(("feather", "group")):
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
    if name.startswith(("feather", "group")):
        assert stats["decisions"] == stats["adds"] + stats["stops"] > 0


def test_stop_holds_requests_and_they_still_count_as_waiting(sched, feather_llm):
    sched.feather_configure({"name": "feather-heuristic", "chunk_size": TEST_CHUNK, "max_wait": None})
    engine = feather_llm.llm_engine
    reqs = workload("hold", groups=8, per_group=2, prefix=640, out=(4, 4), seed=2)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    engine.step()
    held = len(sched.feather_held)
    assert held > 0, "the heuristic should STOP before other documents"
    running, waiting = sched.get_request_counts()
    assert running + waiting == len(reqs)  # no request finishes in one step
    stats = sched.make_stats()  # what vLLM exports (vllm:num_requests_waiting)
    assert stats.num_running_reqs + stats.num_waiting_reqs + stats.num_skipped_waiting_reqs == len(reqs)
    assert sched.feather_stats()["stops"] >= 1
    assert drain(engine, sched) == {rid: out for rid, _, out in reqs}


def cap_one_at_any_kv_usage(tmp_path: Path) -> str:
    """``group-cap-1`` holding at any KV usage (``kv_min = 0``), as a policy file's scheduler name:
    this test engine's cache is never a fifth full, where the named rule would admit."""
    spec = ObservationSpec(names=GROUP_OBS_NAMES, low=(0.0,) * 9, high=(1e6,) * 9, scale=(1.0,) * 9,
                           chunk_size=TEST_CHUNK)
    path = write_policy(tmp_path / "cap1.feather", GroupCapPolicy(spec, GroupCapRule(cap=1, kv_min=0.0)))
    return f"feather:{path}"


def test_group_cap_keeps_its_documents_in_flight_inside_vllm(sched, feather_llm, tmp_path):
    """group-cap-1: one document in flight at every step, its questions flowing; what the core
    reads of vLLM (cached prefix, queue) agrees with vLLM's own state."""
    sched.feather_configure({"name": cap_one_at_any_kv_usage(tmp_path), "chunk_size": TEST_CHUNK,
                             "max_wait": None, "retain_held_prefixes": True})
    engine = feather_llm.llm_engine
    reqs = workload("grp", groups=4, per_group=4, prefix=640, out=(3, 6), seed=5)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    core = sched.feather.core
    view = sched.feather_view
    seen: list[int] = []

    def check() -> None:
        seen.append(core.groups.num_in_flight)
        assert view.num_queued() == len(sched.waiting) + len(sched.kv_holding_waiting)
        for rid in list(sched.feather_held)[:3]:
            request = sched.feather_held[rid]
            full = view.cached_prefix_tokens(rid)
            # the view's first-block shortcut answers as vLLM's own admission lookup
            assert full == sched.kv_cache_manager.get_computed_blocks(request)[1]
            assert view.cached_prefix_tokens(rid, 256) == min(full, 256)

    assert drain(engine, sched, on_step=check) == {rid: out for rid, _, out in reqs}
    stats = sched.feather_stats()
    assert max(seen) == 1 and stats["stops"] > 0 and stats["released"]["group"] > 0


@pytest.mark.parametrize("name", ["fcfs@256", "group-cap-2@256"])
def test_a_names_token_budget_bounds_every_engine_step_and_goes_with_the_name(sched, feather_llm, name,
                                                                             monkeypatch):
    """``NAME@TOKENS``: no engine step schedules more than TOKENS tokens (600-token prompts are cut
    into chunks), every request is still served exactly once; the next name without a budget gets
    the engine's own budget (2,048) back."""
    steps: list[int] = []
    schedule = sched.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append(out.total_num_scheduled_tokens)
        return out

    monkeypatch.setattr(sched, "schedule", recording)
    engine = feather_llm.llm_engine
    runs = (({"name": name, "chunk_size": TEST_CHUNK}, "bud", 256), ({"name": "fcfs"}, "nob", None))
    for config, tag, cap in runs:
        sched.feather_configure(config)
        steps.clear()
        reqs = workload(tag, groups=3, per_group=3, prefix=600, out=(2, 6), seed=9)
        for rid, prompt, out in reqs:
            add(engine, rid, prompt, out)
        assert drain(engine, sched) == {rid: out for rid, _, out in reqs}
        if cap is not None:
            assert max(steps) == cap  # the budget is used to its end, never past it
        else:
            assert max(steps) > 256  # the engine's own budget again
    assert sched.max_num_scheduled_tokens == 2048


def test_retention_moves_a_held_documents_cached_blocks_to_the_end_of_vllms_eviction_order(
        sched, feather_llm, tmp_path):
    sched.feather_configure({"name": cap_one_at_any_kv_usage(tmp_path), "chunk_size": TEST_CHUNK,
                             "max_wait": None})
    engine = feather_llm.llm_engine
    (first, prompt, out), other = workload("keep", groups=2, per_group=1, prefix=640, out=(3, 3), seed=6)
    add(engine, first, prompt, out)
    drain(engine, sched)  # the document's blocks are free now, and cached
    queue = sched.kv_cache_manager.block_pool.free_block_queue
    later = prompt[:640] + [7] * 20  # a later question of the same document, held
    add(engine, "keep-later", later, 3)
    (held,) = sched.feather_held  # vLLM's own id for it
    doc_blocks = sched.feather_view.cached_prefix_tokens(held) // sched.block_size
    assert doc_blocks == 640 // sched.block_size
    # a hit, answered as vLLM's own admission lookup answers it
    hit = sched.kv_cache_manager.get_computed_blocks(sched.feather_held[held])[1]
    assert sched.feather_view.cached_prefix_tokens(held) == hit
    assert sched.feather_view.cached_prefix_tokens(held, 256) == 256
    moved = sched.feather_view.retain_prefixes([held])
    assert moved == doc_blocks
    tail = queue.get_all_free_blocks()[-moved:]
    assert [b.block_hash is not None for b in tail] == [True] * moved
    # the document's first block is the very last to be evicted
    first_hash = sched.feather_held[held].block_hashes[0]
    assert tail[-1] is sched.kv_cache_manager.block_pool.get_cached_block(first_hash, [0])[0]
    add(engine, other[0], other[1], other[2])
    assert len(drain(engine, sched)) == 2


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
        assert set(core.waiting_ids()) == set(sched.feather_held)

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
    held = list(sched.feather_held)[:2]
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
    """A policy that always STOPs would serve one request per batch; max_wait releases the rest.

    The bound itself (no wait beyond max_wait plus one batch) is a property of the core, checked
    on a simulated clock in test_scheduler_core; here: the engine really runs those releases.
    """
    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64),
                                  scale=(64, 64, 64), chunk_size=TEST_CHUNK)
    path = write_policy(tmp_path / "stop.feather", ConstantPolicy(spec, STOP))
    sched.feather_configure({"name": f"feather:{path}", "max_wait": 0.3})
    engine = feather_llm.llm_engine
    reqs = workload("wait", groups=4, per_group=3, prefix=300, out=(40, 40), seed=5)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    batches = []  # the running set after each step

    done = drain(engine, sched, on_step=lambda: batches.append(len(sched.running)))
    assert done == {rid: out for rid, _, out in reqs}
    stats = sched.feather_stats()
    assert stats["adds"] == 0 and stats["stops"] > 0
    # every release but the seeds of empty batches was max_wait's, and they ran side by side
    assert stats["released"]["max_wait"] + stats["released"]["seed"] == len(reqs)
    assert stats["released"]["max_wait"] > 0 and max(batches) > 1


# ---------------------------------------------------------------------------- fault isolation

FAULTY = "feather:py:fault_policies:RaisesOnFiftiethDecision"


def test_a_policy_fault_hands_every_held_request_to_vllm_and_serves_on_as_fcfs(sched, feather_llm):
    """An exception in the policy used to end the engine and every request in it."""
    sched.feather_configure({"name": FAULTY, "chunk_size": TEST_CHUNK})
    engine = feather_llm.llm_engine
    reqs = workload("fault", groups=8, per_group=10, prefix=600, out=(2, 8), seed=6)
    before = fault_count(FAULTY, "plan")
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    held_at_fault = []

    def watch():
        if sched.feather is None and not held_at_fault:
            held_at_fault.append(sched.feather_stats()["handed_to_vllm"])

    done = drain(engine, sched, on_step=watch)
    assert done == {rid: out for rid, _, out in reqs}  # none lost, none twice
    stats = sched.feather_stats()
    assert stats["faults"] == {"plan": 1} and stats["disabled"]
    assert held_at_fault and held_at_fault[0] > 0  # requests were held when it failed
    assert sched.feather is None  # fcfs from there on
    assert fault_count(FAULTY, "plan") - before == 1


def _raise_on_call(fn, n: int):
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"injected fault in {fn.__name__}")
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("stage, target", [("arrive", "arrive"), ("freed", "left_engine"),
                                           ("preempted", "preempted"), ("metrics", "push")])
def test_a_fault_in_any_hook_is_isolated(sched, feather_llm, monkeypatch, stage, target):
    """Fault injection into each hook of the real scheduler (arrival, free, preemption, metrics)."""
    name = "feather-heuristic+svf"
    if stage == "preempted":  # as test_preemption_keeps_the_state_consistent: the KV cache overflows
        sched.feather_configure("feather-heuristic")
        name = "feather-heuristic"
        reqs = workload("fp", groups=16, per_group=1, prefix=480, out=(150, 150), seed=3)
    else:
        sched.feather_configure({"name": name, "chunk_size": TEST_CHUNK})
        reqs = workload(f"f{stage[:2]}", groups=4, per_group=6, prefix=600, out=(2, 12), seed=7)
    owner = sched._feather_metrics if target == "push" else sched.feather
    nth_call = 1 if stage == "preempted" else 3
    monkeypatch.setattr(owner, target, _raise_on_call(getattr(owner, target), nth_call))
    engine = feather_llm.llm_engine
    before = fault_count(name, stage)
    for rid, prompt, out in reqs:
        add(engine, rid, prompt, out)
    done = drain(engine, sched)
    assert done == {rid: out for rid, _, out in reqs}
    assert sched.feather_stats()["faults"] == {stage: 1}
    assert fault_count(name, stage) - before == 1


def test_max_faults_restarts_feather_until_the_last_fault(sched, feather_llm):
    """max_faults=2: the first fault restarts Feather for the requests that arrive after it, the
    second switches it off."""
    name = "feather:py:fault_policies:RaisesOnFifthDecision"
    sched.feather_configure({"name": name, "chunk_size": TEST_CHUNK, "max_faults": 2})
    engine = feather_llm.llm_engine
    first = workload("once", groups=4, per_group=6, prefix=600, out=(2, 6), seed=8)
    second = workload("twice", groups=4, per_group=6, prefix=600, out=(2, 6), seed=11)
    for rid, prompt, out in first:
        add(engine, rid, prompt, out)
    restarted = []

    def watch():
        if not restarted and sched.feather is not None and sched.feather_stats()["faults"] == {"plan": 1}:
            restarted.append(True)  # a fresh runtime (and policy) took over: the next wave arrives
            for rid, prompt, out in second:
                add(engine, rid, prompt, out)

    done = drain(engine, sched, on_step=watch)
    assert done == {rid: out for rid, _, out in first + second}
    assert restarted and sched.feather_stats()["faults"] == {"plan": 2}
    assert sched.feather is None and sched.feather_stats()["disabled"]


def test_malformed_hints_from_trusted_clients_are_served_with_the_fallback(sched, feather_llm):
    """``"abc"`` or ``[1]`` in feather_output_len raised in the engine's busy loop
    (the engine died) and ``"nan"`` poisoned the KV budget."""
    sched.feather_configure({"name": "oracle-svf", "trust_client_hints": True})
    engine = feather_llm.llm_engine
    reqs = workload("hint", groups=4, per_group=6, prefix=300, out=(4, 8), seed=9)
    malformed = ["abc", [1], "nan", "inf", -5, 1e12]
    for i, (rid, prompt, out) in enumerate(reqs):
        add(engine, rid, prompt, out, hint=malformed[i] if i < len(malformed) else None)
    seen = []
    done = drain(engine, sched, on_step=lambda: seen.append(sched.feather.core.budget.used))
    assert done == {rid: out for rid, _, out in reqs}
    stats = sched.feather_stats()
    assert stats["invalid_hints"] == len(malformed) and stats["faults"] == {}
    assert all(np.isfinite(seen)) and max(seen) <= sched.feather.core.budget.capacity


# ---------------------------------------------------------------------------- AsyncScheduler


def test_feather_async_scheduler_serves_each_request_once_in_a_cpu_engine():
    """vLLM's CPU platform turns async scheduling off (``platforms/cpu.py`` sets
    ``scheduler_config.async_scheduling = False``), so the engine steps synchronously here; what
    runs is FeatherAsyncScheduler's bookkeeping (AsyncScheduler's output placeholders under
    Feather's hooks). Its own engine, after the module's tests."""
    config = EngineConfig(kv_cache_gib=KV_GIB, max_num_seqs=32, max_model_len=2048,
                          max_num_batched_tokens=2048)
    llm = build_llm(config, **engine_overrides("feather-heuristic+svf", async_scheduling=True,
                                               chunk_size=TEST_CHUNK))
    try:
        core = engine_core_of(llm)
        sched = core.scheduler
        assert type(sched).__name__ == "FeatherAsyncScheduler"
        assert core.vllm_config.scheduler_config.async_scheduling is False  # the CPU platform's choice
        engine = llm.llm_engine
        reqs = workload("async", groups=4, per_group=6, prefix=600, out=(2, 12), seed=10)
        for rid, prompt, out in reqs:
            add(engine, rid, prompt, out)
        assert sched.get_request_counts() == (0, len(reqs))  # all held
        assert drain(engine, sched) == {rid: out for rid, _, out in reqs}
        stats = sched.feather_stats()
        assert stats["finished"] == len(reqs) and stats["decisions"] > 0 and stats["faults"] == {}
    finally:
        engine_core_of(llm).shutdown()


def test_metrics_export_waits_its_turn_only_while_requests_are_held():
    """The scheduler's push exports at most once a second while requests are held, at once when a
    counter moved with nothing held and when the scheduler goes idle; flush exports the rest."""
    from scheduler_runtime.batching import CoreStats
    from scheduler_runtime.schedulers import RuntimeStats
    from scheduler_runtime.serving.vllm_scheduler import _StepMetrics

    name, now = "step-metrics-test", [100.0]
    metrics = _StepMetrics(name, interval=1.0, clock=lambda: now[0])
    stats, runtime_stats = CoreStats(), RuntimeStats()

    def exported() -> tuple[float | None, ...]:
        read = prometheus_client.REGISTRY.get_sample_value
        return tuple(read(f"feather_scheduler_{key}", {"scheduler": name})
                     for key in ("decisions_total", "held_requests", "batch_requests"))

    def step(plans: int, held: int, batch: int, dt: float = 0.1) -> tuple[float | None, ...]:
        now[0] += dt
        stats.plan_calls += plans
        stats.decisions += plans
        metrics.push(stats, runtime_stats, held, batch)
        return exported()

    stats.arrived = 5
    assert step(1, 4, 1) == (1, 4, 1)  # the first push exports
    assert step(1, 3, 2) == (1, 4, 1)  # held: waits for its second
    assert step(1, 0, 5) == (3, 0, 5)  # nothing held, counters moved: at once
    assert step(0, 0, 4) == (3, 0, 5)  # only the batch gauge moved: waits
    assert step(0, 0, 0) == (3, 0, 0)  # idle: at once
    assert step(0, 0, 0) == (3, 0, 0)
    stats.arrived = 6
    assert step(1, 1, 0) == (3, 0, 0)  # held again, within the second
    assert step(1, 1, 1, dt=1.0) == (5, 1, 1)  # its second has come
    assert step(1, 1, 1) == (5, 1, 1)
    metrics.flush()
    assert exported() == (6, 1, 1)
