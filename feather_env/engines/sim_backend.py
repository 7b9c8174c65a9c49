"""The simulator backend: the serving loop on a model of vLLM, its steps timed by the fitted step model.

:class:`SimBackend` is :class:`~feather_env.engines.vllm_backend.VLLMBackend` with the engine replaced by
:class:`~feather_env.engines.sim_engine.SimEngine`: vLLM's admission (token budget, ``max_num_seqs``, KV
blocks), block-level prefix cache with LRU eviction, chunked prefill, preemption and the
persistent batch's order, modelled exactly (``tests/test_sim_engine.py`` checks them against
vLLM's own scheduler), and each step's time predicted by a
:class:`~feather_env.step_model.StepCostModel` fitted on the real engine
(:mod:`feather_env.calibrate`, which also measures the error on fresh episodes). The batching
core sits in front of it as it sits in front of vLLM: the backend holds arrivals in a
:class:`~scheduler_runtime.schedulers.FeatherRuntime` and moves released requests into the
engine's queue, as ``FeatherScheduler``'s hooks do.

Between two decisions the engine runs up to the next event the core can see (a finish, an
arrival, a ``max_wait`` deadline); stretches of identical decode steps in between are taken in
one go (:meth:`~feather_env.engines.sim_engine.SimEngine.advance_decode`), their time summed in closed
form (a decode step grows linearly with the contexts it reads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from feather_env.engines.sim_config import SimEngineConfig
from feather_env.engines.sim_engine import SimEngine
from feather_env.engines.step_result import StepResult
from feather_env.engines.vllm_engine import EngineConfig, EngineError
from feather_env.records import Advance
from feather_env.serving import ServingBackend
from feather_env.step_model import DEFAULT_PROFILE, StepCostModel, features_from_columns, load_profile
from feather_env.workloads import Request
from scheduler_runtime.decision import EngineView
from scheduler_runtime.frontend import HeldRequests, free_slots
from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN, FeatherRuntime, SchedulerConfig

__all__ = ["SimBackend"]


class _SimView:
    """The simulated engine as the core's observation sees it (``decision.EngineView``)."""

    def __init__(self, backend: SimBackend) -> None:
        self.backend = backend

    def kv_usage(self) -> float:
        return self.backend.engine.kv_usage

    def cached_prefix_tokens(self, request_id: str, limit: int | None = None) -> int:
        backend = self.backend
        request = backend.held.get(request_id)
        if request is None:
            return 0
        engine = backend.engine
        cached = backend._block_hashes.get(request_id)
        if cached is None or cached[0] is not request:
            cached = (request, engine.block_hashes(request.prompt_token_ids))
            backend._block_hashes[request_id] = cached
        return engine.cached_prefix_tokens(request.prompt_token_ids, limit, cached[1])

    def num_queued(self) -> int:
        return self.backend.engine.num_waiting

    def retain_prefixes(self, request_ids: Sequence[str]) -> int:
        backend = self.backend
        prefixes = []
        for rid in request_ids:
            request = backend.held.get(rid)
            if request is None:
                continue
            self.cached_prefix_tokens(rid, 0)  # keeps the prompt's block hashes
            prefixes.append(backend._block_hashes[rid][1])
        return backend.engine.retain(prefixes)


class SimBackend(ServingBackend):
    """The serving loop on :class:`~feather_env.engines.sim_engine.SimEngine` (see the module docstring).

    Args:
        engine: the engine to model (its KV blocks, batch size, token budget, model length).
        profile: the calibrated profile JSON (default: ``configs/profiles/cpu-tiny-llama.json``).
    """

    deterministic = True

    def __init__(self, engine: EngineConfig | None = None, profile: str | Path | None = None) -> None:
        super().__init__()
        self.engine_config = engine or EngineConfig()
        self.profile_path = Path(profile or DEFAULT_PROFILE)
        self.profile = load_profile(self.profile_path)
        self.model = StepCostModel.from_dict(self.profile["step_model"])
        e = self.engine_config
        self.sim_config = SimEngineConfig(num_blocks=e.num_kv_blocks, block_size=e.block_size,
                                          max_num_seqs=e.max_num_seqs,
                                          max_num_batched_tokens=e.max_num_batched_tokens,
                                          max_model_len=e.max_model_len)
        self.kv_capacity_tokens = e.usable_kv_tokens
        self.engine = SimEngine(self.sim_config)
        #: The requests the core holds, released into the engine's queue (scheduler_runtime.frontend).
        self.held: HeldRequests[Request] = HeldRequests(self._enqueue)
        self._hit: dict[str, int] = {}
        self._hashes: dict[tuple[str, int], tuple[Request, np.ndarray]] = {}
        self._block_hashes: dict[str, tuple[Request, list[int]]] = {}
        self._view = _SimView(self)
        w = self.model.coef
        self._decode_growth = w[3] + w[4]  # seconds per decoding request per further decode step
        #: Every predicted step time is multiplied by this: a slower (> 1) or faster machine than
        #: the one the profile was fitted on (the environment's ``engine_slowdown``).
        self.time_scale = 1.0
        #: A step's prefill part (the prefilling requests' tokens and attention,
        #: :meth:`~feather_env.step_model.StepCostModel.prefill_seconds`) and the rest of it (the
        #: constant, per-request, decoding tokens and KV reads) are multiplied by these: a replica
        #: whose prefill and decode are slower (> 1) by different factors, as GPU generations and
        #: tensor-parallel degrees differ (:class:`~feather_env.cluster_sim.ReplicaSpec`).
        self.prefill_scale = 1.0
        self.decode_scale = 1.0

    # -- the serving loop's hooks ----------------------------------------------------------------
    @property
    def view(self) -> EngineView:
        return self._view

    def free_slots(self) -> int:
        engine = self.engine
        return free_slots(self.sim_config.max_num_seqs, engine.num_running + engine.num_waiting)

    def release(self, request_ids: Sequence[str]) -> None:
        self.held.release(request_ids)

    def _enqueue(self, request: Request) -> None:
        self.engine.add_request(request.request_id, request.prompt_token_ids, request.output_len)

    def _reset_engine(self, config: SchedulerConfig) -> None:
        budget = config.max_num_batched_tokens  # a name's NAME@TOKENS, as the vLLM scheduler applies it
        sim_config = self.sim_config if budget is None else replace(
            self.sim_config, max_num_scheduled_tokens=min(budget, self.sim_config.max_num_batched_tokens))
        self.engine = SimEngine(sim_config)
        self.runtime = FeatherRuntime(config, self.kv_capacity_tokens,
                                      max_model_len=self.sim_config.max_model_len)
        self.held = HeldRequests(self._enqueue)
        self._hit = {}

    def _engine_busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _arrive(self, request: Request) -> None:
        runtime = self.runtime
        assert runtime is not None
        if request.peak_tokens > self.sim_config.max_model_len:
            raise EngineError(f"request {request.request_id!r}: {request.prompt_len} prompt + "
                              f"{request.output_len} output tokens exceed max_model_len="
                              f"{self.sim_config.max_model_len}")
        # the same pool requests come back episode after episode: hash each prompt once
        key = (request.request_id, runtime.chunk_size)
        cached = self._hashes.get(key)
        if cached is None or cached[0] is not request:
            cached = self._hashes[key] = (request, runtime.core.cht.hash_prompt(request.prompt_token_ids))
        runtime.arrive(request.request_id, request.prompt_token_ids, now=self.clock,
                       max_tokens=request.output_len,
                       extra_args={EXTRA_OUTPUT_LEN: request.output_len}, prompt_hashes=cached[1])
        self.held.hold(request.request_id, request)

    def admission_profile(self) -> dict:
        return self.profile

    def _abort_waiting(self, request_id: str) -> None:
        runtime = self.runtime
        if self.held.drop(request_id) is None:  # released: in the engine's queue
            self.engine.abort_request(request_id)
        if runtime is not None:
            runtime.left_engine(request_id, aborted=True)

    def _deadline(self) -> float:
        """The clock of the next event the core sees: an arrival, its oldest request's max_wait, or
        the admission rule's next deadline."""
        deadline = self.next_arrival
        if self.admission is not None:
            due = self.admission.next_deadline()
            if due > self.clock:
                deadline = min(deadline, due)
        runtime = self.runtime
        assert runtime is not None
        max_wait = runtime.core.config.max_wait
        oldest = runtime.core.oldest_arrival()
        if max_wait is not None and oldest is not None:
            due = oldest + max_wait
            if due > self.clock:
                deadline = min(deadline, due)
        return deadline

    def _advance_engine(self, adv: Advance) -> None:
        engine = self.engine
        deadline = self._deadline()
        while True:
            k = engine.decode_horizon()
            if k > 0:
                self._fast_forward(k, deadline, adv)
            elif self._step(adv):
                return
            if self.clock >= deadline or not engine.has_unfinished_requests():
                return

    def _batch_seconds(self, res: StepResult) -> float:
        """Predicted seconds of the (first) step of ``res``."""
        hit = self._hit
        shared = [hit.get(rid, 0) for rid in res.request_ids]  # every column in persistent-batch order
        feats = features_from_columns(res.num_scheduled, res.num_computed, res.first_block, shared,
                                      res.is_prefill, self.model.cache_tokens)
        total = float(self.model.predict_features(feats))
        if self.prefill_scale == self.decode_scale:
            return total * self.decode_scale * self.time_scale
        prefill = self.model.prefill_seconds(feats, sum(q for q, pre in zip(res.num_scheduled, res.is_prefill,
                                                                            strict=True) if pre))
        return (self.prefill_scale * prefill + self.decode_scale * (total - prefill)) * self.time_scale

    def _step(self, adv: Advance) -> bool:
        """One engine step; True when a request finished (the core has news), or, for the group
        decision (which reads the engine's queue), when the engine admitted a queued request."""
        res = self.engine.step()
        n = len(res.request_ids)
        if n == 0:
            raise EngineError("the simulated engine scheduled nothing while it has requests")
        start = self.clock
        for rid, hit in res.admitted:
            self._hit[rid] = hit
            self._record_scheduled(rid, hit, start)
        dt = self._batch_seconds(res)
        self._advance_clock(dt, adv)
        now = self.clock
        if not res.admitted and not any(res.is_prefill):
            adv.decode_tokens += n
            adv.decode_seconds += dt
        runtime = self.runtime
        assert runtime is not None
        for rid in res.preempted:
            runtime.preempted(rid)
        for rid in res.first_token:
            self._record_tokens(rid, 1, False, now, adv)
        for rid in res.finished:
            t = self._timelines[rid]
            self._record_tokens(rid, t.output_len - t.tokens, True, now, adv)
            if not runtime.left_engine(rid, aborted=False):
                raise RuntimeError(f"the simulated engine finished {rid!r}, which its scheduler never held")
            self._hit.pop(rid, None)
        return bool(res.finished) or (bool(res.admitted) and runtime.core.config.decision == "group")

    def _fast_forward(self, k: int, deadline: float, adv: Advance) -> None:
        """Up to ``k`` identical decode steps, stopping at the first that reaches ``deadline``."""
        engine = self.engine
        # the first step's time, then each step adds growth x decoding requests
        probe = engine.advance_decode(1)
        n = len(probe.request_ids)
        t0 = self._batch_seconds(probe)
        g = self._decode_growth * n * self.time_scale * self.decode_scale
        self._advance_clock(t0, adv)
        adv.decode_tokens += n
        adv.decode_seconds += t0
        if k > 1 and self.clock < deadline:
            room = deadline - self.clock
            t1 = t0 + g  # the next step's time
            m = _steps_to_reach(room, t1, g, k - 1)
            engine.advance_decode(m)
            dt = m * t1 + g * m * (m - 1) / 2.0
            self._advance_clock(dt, adv, m)
            adv.decode_tokens += m * n
            adv.decode_seconds += dt

    def _advance_clock(self, dt: float, adv: Advance, steps: int = 1) -> None:
        self.clock += dt
        adv.seconds += dt
        adv.request_seconds += self._in_system * dt
        adv.steps += steps


def _steps_to_reach(room: float, t1: float, g: float, cap: int) -> int:
    """The fewest steps (at most ``cap``) of times ``t1, t1 + g, t1 + 2g, ...`` summing to >= ``room``."""
    if math.isinf(room) or (t1 <= 0 and g <= 0):
        return cap
    if g <= 1e-9 * t1:  # linear (a quadratic's root would divide by ~0)
        est = room / t1
    else:  # m * t1 + g * m * (m - 1) / 2 >= room
        a, b = g / 2.0, t1 - g / 2.0
        est = (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
    m = cap if not math.isfinite(est) or est >= cap else max(1, math.ceil(est))
    while m > 1 and (m - 1) * t1 + g * (m - 1) * (m - 2) / 2.0 >= room:
        m -= 1
    while m < cap and m * t1 + g * m * (m - 1) / 2.0 < room:
        m += 1
    return m
