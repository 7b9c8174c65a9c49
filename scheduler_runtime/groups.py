"""Prefix groups: the requests that share a leading prefix (an L-Eval document), and which are in flight.

Continuous batching admits requests one by one, but what fills the KV cache is *documents*: every
question of a document shares its KV blocks, and each further document in flight takes a
document's worth of blocks that the prefix cache can no longer keep for the documents that wait.
So the batching core (:mod:`scheduler_runtime.batching`) can decide admission at the granularity
of groups: requests of a group already in flight join it freely, and a request that would open a
new group is the decision.

A request's *group key* is its CHT hash at depth ``group_chunks`` (the first ``group_chunks``
chunks of its prompt; a shorter prompt's key is its whole prompt's hash), so two requests are in
one group exactly when their first ``group_chunks`` chunks are equal. The structure keeps, per
group, its waiting (held) requests in arrival order and its count of *active* ones (released, not
finished): a group is *in flight* while that count is positive.

Requests that share nothing. ShareGPT-like traffic has no shared prefix: every request is a group
of one, and a cap on the groups in flight would cap the requests in flight. A request *shares
nothing* when no other live request has its key, its key is not among the last :attr:`window`
arrivals' keys, and fewer than half of those arrivals repeated a key (the workload itself does
not share). The batching core never holds such a request on account of its group: the group
decision is only asked about requests whose group has (or, on this workload, is expected to have)
other members. The rate is measured over arrivals, so an L-Eval server, where most questions
follow another of their document, treats a document's first question as the opener of a group,
and a ShareGPT server never does.

Every operation is O(1) (amortized) except :meth:`waiting_groups_out_of_flight`, which walks the
waiting groups that are not in flight (the cached-first choice reads them once per round).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = ["PrefixGroups"]


class PrefixGroups:
    """Waiting and active requests by group key (see the module docstring).

    Args:
        window: how many recent arrivals the sharing rate is measured over.
    """

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._key: dict[str, int] = {}
        self._waiting: dict[int, dict[str, None]] = {}  # key -> waiting ids, arrival order
        self._active: dict[int, int] = {}  # key -> active requests (> 0)
        # waiting groups that are in flight: their requests join without a decision
        self._flight_waiting: dict[int, None] = {}
        self._recent: deque[tuple[int, bool]] = deque()
        self._recent_count: dict[int, int] = {}
        self._repeats = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def arrive(self, request_id: str, key: int) -> None:
        """A request of group ``key`` arrived (it waits)."""
        repeat = key in self._recent_count or key in self._waiting or key in self._active
        self._key[request_id] = key
        members = self._waiting.get(key)
        if members is None:
            members = self._waiting[key] = {}
        members[request_id] = None
        if key in self._active:
            self._flight_waiting[key] = None
        recent = self._recent
        recent.append((key, repeat))
        self._recent_count[key] = self._recent_count.get(key, 0) + 1
        self._repeats += repeat
        if len(recent) > self.window:
            old, old_repeat = recent.popleft()
            self._repeats -= old_repeat
            left = self._recent_count[old] - 1
            if left:
                self._recent_count[old] = left
            else:
                del self._recent_count[old]

    def release(self, request_id: str) -> None:
        """A waiting request was released: its group is in flight."""
        key = self._unwait(request_id)
        self._active[key] = self._active.get(key, 0) + 1
        if key in self._waiting:
            self._flight_waiting[key] = None

    def finish(self, request_id: str) -> None:
        """An active request left (finished or aborted)."""
        key = self._key.pop(request_id)
        left = self._active[key] - 1
        if left:
            self._active[key] = left
        else:
            del self._active[key]
            self._flight_waiting.pop(key, None)

    def remove(self, request_id: str) -> None:
        """A waiting request was aborted."""
        self._unwait(request_id)
        del self._key[request_id]

    def _unwait(self, request_id: str) -> int:
        key = self._key[request_id]
        members = self._waiting[key]
        del members[request_id]
        if not members:
            del self._waiting[key]
            self._flight_waiting.pop(key, None)
        return key

    # -- queries ----------------------------------------------------------------------------------
    def key_of(self, request_id: str) -> int:
        return self._key[request_id]

    def in_flight(self, request_id: str) -> bool:
        """Whether the request's group has an active request."""
        return self._key[request_id] in self._active

    def shares_nothing(self, request_id: str) -> bool:
        """Whether the request shares its group with no one, on a workload that does not share
        (module docstring); only for a waiting request."""
        key = self._key[request_id]
        if len(self._waiting[key]) > 1 or key in self._active or self._recent_count.get(key, 0) > 1:
            return False
        return 2 * self._repeats < len(self._recent)

    @property
    def sharing_rate(self) -> float:
        """Fraction of the recent arrivals whose key was already known."""
        return self._repeats / len(self._recent) if self._recent else 0.0

    @property
    def num_in_flight(self) -> int:
        """Groups with an active request."""
        return len(self._active)

    @property
    def num_waiting_groups(self) -> int:
        """Groups with a waiting request."""
        return len(self._waiting)

    def waiting_size(self, key: int) -> int:
        """Waiting requests of group ``key``."""
        members = self._waiting.get(key)
        return len(members) if members else 0

    def first_waiting_in_flight(self) -> str | None:
        """The oldest waiting request of some group in flight (None when there is none)."""
        for key in self._flight_waiting:
            return next(iter(self._waiting[key]))
        return None

    def waiting_in_flight(self) -> int:
        """Waiting requests of groups in flight."""
        waiting = self._waiting
        return sum(len(waiting[k]) for k in self._flight_waiting)

    def waiting_groups_out_of_flight(self) -> Iterator[tuple[int, str]]:
        """``(key, oldest waiting request)`` of each waiting group that is not in flight, the
        groups in order of their oldest waiting request's arrival."""
        active = self._active
        for key, members in self._waiting.items():
            if key not in active:
                yield key, next(iter(members))

    def check_consistency(self, waiting: set[str], active: set[str]) -> None:
        """Recompute the counts from the core's sets; AssertionError on a mismatch (tests)."""
        assert set(self._key) == waiting | active, "group keys"
        assert {r for m in self._waiting.values() for r in m} == waiting, "waiting members"
        counts: dict[int, int] = {}
        for rid in active:
            counts[self._key[rid]] = counts.get(self._key[rid], 0) + 1
        assert counts == self._active, "active counts"
        assert set(self._flight_waiting) == set(self._waiting) & set(self._active), "in flight and waiting"
        assert len(self._recent) <= self.window
        assert sum(r for _, r in self._recent) == self._repeats, "repeats"
