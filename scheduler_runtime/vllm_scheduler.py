"""vLLM V1 schedulers that batch with Feather (or a baseline): thin subclasses of vLLM's own.

Select one with ``LLM(scheduler_cls=...)`` / ``--scheduler-cls`` (see
:func:`scheduler_runtime.schedulers.resolve` for names -> classes). Every decision is taken by
the engine-free :class:`~scheduler_runtime.schedulers.FeatherRuntime`; the subclass only
moves requests between vLLM's queues:

* a new request is *held* in ``_feather_held`` (outside ``self.waiting``) and handed to the
  runtime (CHT insert, length prediction);
* before each ``schedule()``, the requests the runtime releases are appended to
  ``self.waiting``, and vLLM's own ``schedule()`` admits from there as usual (token budget,
  KV blocks, preemption), so a released request may wait there a few steps;
* freeing a request (finished, aborted) and preempting one are reported to the runtime.

Held requests are counted by :meth:`get_request_counts` (so ``has_requests()`` and the
engine's idle check see them) and therefore by vLLM's ``num_requests_waiting`` metric.
Requests the runtime cannot order (prompt embeddings, resumable streaming sessions) bypass
it and go to ``self.waiting`` directly.

On CUDA, vLLM schedules asynchronously by default: use :class:`FeatherAsyncScheduler` there
(``resolve(name, async_scheduling=True)``).

The environment (``feather_env.env``, real-engine backend) runs this very class in its loop. It
sets ``feather_clock`` to the episode's engine clock and ``feather_external_rounds``: then
``schedule()`` does not ask the policy; the environment opens each round of the core before the
engine step (with :meth:`~_FeatherMixin.feather_free_slots` and :attr:`~_FeatherMixin.feather_view`),
lets the agent answer its decisions, and hands the released ids to :meth:`~_FeatherMixin.feather_release`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from scheduler_runtime.decision import BatchingPolicy
from scheduler_runtime.metrics import SchedulerMetrics
from scheduler_runtime.schedulers import (
    DEFAULT_NAME,
    FeatherRuntime,
    SchedulerConfig,
    load_scheduler_config,
)

__all__ = [
    "DFSWeightScheduler",
    "FeatherAsyncScheduler",
    "FeatherHeuristicScheduler",
    "FeatherScheduler",
    "LPMScheduler",
    "OracleSJFScheduler",
    "OracleSVFScheduler",
    "SJFScheduler",
    "SVF1BitScheduler",
    "SVFScheduler",
]


_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class _EngineView:
    """What the batching core's observation reads of this engine (``decision.EngineView``)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def kv_usage(self) -> float:
        return float(self.scheduler.kv_cache_manager.usage)

    def cached_prefix_tokens(self, request_id: str) -> int:
        request = self.scheduler._feather_held.get(request_id)
        if request is None:
            return 0
        # vLLM's own admission lookup (no side effects): full blocks, at most prompt - 1 tokens
        return int(self.scheduler.kv_cache_manager.get_computed_blocks(request)[1])


class _FeatherMixin:
    """The hooks; mixed into vLLM's ``Scheduler`` and ``AsyncScheduler``."""

    #: Scheduler name used when no configuration names one.
    default_scheduler_name: ClassVar[str] = DEFAULT_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before vLLM's __init__, so every hook works whenever vLLM calls it.
        self._feather_held: dict[str, Request] = {}
        self.feather: FeatherRuntime | None = None
        #: The clock of arrivals and of max_wait (the environment sets its engine clock).
        self.feather_clock: Callable[[], float] = time.monotonic
        #: The environment answers the core's decisions itself (see the module docstring).
        self.feather_external_rounds = False
        self.feather_view = _EngineView(self)
        super().__init__(*args, **kwargs)
        self.feather_configure(
            load_scheduler_config(self.vllm_config.additional_config, self.default_scheduler_name)
        )

    # -- configuration ------------------------------------------------------------------------
    def feather_configure(self, config: SchedulerConfig | Mapping[str, Any] | str,
                          policy: BatchingPolicy | None = None) -> None:
        """Switch to another scheduler configuration (a name, a mapping or a config), optionally
        with a policy object instead of the configuration's (``config.policy`` or the heuristic).

        Only between workloads: raises RuntimeError while the scheduler holds any request.
        """
        if self.requests:
            raise RuntimeError(f"cannot reconfigure the scheduler with {len(self.requests)} requests in it")
        if isinstance(config, str):
            config = SchedulerConfig.for_name(config)
        elif isinstance(config, Mapping):
            config = load_scheduler_config({"feather_scheduler": dict(config)}, DEFAULT_NAME, environ={})
        self.feather_config = config
        pool = self.kv_cache_manager.block_pool
        capacity = (pool.num_gpu_blocks - 1) * self.block_size  # block 0 is vLLM's null block
        self.feather = None if config.passthrough else FeatherRuntime(config, capacity, policy=policy)
        self._feather_metrics = SchedulerMetrics(config.name)

    def feather_stats(self) -> dict[str, Any]:
        """The runtime's counters (decisions, ADD/STOP, held, decision time, ...)."""
        if self.feather is None:
            return {"scheduler": self.feather_config.name, "held": 0}
        return self.feather.snapshot()

    # -- vLLM hooks ---------------------------------------------------------------------------
    def _enqueue_waiting_request(self, request: Request) -> None:
        runtime = self.feather
        if (
            runtime is not None
            and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
            and request.prompt_token_ids is not None
            and not request.resumable
            and request.request_id not in runtime
        ):
            sampling = request.sampling_params
            runtime.arrive(
                request.request_id,
                request.prompt_token_ids,
                now=self.feather_clock(),
                max_tokens=request.max_tokens,
                extra_args=sampling.extra_args if sampling is not None else None,
            )
            self._feather_held[request.request_id] = request
            return
        super()._enqueue_waiting_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self.feather
        if runtime is None:
            return super().schedule(*args, **kwargs)
        core = runtime.core
        start, planned = time.perf_counter(), core.stats.decision_seconds
        unpaused = self._pause_state == PauseState.UNPAUSED
        if self._feather_held and unpaused and not self.feather_external_rounds:
            released = runtime.plan(self.feather_clock(), self.feather_free_slots(), self.feather_view)
            self.feather_release(released)
        # the plan itself is counted in decision_seconds; the hooks get the rest
        middle = time.perf_counter() - (core.stats.decision_seconds - planned)
        output = super().schedule(*args, **kwargs)
        end = time.perf_counter()
        self._feather_metrics.push(core.stats, runtime.stats, core.num_waiting, core.num_active)
        runtime.stats.hook_seconds += (middle - start) + (time.perf_counter() - end)
        return output

    def feather_free_slots(self) -> int:
        """How many more requests the batch can take: vLLM's running limit minus the requests
        already in the engine (running, or released and waiting in vLLM's queues)."""
        in_engine = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        return self.max_num_active_reqs - in_engine

    def feather_release(self, request_ids: list[str]) -> None:
        """Hand released requests (in release order) from the hold to vLLM's waiting queue."""
        held = self._feather_held
        for request_id in request_ids:
            self.waiting.add_request(held.pop(request_id))

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        if self.feather is not None:
            self.feather.preempted(request.request_id)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        result = super()._free_request(request, *args, **kwargs)
        runtime = self.feather
        if runtime is not None and request.request_id in runtime:
            start = time.perf_counter()
            self._feather_held.pop(request.request_id, None)
            # Anything but a normal end (stop string/EOS, length) counts as an abort.
            runtime.freed(request.request_id, aborted=request.status not in _COMPLETED)
            runtime.stats.hook_seconds += time.perf_counter() - start
        return result

    def get_request_counts(self) -> tuple[int, int]:
        num_running, num_waiting = super().get_request_counts()
        return num_running, num_waiting + len(self._feather_held)


class FeatherScheduler(_FeatherMixin, Scheduler):
    """vLLM's ``Scheduler`` with Feather batching (default ``feather-heuristic+svf``)."""


class FeatherAsyncScheduler(_FeatherMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (CUDA default) with Feather batching."""


# One class per baseline, so ``--scheduler-cls`` alone can pick one (a configuration that
# names a scheduler still wins). fcfs is vLLM's own ``Scheduler``.
class SJFScheduler(FeatherScheduler):
    default_scheduler_name = "sjf"


class OracleSJFScheduler(FeatherScheduler):
    default_scheduler_name = "oracle-sjf"


class SVFScheduler(FeatherScheduler):
    default_scheduler_name = "svf"


class SVF1BitScheduler(FeatherScheduler):
    default_scheduler_name = "svf-1bit"


class OracleSVFScheduler(FeatherScheduler):
    default_scheduler_name = "oracle-svf"


class LPMScheduler(FeatherScheduler):
    default_scheduler_name = "lpm"


class DFSWeightScheduler(FeatherScheduler):
    default_scheduler_name = "dfs-weight"


class FeatherHeuristicScheduler(FeatherScheduler):
    default_scheduler_name = "feather-heuristic"
