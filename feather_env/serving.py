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

Every request is checked to be served exactly once with its token count: a request that finishes
twice, with the wrong number of tokens, or never, is an
:class:`~feather_env.engines.vllm_engine.EngineError`. Under an admission rule (the setting's
``~RULE``, :mod:`scheduler_runtime.admission`, with the SLOs of :attr:`ServingBackend.admission_slos`)
a request can instead be *rejected* at arrival, never reaching the engine, or *aborted* by the
deadline rule while it still waits for its first step; its timeline says so (``outcome``), and it
is a clear answer, not a failure. The backend decides as the API server does: from the requests
it admitted, their first tokens and finishes, and the step model of :meth:`admission_profile`.

The two engines are in :mod:`feather_env.engines`: the real in-process vLLM engine
(:class:`~feather_env.engines.vllm_backend.VLLMBackend`, running the very
:class:`~scheduler_runtime.serving.vllm_scheduler.FeatherScheduler` that serves) and the simulator
(:class:`~feather_env.engines.sim_backend.SimBackend`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from feather_env.engines.vllm_engine import EngineConfig, EngineError
from feather_env.records import Advance, MeasuredStep, RequestTimeline
from feather_env.workloads import Request, Workload
from scheduler_runtime.admission import AdmissionController, AdmissionRule, StepTimeModel, prompt_block_hashes
from scheduler_runtime.decision import EngineView, observation_kind
from scheduler_runtime.plugins import load_policy_spec
from scheduler_runtime.schedulers import FeatherRuntime, SchedulerConfig

__all__ = ["ServingBackend", "env_scheduler_config"]


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
    #: The engine served (its KV blocks, batch size and token budget size the admission rule).
    engine_config: EngineConfig

    def __init__(self) -> None:
        self.clock = 0.0
        self.runtime: FeatherRuntime | None = None
        self._timelines: dict[str, RequestTimeline] = {}
        self._pending: list[Request] = []  # arrivals not yet in the system, in arrival order
        self._next = 0
        self._in_system = 0
        self._finished = 0
        self._failed: str | None = None
        self._shed = 0
        self.record_steps = False
        self.measured_steps: list[MeasuredStep] = []
        #: The SLOs (ms, vLLM's ``--goodput`` names) an admission rule reads; set before :meth:`start`.
        self.admission_slos: dict[str, float] = {}
        #: The episode's admission controller (``None``: the setting admits everything).
        self.admission: AdmissionController | None = None
        self._block_cache: dict[str, tuple[Request, list[int]]] = {}

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
        self._shed = 0
        self._failed = None
        self.measured_steps = []
        self.admission = self._admission_controller(config)
        self._admit_arrivals()
        return self.runtime

    def _admission_controller(self, config: SchedulerConfig) -> AdmissionController | None:
        """The episode's controller: the setting's ``~RULE``, ``None`` when it admits everything."""
        rule = AdmissionRule.parse(config.admission_rule)
        return None if rule.is_none else self.admission_controller(config, rule)

    def admission_controller(self, config: SchedulerConfig, rule: AdmissionRule) -> AdmissionController:
        """A controller of ``rule`` for this engine served with ``config`` (its token budget), the SLOs
        of :attr:`admission_slos` and the step model of :meth:`admission_profile`."""
        e = self.engine_config
        budget = min(config.max_num_batched_tokens or e.max_num_batched_tokens, e.max_num_batched_tokens)
        return AdmissionController(rule, self.admission_slos,
                                   model=StepTimeModel.from_profile(self.admission_profile()),
                                   token_budget=budget, max_num_seqs=e.max_num_seqs,
                                   kv_capacity_tokens=max(1, e.usable_kv_tokens), block_size=e.block_size)

    def admission_profile(self) -> dict[str, Any]:
        """The step-time profile the admission rule predicts with: the shipped one of this kind of
        machine (``scheduler_runtime.hardware.machine_profile``); the simulator's: its own."""
        from feather_env.step_model import load_profile
        from scheduler_runtime.hardware import machine_profile

        return load_profile(machine_profile())

    @property
    def done(self) -> bool:
        """Every request of the episode has finished, or was rejected or aborted by the admission rule."""
        return self._finished + self._shed == len(self._timelines)

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
                    raise EngineError(f"the engine is idle with "
                                      f"{len(self._timelines) - self._finished - self._shed} "
                                      "requests unfinished and none left to arrive")
                jump = max(0.0, self._pending[self._next].arrival_time - self.clock)
                adv.seconds += jump
                self.clock += jump
            else:
                self._advance_engine(adv)
            self._admit_arrivals()
            if self.admission is not None and self.admission.rule.deadline:
                self._abort_overdue()
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
        bad = [t for t in self._timelines.values() if not t.completed and not t.shed]
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

    @abstractmethod
    def _abort_waiting(self, request_id: str) -> None:
        """Take a request that no engine step has scheduled yet out of the core or the engine's queue."""

    def submit(self, request: Request) -> None:
        """One more request for the episode being served, arriving at its ``arrival_time`` (not
        before the clock): what a router does to a replica (``feather_env.cluster_sim``).

        Raises:
            ValueError: a request of that id is already in the episode.
        """
        if request.request_id in self._timelines:
            raise ValueError(f"request {request.request_id!r} is already in the episode")
        self._pending.append(request)
        self._timelines[request.request_id] = RequestTimeline(
            request.request_id, request.prompt_len, request.output_len, float(request.arrival_time),
            source=request.source)
        self._admit_arrivals()  # at once if the engine's last step already ran past the arrival

    @property
    def in_system(self) -> int:
        """Requests of the episode that arrived and have not finished."""
        return self._in_system

    @property
    def has_work(self) -> bool:
        """Whether anything is left to serve: requests in the engine or the core, or to arrive."""
        runtime = self.runtime
        return (self._engine_busy() or (runtime is not None and len(runtime.core) > 0)
                or self._next < len(self._pending))

    # -- shared bookkeeping ----------------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        pending, clock, admission = self._pending, self.clock, self.admission
        while self._next < len(pending) and pending[self._next].arrival_time <= clock + 1e-12:
            request = pending[self._next]
            self._next += 1
            if admission is not None:
                decision = admission.offer(request.request_id, request.prompt_len, self._blocks(request),
                                           float(request.arrival_time))
                if not decision.admit:
                    t = self._timelines[request.request_id]
                    t.outcome, t.reason = "rejected", decision.reason
                    self._shed += 1
                    continue
            self._arrive(request)
            self._in_system += 1

    def _blocks(self, request: Request) -> list[int]:
        """The prompt's block hashes for the admission's prefix estimate (once per pooled request)."""
        cached = self._block_cache.get(request.request_id)
        if cached is None or cached[0] is not request:
            block = self.engine_config.block_size
            cached = self._block_cache[request.request_id] = (
                request, prompt_block_hashes(request.prompt_token_ids, block))
        return cached[1]

    def _abort_overdue(self) -> None:
        """The deadline rule: abort the waiting requests that can no longer meet their TTFT and that no
        engine step has scheduled yet (one in its prefill is left to finish it)."""
        admission = self.admission
        assert admission is not None
        for rid in admission.overdue(self.clock):
            t = self._timelines[rid]
            if not math.isnan(t.first_scheduled):
                continue
            self._abort_waiting(rid)
            t.outcome, t.reason = "aborted", "deadline"
            t.finish = self.clock
            admission.finished(rid, aborted=True, now=self.clock)
            self._shed += 1
            self._in_system -= 1

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
                if self.admission is not None:
                    self.admission.started(request_id, now)
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
            if self.admission is not None:
                self.admission.finished(request_id)
            if t.tokens != t.output_len:
                raise EngineError(f"request {request_id!r} finished with {t.tokens} tokens, "
                                  f"{t.output_len} were asked")

    def _record_scheduled(self, request_id: str, hit_tokens: int, now: float) -> None:
        t = self._timelines[request_id]
        if math.isnan(t.first_scheduled):
            t.first_scheduled = now
            t.prefix_hit_tokens = hit_tokens
