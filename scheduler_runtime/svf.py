"""Smallest Volume First (SVF): volumes, the length-ordered queues, and the KV peak budget.

SVF (Kong, Qi, Ye, Zhou, arXiv 2606.22327) admits waiting requests in ascending KV *volume*
while the KV capacity holds their *peak*. For a request with prompt ``s`` and output ``o``:

* ``volume(s, o) = s*o + (o^2 + o)/2``: the area of its KV footprint over its decode life
  (it holds ``s + t`` tokens at decode step ``t = 1..o``);
* ``peak(s, o) = s + o``: the KV tokens it holds at its last step.

The orderings built on these (all ascending, earliest arrival first among ties):

=============  =======================================================
``sjf``        predicted output length (shortest job first)
``svf``        volume with the predicted output length
``svf-1bit``   volume with the proxy length of the predicted class
               (short ``o <= theta`` or long), see
               :meth:`~scheduler_runtime.predictor.OutputLengthPredictor.proxy_length`
``oracle-*``   the same keys with the true output length
=============  =======================================================

:class:`KeyQueue` is the queue behind every one of them: a min-heap with lazy deletion, so
an admitted or aborted request costs O(1) now and one skipped pop later. :class:`KVBudget`
is SVF's admission check: the tokens the admitted set will hold at its peak, against the
KV capacity. Nothing here knows about vLLM.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

__all__ = ["KVBudget", "KeyQueue", "peak", "volume"]


def volume(prompt_len: float, output_len: float) -> float:
    """SVF volume ``s*o + (o^2 + o)/2`` (token x steps) of a request."""
    s, o = float(prompt_len), float(output_len)
    return s * o + (o * o + o) / 2.0


def peak(prompt_len: float, output_len: float) -> float:
    """KV tokens a request holds at its last decode step: ``s + o``."""
    return float(prompt_len) + float(output_len)


class KeyQueue:
    """Requests ordered by an ascending key (ties: insertion order), with O(1) removal.

    Removal only forgets the id; its heap entry is skipped when it reaches the top. The heap
    is rebuilt when stale entries outnumber live ones, so memory stays O(live).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}  # id -> seq of its live heap entry
        self._seq = itertools.count()

    def push(self, request_id: str, key: float) -> None:
        """Add ``request_id`` (replacing its key if it is already queued)."""
        seq = next(self._seq)
        self._live[request_id] = seq
        heapq.heappush(self._heap, (float(key), seq, request_id))

    def discard(self, request_id: str) -> bool:
        """Forget ``request_id``; False if it was not queued."""
        if self._live.pop(request_id, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)
        return True

    def peek(self) -> str | None:
        """The id with the smallest key (stays queued); None when empty."""
        heap, live = self._heap, self._live
        while heap:
            _, seq, rid = heap[0]
            if live.get(rid) == seq:
                return rid
            heapq.heappop(heap)
        return None

    def pop(self) -> str | None:
        """Remove and return the id with the smallest key; None when empty."""
        rid = self.peek()
        if rid is not None:
            heapq.heappop(self._heap)
            del self._live[rid]
        return rid

    def ordered(self) -> Iterator[str]:
        """Every queued id in key order (a sorted copy; O(n log n), for tests and ranking)."""
        return (rid for _, seq, rid in sorted(self._heap) if self._live.get(rid) == seq)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)


class KVBudget:
    """SVF's peak check: the admitted set's KV tokens at their peak must fit the capacity.

    Each admitted request is charged its *footprint* (what it adds to the KV cache at its
    peak: the prompt tokens not already held by the batch, plus its output when the check
    counts outputs); the charge is returned when it finishes or is aborted. Summing peaks is
    an upper bound of SVF's forward check (which looks at each future completion time): it
    never admits a set the forward check would refuse, and costs O(1) per decision.

    Args:
        capacity: KV capacity in tokens; ``None`` disables the check.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"KV capacity must be >= 1 token or None, got {capacity}")
        self.capacity = capacity
        self.used = 0.0
        self._charged: dict[str, float] = {}

    def fits(self, footprint: float) -> bool:
        """Whether ``footprint`` more tokens fit. An empty set always admits one request, so
        a request larger than the whole cache is served alone instead of never."""
        if self.capacity is None or not self._charged:
            return True
        return self.used + footprint <= self.capacity

    def charge(self, request_id: str, footprint: float) -> None:
        if request_id in self._charged:
            raise ValueError(f"request {request_id!r} is already charged")
        self._charged[request_id] = footprint
        self.used += footprint

    def release(self, request_id: str) -> None:
        """Return a request's charge (no-op if it holds none)."""
        footprint = self._charged.pop(request_id, None)
        if footprint is not None:
            self.used -= footprint
            if not self._charged:
                self.used = 0.0  # no float drift across a long run

    @property
    def fraction(self) -> float:
        """Used share of the capacity (0 with no capacity set)."""
        return self.used / self.capacity if self.capacity else 0.0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._charged

    def __len__(self) -> int:
        return len(self._charged)
