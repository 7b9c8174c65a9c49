"""What one simulated engine step did: :class:`StepResult`, with a :class:`ScheduledEntry` per request.

The simulator's counterpart of what vLLM's scheduler hands on and gets back in a step:
``SchedulerOutput`` (``v1/core/sched/output.py``: scheduled requests and token counts, preempted
requests), the persistent batch's order (``InputBatch.req_ids``, ``v1/worker/gpu_input_batch.py``)
and what ``Scheduler.update_from_output`` reports (first tokens, finished requests).

``ScheduledEntry.is_prefill`` is False exactly when the entry computes one token, its request's
latest sampled one (the shape of a decode); everything else computes prompt tokens or, after a
resume, replays prompt + output tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class ScheduledEntry:
    """One scheduled request of a step, in persistent-batch order."""

    request_id: str
    num_tokens: int  # tokens scheduled this step (1 for a decode)
    num_computed: int  # tokens already in its KV cache before this step
    block_ids: tuple[int, ...]  # its KV blocks (physical ids) during this step
    is_prefill: bool  # computing prompt (or resumed) tokens rather than one decode token


@dataclass(eq=False)
class StepResult:
    """What one engine step (or a fast-forwarded decode stretch) did.

    The per-request views are built on first access from a snapshot taken in scheduling order
    during the step (block lists are append-only while a request runs, so a list and a length
    pin its blocks); a consumer that reads only ``admitted`` / ``finished`` pays nothing for them.
    """

    admitted: list[tuple[str, int]]  # newly scheduled (or resumed) requests and their hit tokens
    preempted: list[str]
    finished: list[str]
    first_token: list[str]
    num_steps: int = 1  # >1 for a fast-forwarded decode stretch (see SimEngine.advance_decode)
    # Snapshot, in scheduling order (running requests, then admissions), and the batch order.
    _request_ids: list[str] = field(default_factory=list, repr=False)
    _num_scheduled: list[int] = field(default_factory=list, repr=False)
    _num_computed: list[int] = field(default_factory=list, repr=False)
    _block_ids: list[list[int]] = field(default_factory=list, repr=False)
    _is_prefill: list[bool] = field(default_factory=list, repr=False)
    _batch_order: list[int] = field(default_factory=list, repr=False)  # scheduling index of each slot
    _block_size: int = field(default=1, repr=False)
    _entries: list[ScheduledEntry] | None = field(default=None, repr=False)

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        """(request id, tokens) in the scheduler's order (vLLM's ``num_scheduled_tokens``)."""
        return list(zip(self._request_ids, self._num_scheduled, strict=True))

    @property
    def entries(self) -> list[ScheduledEntry]:
        """The scheduled requests in persistent-batch order (of the first step of a stretch)."""
        if self._entries is None:
            block_size = self._block_size
            ids, num_scheduled, num_computed = self._request_ids, self._num_scheduled, self._num_computed
            block_ids, is_prefill = self._block_ids, self._is_prefill
            self._entries = [
                ScheduledEntry(ids[k], num_scheduled[k], num_computed[k],
                               tuple(block_ids[k][: -(-(num_computed[k] + num_scheduled[k]) // block_size)]),
                               is_prefill[k])
                for k in self._batch_order
            ]
        return self._entries

    def _in_batch_order(self, values: list[T]) -> list[T]:
        return [values[k] for k in self._batch_order]

    @property
    def request_ids(self) -> list[str]:
        """Scheduled request ids in persistent-batch order."""
        return self._in_batch_order(self._request_ids)

    @property
    def num_scheduled(self) -> list[int]:
        """Tokens scheduled per request (persistent-batch order; per step of a stretch)."""
        return self._in_batch_order(self._num_scheduled)

    @property
    def num_computed(self) -> list[int]:
        """Tokens already cached per request before the (first) step, persistent-batch order."""
        return self._in_batch_order(self._num_computed)

    @property
    def is_prefill(self) -> list[bool]:
        """Per request, persistent-batch order: not a decode (see ScheduledEntry.is_prefill)."""
        return self._in_batch_order(self._is_prefill)

    @property
    def first_block(self) -> list[int]:
        """Per request, persistent-batch order: its first KV block (shared by a shared cached prefix)."""
        return [self._block_ids[k][0] for k in self._batch_order]

    @property
    def total_tokens(self) -> int:
        """Tokens scheduled in one step."""
        return sum(self._num_scheduled)
