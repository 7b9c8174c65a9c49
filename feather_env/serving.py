"""The serving loop the environment steps: an engine serving one episode, the batching core in its scheduler.

A :class:`ServingBackend` serves one episode (a :class:`~feather_env.workloads.Workload` with
arrival times) through continuous batching, on a clock of its own: the sum of the engine's step
times (measured on the real engine, predicted by the simulator); an idle engine jumps to the next
arrival, and nothing sleeps. The batching core (:class:`~scheduler_runtime.batching.BatchingCore`,
inside a :class:`~scheduler_runtime.schedulers.FeatherRuntime`) holds every arrived request
until a round releases it, exactly as in serving; the environment opens the rounds and answers
the decisions, and the backend moves the engine between them:

- :meth:`ServingBackend.start`: a new episode on an empty engine (its prefix cache cleared);
- :meth:`ServingBackend.free_slots` and :attr:`ServingBackend.view`: what a round needs;
- :meth:`ServingBackend.release`: the round's released requests enter the engine's queue;
- :meth:`ServingBackend.advance`: the engine runs until the core may have a decision again (the
  real engine: one step, as vLLM's scheduler plans before every step; the simulator: up to the
  next arrival, finish or ``max_wait`` deadline, skipping the steps in between) and reports what
  that cost (:class:`Advance`);
- :meth:`ServingBackend.timelines`: every request's arrival, first scheduling, first token and
  finish on the episode's clock, and its prefix-cache hit.

:meth:`VLLMBackend.serve` serves a whole episode the other way, as in production: the
scheduler answers its own decisions inside the engine (what ``evaluate.py`` measures).

Every request is checked to be served exactly once with its token count: a request that finishes
twice, with the wrong number of tokens, or never, is an :class:`~feather_env.engine.EngineError`.

:class:`VLLMBackend` is the real in-process vLLM engine, running the very
:class:`~scheduler_runtime.vllm_scheduler.FeatherScheduler` that serves; the simulator is
:class:`feather_env.sim.SimBackend`.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from feather_env.engine import (
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
from feather_env.workloads import Request, Workload
from scheduler_runtime.decision import EngineView, observation_kind
from scheduler_runtime.frontend import AnsweredRounds
from scheduler_runtime.plugins import load_policy_spec
from scheduler_runtime.schedulers import (
    EXTRA_OUTPUT_LEN,
    EXTRA_SOURCE,
    FEATHER_SCHEDULER,
    FeatherRuntime,
    SchedulerConfig,
)

__all__ = ["ServingBackend", "VLLMBackend", "env_scheduler_config"]


def env_scheduler_config(name: str, **overrides: Any) -> SchedulerConfig:
    """The core configuration of scheduler ``name`` inside the environment.

    As in serving (:meth:`SchedulerConfig.for_name`), except that ``fcfs``, which serves as vLLM's
    own scheduler, runs as the core's ``fcfs`` ordering with no admission test: every arrival is
    released at once in arrival order, as far as the batch has room, which is what vLLM's own
    queue does. Output lengths are the requests' true lengths (the environment replays its own
    workload, so its hints are trusted).
    """
    config = SchedulerConfig.for_name(name, **{"trust_client_hints": True, **overrides})
    if (config.policy and "decision" not in overrides
            and observation_kind(load_policy_spec(config.policy)) == "group"):
        config = replace(config, decision="group")  # as the runtime serves it
    if config.passthrough:
        config = replace(config, ordering="fcfs", admission="none", svf_seed=False, max_wait=None)
    return config


class ServingBackend(ABC):
    """An engine that serves one episode at a time, with the batching core in its scheduler."""

    #: Whether two runs of one episode give the same clock (the simulator) or not (real timing).
    deterministic: bool = False

    def __init__(self) -> None:
        self.clock = 0.0
        self.runtime: FeatherRuntime | None = None
        self._timelines: dict[str, RequestTimeline] = {}
        self._pending: list[Request] = []  # arrivals not yet in the system, in arrival order
        self._next = 0
        self._in_system = 0
        self._finished = 0
        self._failed: str | None = None
        self.record_steps = False
        self.measured_steps: list[MeasuredStep] = []

    # -- what the environment calls ------------------------------------------------------------
    def start(self, episode: Workload, config: SchedulerConfig) -> FeatherRuntime | None:
        """Serve ``episode`` from now on: an empty engine, a cleared prefix cache, a new core.

        Returns the runtime whose core the environment drives (``None`` for a passthrough
        configuration, ``fcfs``: vLLM's own scheduler, which only :meth:`serve` runs).
        """
        self._reset_engine(config)
        assert self.runtime is not None or config.passthrough
        self.clock = 0.0
        self._pending = sorted(episode, key=lambda r: r.arrival_time)  # stable: queue order on ties
        self._timelines = {r.request_id: RequestTimeline(r.request_id, r.prompt_len, r.output_len,
                                                         float(r.arrival_time), source=r.source)
                           for r in self._pending}
        if len(self._timelines) != len(self._pending):
            raise EngineError("the episode has duplicate request ids")
        self._next = 0
        self._in_system = 0
        self._finished = 0
        self._failed = None
        self.measured_steps = []
        self._admit_arrivals()
        return self.runtime

    @property
    def done(self) -> bool:
        """Every request of the episode has finished."""
        return self._finished == len(self._timelines)

    @property
    def failed(self) -> str | None:
        """Why the episode failed (the engine raised), else None; :meth:`start` clears it."""
        return self._failed

    def advance(self) -> Advance:
        """Run the engine until the core may need a decision again (see the module docstring).

        Raises:
            EngineError: the engine failed, or served a request twice or with the wrong tokens.
        """
        if self._failed is not None:
            raise EngineError(f"the episode failed earlier ({self._failed}); start a new one")
        if self.done:
            raise EngineError("the episode is over: every request has finished")
        adv = Advance()
        try:
            if not self._engine_busy() and (self.runtime is None or not len(self.runtime.core)):
                # nothing in the system: jump to the next arrival
                if self._next >= len(self._pending):
                    raise EngineError(f"the engine is idle with {len(self._timelines) - self._finished} "
                                      "requests unfinished and none left to arrive")
                jump = max(0.0, self._pending[self._next].arrival_time - self.clock)
                adv.seconds += jump
                self.clock += jump
            else:
                self._advance_engine(adv)
            self._admit_arrivals()
        except EngineError as exc:
            self._failed = str(exc)
            raise
        except Exception as exc:  # engine internals: name the episode's state
            self._failed = repr(exc)
            raise EngineError(f"the engine failed at t={self.clock:.3f}s with {self._in_system} requests "
                              f"in the system: {exc!r}") from exc
        return adv

    @property
    @abstractmethod
    def view(self) -> EngineView:
        """The engine as the core's observation sees it."""

    @abstractmethod
    def free_slots(self) -> int:
        """How many more requests the batch can take now."""

    @abstractmethod
    def release(self, request_ids: Sequence[str]) -> None:
        """The round released these held requests: they enter the engine's waiting queue."""

    def external_id(self, request_id: str) -> str:
        """Our id of a request the core knows by ``request_id`` (the engine may rename them)."""
        return request_id

    def timelines(self) -> list[RequestTimeline]:
        """Every request of the episode, in arrival order (complete once :attr:`done`)."""
        return list(self._timelines.values())

    def check_complete(self) -> None:
        """Raise :class:`EngineError` unless every request finished exactly once with its tokens."""
        bad = [t for t in self._timelines.values() if not t.completed]
        if bad:
            t = bad[0]
            raise EngineError(f"{len(bad)} requests were not served exactly once with their tokens, "
                              f"e.g. {t.request_id!r}: finished {t.finished_count}x with {t.tokens} of "
                              f"{t.output_len} tokens")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine."""

    # -- what an engine implements -------------------------------------------------------------
    @abstractmethod
    def _reset_engine(self, config: SchedulerConfig) -> None:
        """Empty engine, cleared prefix cache, ``self.runtime`` a new runtime for ``config``."""

    @abstractmethod
    def _engine_busy(self) -> bool:
        """Whether the engine has requests (running or in its queue)."""

    @abstractmethod
    def _arrive(self, request: Request) -> None:
        """A request arrives now: hand it to the scheduler (which holds it in the core)."""

    @abstractmethod
    def _advance_engine(self, adv: Advance) -> None:
        """Run the engine (see :meth:`advance`), recording into ``adv`` and the timelines."""

    # -- shared bookkeeping ----------------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        pending, clock = self._pending, self.clock
        while self._next < len(pending) and pending[self._next].arrival_time <= clock + 1e-12:
            self._arrive(pending[self._next])
            self._in_system += 1
            self._next += 1

    @property
    def next_arrival(self) -> float:
        """Arrival time of the next request not yet arrived (inf when none is left)."""
        if self._next < len(self._pending):
            return float(self._pending[self._next].arrival_time)
        return math.inf

    def _record_tokens(self, request_id: str, new_tokens: int, finished: bool, now: float,
                       adv: Advance) -> None:
        t = self._timelines.get(request_id)
        if t is None:
            raise EngineError(f"the engine returned unknown request {request_id!r}")
        if t.finished_count:
            raise EngineError(f"request {request_id!r} produced output after it finished")
        if new_tokens:
            if math.isnan(t.first_token):
                t.first_token = now
            else:
                t.itl.append(now - t.last_output)
            t.last_output = now
        t.tokens += new_tokens
        if finished:
            t.finished_count += 1
            t.finish = now
            self._finished += 1
            self._in_system -= 1
            adv.finished.append(request_id)
            if t.tokens != t.output_len:
                raise EngineError(f"request {request_id!r} finished with {t.tokens} tokens, "
                                  f"{t.output_len} were asked")

    def _record_scheduled(self, request_id: str, hit_tokens: int, now: float) -> None:
        t = self._timelines[request_id]
        if math.isnan(t.first_scheduled):
            t.first_scheduled = now
            t.prefix_hit_tokens = hit_tokens


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
                self._record_step(dt)
        for out in outputs:
            ext = internal.get(out.request_id, out.request_id)
            new = sum(len(c.token_ids) for c in out.outputs)
            self._record_tokens(ext, new, bool(out.finished), now, adv)

    def _record_step(self, dt: float) -> None:
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
        self.measured_steps.append(MeasuredStep(batch, dt))

    def persistent_order(self) -> list[str]:
        """The engine's persistent batch after the last step, by slot (our request ids)."""
        return [self._internal.get(r, r) for r in self._model_runner.input_batch.req_ids if r is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown_engine(self.llm)
