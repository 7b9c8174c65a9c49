"""The real engine in the serving loop: vLLM in-process, with the very scheduler that serves in its loop.

:class:`VLLMBackend` is the :class:`~feather_env.serving.ServingBackend` of the real engine:
``vllm.LLM`` built once (with the scenario's KV cache, batch size and token budget) and reused by
every episode, its scheduler a :class:`~scheduler_runtime.serving.vllm_scheduler.FeatherScheduler` whose
rounds the environment answers (:class:`~scheduler_runtime.frontend.AnsweredRounds`), on an
engine clock that is the sum of the measured step times. :meth:`VLLMBackend.serve` serves a whole
episode the other way, as in production: the scheduler answers its own decisions inside the
engine (what ``evaluate.py`` measures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from feather_env.engines.vllm_engine import (
    EngineConfig,
    EngineError,
    ScheduleTap,
    build_llm,
    engine_core_of,
    forced_length_params,
    shutdown_engine,
    tokens_prompt,
)
from feather_env.records import Advance, MeasuredStep, RequestTimeline, StepRequest
from feather_env.serving import ServingBackend
from feather_env.workloads import Request, Workload
from scheduler_runtime.decision import EngineView
from scheduler_runtime.frontend import AnsweredRounds
from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN, EXTRA_SOURCE, FEATHER_SCHEDULER, SchedulerConfig

__all__ = ["VLLMBackend"]


class VLLMBackend(ServingBackend):
    """The real in-process vLLM engine, with the very ``FeatherScheduler`` that serves in its loop.

    The engine is built once (with the scenario's KV cache, batch size and token budget) and
    reused by every episode; :meth:`start` aborts what an unfinished episode left, clears the prefix
    cache and gives the scheduler a new core. Inside an episode the prefix cache persists and
    evicts as in serving; chunked prefill runs as the engine is configured.

    Args:
        engine: the engine configuration (``scheduler_cls`` is set to ``FeatherScheduler``).
        llm: an already built ``vllm.LLM`` whose scheduler is a ``FeatherScheduler`` (tests share
            one per session).
    """

    def __init__(self, engine: EngineConfig | None = None, *, llm: Any = None) -> None:
        super().__init__()
        self.engine_config = engine or EngineConfig()
        if llm is None:
            llm = build_llm(self.engine_config, scheduler_cls=FEATHER_SCHEDULER)
        self.llm = llm
        self._engine = llm.llm_engine
        core = engine_core_of(llm)
        self.scheduler = core.scheduler
        if not hasattr(self.scheduler, "feather_configure"):
            raise EngineError(f"the engine's scheduler is {type(self.scheduler).__name__}, not "
                              f"FeatherScheduler: build it with scheduler_cls={FEATHER_SCHEDULER!r}")
        # the environment answers the rounds between engine steps (scheduler_runtime.frontend)
        self._answered = AnsweredRounds()
        self.scheduler.feather_planner = self._answered
        self.scheduler.feather_clock = lambda: self.clock
        self.tap = ScheduleTap.on(self.scheduler)
        self._model_runner = core.model_executor.driver_worker.worker.model_runner
        pool = self.scheduler.kv_cache_manager.block_pool
        self.kv_capacity_tokens = (pool.num_gpu_blocks - 1) * self.scheduler.block_size
        self._internal: dict[str, str] = {}  # vLLM's request id -> ours
        self._closed = False

    @property
    def view(self) -> EngineView:
        return self.scheduler.feather_view

    def external_id(self, request_id: str) -> str:
        return self._internal.get(request_id, request_id)

    def free_slots(self) -> int:
        return self.scheduler.feather_free_slots()

    def release(self, request_ids: Sequence[str]) -> None:
        self._answered.push(request_ids)  # into vLLM's queue at the next schedule()

    def serve(self, episode: Workload, config: SchedulerConfig,
              on_advance: Callable[[Advance], None] | None = None) -> list[RequestTimeline]:
        """Serve the whole of ``episode`` as in production, and return :meth:`timelines`.

        The scheduler answers its own decisions in every ``schedule()`` (its policy, ordering and
        ``max_wait``, on this backend's clock), as ``feather-serve`` runs it; a passthrough
        ``config`` (``fcfs``) is vLLM's own scheduler. Arrivals, steps, the exactly-once checks and
        the timelines are :meth:`start`'s and :meth:`advance`'s. ``on_advance`` sees every
        :class:`Advance` (it may raise to stop the episode; the next :meth:`start` cleans up).

        Raises:
            EngineError: as :meth:`advance`, or a request not served exactly once with its tokens.
        """
        scheduler = self.scheduler
        scheduler.feather_planner = None  # the scheduler's own policy answers, as it serves
        try:
            self.start(episode, config)
            while not self.done:
                adv = self.advance()
                if on_advance is not None:
                    on_advance(adv)
            self.check_complete()
        finally:
            scheduler.feather_planner = self._answered
        return self.timelines()

    def _reset_engine(self, config: SchedulerConfig) -> None:
        if self._closed:
            raise EngineError("the backend is closed")
        engine = self._engine
        leftover = list(self.scheduler.requests)
        if leftover:  # an unfinished episode (check_env stops mid-episode)
            engine.abort_request(leftover, internal=True)
        if engine.has_unfinished_requests():
            engine.abort_request(list(engine.output_processor.request_states))
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM could not reset its prefix cache (requests still hold blocks)")
        self.scheduler.feather_configure(config)
        self._answered.clear()
        self.runtime = self.scheduler.feather
        self._internal = {}
        self.tap.record_detail = self.record_steps

    def _engine_busy(self) -> bool:
        s = self.scheduler
        return bool(s.running or s.waiting or s.kv_holding_waiting)

    def _arrive(self, request: Request) -> None:
        extra = {EXTRA_OUTPUT_LEN: int(request.output_len)}
        if request.source:
            extra[EXTRA_SOURCE] = request.source
        rid = self._engine.add_request(request.request_id, tokens_prompt(request.prompt_token_ids),
                                       forced_length_params(request.output_len, extra_args=extra, delta=True))
        internal = rid if isinstance(rid, str) else request.request_id
        self._internal[internal] = request.request_id

    def _advance_engine(self, adv: Advance) -> None:
        tap, internal = self.tap, self._internal
        tap.reset()
        in_system = self._in_system
        waiting = len(self.scheduler.waiting) if self.record_steps else 0
        t0 = time.perf_counter()
        outputs = self._engine.step()
        dt = time.perf_counter() - t0
        self.clock += dt
        now = self.clock
        adv.seconds += dt
        adv.request_seconds += in_system * dt
        adv.steps += 1
        if tap.called:
            start = now - dt
            for rid, hit in tap.new:
                self._record_scheduled(internal[rid], hit, start)
            if tap.decode_only:
                adv.decode_tokens += tap.scheduled_reqs
                adv.decode_seconds += dt
            if self.record_steps and tap.num_scheduled:
                self._record_step(dt, waiting)
        for out in outputs:
            ext = internal.get(out.request_id, out.request_id)
            new = sum(len(c.token_ids) for c in out.outputs)
            self._record_tokens(ext, new, bool(out.finished), now, adv)

    def _abort_waiting(self, request_id: str) -> None:
        internal = next((i for i, e in self._internal.items() if e == request_id), request_id)
        self._engine.abort_request([internal], internal=True)

    def _record_step(self, dt: float, waiting: int) -> None:
        tap = self.tap
        hits = {self._internal[r]: self._timelines[self._internal[r]].prefix_hit_tokens
                for r in tap.num_scheduled}
        batch = []
        for rid in self._model_runner.input_batch.req_ids:
            n = tap.num_scheduled.get(rid)
            if n is None:
                continue
            computed, first_block, prompt = tap.detail[rid]
            batch.append(StepRequest(num_tokens=n, num_computed=computed, group=first_block,
                                     shared_tokens=hits[self._internal[rid]],
                                     is_prefill=computed < prompt))
        self.measured_steps.append(MeasuredStep(batch, dt, waiting))

    def persistent_order(self) -> list[str]:
        """The engine's persistent batch after the last step, by slot (our request ids)."""
        return [self._internal.get(r, r) for r in self._model_runner.input_batch.req_ids if r is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown_engine(self.llm)
