"""SimEngine against vLLM's own scheduler, run in-process with no model.

Every lockstep test feeds the same requests (same arrival steps, same aborts) to
``feather_env.engines.sim_engine.SimEngine`` and to a real ``vllm.v1.core.sched.scheduler.Scheduler``
stepped with a fake ``ModelRunnerOutput`` (one sampled token for every request whose prefill or
decode completes in the step), and after every step compares: the scheduled requests and token
counts in scheduling order, admissions with their prefix-cache hits, preemptions, finishes,
first tokens, the RUNNING and WAITING queues, the free-block count, the whole free-block queue
in eviction order, the set of cached blocks, every request's block ids, the KV usage and the
prefix-cache statistics. The persistent-batch order is checked against vLLM's real
``InputBatch`` driven the way ``GPUModelRunner._update_states`` drives it. Fast-forwarded decode
stretches (``advance_decode``) step vLLM k times, checking that each of those steps really was
the same pure-decode step, then compare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.sim_engine_speed import shared_document_episode
from feather_env.engines.sim_config import SimEngineConfig
from feather_env.engines.sim_engine import SimEngine

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LLAMA = os.path.join(REPO, "configs", "models", "tiny-llama")
MAX_MODEL_LEN = 2048
VOCAB = 8192
OUT_TOKEN_BASE = 9000  # sampled tokens lie outside the prompts' 3..7999: outputs are unique


@pytest.fixture(scope="module")
def vm():
    """vLLM's classes and one ModelConfig (building it and importing vLLM are the slow parts)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    model_configs: dict[int, ModelConfig] = {}

    def model_config(max_model_len: int) -> ModelConfig:
        if max_model_len not in model_configs:
            model_configs[max_model_len] = ModelConfig(model=TINY_LLAMA, skip_tokenizer_init=True,
                                                       dtype="bfloat16", max_model_len=max_model_len)
        return model_configs[max_model_len]

    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return dict(torch=torch, CacheConfig=CacheConfig, DeviceConfig=DeviceConfig,
                SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig, SamplingParams=SamplingParams,
                Scheduler=Scheduler,
                FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
                KVCacheGroupSpec=KVCacheGroupSpec, ModelRunnerOutput=ModelRunnerOutput, Request=Request,
                RequestStatus=RequestStatus, StructuredOutputManager=StructuredOutputManager,
                CachedRequestState=CachedRequestState, InputBatch=InputBatch, model_config=model_config,
                hash_fn=hash_fn, get_request_block_hasher=get_request_block_hasher)


def make_vllm_config(vm, cfg: SimEngineConfig):
    sched_kwargs = dict(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_model_len=cfg.max_model_len, is_encoder_decoder=False,
                        enable_chunked_prefill=cfg.enable_chunked_prefill,
                        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                        long_prefill_token_threshold_adaptive=cfg.long_prefill_token_threshold_adaptive,
                        watermark=cfg.watermark, scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl)
    if cfg.max_num_active_seqs is not None:
        sched_kwargs["max_num_active_seqs"] = cfg.max_num_active_seqs
    cache_config = vm["CacheConfig"](block_size=cfg.block_size,
                                     enable_prefix_caching=cfg.enable_prefix_caching)
    cache_config.num_gpu_blocks = cfg.num_blocks
    return vm["VllmConfig"](model_config=vm["model_config"](cfg.max_model_len),
                            scheduler_config=vm["SchedulerConfig"](**sched_kwargs),
                            cache_config=cache_config, device_config=vm["DeviceConfig"]("cpu"))


class ShadowRunner:
    """vLLM's InputBatch updated as GPUModelRunner._update_states does (gpu_model_runner.py)."""

    def __init__(self, vm, cfg: SimEngineConfig):
        self.vm = vm
        self.batch = vm["InputBatch"](max_num_reqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                      max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      device=vm["torch"].device("cpu"), vocab_size=VOCAB + 4096,
                                      block_sizes=[cfg.block_size],
                                      max_num_blocks_per_req=[-(-cfg.max_model_len // cfg.block_size)])
        self.states: dict = {}

    def update(self, so) -> None:
        ib = self.batch
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            ib.remove_request(rid)
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        for rid in set(ib.req_id_to_index) - (set(so.num_scheduled_tokens) - resumed):
            ib.remove_request(rid)
        to_add = []
        for new in so.scheduled_new_reqs:
            state = self.vm["CachedRequestState"](
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, mm_features=[],
                sampling_params=new.sampling_params, generator=None, block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens, output_token_ids=[])
            self.states[new.req_id] = state
            to_add.append(state)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.states[rid]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            index = ib.req_id_to_index.get(rid)
            if rid in resumed:
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            if index is None:
                to_add.append(state)
            elif new_block_ids is not None:
                ib.block_table.append_row(new_block_ids, index)
        for state in to_add:
            ib.add_request(state)
        ib.condense()
        ib.refresh_metadata()  # ends the step's batch update (resets BatchUpdateBuilder)

    def sampled(self, rid: str, token: int) -> None:
        self.states[rid].output_token_ids.append(token)

    def order(self) -> list[str | None]:
        return list(self.batch.req_ids)

    def row_blocks(self, rid: str) -> list[int]:
        table = self.batch.block_table[0]
        index = self.batch.req_id_to_index[rid]
        return table.block_table.np[index, : table.num_blocks_per_row[index]].tolist()


@dataclass
class Counters:
    """What a lockstep run exercised, so tests can insist their scenario did what it is for."""

    steps: int = 0
    fast_forwarded: int = 0
    preemptions: int = 0
    admissions: int = 0
    hit_tokens: int = 0
    finished: int = 0
    aborts: int = 0
    evictions: int = 0
    admitted_at: dict = field(default_factory=dict)  # request id -> step of its (last) admission
    hit_of: dict = field(default_factory=dict)  # request id -> prefix-cache hit of that admission
    seen: set = field(default_factory=set)  # cached blocks after the last check


class Lockstep:
    """The same requests on SimEngine and on vLLM's Scheduler, compared after every step."""

    def __init__(self, vm, cfg: SimEngineConfig, check_batch: bool = True):
        self.vm = vm
        self.cfg = cfg
        vllm_config = make_vllm_config(vm, cfg)
        spec = vm["FullAttentionSpec"](block_size=cfg.block_size, num_kv_heads=4, head_size=64,
                                       dtype=vm["torch"].bfloat16)
        kv_config = vm["KVCacheConfig"](num_blocks=cfg.num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[vm["KVCacheGroupSpec"](["layer"], spec)])
        self.sched = vm["Scheduler"](vllm_config=vllm_config, kv_cache_config=kv_config,
                                     structured_output_manager=vm["StructuredOutputManager"](vllm_config),
                                     block_size=cfg.block_size, log_stats=True)
        self.hasher = vm["get_request_block_hasher"](cfg.block_size, vm["hash_fn"])
        self.sim = SimEngine(cfg)
        self.runner = ShadowRunner(vm, cfg) if check_batch else None
        self.token_of: dict[str, int] = {}
        self.num_added = 0
        self.vllm_stats = [0, 0, 0, 0]
        self.count = Counters()

    @property
    def pool(self):
        return self.sched.kv_cache_manager.block_pool

    def vllm_request(self, rid: str, prompt: list[int], max_tokens: int):
        params = self.vm["SamplingParams"](max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                           detokenize=False)
        return self.vm["Request"](rid, list(prompt), params, None, arrival_time=0.0, block_hasher=self.hasher)

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.token_of[rid] = OUT_TOKEN_BASE + self.num_added  # each request samples its own token
        self.num_added += 1
        self.sched.add_request(self.vllm_request(rid, prompt, max_tokens))
        self.sim.add_request(rid, np.asarray(prompt, dtype=np.int64), max_tokens)
        self.check_state()

    def abort(self, rid: str) -> None:
        self.sched.finish_requests(rid, self.vm["RequestStatus"].FINISHED_ABORTED)
        self.sim.abort_request(rid)
        self.count.aborts += 1
        self.check_state()

    def busy(self) -> bool:
        busy = self.sched.has_unfinished_requests()
        assert self.sim.has_unfinished_requests() == busy
        return busy

    def _vllm_step(self):
        """One vLLM step; returns what the sim's StepResult must say about it."""
        sched = self.sched
        so = sched.schedule()
        scheduled = list(so.num_scheduled_tokens.items())
        hits = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                hits[rid] = cached.num_computed_tokens[i]
        admitted = [(rid, hits[rid]) for rid, _ in scheduled if rid in hits]
        entries = {}
        for rid, n in scheduled:
            req = sched.requests[rid]
            computed_before = req.num_computed_tokens - n
            decode = n == 1 and req.num_output_tokens > 0 and computed_before == req.num_tokens - 1
            entries[rid] = (n, computed_before, tuple(sched.kv_cache_manager.get_block_ids(rid)[0]),
                            not decode)
        if self.runner is not None:
            self.runner.update(so)
        ids = [rid for rid, _ in scheduled]
        sampled, first = [], []
        for rid in ids:
            req = sched.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([self.token_of[rid]])
                if req.num_output_tokens == 0:
                    first.append(rid)
                if self.runner is not None:
                    self.runner.sampled(rid, self.token_of[rid])
            else:
                sampled.append([])
        out = self.vm["ModelRunnerOutput"](req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                           sampled_token_ids=sampled)
        outputs = sched.update_from_output(so, out)
        finished = [o.request_id for eco in outputs.values() for o in eco.outputs
                    if o.finish_reason is not None]
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                pcs = eco.scheduler_stats.prefix_cache_stats
                self.vllm_stats[0] += pcs.queries
                self.vllm_stats[1] += pcs.hits
                self.vllm_stats[2] += pcs.preempted_queries
                self.vllm_stats[3] += pcs.preempted_hits
        return dict(scheduled=scheduled, admitted=admitted, preempted=set(so.preempted_req_ids),
                    finished=finished, first=first, entries=entries)

    def step(self) -> None:
        want = self._vllm_step()
        got = self.sim.step()
        c = self.count
        c.steps += 1
        assert got.scheduled == want["scheduled"]
        assert got.admitted == want["admitted"]
        assert set(got.preempted) == want["preempted"]
        assert got.finished == want["finished"]
        assert got.first_token == want["first"]
        assert got.num_steps == 1
        self.check_entries(got, want["entries"])
        c.preemptions += len(got.preempted)
        c.admissions += len(got.admitted)
        c.hit_tokens += sum(h for _, h in got.admitted)
        c.finished += len(got.finished)
        c.admitted_at.update((rid, c.steps) for rid, _ in got.admitted)
        c.hit_of.update(got.admitted)
        self.check_state()

    def check_entries(self, got, want_entries: dict) -> None:
        entries = got.entries
        assert [e.request_id for e in entries] == got.request_ids
        assert got.num_scheduled == [e.num_tokens for e in entries]
        assert got.num_computed == [e.num_computed for e in entries]
        assert got.is_prefill == [e.is_prefill for e in entries]
        assert got.first_block == [e.block_ids[0] for e in entries]
        assert sorted(got.request_ids) == sorted(want_entries)
        for e in entries:
            n, computed_before, blocks, prefill = want_entries[e.request_id]
            assert (e.num_tokens, e.num_computed, e.block_ids, e.is_prefill) == (n, computed_before, blocks,
                                                                                   prefill), e.request_id
        if self.runner is not None:
            assert self.sim.persistent_order() == self.runner.order() == got.request_ids
            for e in entries:
                if e.request_id in self.runner.states:
                    assert self.runner.row_blocks(e.request_id) == list(e.block_ids)

    def advance(self, k: int) -> None:
        """Fast-forward the sim by k decode steps; step vLLM k times, each the same pure decode."""
        running = self.sim.running_ids()
        horizon = self.sim.decode_horizon()
        got = self.sim.advance_decode(k)
        # The rest of a stretch is still a stretch: callers split one (SimBackend does).
        assert self.sim.decode_horizon() == horizon - k
        assert got.num_steps == k and not (got.admitted or got.preempted or got.finished or got.first_token)
        assert got.request_ids == self.sim.persistent_order()
        for i in range(k):
            want = self._vllm_step()
            assert want["scheduled"] == [(rid, 1) for rid in running], f"step {i} of {k}"
            assert not (want["admitted"] or want["preempted"] or want["finished"] or want["first"])
            if i == 0:
                self.check_entries(got, want["entries"])
            elif self.runner is not None:
                assert self.runner.order() == got.request_ids
        self.count.steps += k
        self.count.fast_forwarded += k
        self.check_state()

    def check_state(self) -> None:
        sched, sim, pool = self.sched, self.sim, self.pool
        assert sim.running_ids() == [r.request_id for r in sched.running]
        assert sim.waiting_ids() == [r.request_id for r in sched.waiting]
        assert not sched.kv_holding_waiting
        assert sim.num_running == len(sched.running) and sim.num_waiting == len(sched.waiting)
        assert sim.num_free_blocks == pool.get_num_free_blocks()
        assert sim.free_block_queue() == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
        self.count.evictions += len(self.count.seen - cached - set(sim.free_block_queue()))
        self.count.seen = cached
        assert sim.cached_block_ids() == cached
        for req in list(sched.running) + list(sched.waiting):
            want = sched.kv_cache_manager.get_block_ids(req.request_id)[0]
            assert sim.request_blocks(req.request_id) == want, req.request_id
        assert sim.kv_usage == pytest.approx(sched.kv_cache_manager.usage, abs=1e-12)
        assert sim.prefix_cache_stats == tuple(self.vllm_stats[:2])
        assert sim.preempted_prefix_cache_stats == tuple(self.vllm_stats[2:])

    def check_probe(self, prompt: list[int]) -> None:
        probe = self.vllm_request("probe", prompt, 1)
        _, num_hit, _ = self.sched.kv_cache_manager.get_computed_blocks(probe)
        assert self.sim.cached_prefix_tokens(np.asarray(prompt)) == num_hit


@dataclass
class Arrival:
    step: int
    rid: str
    prompt: list[int]
    max_tokens: int
    abort_at: int | None = None  # engine step at which it is aborted (if still unfinished)


def run(pair: Lockstep, arrivals: list[Arrival], fast_forward: bool | str = False,
        probes: list[list[int]] = (), max_steps: int = 4000) -> Counters:
    """Drive both engines through the arrivals; fast_forward: False, True (whole horizon) or 'half'."""
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts = sorted((a.abort_at, a.rid) for a in arrivals if a.abort_at is not None)
    clock = 0
    while pending or aborts or pair.busy():
        assert clock < max_steps, "engines did not drain"
        while pending and pending[0].step <= clock:
            a = pending.pop(0)
            pair.add(a.rid, a.prompt, a.max_tokens)
        while aborts and aborts[0][0] <= clock:
            _, rid = aborts.pop(0)
            if rid in pair.sched.requests:
                pair.abort(rid)
        for p in probes:
            pair.check_probe(p)
        if not pair.busy():
            clock += 1
            continue
        horizon = pair.sim.decode_horizon() if fast_forward else 0
        if horizon > 0:
            # Stop at the next arrival or abort, so they happen at the same step either way.
            next_events = [a.step for a in pending[:1]] + [at for at, _ in aborts[:1]]
            if next_events:
                horizon = min(horizon, max(min(next_events) - clock, 1))
            k = horizon if fast_forward is True else max(1, horizon // 2)
            pair.advance(k)
            clock += k
        else:
            pair.step()
            clock += 1
    assert not pair.sim.has_unfinished_requests()
    assert pair.sim.num_free_blocks == pair.pool.get_num_free_blocks()
    return pair.count


# ------------------------------------------------------------------ workloads

def shared_prefix_workload(rng: np.random.Generator, groups: int, per_group: int, prefix: int, suffix: tuple,
                           out: tuple, stagger: int = 0, tag: str = "r") -> list[Arrival]:
    docs = [rng.integers(3, 8000, prefix).tolist() for _ in range(groups)]
    arrivals = []
    for i in range(groups * per_group):
        own = int(rng.integers(suffix[0], suffix[1] + 1))
        prompt = docs[i % groups] + rng.integers(3, 8000, own).tolist()
        arrivals.append(Arrival(step=i * stagger, rid=f"{tag}{i}", prompt=prompt,
                                max_tokens=int(rng.integers(out[0], out[1] + 1))))
    return arrivals


def min_blocks(arrivals: list[Arrival], block_size: int) -> int:
    return max(-(-(len(a.prompt) + a.max_tokens - 1) // block_size) for a in arrivals) + 1


# ----------------------------------------------------------- lockstep tests

def test_kv_pressure_forces_eviction_and_preemption(vm):
    rng = np.random.default_rng(1)
    arrivals = shared_prefix_workload(rng, groups=3, per_group=4, prefix=600, suffix=(10, 200), out=(20, 80),
                                      stagger=2)
    cfg = SimEngineConfig(num_blocks=min_blocks(arrivals, 128) + 6, block_size=128, max_num_seqs=8,
                          max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN)
    c = run(Lockstep(vm, cfg), arrivals, probes=[arrivals[0].prompt, arrivals[1].prompt[:300]])
    assert c.preemptions > 0 and c.evictions > 0 and c.hit_tokens > 0 and c.finished == len(arrivals)


@pytest.mark.parametrize("grouped", [False, True], ids=["interleaved", "grouped"])
def test_performance_scenario_matches_vllm(vm, grouped):
    """The 128-request, 6000-token-document episode of the benchmark, fast-forwarded."""
    cfg, requests = shared_document_episode(seed=0, grouped=grouped)
    arrivals = [Arrival(0, rid, prompt.tolist(), out) for rid, prompt, out in requests]
    c = run(Lockstep(vm, cfg), arrivals, fast_forward=True)
    assert c.finished == len(requests) and c.fast_forwarded > c.steps // 3
    assert c.evictions > 0 and (c.hit_tokens > 0) == grouped


def test_fast_forward_matches_vllm_step_by_step(vm):
    rng = np.random.default_rng(2)
    arrivals = shared_prefix_workload(rng, groups=2, per_group=5, prefix=300, suffix=(1, 150), out=(30, 200),
                                      stagger=3)
    cfg = SimEngineConfig(num_blocks=min_blocks(arrivals, 16) + 40, block_size=16, max_num_seqs=6,
                          max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN)
    c = run(Lockstep(vm, cfg), arrivals, fast_forward=True)
    # Long stretches were skipped, across block boundaries (16-token blocks), and under KV pressure.
    assert c.fast_forwarded > c.steps // 2 and c.preemptions > 0


def test_chunked_prefill_off_threshold_watermark_and_active_limit(vm):
    rng = np.random.default_rng(3)
    arrivals = shared_prefix_workload(rng, groups=2, per_group=4, prefix=400, suffix=(50, 900), out=(5, 40))
    cfg = SimEngineConfig(num_blocks=min_blocks(arrivals, 128) + 8, block_size=128, max_num_seqs=6,
                          max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
                          enable_chunked_prefill=False, watermark=0.1, max_num_active_seqs=4)
    run(Lockstep(vm, cfg), arrivals, fast_forward=True)
    cfg = SimEngineConfig(num_blocks=min_blocks(arrivals, 128) + 4, block_size=128, max_num_seqs=6,
                          max_num_batched_tokens=1024, max_model_len=MAX_MODEL_LEN,
                          long_prefill_token_threshold=200, long_prefill_token_threshold_adaptive=True,
                          scheduler_reserve_full_isl=False)
    run(Lockstep(vm, cfg), arrivals, fast_forward="half")


def test_watermark_applies_only_while_something_runs(vm):
    rng = np.random.default_rng(6)
    # a needs 19 of the 20 usable blocks, 20 by its end; the watermark is int(0.1 * 21) = 2 blocks.
    a = Arrival(0, "a", rng.integers(3, 8000, 300).tolist(), 10)
    b = Arrival(1, "b", rng.integers(3, 8000, 10).tolist(), 3)
    cfg = SimEngineConfig(num_blocks=21, block_size=16, max_num_seqs=4, max_num_batched_tokens=512,
                          max_model_len=MAX_MODEL_LEN, watermark=0.1)
    c = run(Lockstep(vm, cfg), [a, b])
    # a was admitted with fewer free blocks than its need + watermark (nothing ran); b, which
    # would have fit the one free block, waited for a to finish.
    assert c.admitted_at == {"a": 1, "b": 11}


def test_chunks_computed_side_by_side_leave_duplicate_cached_blocks(vm):
    rng = np.random.default_rng(7)
    doc = rng.integers(3, 8000, 128).tolist()  # 8 blocks of 16
    arrivals = [Arrival(0, "a", doc + rng.integers(3, 8000, 10).tolist(), 4),
                Arrival(0, "b", doc + rng.integers(3, 8000, 10).tolist(), 4),
                Arrival(12, "c", doc + rng.integers(3, 8000, 10).tolist(), 2)]
    cfg = SimEngineConfig(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=128,
                          max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=48)
    pair = Lockstep(vm, cfg)
    blocks: dict[str, list[int]] = {}
    original_step = pair.step

    def step():
        original_step()
        for rid in pair.sim.running_ids():
            blocks[rid] = pair.sim.request_blocks(rid)
    pair.step = step
    run(pair, arrivals)
    # a and b prefilled the document 48 tokens at a time, each a chunk ahead of the other, so
    # each of its blocks was cached twice; c hits the copy cached first, from either of them.
    a_doc, b_doc, c_doc = (set(blocks[r][:8]) for r in "abc")
    assert c_doc <= a_doc | b_doc and c_doc & a_doc and c_doc & b_doc


def test_a_fully_cached_prompt_recomputes_its_last_block(vm):
    rng = np.random.default_rng(8)
    aligned = rng.integers(3, 8000, 256).tolist()  # exactly 2 blocks
    ragged = rng.integers(3, 8000, 300).tolist()
    arrivals = [Arrival(0, "a", aligned, 3), Arrival(0, "r", ragged, 3),
                Arrival(6, "a2", aligned, 3), Arrival(6, "r2", ragged, 3), Arrival(6, "p", aligned[:128], 2)]
    cfg = SimEngineConfig(num_blocks=30, block_size=128, max_num_seqs=4, max_num_batched_tokens=1024,
                          max_model_len=MAX_MODEL_LEN)
    c = run(Lockstep(vm, cfg), arrivals, probes=[aligned, ragged, aligned[:200]])
    # The lookup stops at num_tokens - 1 tokens: the resent aligned prompt hits one of its two
    # blocks, the ragged one both, the one-block prefix none.
    assert c.hit_of == {"a": 0, "r": 0, "a2": 128, "r2": 256, "p": 0}


def test_prefix_caching_off(vm):
    rng = np.random.default_rng(4)
    arrivals = shared_prefix_workload(rng, groups=2, per_group=3, prefix=200, suffix=(1, 100), out=(40, 120),
                                      stagger=1)
    cfg = SimEngineConfig(num_blocks=min_blocks(arrivals, 32) + 3, block_size=32, max_num_seqs=4,
                          max_num_batched_tokens=128, max_model_len=MAX_MODEL_LEN,
                          enable_prefix_caching=False, scheduler_reserve_full_isl=False)
    c = run(Lockstep(vm, cfg), arrivals, fast_forward=True)
    assert c.hit_tokens == 0 and c.preemptions > 0


def test_reset_prefix_cache_between_episodes(vm):
    rng = np.random.default_rng(5)
    arrivals = shared_prefix_workload(rng, groups=1, per_group=3, prefix=300, suffix=(1, 20), out=(2, 5))
    cfg = SimEngineConfig(num_blocks=30, block_size=128, max_num_seqs=4, max_num_batched_tokens=512,
                          max_model_len=MAX_MODEL_LEN)
    pair = Lockstep(vm, cfg)
    run(pair, arrivals)
    assert pair.sim.cached_prefix_tokens(np.asarray(arrivals[0].prompt)) == 256
    assert pair.sim.reset_prefix_cache() and pair.sched.reset_prefix_cache()
    pair.vllm_stats = [0, 0, 0, 0]  # vLLM's hit-rate metric restarts on a reset as well
    pair.check_state()
    assert pair.sim.cached_prefix_tokens(np.asarray(arrivals[0].prompt)) == 0
    # The same ids again (vLLM accepts an id once its request finished).
    again = [Arrival(i, a.rid, a.prompt, a.max_tokens) for i, a in enumerate(arrivals)]
    run(pair, again, fast_forward=True)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([16, 32, 128]))
    groups = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    # Document lengths around multiples of half a block, so hits end on and off block edges.
    doc_lens = [draw(st.integers(0, 5)) * block_size // 2 + int(rng.integers(0, 40)) for _ in range(groups)]
    docs = [rng.integers(3, 8000, n).tolist() for n in doc_lens]
    n = draw(st.integers(1, 24))
    arrivals = []
    for i in range(n):
        doc = docs[draw(st.integers(0, groups - 1))]
        suffix = draw(st.integers(0 if doc else 1, 3 * block_size))
        prompt = doc + rng.integers(3, 8000, suffix).tolist()
        abort_at = None
        step = draw(st.integers(0, 25))
        if draw(st.integers(0, 9)) == 0:
            abort_at = step + draw(st.integers(0, 12))
        arrivals.append(Arrival(step, f"w{i}", prompt, draw(st.integers(1, 60)), abort_at))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 12))
    budget = draw(st.integers(max(max_num_seqs, 8), 600)) if chunked else MAX_MODEL_LEN
    cfg = SimEngineConfig(
        num_blocks=min_blocks(arrivals, block_size) + draw(st.integers(0, 24)), block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 24, 100, 300])),
        long_prefill_token_threshold_adaptive=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        max_num_active_seqs=draw(st.one_of(st.none(), st.integers(1, max_num_seqs))),
    )
    fast_forward = draw(st.sampled_from([False, True, "half"]))
    probes = [a.prompt for a in arrivals[:2]]
    return cfg, arrivals, fast_forward, probes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_workloads_match_vllm(vm, workload):
    cfg, arrivals, fast_forward, probes = workload
    run(Lockstep(vm, cfg), arrivals, fast_forward=fast_forward, probes=probes)


# ------------------------------------------------------------ unit tests

def test_decode_horizon_of_a_single_request():
    sim = SimEngine(SimEngineConfig(num_blocks=20, block_size=16, max_num_batched_tokens=64,
                                    max_model_len=512))
    sim.add_request("a", np.arange(3, 40), 50)
    assert sim.decode_horizon() == 0  # the next step is a prefill
    first = sim.step()
    assert first.first_token == ["a"] and first.entries[0].is_prefill and first.entries[0].num_tokens == 37
    # 49 tokens to go; the step that samples the last one finishes it and is not fast-forwarded.
    assert sim.decode_horizon() == 48
    res = sim.advance_decode(48)
    assert res.num_steps == 48 and res.entries[0].num_computed == 37 and not res.entries[0].is_prefill
    assert res.entries[0].block_ids == (1, 2, 3)  # the first step's 38 tokens fill 3 blocks of 16
    assert sim.request_blocks("a") == [1, 2, 3, 4, 5, 6]  # 85 tokens after the stretch
    assert sim.decode_horizon() == 0
    assert sim.step().finished == ["a"] and not sim.has_unfinished_requests()
    with pytest.raises(ValueError):
        sim.advance_decode(1)


def test_decode_horizon_stops_before_a_failed_allocation():
    # 5 usable blocks of 4 tokens; the request holds 3 (9 tokens + 1 sampled), 2 left.
    sim = SimEngine(SimEngineConfig(num_blocks=6, block_size=4, max_num_batched_tokens=16, max_model_len=64))
    sim.add_request("a", np.arange(3, 12), 11)
    sim.step()
    # Decodes at 10..12 tokens fit block 3; the token 13 step takes block 4, 17 takes block 5,
    # 21 would need a sixth: the stretch ends before it (and before the finishing step at 19).
    assert sim.decode_horizon() == 9
    sim.advance_decode(9)
    assert sim.num_free_blocks == 0 and sim.step().finished == ["a"]


def test_decode_horizon_is_zero_when_the_waiting_head_can_be_admitted():
    sim = SimEngine(SimEngineConfig(num_blocks=40, block_size=16, max_num_batched_tokens=64,
                                    max_model_len=512))
    sim.add_request("a", np.arange(3, 30), 20)
    sim.step()
    assert sim.decode_horizon() > 0
    sim.add_request("b", np.arange(3, 30), 20)
    assert sim.decode_horizon() == 0
    res = sim.step()
    assert res.admitted == [("b", 16)]  # a's first full block, cached when a was admitted


def test_persistent_batch_fills_lowest_hole_then_appends_then_condenses():
    cfg = SimEngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=512)
    sim = SimEngine(cfg)
    for rid, out in [("a", 10), ("b", 2), ("c", 10), ("d", 3)]:
        sim.add_request(rid, np.arange(3, 20), out)
    sim.step()
    assert sim.persistent_order() == ["a", "b", "c", "d"]
    sim.step()  # b samples its second token and finishes: its slot is freed on the next step
    assert sim.persistent_order() == ["a", "b", "c", "d"]
    sim.add_request("e", np.arange(100, 120), 5)
    sim.add_request("f", np.arange(200, 220), 5)
    res = sim.step()  # b's hole goes to e (lowest hole first), f is appended; d finishes now
    assert res.finished == ["d"] and sim.persistent_order() == ["a", "e", "c", "d", "f"]
    res = sim.step()  # d's hole (3) is filled by condense() moving the last request (f) down
    assert sim.persistent_order() == ["a", "e", "c", "f"] == res.request_ids


def test_preemption_eviction_and_resumed_requests_join_the_batch_after_new_ones():
    # 3 usable blocks of 4 tokens; a and b (4-token prompts, 6 outputs) both need a second block
    # at their first decode.
    sim = SimEngine(SimEngineConfig(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                    max_model_len=64))
    sim.add_request("a", np.arange(3, 7), 6)
    sim.add_request("b", np.arange(10, 14), 6)
    res = sim.step()
    assert res.admitted == [("a", 0), ("b", 0)] and res.first_token == ["a", "b"]
    res = sim.step()  # a takes the last free block; b cannot grow and preempts itself
    assert res.preempted == ["b"] and res.scheduled == [("a", 1)]
    assert sim.persistent_order() == ["a"] and sim.waiting_ids() == ["b"]
    assert sim.free_block_queue() == [2]  # b's cached prompt block, kept for a later hit
    # b would hit its block but needs it plus one more: waits. Nothing changes until a's third
    # block at 9 tokens, and a's last token (6th) is sampled on the step after that.
    assert sim.decode_horizon() == 3
    sim.advance_decode(3)
    res = sim.step()  # a's third block evicts b's cached block (the only free one); a finishes
    assert res.finished == ["a"] and sim.free_block_queue() == [2, 3, 1]  # unhashed tail first
    assert sim.cached_block_ids() == {1, 3}
    sim.add_request("c", np.arange(20, 24), 2)
    res = sim.step()
    # b (resumed: prompt + its output, no hit left) is admitted before c, but the model runner
    # adds new requests first: c takes a's freed slot 0, b is appended.
    assert res.admitted == [("b", 0), ("c", 0)] and res.scheduled == [("b", 5), ("c", 4)]
    assert sim.persistent_order() == ["c", "b"] == res.request_ids
    assert res.entries[1].block_ids == (2, 3) and res.entries[0].block_ids == (1,)
    assert sim.cached_block_ids() == {1, 2}  # c's prompt block and b's replayed first block


def test_add_request_rejects_bad_requests():
    sim = SimEngine(SimEngineConfig(num_blocks=5, block_size=16, max_model_len=256,
                                    max_num_batched_tokens=256))
    sim.add_request("a", np.arange(10), 5)
    with pytest.raises(ValueError, match="duplicate"):
        sim.add_request("a", np.arange(10), 5)
    with pytest.raises(ValueError, match="non-empty"):
        sim.add_request("b", np.array([], dtype=np.int64), 5)
    with pytest.raises(ValueError, match="max_model_len"):
        sim.add_request("c", np.arange(250), 10)
    with pytest.raises(ValueError, match="could never finish"):
        sim.add_request("d", np.arange(60), 10)  # 69 tokens need 5 blocks, 4 are usable
    sim.add_request("e", np.arange(60), 5)  # 64 tokens fit the 4 usable blocks exactly
    with pytest.raises(ValueError):
        SimEngineConfig(num_blocks=1)
    sim.abort_request("nobody")  # ignored, as vLLM ignores unknown ids
    sim.abort_request("a")
    assert sim.waiting_ids() == ["e"]


def test_from_vllm_reads_the_config(vm):
    cfg = SimEngineConfig(num_blocks=77, block_size=32, max_num_seqs=12, max_num_batched_tokens=300,
                          max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=64, watermark=0.1,
                          scheduler_reserve_full_isl=False, max_num_active_seqs=5)
    vllm_config = make_vllm_config(vm, cfg)
    assert SimEngineConfig.from_vllm(vllm_config, 77) == cfg
    vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(ValueError, match="async scheduling"):
        SimEngineConfig.from_vllm(vllm_config, 77)
