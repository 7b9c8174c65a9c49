"""The Ray Serve request router of ``feather-serve --replicas N --router prefix``.

:class:`PrefixRequestRouter` is a ``ray.serve.request_router.RequestRouter`` around the engine-free
:class:`~scheduler_runtime.router.PrefixAffinityRouter` (the code the simulator runs). Ray Serve
builds it in the process that holds the engine deployment's handle (the ingress) and copies this
module there by value, so the module keeps to the router; its instances register with
:data:`scheduler_runtime.serving.cluster_base.LIVE_ROUTERS`, imported at run time, for ``/metrics``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
from ray.serve.request_router import RequestRouter

from scheduler_runtime.router import PrefixAffinityRouter

__all__ = ["PrefixRequestRouter"]


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

    def initialize_state(self, **kwargs: Any) -> None:
        from scheduler_runtime.serving import cluster_base  # the real module (this one is a copy)

        self.affinity = PrefixAffinityRouter(**kwargs)
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
        choice = self.affinity.choose(hashes, loads, set(kwargs.get("avoid") or ()))
        if pending_request is not None and hashes is not None:
            self._hashes[pending_request.metadata.internal_request_id] = hashes
        rest = [r for rid, r in by_id.items() if rid != choice]
        self.decision_seconds += time.perf_counter() - t0
        self.decisions += 1
        return [[by_id[choice]], rest] if rest else [[by_id[choice]]]

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
