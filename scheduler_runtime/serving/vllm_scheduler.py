"""vLLM V1 schedulers that batch with Feather (or a baseline): thin subclasses of vLLM's own.

Select one with ``LLM(scheduler_cls=...)`` / ``--scheduler-cls`` (see
:func:`scheduler_runtime.schedulers.resolve` for names -> classes). Every decision is taken by
the engine-free :class:`~scheduler_runtime.schedulers.FeatherRuntime`; the subclass only
moves requests between vLLM's queues:

* a new request is *held* in :attr:`~_FeatherMixin.feather_held` (outside ``self.waiting``;
  :class:`~scheduler_runtime.frontend.HeldRequests`) and handed to the runtime (CHT insert,
  length prediction);
* at each ``schedule()``, the scheduler's planner answers a round (the runtime's policy), the
  requests it releases are appended to ``self.waiting``, and vLLM's own ``schedule()`` admits
  from there as usual (token budget, KV blocks, preemption), so a released request may wait
  there a few steps;
* freeing a request (finished, aborted) and preempting one are reported to the runtime.

Held requests are counted by :meth:`get_request_counts` (so ``has_requests()`` and the
engine's idle check see them) and therefore by vLLM's ``num_requests_waiting`` metric.
Requests the runtime cannot order (prompt embeddings, resumable streaming sessions) bypass
it and go to ``self.waiting`` directly. Structured-output requests are held like any other
(their grammar compiles meanwhile); once released, vLLM skips them until the grammar is ready.

Fault isolation. Every call into Feather's own code (the runtime's ``arrive``, ``plan``,
``freed``, ``preempted``, the metrics push) is guarded: an exception there is logged once with
its traceback, counted on ``/metrics`` as ``feather_scheduler_faults_total{stage=...}``, and
the scheduler stops using the runtime. Every held request is then handed to vLLM's own waiting
queue, in arrival order, at once (``arrive``, ``plan``) or at the next ``schedule()`` or arrival
(the other hooks run inside vLLM's own loops over its queues); requests already released stay
where vLLM has them. So no request is lost or queued twice, and the engine serves on as vLLM's
plain fcfs scheduler until it restarts. With ``max_faults`` above 1 (``SchedulerConfig``),
the faults before the last one restart Feather instead, with a fresh runtime (fresh policy,
empty CHT) for the requests that arrive from then on. An exception in vLLM's own code is not
Feather's to catch. :meth:`feather_stats` reports ``faults`` (per stage), ``disabled`` and
``handed_to_vllm``.

Cost per step. ``schedule()`` times vLLM's own ``schedule()`` (the ``super()`` call) apart
(``feather_stats()``'s ``vllm_schedule_seconds`` over ``schedule_calls``), beside Feather's added
time: the plan (``decision_seconds``) and the hooks (``hook_seconds``); see
``benchmarks.scheduler_overhead``. Two things keep the hooks cheap without changing a decision:
the runtime's round is not opened when the batch has no free slot (it would release nothing and
change nothing: it ends before even the overdue requests), unless it retains the held groups'
prefixes; and the counters reach Prometheus at most once a second while requests are held
(:class:`_StepMetrics`).

On CUDA, vLLM schedules asynchronously by default: use :class:`FeatherAsyncScheduler` there
(``resolve(name, async_scheduling=True)``). vLLM's CPU platform switches async scheduling off
(``vllm/platforms/cpu.py``), so on CPU the class runs in a synchronously stepped engine.

The environment (``feather_env.env``, real-engine backend) runs this very class in its loop. It
sets ``feather_clock`` to the episode's engine clock and :attr:`~_FeatherMixin.feather_planner` to
an :class:`~scheduler_runtime.frontend.AnsweredRounds`: the environment opens each round of the core
between engine steps (with :meth:`~_FeatherMixin.feather_free_slots` and
:attr:`~_FeatherMixin.feather_view`), lets the agent answer its decisions, and pushes the released
ids there; ``schedule()`` hands them to vLLM as it hands the policy's (``scheduler_runtime.frontend``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from scheduler_runtime.decision import BatchingPolicy
from scheduler_runtime.frontend import HeldRequests, Planner, free_slots
from scheduler_runtime.schedulers import (
    DEFAULT_NAME,
    FeatherRuntime,
    SchedulerConfig,
    load_scheduler_config,
)
from scheduler_runtime.serving.metrics import SchedulerMetrics

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


logger = init_logger(__name__)

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
#: Statuses of a new request that Feather holds (a structured-output request compiles its grammar).
_HOLDABLE = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)


class _EngineView:
    """What the batching core's observation reads of this engine (``decision.EngineView``)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        #: Whether a miss on a prompt's first block settles a lookup (None: not known yet).
        self._first_block_settles: bool | None = None
        #: Each held request's first block as vLLM's cached-block map keys it, with the request.
        self._first_keys: dict[str, tuple[Request, Any]] = {}

    def kv_usage(self) -> float:
        return float(self.scheduler.kv_cache_manager.usage)

    def _first_block_decides(self) -> bool:
        """Whether a prompt whose first block is not cached has no cache hit at all: one
        full-attention KV cache group, whose hit is a run of blocks from the prompt's start
        (vLLM's ``FullAttentionManager.find_longest_cache_hit``). The cached-first scan asks this
        engine about every waiting group at every round; one dictionary lookup answers most."""
        if self._first_block_settles is None:
            from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
            from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

            coordinator = self.scheduler.kv_cache_manager.coordinator
            self._first_block_settles = (
                type(coordinator) is UnitaryKVCacheCoordinator
                and type(coordinator.single_type_managers[0]) is FullAttentionManager
                and coordinator.dcp_world_size == 1
                and coordinator.pcp_world_size == 1
            )
        return self._first_block_settles

    def _first_block_key(self, request_id: str, request: Request) -> Any:
        """The request's first block's key in vLLM's cached-block map (``BlockPool.get_cached_block``'s
        lookup), kept while the request is held; None for a prompt shorter than a block."""
        keys = self._first_keys
        known = keys.get(request_id)
        if known is not None and known[0] is request:
            return known[1]
        if not request.block_hashes:
            return None
        held = self.scheduler.feather_held
        if len(keys) > 2 * len(held) + 64:  # forget the requests no longer held
            keys = self._first_keys = {rid: kv for rid, kv in keys.items() if held.get(rid) is kv[0]}
        key = make_block_hash_with_group_id(request.block_hashes[0], 0)
        keys[request_id] = (request, key)
        return key

    def cached_prefix_tokens(self, request_id: str, limit: int | None = None) -> int:
        scheduler = self.scheduler
        request = scheduler.feather_held.get(request_id)
        if request is None:
            return 0
        manager = scheduler.kv_cache_manager
        settles = self._first_block_settles
        if settles is None:
            settles = self._first_block_decides()
        if settles:
            # _first_block_key's known key, read here: the cached-first scan asks once per group
            known = self._first_keys.get(request_id)
            key = known[1] if known is not None and known[0] is request else self._first_block_key(
                request_id, request)
            if key is not None and manager.block_pool.cached_block_hash_to_block.get_one_block(key) is None:
                return 0
        if limit is None:
            # vLLM's own admission lookup (no side effects): full blocks, at most prompt - 1 tokens
            return int(manager.get_computed_blocks(request)[1])
        if not manager.prefix_cache_lookup_enabled(request):
            return 0
        # the same lookup, stopped after ``limit`` tokens (a group's prefix)
        length = min(int(limit), request.num_tokens - 1)
        return int(manager.coordinator.find_longest_cache_hit(request.block_hashes, length)[1])

    def num_queued(self) -> int:
        scheduler = self.scheduler
        return len(scheduler.waiting) + len(scheduler.kv_holding_waiting)

    def retain_prefixes(self, request_ids: Sequence[str]) -> int:
        # vLLM's block pool: a free block (ref_cnt 0) moved from its place in the free queue to
        # the end, which is evicted last (BlockPool.touch's remove, then free_blocks' append)
        pool = self.scheduler.kv_cache_manager.block_pool
        queue, held = pool.free_block_queue, self.scheduler.feather_held
        moved = 0
        for rid in request_ids:
            request = held.get(rid)
            if request is None:
                continue
            blocks = []
            for block_hash in request.block_hashes:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None:
                    break
                blocks.append(cached[0])
            for block in reversed(blocks):
                if block.ref_cnt == 0 and not block.is_null:
                    queue.remove(block)
                    queue.append(block)
                    moved += 1
        return moved


#: How often, at most, ``schedule()`` exports the counters and gauges to Prometheus (seconds).
METRICS_INTERVAL_S = 1.0


class _StepMetrics(SchedulerMetrics):
    """:class:`SchedulerMetrics` as ``schedule()`` pushes them: while requests are held (decisions
    run at every step), at most once per ``interval`` seconds; while none is, whenever a counter
    changed, and when the scheduler goes idle (nothing held, an empty batch). A push is a dozen
    prometheus_client calls (each takes a lock; in multiprocess mode each writes a file): about
    20 us warm, 40-60 us inside an engine step, whose caches the model's forward pass has
    flushed; that was the largest part of the hooks' time. The counters keep their totals (each
    export adds every increment since the last one), so ``/metrics`` shows the same figures: up to
    a second late while requests are held, the batch gauge up to a second late while none is,
    exact once nothing is held. :meth:`flush` exports what is pending (before the scheduler
    replaces this object)."""

    def __init__(self, scheduler_name: str, interval: float = METRICS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(scheduler_name)
        self.interval = interval
        self._clock = clock
        self._due = float("-inf")
        #: What the last export saw: the core's counters that every other exported figure moves
        #: with (a round, an arrival, a preemption), and the gauges.
        self._counts: tuple[int, int, int] | None = None
        self._gauges: tuple[int, int] | None = None
        self._pending: tuple[Any, Any, int, int] | None = None

    def push(self, stats: Any, runtime_stats: Any, held: int, batch: int) -> None:
        now = self._clock()
        # every exported counter moves only in a round (plan_calls), at an arrival or a preemption
        counts = (stats.plan_calls, stats.arrived, stats.preempted)
        if now < self._due and (held or (counts == self._counts and (batch or self._gauges == (0, 0)))):
            self._pending = (stats, runtime_stats, held, batch)
            return
        self._export(stats, runtime_stats, held, batch, now, counts)

    def _export(self, stats: Any, runtime_stats: Any, held: int, batch: int, now: float,
                counts: tuple[int, int, int]) -> None:
        self._due = now + self.interval
        self._counts, self._gauges, self._pending = counts, (held, batch), None
        super().push(stats, runtime_stats, held, batch)

    def flush(self) -> None:
        """Export the figures of the last push that waited for its turn, if any."""
        pending = self._pending
        if pending is not None:
            stats = pending[0]
            self._export(*pending, self._clock(), (stats.plan_calls, stats.arrived, stats.preempted))


class _FeatherMixin:
    """The hooks; mixed into vLLM's ``Scheduler`` and ``AsyncScheduler``."""

    #: Scheduler name used when no configuration names one.
    default_scheduler_name: ClassVar[str] = DEFAULT_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before vLLM's __init__, so every hook works whenever vLLM calls it.
        #: The requests held back from vLLM's queue while the core decides.
        self.feather_held: HeldRequests[Request] = HeldRequests(super()._enqueue_waiting_request)
        self.feather: FeatherRuntime | None = None
        #: The clock of arrivals and of max_wait (the environment sets its engine clock).
        self.feather_clock: Callable[[], float] = time.monotonic
        #: Who answers a round at each ``schedule()``: ``None`` is the runtime (its policy); the
        #: environment sets an :class:`~scheduler_runtime.frontend.AnsweredRounds`.
        self.feather_planner: Planner | None = None
        self.feather_view = _EngineView(self)
        self._feather_policy: BatchingPolicy | None = None
        self._feather_faults: dict[str, int] = {}
        self._feather_disabled = False
        self._feather_handover_pending = False
        self._feather_handed = 0
        self._feather_last_stats: dict[str, Any] = {}
        #: Wall time of vLLM's own ``schedule()`` (the ``super()`` call) in the ``schedule()``
        #: calls that ran with the runtime, and how many there were (``feather_stats``).
        self.feather_vllm_schedule_seconds = 0.0
        self.feather_schedule_calls = 0
        super().__init__(*args, **kwargs)
        #: The engine's own per-step token budget; a name's ``@TOKENS`` lowers it (feather_configure).
        self._feather_engine_budget: int = self.max_num_scheduled_tokens
        self.feather_configure(
            load_scheduler_config(self.vllm_config.additional_config, self.default_scheduler_name)
        )

    # -- configuration ------------------------------------------------------------------------
    def feather_configure(self, config: SchedulerConfig | Mapping[str, Any] | str,
                          policy: BatchingPolicy | None = None) -> None:
        """Switch to another scheduler configuration (a name, a mapping or a config), optionally
        with a policy object instead of the configuration's (``config.policy`` or the heuristic).

        Only between workloads: raises RuntimeError while the scheduler holds any request.
        Clears the fault state (:meth:`feather_stats`).
        """
        if self.requests:
            raise RuntimeError(f"cannot reconfigure the scheduler with {len(self.requests)} requests in it")
        if isinstance(config, str):
            config = SchedulerConfig.for_name(config)
        elif isinstance(config, Mapping):
            config = load_scheduler_config({"feather_scheduler": dict(config)}, DEFAULT_NAME, environ={})
        self.feather_config = config
        # the per-step token budget of the name (NAME@TOKENS), never above the engine's own
        budget, engine_budget = config.max_num_batched_tokens, self._feather_engine_budget
        self.max_num_scheduled_tokens = engine_budget if budget is None else min(budget, engine_budget)
        self._feather_policy = policy
        self._feather_faults = {}
        self._feather_disabled = self._feather_handover_pending = False
        self._feather_handed = 0
        self._feather_last_stats = {}
        self._feather_flush_metrics()
        self.feather = None if config.passthrough else self._feather_runtime()
        self._feather_metrics = _StepMetrics(config.name)

    def _feather_flush_metrics(self) -> None:
        """Export the figures the metrics object still holds back, before it is replaced."""
        metrics = getattr(self, "_feather_metrics", None)
        if metrics is None:
            return
        try:
            metrics.flush()
        except Exception:  # the counts are also in feather_stats()
            logger.warning("Feather scheduler: cannot export its counters", exc_info=True)

    def _feather_runtime(self) -> FeatherRuntime:
        pool = self.kv_cache_manager.block_pool
        capacity = (pool.num_gpu_blocks - 1) * self.block_size  # block 0 is vLLM's null block
        return FeatherRuntime(self.feather_config, capacity, policy=self._feather_policy,
                              max_model_len=self.vllm_config.model_config.max_model_len)

    def feather_stats(self) -> dict[str, Any]:
        """The runtime's counters (decisions, ADD/STOP, held, decision time, ...) and the faults.

        After the runtime was switched off by a fault, its counters as they were at the fault.
        """
        if self.feather is not None:
            out = self.feather.snapshot()
        else:
            out = {"scheduler": self.feather_config.name, **self._feather_last_stats,
                   "held": len(self.feather_held)}
        out["faults"] = dict(self._feather_faults)
        out["disabled"] = self._feather_disabled
        out["handed_to_vllm"] = self._feather_handed
        out["vllm_schedule_seconds"] = self.feather_vllm_schedule_seconds
        out["schedule_calls"] = self.feather_schedule_calls
        return out

    # -- fault isolation ----------------------------------------------------------------------
    def _feather_fault(self, stage: str, exc: Exception) -> None:
        """Feather's own code raised at ``stage``: count and log it, stop using the runtime; the
        held requests go to vLLM at :meth:`_feather_hand_over` (module docstring)."""
        self._feather_faults[stage] = self._feather_faults.get(stage, 0) + 1
        total = sum(self._feather_faults.values())
        self._feather_disabled = total >= self.feather_config.max_faults
        try:
            self._feather_metrics.fault(stage)
        except Exception:  # the count is also in feather_stats()
            logger.warning("Feather scheduler: cannot export the fault count", exc_info=True)
        runtime, self.feather = self.feather, None
        if runtime is not None:
            try:
                self._feather_last_stats = runtime.snapshot()
            except Exception:  # a broken runtime may not even report
                self._feather_last_stats = {}
        then = ("running as vLLM's fcfs scheduler until the engine restarts" if self._feather_disabled
                else f"restarting Feather (fault {total} of max_faults={self.feather_config.max_faults})")
        logger.error("Feather scheduler %r: %s in %s; %d held request(s) go to vLLM's queue; %s",
                     self.feather_config.name, type(exc).__name__, stage, len(self.feather_held), then,
                     exc_info=exc)
        self._feather_handover_pending = True

    def _feather_hand_over(self) -> None:
        """Give every held request to vLLM's waiting queue (arrival order), then restart Feather
        unless the last fault switched it off. Only where vLLM's queues may change."""
        self._feather_handover_pending = False
        self._feather_flush_metrics()  # before the gauges drop to 0
        held = self.feather_held.take_all()
        for request in held:
            if not request.is_finished():
                super()._enqueue_waiting_request(request)  # type: ignore[misc]
        self._feather_handed += len(held)
        try:
            self._feather_metrics.gauges(held=0, batch=0)
        except Exception:
            logger.warning("Feather scheduler: cannot export its gauges", exc_info=True)
        if self._feather_disabled:
            return
        try:
            self.feather = self._feather_runtime()
            self._feather_metrics = _StepMetrics(self.feather_config.name)
        except Exception as exc:
            self._feather_faults["restart"] = self._feather_faults.get("restart", 0) + 1
            self._feather_disabled = True
            self.feather = None
            logger.error("Feather scheduler %r: cannot restart (%s); running as vLLM's fcfs scheduler",
                         self.feather_config.name, exc, exc_info=exc)

    # -- vLLM hooks ---------------------------------------------------------------------------
    def _enqueue_waiting_request(self, request: Request) -> None:
        if self._feather_handover_pending:
            self._feather_hand_over()
        runtime = self.feather
        if (
            runtime is not None
            and request.status in _HOLDABLE
            and request.num_computed_tokens == 0
            and request.prompt_token_ids is not None
            and not request.resumable
            and request.request_id not in runtime
        ):
            sampling = request.sampling_params
            try:
                runtime.arrive(
                    request.request_id,
                    request.prompt_token_ids,
                    now=self.feather_clock(),
                    max_tokens=request.max_tokens,
                    extra_args=sampling.extra_args if sampling is not None else None,
                )
            except Exception as exc:  # fault isolation (module docstring)
                self._feather_fault("arrive", exc)
                self._feather_hand_over()
                super()._enqueue_waiting_request(request)  # type: ignore[misc]
                return
            self.feather_held.hold(request.request_id, request)
            return
        super()._enqueue_waiting_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._feather_handover_pending:
            self._feather_hand_over()
        runtime = self.feather
        if runtime is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        core = runtime.core
        start, planned = time.perf_counter(), core.stats.decision_seconds
        unpaused = self._pause_state == PauseState.UNPAUSED
        if self.feather_held and unpaused:
            try:
                planner, free = self.feather_planner, self.feather_free_slots()
                # the runtime's round with no free slot releases nothing and changes nothing (it
                # ends before the overdue requests), unless it retains the held groups' prefixes
                if planner is not None or free > 0 or core.config.retain_held_prefixes:
                    # the runtime's round is its core's (FeatherRuntime.plan), called directly
                    released = (planner or core).plan(self.feather_clock(), free, self.feather_view)
                    if released:
                        self.feather_held.release(released)
            except Exception as exc:  # fault isolation (module docstring)
                self._feather_fault("plan", exc)
                self._feather_hand_over()
                return super().schedule(*args, **kwargs)  # type: ignore[misc]
        # the plan itself is counted in decision_seconds; the hooks get the rest
        middle = time.perf_counter()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        end = time.perf_counter()
        # vLLM's own schedule(), on the same steps: what Feather's added time compares with
        self.feather_vllm_schedule_seconds += end - middle
        self.feather_schedule_calls += 1
        middle -= core.stats.decision_seconds - planned
        if self.feather is runtime:  # no fault inside vLLM's schedule() (a preemption hook)
            try:
                self._feather_metrics.push(core.stats, runtime.stats, core.num_waiting, core.num_active)
            except Exception as exc:
                self._feather_fault("metrics", exc)
        runtime.stats.hook_seconds += (middle - start) + (time.perf_counter() - end)
        return output

    def feather_free_slots(self) -> int:
        """How many more requests the batch can take (:func:`~scheduler_runtime.frontend.free_slots`
        of vLLM's running limit and the requests in its queues)."""
        return free_slots(self.max_num_active_reqs,
                          len(self.running) + len(self.waiting) + len(self.kv_holding_waiting))

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        runtime = self.feather
        if runtime is not None:
            try:
                runtime.preempted(request.request_id)
            except Exception as exc:  # fault isolation (module docstring)
                self._feather_fault("preempted", exc)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        result = super()._free_request(request, *args, **kwargs)  # type: ignore[misc]
        self.feather_held.drop(request.request_id)  # a held request was aborted
        runtime = self.feather
        if runtime is not None:
            start = time.perf_counter()
            try:
                # Anything but a normal end (stop string/EOS, length) counts as an abort; a request
                # the runtime never held (handed to vLLM by a fault) is not its to count.
                runtime.left_engine(request.request_id, aborted=request.status not in _COMPLETED)
            except Exception as exc:  # fault isolation (module docstring)
                self._feather_fault("freed", exc)
            runtime.stats.hook_seconds += time.perf_counter() - start
        return result

    def get_request_counts(self) -> tuple[int, int]:
        num_running, num_waiting = super().get_request_counts()  # type: ignore[misc]
        return num_running, num_waiting + len(self.feather_held)


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
