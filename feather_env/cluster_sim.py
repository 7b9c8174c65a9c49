"""N simulated engine replicas behind one router: routing studied at 4-64 replicas on a laptop.

:class:`ClusterSim` serves a workload (its requests, token ids and arrival times) on ``replicas``
copies of the simulator backend (:class:`~feather_env.engines.sim_backend.SimBackend`: vLLM's
admission, prefix cache, eviction and persistent batch modelled exactly, steps timed by the
calibrated step model),
each with the Feather scheduler's batching core in front of it as in ``feather-serve``, behind a
:class:`~scheduler_runtime.router.ReplicaRouter`: the very router code the Ray Serve application
runs (:mod:`scheduler_runtime.serving.cluster`), fed with what the ingress feeds it there, the request's
chunked prefix hashes and the requests each replica is serving.

The replicas share one clock. Before each arrival every replica runs up to the arrival's time (a
replica stops at the first engine step that reaches it, as a real engine finishes its step before
it sees a new request), the router chooses with the loads of that moment, and the request enters
that replica's scheduler. After the last arrival every replica runs until it has served all of its
requests. Each replica's scheduler answers its own ADD/STOP decisions with its policy (Feather's
heuristic by default), as it does inside vLLM. Every router is given the prompt's length (as
``feather-serve``'s proxy gives it, from the body); a router that reads the request's life
(:attr:`~scheduler_runtime.router.ReplicaRouter.tracks_requests`: the field's routers) gets the
request's id with each routing, and hears of
every first token (:meth:`~scheduler_runtime.router.ReplicaRouter.prefilled`) and finish
(:meth:`~scheduler_runtime.router.ReplicaRouter.finished`) that happened before the next arrival,
as a router watching the responses stream would; one that observes the service also hears, just before
the finish, how long the request waited at its replica before its first step
(:meth:`~scheduler_runtime.router.ReplicaRouter.scheduled`), where vLLM reports it: on a stream's final
chunk.

Under an admission rule (the scheduler's ``~RULE``, e.g. ``feather-heuristic~slo``, with
``admission_slos``: :mod:`scheduler_runtime.admission`), each replica decides at the arrival, as
``feather-serve``'s replicas do, with its own controller fed by its own service (the ``slo`` rule's
pace included, so a slower replica learns its own). A request that a replica sheds is routed again
among the replicas not yet tried, as the proxy does with an admission rejection
(:mod:`scheduler_runtime.serving.proxy`): the router is told that attempt's finish (no output), and
:meth:`ClusterRun.next_arrival` returns the same request with those replicas avoided and left out of
its loads (``reroute_shed=True``, ``feather-serve --reroute-shed``). Only when every replica has shed it
is it rejected, a request that met no SLO. By default, as ``feather-serve`` now serves, the first
replica's rejection is the answer. The result counts each request
once: where it was served, or its last rejection.

Every request is checked to be served exactly once with its tokens
(:meth:`~feather_env.serving.ServingBackend.check_complete`, per replica).

Unequal replicas (``profiles``, one :class:`ReplicaSpec` per replica): each replica may have its own
engine (KV cache, ``max_num_seqs``, token budget) and its own speed: the calibrated step model's
prefill part and decode part of every step are multiplied by the replica's own factors (a replica
3x slower in prefill and 1.5x in decode), and a ``drift`` multiplies both further from given
times on (a replica that slows down for a while, as one sharing its host with other work). A router
that learns from the service it sees (:attr:`~scheduler_runtime.router.ReplicaRouter.observes_service`)
reads the cluster's clock (its ``clock``, set here: the time of the arrival it routes, or of the first
token or finish it hears of), is told each finished request's output tokens, and is handed each
replica's published metrics (:meth:`ReplicaSim.metrics`: what vLLM's ``/metrics`` shows, its
``vllm:cache_config_info`` included) every ``scrape_s`` seconds of the clock, at an arrival.
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.engines.sim_backend import SimBackend
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.records import RequestTimeline
from feather_env.serving import env_scheduler_config
from feather_env.serving_metrics import meets_slos, serving_metrics
from feather_env.workloads import Request, Workload
from scheduler_runtime.admission import AdmissionRule, check_slos
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.router import PrefixHasher, ReplicaRouter
from scheduler_runtime.schedulers import SchedulerConfig

__all__ = ["Arrival", "ClusterResult", "ClusterRun", "ClusterSim", "ReplicaSim", "ReplicaSpec",
           "distinct_documents", "drift_workload", "replica_breakdown", "zipf_documents"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica of an unequal fleet: its engine and its speed beside the calibrated step model's.

    Attributes:
        prefill_slowdown: the prefill part of each step (the prefilling requests' tokens and their
            attention, :meth:`~feather_env.step_model.StepCostModel.prefill_seconds`) takes this many
            times the calibrated time (> 1: slower).
        decode_slowdown: the rest of each step (constant, per-request, decoding tokens, KV reads) takes
            this many times the calibrated time.
        kv_cache_gib, max_num_seqs, max_num_batched_tokens: the replica's own engine settings
            (``None``: the cluster's engine's).
        drift: ``(from_s, factor)`` pairs in time order: from ``from_s`` seconds of the cluster's clock
            on, both parts take ``factor`` times longer still (1: back to the replica's own speed). A
            step takes the factor in force when it starts.
    """

    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0
    kv_cache_gib: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    drift: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.prefill_slowdown > 0 and self.decode_slowdown > 0):
            raise ValueError("slowdowns must be > 0")
        times = [t for t, _ in self.drift]
        if times != sorted(times) or any(f <= 0 for _, f in self.drift):
            raise ValueError("drift must be (time, factor > 0) pairs in time order")

    def engine(self, base: EngineConfig) -> EngineConfig:
        """``base`` with this replica's own settings."""
        own = {k: v for k, v in (("kv_cache_gib", self.kv_cache_gib), ("max_num_seqs", self.max_num_seqs),
                                 ("max_num_batched_tokens", self.max_num_batched_tokens)) if v is not None}
        return replace(base, **own) if own else base

    def drift_at(self, t: float) -> float:
        """The drift factor in force at ``t``."""
        i = bisect.bisect_right([s for s, _ in self.drift], t)
        return self.drift[i - 1][1] if i else 1.0

    def slowdowns_at(self, t: float) -> tuple[float, float]:
        """``(prefill, decode)`` slowdowns in force at ``t``."""
        f = self.drift_at(t)
        return self.prefill_slowdown * f, self.decode_slowdown * f

    def next_change(self, t: float) -> float:
        """The first drift time after ``t`` (inf: none)."""
        return next((s for s, _ in self.drift if s > t), math.inf)


class ReplicaSim(SimBackend):
    """One replica: the simulator backend taking requests as the router sends them, on the cluster's clock.

    :meth:`open` starts it with its first request, :meth:`submit` adds the later ones at their
    arrival, :meth:`run_until` serves up to a time, answering the scheduler's decisions with
    ``policy``.
    """

    def __init__(self, name: str, engine: EngineConfig, config: SchedulerConfig,
                 profile: str | Path | None = None, spec: ReplicaSpec | None = None,
                 admission_slos: Mapping[str, float] | None = None) -> None:
        self.spec = spec or ReplicaSpec()
        super().__init__(self.spec.engine(engine), profile)
        self.name = name
        self.config = config
        self.admission_slos = dict(admission_slos or {})
        #: The cluster's next event: the engine runs no further than the first step that reaches it.
        self.horizon = math.inf
        self.opened = False
        #: ``(request_id, finished)`` for each first token (False) and finish (True), when recorded.
        self.events: list[tuple[str, bool]] | None = None
        #: The clock of each of ``events``, when recorded (a router that reads the clock needs it).
        self.event_times: list[float] | None = None
        #: vLLM's request-level histograms' sums and counts, kept at each finish (:meth:`metrics`).
        self._served: dict[str, float] = dict.fromkeys(_SERVED_KEYS, 0.0)
        self.prefill_scale, self.decode_scale = self.spec.slowdowns_at(0.0)

    @property
    def next_arrival(self) -> float:
        # a drift time is an event too: the steps after it run at the new speed
        return min(super().next_arrival, self.horizon, self.spec.next_change(self.clock))

    def _advance_engine(self, adv: Any) -> None:
        self.prefill_scale, self.decode_scale = self.spec.slowdowns_at(self.clock)
        super()._advance_engine(adv)

    def metrics(self) -> dict[str, Any]:
        """What this replica's vLLM would publish at ``/metrics`` now, under vLLM's metric names:
        ``vllm:cache_config_info`` (its labels ``num_gpu_blocks`` and ``block_size``), the requests
        running and waiting (the core's held requests count as waiting), the KV usage, and the sums
        and counts of the request-level histograms (queue, prefill, decode time; prompt and generation
        tokens) with the prefix cache's hit tokens, over the requests finished so far (vLLM observes
        the histograms at a request's finish; its hit counter moves at each step, here at the finish)."""
        e = self.engine_config
        engine = self.engine
        running = engine.num_running if self.opened else 0
        return {"vllm:cache_config_info": {"num_gpu_blocks": e.num_kv_blocks, "block_size": e.block_size},
                "vllm:num_requests_running": running,
                "vllm:num_requests_waiting": max(0, self.in_flight - running),
                "vllm:kv_cache_usage_perc": engine.kv_usage if self.opened else 0.0,
                **self._served}

    @property
    def in_flight(self) -> int:
        """Requests routed here and not finished (the router's load)."""
        return self.in_system + (len(self._pending) - self._next) if self.opened else 0

    def submit(self, request: Request) -> None:
        """``request`` arrives now (its ``arrival_time``, the cluster's clock); the first one routed
        here starts the replica (an empty engine, a new core and policy)."""
        if self.opened:
            self._catch_up(request)
            super().submit(request)
            return
        self.start(Workload(f"replica-{self.name}", (request,)), self.config)
        self.opened = True
        if self.admission is not None:  # a new replica: idle until this arrival
            self.clock = max(self.clock, float(request.arrival_time))
            self._admit_arrivals()

    def _catch_up(self, request: Request) -> None:
        """Under an admission rule the replica decides at the arrival: an idle replica whose clock is
        behind it moves to it (as its next step would), so that :meth:`rejected` answers at once."""
        if self.admission is not None and self.clock < request.arrival_time and not self.has_work:
            self.clock = float(request.arrival_time)

    def rejected(self, request_id: str) -> bool:
        """Whether this replica's admission rule rejected ``request_id`` at its arrival."""
        t = self._timelines.get(request_id)
        return t is not None and t.outcome == "rejected"

    def run_until(self, t: float) -> None:
        """Serve until the clock reaches ``t`` (the step that crosses it included) or nothing is left:
        before every engine step the scheduler plans a round with its own policy, as it serves."""
        self.horizon = t
        while self.opened and self.has_work and self.clock < t:
            runtime = self.runtime
            assert runtime is not None
            self.release(runtime.plan(self.clock, self.free_slots(), self.view))
            if self.done:
                break
            self.advance()

    def timelines_if_open(self) -> list[RequestTimeline]:
        return self.timelines() if self.opened else []

    def _record_tokens(self, request_id: str, new_tokens: int, finished: bool, now: float,
                       adv: Any) -> None:
        events, times = self.events, self.event_times
        if events is not None:
            t = self._timelines.get(request_id)
            if t is not None and new_tokens and math.isnan(t.first_token):
                events.append((request_id, False))
                if times is not None:
                    times.append(now)
        super()._record_tokens(request_id, new_tokens, finished, now, adv)
        if finished:
            self._observe_finish(self._timelines[request_id])
            if events is not None:
                events.append((request_id, True))
                if times is not None:
                    times.append(now)

    def _observe_finish(self, t: RequestTimeline) -> None:
        served = self._served
        served["vllm:request_queue_time_seconds_sum"] += t.first_scheduled - t.arrival
        served["vllm:request_prefill_time_seconds_sum"] += t.first_token - t.first_scheduled
        served["vllm:request_decode_time_seconds_sum"] += t.finish - t.first_token
        served["vllm:request_prompt_tokens_sum"] += t.prompt_len
        served["vllm:request_generation_tokens_sum"] += t.tokens
        served["vllm:prefix_cache_hits_total"] += t.prefix_hit_tokens
        served["vllm:request_success_total"] += 1


#: The request-level sums :meth:`ReplicaSim.metrics` publishes (vLLM's names; ``_sum`` of a histogram,
#: ``vllm:request_success_total`` its count).
_SERVED_KEYS = ("vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
                "vllm:request_decode_time_seconds_sum", "vllm:request_prompt_tokens_sum",
                "vllm:request_generation_tokens_sum", "vllm:prefix_cache_hits_total",
                "vllm:request_success_total")


@dataclass
class ClusterResult:
    """One workload served by the cluster under one router.

    Attributes:
        router: the router's name; ``replicas``: how many.
        metrics: :func:`~feather_env.serving_metrics.serving_metrics` over every request
            (``output_throughput``, ``prefix_hit_rate``, latencies, ...), on the shared clock.
        requests_per_replica: requests each replica served, replica order.
        router_state: the router's counters (:meth:`ReplicaRouter.state`).
        wall_s: how long the simulation took.
        per_replica: per replica, replica order (:func:`replica_breakdown`): its requests, prompt and
            prefix-hit tokens, mean queueing delay, and with ``goodput`` its good requests and its misses
            by cause (TTFT, TPOT).
        routed: ``(arrival time, replica)`` of every request, in arrival order (a routed share over time).
        good_by_slo: with ``also_slos``, the good requests under each of them, in their order.
        met: with ``goodput``, whether each request met it, in the order of ``routed``.
    """

    router: str
    replicas: int
    metrics: dict[str, Any]
    requests_per_replica: list[int]
    router_state: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    per_replica: list[dict[str, float]] = field(default_factory=list)
    routed: list[tuple[float, str]] = field(default_factory=list)
    good_by_slo: list[int] = field(default_factory=list)
    met: list[bool] = field(default_factory=list)

    @property
    def max_over_mean(self) -> float:
        """The busiest replica's requests over the mean (1.0: perfectly even)."""
        counts = self.requests_per_replica
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else math.nan

    def to_dict(self) -> dict[str, Any]:
        keys = ("output_throughput", "request_throughput", "prefix_hit_rate", "duration", "completed",
                "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "p99_e2el_ms")
        return {"router": self.router, "replicas": self.replicas,
                **{k: self.metrics.get(k) for k in keys},
                "requests_per_replica": self.requests_per_replica, "max_over_mean": self.max_over_mean,
                "router_state": self.router_state, "wall_s": self.wall_s}


class ClusterSim:
    """``replicas`` simulated engines, each with a Feather scheduler, behind a router (module docstring).

    Args:
        replicas: how many engine replicas (>= 1).
        engine: each replica's engine (KV cache, batch size, token budget).
        scheduler: each replica's scheduler name (:mod:`scheduler_runtime.schedulers`; ``fcfs`` runs
            as the environment runs it: every arrival released at once, in order).
        profile: the simulator's calibrated profile (default: the bundled one).
        scheduler_overrides: :class:`~scheduler_runtime.schedulers.SchedulerConfig` fields
            (``chunk_size``, ``max_wait``, ...).
        profiles: one :class:`ReplicaSpec` per replica (an unequal fleet; default: every replica
            ``engine`` at the calibrated speed).
        admission_slos: the SLOs (ms, vLLM's ``--goodput`` names) each replica's admission rule reads,
            when ``scheduler`` names one (``~RULE``; module docstring).
        reroute_shed: route a request that a replica's rule shed to another replica (``feather-serve
            --reroute-shed``); False (the default): the rejection stands.

    Raises:
        ValueError: a bad count of replicas or profiles, or a rule that reads SLOs without them.
    """

    def __init__(self, replicas: int, engine: EngineConfig, *, scheduler: str = "feather-heuristic",
                 profile: str | Path | None = None, profiles: Sequence[ReplicaSpec] | None = None,
                 admission_slos: Mapping[str, float] | None = None, reroute_shed: bool = False,
                 **scheduler_overrides: Any) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if profiles is not None and len(profiles) != replicas:
            raise ValueError(f"{len(profiles)} replica profiles for {replicas} replicas")
        config = env_scheduler_config(scheduler, **scheduler_overrides)
        rule = AdmissionRule.parse(config.admission_rule)
        if rule.needs_slos and "ttft" not in (admission_slos or {}):
            raise ValueError(f"the admission rule {rule} reads the TTFT SLO: give admission_slos")
        self.admission_slos = check_slos(admission_slos or {})
        self.reroute_shed = reroute_shed
        self.engine = engine
        self.config = config
        self.scheduler = scheduler
        self.profile = profile
        self.num_replicas = replicas
        self.names = [str(i) for i in range(replicas)]
        self.specs: list[ReplicaSpec] = list(profiles) if profiles is not None else [ReplicaSpec()] * replicas

    def _replicas(self) -> list[ReplicaSim]:
        # each replica's runtime builds its own policy (a stateful one sees only its replica)
        return [ReplicaSim(name, self.engine, self.config, self.profile, spec, self.admission_slos)
                for name, spec in zip(self.names, self.specs, strict=True)]

    def run(self, workload: Workload | Sequence[Request], router: ReplicaRouter,
            hasher: PrefixHasher | None = None, *,
            goodput: Mapping[str, float] | None = None, scrape_s: float = 1.0,
            also_slos: Sequence[Mapping[str, float]] = ()) -> ClusterResult:
        """Serve ``workload`` (arrival times as given) through ``router``.

        ``hasher``: the routing key (default: the replicas' CHT chunk size), computed only for a
        router that reads it. ``goodput``: SLOs in ms (``{"ttft": ..., "e2el": ...}``, vLLM's
        ``--goodput``) for the metrics' ``request_goodput``. ``scrape_s``: how often a router that
        observes the service is handed each replica's metrics (seconds of the clock, at the first
        arrival past it). ``also_slos``: further SLOs (ms, as ``goodput``) whose good requests are
        counted too (:attr:`ClusterResult.good_by_slo`).

        Raises:
            EngineError: a request was not served exactly once with its tokens.
        """
        run = self.serve(workload, router, hasher, goodput=goodput, scrape_s=scrape_s, also_slos=also_slos)
        while (arrival := run.next_arrival()) is not None:
            run.route(router.choose(arrival.hashes, arrival.loads, arrival.avoid, tokens=arrival.tokens))
        return run.finish()

    def serve(self, workload: Workload | Sequence[Request], router: ReplicaRouter,
              hasher: PrefixHasher | None = None, *, goodput: Mapping[str, float] | None = None,
              scrape_s: float = 1.0, record_finishes: bool = False,
              also_slos: Sequence[Mapping[str, float]] = ()) -> ClusterRun:
        """:meth:`run` one arrival at a time, the choice left to the caller (:class:`ClusterRun`):
        ``router`` hears of everything as in :meth:`run` (routings, first tokens, finishes, metrics)
        except that its :meth:`~scheduler_runtime.router.ReplicaRouter.choose` is not called.
        ``record_finishes``: keep each finished request's timeline (:attr:`ClusterRun.finished`)."""
        return ClusterRun(self, workload, router, hasher, goodput=goodput, scrape_s=scrape_s,
                          record_finishes=record_finishes, also_slos=also_slos)


@dataclass
class Arrival:
    """A request at its arrival, the replicas run up to it: what a router chooses with.

    Attributes:
        index: its position in arrival order; ``request``: the request; ``clock``: its arrival time.
        hashes: its chunk hashes (``None`` for a router that does not read them); ``tokens``: its
            prompt's length; ``loads``: each replica's requests in flight (replica name -> count), of
            the replicas it may go to; ``avoid``: the replicas whose admission rule shed it already
            (left out of ``loads``).
    """

    index: int
    request: Request
    clock: float
    hashes: np.ndarray | None
    tokens: int
    loads: dict[str, int]
    avoid: tuple[str, ...] = ()


class ClusterRun:
    """One workload served by a :class:`ClusterSim` one arrival at a time (:meth:`ClusterSim.serve`).

    :meth:`next_arrival` runs every replica up to the next request's arrival (the router hearing of
    the first tokens and finishes before it, and scraping each replica's metrics when due) and returns
    it; :meth:`route` sends it to a replica (the router is told, ``routed``); :meth:`finish` serves
    every replica to its end and returns the :class:`ClusterResult`. :meth:`ClusterSim.run` is this
    loop with the router's own choice, so a caller that routes as the router would reproduces it
    exactly. :meth:`fork` copies the run's whole state (replicas, router, clock) for a look ahead.
    """

    def __init__(self, sim: ClusterSim, workload: Workload | Sequence[Request], router: ReplicaRouter,
                 hasher: PrefixHasher | None = None, *, goodput: Mapping[str, float] | None = None,
                 scrape_s: float = 1.0, record_finishes: bool = False,
                 also_slos: Sequence[Mapping[str, float]] = ()) -> None:
        self.started = time.perf_counter()
        self.also_slos = tuple(also_slos)
        #: (arrival time, replica) of each request routed, in arrival order.
        self.routed: list[tuple[float, str]] = []
        self.requests = sorted(workload, key=lambda r: r.arrival_time)  # stable: queue order on ties
        if hasher is None and router.uses_hashes:
            hasher = PrefixHasher(sim.config.chunk_size or DEFAULT_CHUNK_SIZE)
        self.hasher = hasher
        self.router = router
        self.goodput = goodput
        self.scrape_s = scrape_s
        self.replicas = sim._replicas()
        self.by_name = {r.name: r for r in self.replicas}
        self.tracks = router.tracks_requests
        self.observes = router.observes_service
        self.record_finishes = record_finishes
        #: Timelines of the requests finished since the caller last cleared it (``record_finishes``).
        self.finished: list[RequestTimeline] = []
        self.now = 0.0  # the router's clock, when it reads one
        if self.observes:
            router.clock = self._clock
        if self.tracks or record_finishes:
            for replica in self.replicas:
                replica.events = []
                replica.event_times = [] if self.observes else None
        self.next_scrape = -math.inf
        #: ``(replica, request id)`` of each attempt a replica shed and another replica was tried after.
        self.rerouted: set[tuple[str, str]] = set()
        self.reroute_shed = sim.reroute_shed
        self.i = 0  # the next request to arrive
        self.pending: Arrival | None = None
        self.result: ClusterResult | None = None

    def _clock(self) -> float:
        return self.now

    @property
    def done(self) -> bool:
        """Every request has been routed."""
        return self.i >= len(self.requests) and self.pending is None

    def _tell(self, replica: ReplicaSim) -> None:
        """What the router hears of ``replica``'s first tokens and finishes (and the finishes kept)."""
        events = replica.events or ()
        times = replica.event_times or [math.nan] * len(events)
        router, observes = self.router, self.observes
        for (rid, done), at in zip(events, times, strict=True):
            self.now = at
            if done and self.record_finishes:
                self.finished.append(replica._timelines[rid])
            if not self.tracks:
                continue
            if done:
                if observes:  # its wait before its first step, reported at its end as vLLM's does
                    t = replica._timelines[rid]
                    router.scheduled(rid, t.first_scheduled - t.arrival)
                router.finished(rid, output_tokens=replica._timelines[rid].tokens if observes else None)
            else:
                router.prefilled(rid)
        if replica.events:
            replica.events.clear()
        if replica.event_times:
            replica.event_times.clear()

    def next_arrival(self) -> Arrival | None:
        """The next request at its arrival (the replicas run up to it), or ``None`` when every request
        has been routed. Until it is routed, the same arrival is returned again."""
        if self.pending is not None:
            return self.pending
        if self.i >= len(self.requests):
            return None
        request = self.requests[self.i]
        t = float(request.arrival_time)
        router = self.router
        for replica in self.replicas:
            replica.run_until(t)
            if replica.events is not None:
                self._tell(replica)
        self.now = t
        if self.observes and t >= self.next_scrape:
            for replica in self.replicas:
                router.scraped(replica.name, replica.metrics())
            self.next_scrape = t + self.scrape_s
        loads = {r.name: r.in_flight for r in self.replicas}
        hashes = self.hasher.hash(request.prompt_token_ids) if router.uses_hashes and self.hasher else None
        n = len(request.prompt_token_ids)  # every router gets the length, as the proxy gives it
        self.pending = Arrival(self.i, request, t, hashes, n, loads)
        return self.pending

    def route(self, name: str) -> bool:
        """Send the pending arrival to replica ``name``. Returns False when that replica's admission rule
        shed it and another is left to try: the arrival stays pending, ``name`` avoided (module
        docstring); True when it is done with (served there, or shed by every replica)."""
        arrival = self.pending
        if arrival is None:
            raise RuntimeError("no arrival to route: call next_arrival() first")
        if name not in self.by_name:
            raise ValueError(f"no replica {name!r}")
        if name in arrival.avoid:
            raise ValueError(f"replica {name!r} shed this request already")
        rid = arrival.request.request_id
        self.router.routed(arrival.hashes, name, tokens=arrival.tokens,
                           request_id=rid if self.tracks else None)
        replica = self.by_name[name]
        replica.submit(arrival.request)
        if replica.rejected(rid):
            if self.tracks:  # the attempt is over, as the proxy tells it: no output
                self.router.finished(rid, output_tokens=None)
            avoid = (*arrival.avoid, name)
            loads = {r.name: r.in_flight for r in self.replicas if r.name not in avoid}
            if loads and self.reroute_shed:
                self.rerouted.add((name, rid))
                self.pending = replace(arrival, loads=loads, avoid=avoid)
                return False
        self.routed.append((arrival.clock, name))
        self.pending = None
        self.i += 1
        return True

    def finish(self) -> ClusterResult:
        """Serve every replica to its end (every request must have been routed) and the result.

        Raises:
            EngineError: a request was not served exactly once with its tokens.
        """
        if not self.done:
            raise RuntimeError(f"{len(self.requests) - self.i} requests not routed yet")
        if self.result is not None:
            return self.result
        for replica in self.replicas:
            replica.run_until(math.inf)
            if replica.events is not None:
                self._tell(replica)
            if replica.opened:
                replica.check_complete()
        timelines = self.timelines()
        if len(timelines) != len(self.requests):
            raise RuntimeError(f"{len(self.requests)} requests routed, {len(timelines)} served")
        goodput = self.goodput
        met: list[bool] = []
        if goodput:
            by_id = {t.request_id: t for t in timelines}
            met = [by_id[r.request_id].completed and meets_slos(by_id[r.request_id], goodput)
                   for r in self.requests]
        self.result = ClusterResult(router=self.router.name, replicas=len(self.replicas),
                                    metrics=serving_metrics(timelines, goodput=goodput),
                                    requests_per_replica=[len(self._kept(r)) for r in self.replicas],
                                    router_state=self.router.state(),
                                    wall_s=time.perf_counter() - self.started,
                                    per_replica=[replica_breakdown(self._kept(r), goodput)
                                                 for r in self.replicas],
                                    routed=list(self.routed),
                                    good_by_slo=[sum(1 for t in timelines
                                                     if t.completed and meets_slos(t, slo))
                                                 for slo in self.also_slos],
                                    met=met)
        return self.result

    def stop_arrivals(self) -> None:
        """Serve no further arrivals: the requests that have not arrived (and a pending one not routed)
        are dropped, so that :meth:`finish` serves what was routed to its end (a look ahead's horizon)."""
        self.requests = self.requests[:self.i]
        self.pending = None

    def timelines(self) -> list[RequestTimeline]:
        """Every routed request's timeline so far, replica by replica: one per request (an attempt a
        replica shed before another replica was tried is left out)."""
        return [t for r in self.replicas for t in self._kept(r)]

    def _kept(self, replica: ReplicaSim) -> list[RequestTimeline]:
        timelines = replica.timelines_if_open()
        if not self.rerouted:
            return timelines
        return [t for t in timelines if (replica.name, t.request_id) not in self.rerouted]

    def fork(self) -> ClusterRun:
        """A deep copy of this run (replicas, router, clock, what is pending) sharing only what never
        changes: the requests and their token ids, the hasher. Serving the copy leaves this run as it
        was (a look ahead)."""
        memo: dict[int, Any] = {id(self.requests): self.requests, id(self.hasher): self.hasher}
        for r in self.requests:
            memo[id(r)] = r
        for replica in self.replicas:
            # per-request hash caches: new entries in the copy, the cached values never change
            for cache in (replica._hashes, replica._block_hashes):
                memo[id(cache)] = dict(cache)
            for t in replica._timelines.values():  # a finished request's timeline never changes
                if t.finished_count:
                    memo[id(t)] = t
        for table in ("_young", "_old"):  # ours' prefix table: chunk key (int) -> replica name (str)
            d = getattr(self.router, table, None)
            if isinstance(d, dict):
                memo[id(d)] = dict(d)
        return copy.deepcopy(self, memo)



def replica_breakdown(timelines: Sequence[RequestTimeline],
                      goodput: Mapping[str, float] | None = None) -> dict[str, float]:
    """One replica's service: ``requests``, ``prompt_tokens``, ``hit_tokens`` (its prefix cache's),
    ``mean_queue_s`` (arrival to first scheduled) and ``mean_ttft_s``; with ``goodput`` (ms) ``good``
    and the misses by cause: ``ttft_miss`` (the first token late), ``tpot_miss`` (the first token in
    time, the decode too slow), ``other_miss`` (the rest: unfinished, or another SLO)."""
    done = [t for t in timelines if t.completed]
    out: dict[str, float] = {
        "requests": float(len(timelines)),
        "prompt_tokens": float(sum(t.prompt_len for t in timelines)),
        "hit_tokens": float(sum(t.prefix_hit_tokens for t in timelines)),
        "mean_queue_s": float(np.mean([t.first_scheduled - t.arrival for t in done])) if done else 0.0,
        "mean_ttft_s": float(np.mean([t.ttft for t in done])) if done else 0.0}
    if goodput:
        ttft_ms, tpot_ms = goodput.get("ttft", math.inf), goodput.get("tpot", math.inf)
        good = sum(1 for t in done if meets_slos(t, goodput))
        ttft_miss = sum(1 for t in done if t.ttft * 1000 > ttft_ms)
        tpot_miss = sum(1 for t in done if t.ttft * 1000 <= ttft_ms and t.tpot * 1000 > tpot_ms)
        out.update(good=float(good), ttft_miss=float(ttft_miss), tpot_miss=float(tpot_miss),
                   other_miss=float(len(timelines) - good - ttft_miss - tpot_miss))
    return out


def drift_workload(pool: Workload, n: int, docs_per_replica: int, blocks: int, seed: int) -> Workload:
    """``blocks`` workloads of ``n x docs_per_replica`` documents one after the other (a run that outlasts
    a drift's recovery): ``blocks x n x docs_per_replica`` distinct documents (at most 8 questions
    each), split into consecutive blocks of ``n x docs_per_replica``, each block's questions in a
    random order."""
    docs = distinct_documents(pool, blocks * n * docs_per_replica, seed=seed, max_per_group=8)
    groups = list(docs.groups().values())
    size = n * docs_per_replica
    rng = np.random.default_rng(seed)
    out = []
    for b in range(blocks):
        block = [r for g in groups[b * size:(b + 1) * size] for r in g]
        out += [block[i] for i in rng.permutation(len(block))]
    return Workload(f"{docs.name}/blocks{blocks}", tuple(out))


def distinct_documents(pool: Workload, documents: int, seed: int,
                       max_per_group: int | None = None) -> Workload:
    """``documents`` prefix groups (documents with their questions) of ``pool``, in a random order.

    First every group of ``pool`` once (drawn at random); past that, copies: copy ``k`` of a document
    has its second token replaced by a marker of ``k`` (its first chunk, hence every chunk key,
    differs from the original's), new request ids (``ID#k``) and a new group id. The copies model more
    documents of the same lengths (another tenant's copy of a contract), to load 64 replicas with
    L-Eval's 244 documents. ``max_per_group``: at most this many questions per document (drawn).
    """
    if documents < 1:
        raise ValueError(f"documents must be >= 1, got {documents}")
    groups = list(pool.groups().values())
    rng = np.random.default_rng(seed)
    step = max(r.prefix_group for r in pool) + 1
    picked: list[Request] = []
    remaining, copy = documents, 0
    while remaining > 0:
        order = rng.permutation(len(groups))[:remaining]
        for g in order:
            members = groups[g]
            if max_per_group is not None and len(members) > max_per_group:
                keep = np.sort(rng.choice(len(members), max_per_group, replace=False))
                members = tuple(members[i] for i in keep)
            picked.extend(members if copy == 0 else [_copy(r, copy, step) for r in members])
        remaining -= len(order)
        copy += 1
    picked = [picked[i] for i in rng.permutation(len(picked))]
    return Workload(f"{pool.name}/documents{documents}@{seed}", tuple(picked))


def zipf_documents(pool: Workload, documents: int, requests: int, s: float, seed: int) -> Workload:
    """``requests`` questions over ``documents`` documents of Zipf popularity: the document of rank
    ``k`` (1 = the hottest; ranks drawn at random) is asked with probability ``~ 1 / k**s``.

    The documents are :func:`distinct_documents`' (copies past the pool's own); each request is one of
    its document's questions drawn with replacement (a hot document's questions come back, under new
    ids ``ID~j``), in a random order.
    """
    if requests < 1 or s < 0:
        raise ValueError("requests must be >= 1 and s >= 0")
    docs = list(distinct_documents(pool, documents, seed).groups().values())
    rng = np.random.default_rng(seed + 7919)
    weights = 1.0 / np.arange(1, len(docs) + 1, dtype=float) ** s
    rank_of = rng.permutation(len(docs))  # document i has rank rank_of[i] + 1
    p = weights[rank_of]
    picks = rng.choice(len(docs), size=requests, p=p / p.sum())
    used: dict[str, int] = {}
    out: list[Request] = []
    for g in picks:
        members = docs[g]
        r = members[int(rng.integers(len(members)))]
        j = used.get(r.request_id, 0)
        used[r.request_id] = j + 1
        out.append(r if j == 0 else Request(f"{r.request_id}~{j}", r.prompt_token_ids, r.prefix_group,
                                            r.output_len, r.arrival_time, r.source, r.meta))
    return Workload(f"{pool.name}/zipf{s:g}-documents{documents}-requests{requests}@{seed}", tuple(out))


def _copy(request: Request, k: int, step: int) -> Request:
    ids = np.array(request.prompt_token_ids)
    pos = min(1, len(ids) - 1)
    marker = 3 + k % 997
    ids[pos] = marker if ids[pos] != marker else marker + 1
    return Request(f"{request.request_id}#{k}", ids, request.prefix_group + k * step, request.output_len,
                   request.arrival_time, request.source, request.meta)
