"""Orderings: how the batching core picks the next candidate of a round, one small class each.

vLLM's ``request_queue.py`` pattern: a policy is a small queue class chosen by an enum. The names
are declared once, in :mod:`scheduler_runtime.core_config` (:class:`OrderingName`, re-exported
here); :func:`make_ordering` builds the class of a core's configured ordering:

=============  ====================================================================================
``feather``    the CHT's best candidate (:class:`FeatherOrdering`); with the group decision,
               requests of groups in flight first, then the most cached waiting group
               (:class:`GroupOrdering`)
``fcfs``       arrival order
``sjf``        shortest output estimate first (:class:`KeyOrdering`)
``svf``        smallest SVF volume first (:class:`KeyOrdering`)
``lpm``        SGLang's longest prefix match over a radix tree, FCFS above a queue length
``dfs-weight`` SGLang's DFS-weight order over a radix tree
=============  ====================================================================================

The core tells its ordering about every change (arrive, release, finish, remove) and asks
:meth:`Ordering.next_candidate` after each release.
"""

from __future__ import annotations

import numpy as np

from scheduler_runtime.core_config import (
    BASELINE_ORDERINGS,
    KEY_ORDERINGS,
    ORDERINGS,
    CoreView,
    Entry,
    OrderingName,
)
from scheduler_runtime.radix import RADIX_ORDERINGS, RadixTree
from scheduler_runtime.svf import KeyQueue, volume

__all__ = [
    "BASELINE_ORDERINGS",
    "ORDERINGS",
    "RADIX_ORDERINGS",
    "FCFSOrdering",
    "FeatherOrdering",
    "GroupOrdering",
    "KeyOrdering",
    "Ordering",
    "OrderingName",
    "RadixOrdering",
    "make_ordering",
]


class Ordering:
    """How an ordering picks the candidates of a round (vLLM's ``request_queue.py`` pattern: one
    small class per policy). The core tells it about every change; :meth:`next_candidate` is asked
    for the next waiting request of the current round after each release."""

    name = ""

    def __init__(self, core: CoreView) -> None:
        self.core = core

    def arrive(self, entry: Entry, tokens: np.ndarray) -> None:  # noqa: B027 - optional hook
        """A request arrived (it is waiting)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """A waiting request was released into the batch."""

    def finish(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """An active request left the batch (finished or aborted)."""

    def remove(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """A waiting request was aborted."""

    def begin_round(self) -> None:  # noqa: B027 - optional hook
        """A round of decisions starts (orderings that sort once per round sort here)."""

    def next_candidate(self) -> str | None:
        """The next waiting request of this round (None when none waits)."""
        raise NotImplementedError


class FeatherOrdering(Ordering):
    """The CHT's best candidate: the waiting request that misses the fewest prefix chunks."""

    name = "feather"

    def next_candidate(self) -> str | None:
        cand = self.core.cht.best_candidate()
        if cand is None:
            return None
        self.core._candidate_cache = cand  # the decision's observation reuses it
        return cand.request_id


class GroupOrdering(FeatherOrdering):
    """The group decision's order: requests of groups in flight first (the CHT's best when it is
    one), then the waiting group whose prefix the engine's cache holds most (cached-first), then
    the CHT's best."""

    name = "feather"

    def __init__(self, core: CoreView) -> None:
        super().__init__(core)
        #: The engine's cached prefix of each group's oldest waiting request, as looked up in this
        #: round: the engine does not change while a round is open, and an arrival or a finish,
        #: which may change the answer or the round, clears it.
        self._hits: dict[str, int] = {}

    def arrive(self, entry: Entry, tokens: np.ndarray) -> None:
        self._hits.clear()

    def finish(self, request_id: str) -> None:
        self._hits.clear()

    def remove(self, request_id: str) -> None:
        self._hits.clear()

    def begin_round(self) -> None:
        self._hits.clear()

    def next_candidate(self) -> str | None:
        core = self.core
        cand = core.cht.best_candidate()
        if cand is None:
            return None
        groups = core.groups
        if groups.in_flight(cand.request_id):
            core._candidate_cache = cand
            return cand.request_id
        joining = groups.first_waiting_in_flight()
        if joining is not None:
            return joining
        if core.nothing_fits(core.cht.missing_count(cand.request_id)):
            core._candidate_cache = cand  # the round ends at the budget: no search
            return cand.request_id
        engine, limit, hits = core._engine, core.group_tokens, self._hits
        best, best_hit = cand.request_id, 0
        for _, rid in groups.waiting_groups_out_of_flight():
            hit = hits.get(rid)
            if hit is None:
                hit = hits[rid] = engine.cached_prefix_tokens(rid, limit)
            if hit > best_hit:
                best, best_hit = rid, hit
                if hit >= limit:  # a lookup stops at ``limit``: no later group can hit more
                    break
        if best == cand.request_id:
            core._candidate_cache = cand
        return best


class FCFSOrdering(Ordering):
    """Arrival order."""

    name = "fcfs"

    def next_candidate(self) -> str | None:
        entry = self.core._oldest_waiting()
        return None if entry is None else entry.request_id


class KeyOrdering(Ordering):
    """Ascending key, earliest arrival among ties: output length (``sjf``) or SVF volume (``svf``)."""

    def __init__(self, core: CoreView, name: str) -> None:
        super().__init__(core)
        self.name = name
        self.queue = KeyQueue()

    def arrive(self, entry: Entry, tokens: np.ndarray) -> None:
        sjf = self.name == OrderingName.SJF
        key = entry.output_len if sjf else volume(entry.prompt_len, entry.output_len)
        self.queue.push(entry.request_id, key)

    def release(self, request_id: str) -> None:
        self.queue.discard(request_id)

    remove = release

    def next_candidate(self) -> str | None:
        return self.queue.peek()


class RadixOrdering(Ordering):
    """SGLang's LPM or DFS-weight over a token radix tree of the batch, sorted once per round.

    SGLang sorts its waiting queue once per scheduling round (``calc_priority``) and then admits
    in that order; so does this, so a round matches every waiting request once, not once per
    admission.
    """

    def __init__(self, core: CoreView, name: str) -> None:
        super().__init__(core)
        self.name = name
        self.radix = RadixTree(name, core.chunk_size, core.config.lpm_fcfs_fallback)  # type: ignore[arg-type]
        self._order: list[str] = []
        self._pos = 0

    def arrive(self, entry: Entry, tokens: np.ndarray) -> None:
        self.radix.insert(entry.request_id, tokens)

    def release(self, request_id: str) -> None:
        self.radix.activate(request_id)

    def finish(self, request_id: str) -> None:
        self.radix.finish(request_id)

    def remove(self, request_id: str) -> None:
        self.radix.remove(request_id)

    def begin_round(self) -> None:
        radix = self.radix
        if self.name == OrderingName.DFS_WEIGHT:
            self._order = radix.dfs_weight_order()
        else:
            waiting = radix.waiting_ids()  # insertion (arrival) order
            fallback = self.core.config.lpm_fcfs_fallback
            if fallback is not None and len(waiting) > fallback:
                self._order = waiting  # SGLang: no prefix matching above the threshold
            else:
                matched = {rid: radix.match_length(rid) for rid in waiting}
                self._order = sorted(waiting, key=lambda rid: -matched[rid])  # stable: FCFS ties
        self._pos = 0

    def next_candidate(self) -> str | None:
        order, waiting = self._order, self.core._waiting
        while self._pos < len(order):
            rid = order[self._pos]
            if rid in waiting:
                return rid
            self._pos += 1  # released earlier in this round (as overdue or seed)
        return None


def make_ordering(core: CoreView) -> Ordering:
    """The :class:`Ordering` of ``core.config.ordering``."""
    name = core.config.ordering
    if name == OrderingName.FEATHER:
        return GroupOrdering(core) if core.config.decision == "group" else FeatherOrdering(core)
    if name == OrderingName.FCFS:
        return FCFSOrdering(core)
    if name in KEY_ORDERINGS:
        return KeyOrdering(core, name)
    if name in RADIX_ORDERINGS:
        return RadixOrdering(core, name)
    raise ValueError(f"ordering must be one of {ORDERINGS}, got {name!r}")
