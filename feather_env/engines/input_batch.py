"""The persistent batch: which slot each scheduled request occupies, step after step.

Mirrors (paths inside the ``vllm`` package, vLLM 0.32) ``v1/worker/gpu_input_batch.py``
``InputBatch.add_request`` / ``remove_request`` / ``condense`` as ``v1/worker/gpu_model_runner.py``
``GPUModelRunner._update_states`` drives them (the V1 model runner the CPU worker uses; vLLM picks
it on CPU because Triton has no CPU backend there). Each step removes the finished and the
unscheduled requests, adds the new requests, then the scheduled requests not in the batch
(running, then resumed), each into the lowest free slot first, else at the end, then moves the
last requests into the remaining holes. The CPU attention builder
(``v1/attention/backends/cpu_attn.py``) leaves ``reorder_batch_threshold`` at ``None``
(``v1/attention/backend.py``), so the batch is not reordered further.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from feather_env.engines.request import SimRequest


class InputBatch:
    """The requests by persistent-batch slot (``None`` for a hole until the batch is condensed)."""

    def __init__(self) -> None:
        self.requests: list[SimRequest | None] = []

    def __len__(self) -> int:
        return len(self.requests)

    def update_states(self, finished: Iterable[SimRequest], scheduled: Sequence[SimRequest],
                      num_from_running: int, new_requests: Iterable[SimRequest],
                      resumed_requests: Iterable[SimRequest], step: int) -> None:
        """One step's batch update: ``finished`` are the requests finished (or aborted) since the last
        step, ``scheduled`` this step's requests in scheduling order (the first ``num_from_running``
        of them were running), each marked with ``scheduled_step == step``."""
        requests = self.requests
        holes: list[int] = []
        # Finished (and aborted) requests since the last step, then the unscheduled ones.
        for request in finished:
            if request.batch_index >= 0:
                holes.append(request.batch_index)
                requests[request.batch_index] = None
                request.batch_index = -1
        for index, request in enumerate(requests):
            if request is not None and request.scheduled_step != step:
                holes.append(index)
                requests[index] = None
                request.batch_index = -1
        # Adds fill the lowest hole first (BatchUpdateBuilder.pop_removed), else append:
        # new requests, then scheduled running requests not in the batch, then resumed ones.
        heapq.heapify(holes)
        for request in new_requests:
            self._add_request(request, holes)
        for index in range(num_from_running):
            request = scheduled[index]
            if request.batch_index < 0:
                self._add_request(request, holes)
        for request in resumed_requests:
            self._add_request(request, holes)
        if holes:
            self._condense(sorted(holes, reverse=True), len(requests) - len(holes))

    def _add_request(self, request: SimRequest, holes: list[int]) -> None:
        """InputBatch.add_request: into the lowest hole, else at the end."""
        requests = self.requests
        if holes:
            index = heapq.heappop(holes)
            requests[index] = request
        else:
            index = len(requests)
            requests.append(request)
        request.batch_index = index

    def _condense(self, empty: list[int], num_requests: int) -> None:
        """InputBatch.condense: move the last requests into the lowest holes (``empty``: descending)."""
        requests = self.requests
        last = num_requests + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            hole = empty[-1]
            if hole >= last:
                break
            empty.pop()
            request = requests[last]
            requests[hole] = request
            requests[last] = None
            request.batch_index = hole  # type: ignore[union-attr]
            last -= 1
        del requests[num_requests:]

    def schedule_order(self) -> list[int]:
        """Each slot's index in the last step's scheduling order."""
        return [request.schedule_index for request in self.requests]  # type: ignore[union-attr]

    def request_ids(self) -> list[str | None]:
        """Request ids by slot (None for holes; none after condense)."""
        return [None if request is None else request.request_id for request in self.requests]
