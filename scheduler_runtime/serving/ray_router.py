"""The Ray Serve request routers of ``feather-serve --replicas N --router prefix`` and ``prefix-learned``.

:class:`PrefixRequestRouter` is a ``ray.serve.request_router.RequestRouter`` around the engine-free
:class:`~scheduler_runtime.router.PrefixAffinityRouter` (the code the simulator runs). Ray Serve
builds it in the process that holds the engine deployment's handle (the ingress) and copies this
module there by value, so the module keeps to the router; its instances register with
:data:`scheduler_runtime.serving.cluster_base.LIVE_ROUTERS`, imported at run time, for ``/metrics``.

:class:`LearnedRequestRouter` is the same around :class:`~scheduler_runtime.learned_router.LearnedRouter`,
fed as the proxy feeds it: each engine replica's ``/metrics``, parsed, comes in its Ray routing stats
(``record_routing_stats``, every ``request_routing_stats_period_s``), handed to ``scraped`` when it
changes; the ingress, which relays each response, tells it each request's first token and its end with
its output tokens (:meth:`LearnedRequestRouter.relayed`), under the ingress's own request id.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
from ray.serve.request_router import RequestRouter

from scheduler_runtime.learned_router import LearnedRouter
from scheduler_runtime.router import PrefixAffinityRouter

__all__ = ["LearnedRequestRouter", "PrefixRequestRouter"]


class PrefixRequestRouter(RequestRouter):
    """``choose_replicas`` ranks first the replica :class:`PrefixAffinityRouter` picks, then the others.

    The request's prefix hashes come in its ``route`` keyword argument (the ingress computes them);
    ``avoid`` lists replicas that just failed it. A replica's load is the number of requests this
    router sent it that have not completed (Ray's routed/completed callbacks). Ray sends the request
    to the first rank's replica unless its queue is full (``max_ongoing_requests``), else to the
    least loaded of the second rank. No FIFO hand-off (Ray's ``FIFOMixin``): a replica chosen for a
    request serves that request. ``request_router_kwargs`` are :class:`PrefixAffinityRouter`'s
    (:meth:`ClusterConfig.router_kwargs <scheduler_runtime.serving.cluster_base.ClusterConfig.router_kwargs>`:
    the load bound, the chunk size and each replica's KV tokens for its cache model, ``None`` where the
    engine arguments do not tell them; every replica of the deployment is started with the same ones).
    """

    def _router(self, **kwargs: Any) -> PrefixAffinityRouter:
        return PrefixAffinityRouter(**kwargs)

    def initialize_state(self, **kwargs: Any) -> None:
        from scheduler_runtime.serving import cluster_base  # the real module (this one is a copy)

        self.affinity = self._router(**kwargs)
        self.in_flight: Counter[str] = Counter()
        self._hashes: dict[str, np.ndarray] = {}
        self.decision_seconds = 0.0
        self.decisions = 0
        cluster_base.LIVE_ROUTERS.append(self)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None
                              ) -> list[list[Any]]:
        t0 = time.perf_counter()
        kwargs = pending_request.kwargs if pending_request is not None else {}
        route = kwargs.get("route")
        hashes = np.asarray(route, dtype=np.uint64) if route else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        loads = {rid: self.in_flight[rid] for rid in by_id}
        choice = self.affinity.choose(hashes, loads, set(kwargs.get("avoid") or ()),
                                      tokens=self._tokens(pending_request))
        if pending_request is not None and hashes is not None:
            self._hashes[pending_request.metadata.internal_request_id] = hashes
        rest = [r for rid, r in by_id.items() if rid != choice]
        self.decision_seconds += time.perf_counter() - t0
        self.decisions += 1
        return [[by_id[choice]], rest] if rest else [[by_id[choice]]]

    @staticmethod
    def _tokens(pending_request: Any) -> int | None:
        """The prompt's tokens, where the ingress gives them (``tokens``: ``prefix-learned`` only)."""
        tokens = pending_request.kwargs.get("tokens") if pending_request is not None else None
        return int(tokens) if tokens else None

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] += 1
        self.affinity.routed(self._hashes.pop(pending_request.metadata.internal_request_id, None), rid)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        self._hashes.pop(internal_request_id, None)
        if self.in_flight[rid] > 0:
            self.in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id.unique_id, None)
        self.affinity.forget(replica_id.unique_id)

    def stats(self) -> dict[str, float]:
        """The router's decisions (``affinity``, ``spilled``, ``new``), table size and time spent."""
        return {**self.affinity.state(), "decisions": self.decisions,
                "decision_seconds": self.decision_seconds}


class LearnedRequestRouter(PrefixRequestRouter):
    """:class:`PrefixRequestRouter` around :class:`LearnedRouter` (``--router prefix-learned``; see the
    module docstring). ``request_router_kwargs`` are :class:`LearnedRouter`'s (told no KV size).

    What each engine replica's routing stats carry (``EngineReplica.record_routing_stats``):
    ``{"seq": N, "metrics": {...}}``, ``metrics`` as
    :func:`scheduler_runtime.serving.vllm_metrics.parse_vllm_metrics` reads the replica's exposition.
    A request's ``rid`` and ``tokens`` keyword arguments (the ingress sets them) name it and give its
    prompt's length. Ray runs a router in an event loop of its own; :meth:`relayed`, called from the
    ingress's, hands the call over to it.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._seen_stats: dict[str, Any] = {}  # replica id -> the last routing stats' seq read
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop Ray runs this router in
        super().initialize_state(**kwargs)

    def _router(self, **kwargs: Any) -> PrefixAffinityRouter:
        return LearnedRouter(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None
                              ) -> list[list[Any]]:
        self._loop = asyncio.get_running_loop()
        for replica in candidate_replicas:
            self._read_stats(replica.replica_id.unique_id, getattr(replica, "routing_stats", None))
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _read_stats(self, rid: str, stats: Any) -> None:
        """Hand a replica's metrics to the router once per new reading (its ``seq``)."""
        if not isinstance(stats, dict) or "metrics" not in stats:
            return
        if self._seen_stats.get(rid) == stats.get("seq"):
            return
        self._seen_stats[rid] = stats.get("seq")
        self.affinity.scraped(rid, stats["metrics"])

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] += 1
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        self.affinity.routed(hashes, rid, tokens=self._tokens(pending_request),
                             request_id=pending_request.kwargs.get("rid"))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._seen_stats.pop(replica_id.unique_id, None)

    def relayed(self, request_id: str, *, first_token: bool = False, finished: bool = False,
                output_tokens: int | None = None, queued_s: float | None = None) -> None:
        """The ingress saw request ``request_id``'s first token, or its end (with its output tokens, where
        known, and the wait before its first step that its replica reported, ``queued_s``): told to the
        router in the router's own loop (unknown ids are ignored)."""
        def tell() -> None:
            if first_token:
                self.affinity.prefilled(request_id)
            if queued_s is not None:
                self.affinity.scheduled(request_id, queued_s)
            if finished:
                self.affinity.finished(request_id, output_tokens=output_tokens)

        loop = self._loop
        if loop is None or loop.is_closed() or _running_in(loop):
            tell()
        else:
            loop.call_soon_threadsafe(tell)

    def estimates(self) -> dict[str, dict[str, Any]]:
        """What the router learned of each replica, by Ray's replica id."""
        return self.affinity.estimates()


def _running_in(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs in this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return getattr(loop, "_thread_id", None) == threading.get_ident()
