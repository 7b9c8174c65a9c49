"""Which engine replica serves a request: prefix affinity bounded by load, and the routers it is compared to.

Engine-free (plain Python + numpy): the Ray Serve request router of ``feather-serve --replicas N``
(:mod:`scheduler_runtime.cluster`) and the multi-replica simulator (:mod:`feather_env.cluster_sim`)
run this very code, so what the simulator measures is what serves.

A request is keyed by the chunked cumulative prefix hashes the scheduler's Chunked Hash Tree keys
it by (:meth:`PrefixHasher.hash`, which is :meth:`ChunkedHashTree.hash_prompt
<scheduler_runtime.cht.ChunkedHashTree.hash_prompt>`): ``H[k]`` stands for the prompt's first
``k + 1`` chunks, and two prompts share ``H[k]`` exactly when they share those chunks. A router
answers one question, :meth:`ReplicaRouter.choose`: given a request's hashes and the load of each
candidate replica (requests it is serving now), which replica; :meth:`ReplicaRouter.routed` tells
it where the request went (the caller may have sent it elsewhere), :meth:`ReplicaRouter.forget`
that a replica is gone with its cache.

The routers (:data:`ROUTERS`, :func:`make_router`):

* ``round-robin``: the candidates in turn;
* ``pow2``: two candidates at random, the less loaded one (Ray Serve's default router);
* ``prefix-hash``: consistent hashing of the prompt's first ``key_chunks`` chunks, no load bound:
  every request of a document on one replica, however hot the document;
* ``prefix`` (:class:`PrefixAffinityRouter`, ours): the replica that was last sent the request's
  longest known prefix (a table of chunk keys, longest match by binary search over depths, as the
  keys are chained), as long as its load stays under the bound of consistent hashing with bounded
  loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): ``ceil(load_factor * (total + 1) / n)``,
  and never below the mean plus ``slack``. Past the bound the request walks the hash ring from its
  deepest known key to the first replica under the bound (a hot prefix spills to the same second
  replica every time, which then holds it too); a prefix no replica holds walks it from its first
  chunk's key.

Every router honours ``avoid`` (replicas that just failed this request) unless nothing else is left.
"""

from __future__ import annotations

import bisect
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE

__all__ = [
    "ROUTERS",
    "PowerOfTwoRouter",
    "PrefixAffinityRouter",
    "PrefixHashRouter",
    "PrefixHasher",
    "ReplicaRouter",
    "RoundRobinRouter",
    "make_router",
]

#: Virtual nodes per replica on the hash ring: an arc share varies by ~1/sqrt(256) = 6% (with 64 the
#: busiest of 16 replicas held ~1.25x the mean of the new prefixes, which showed in its request count).
RING_VNODES = 256
#: Chunk keys the affinity table remembers (least recently routed dropped first): ~16 keys per
#: 8K-token prompt at 512-token chunks, so about 16,000 distinct long prompts.
MAX_TABLE_KEYS = 1 << 18


class PrefixHasher:
    """A prompt's routing key: the Chunked Hash Tree's cumulative chunk hashes (same chunk size,
    same hashes as the scheduler inside each replica)."""

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self._cht = ChunkedHashTree(chunk_size)
        self.chunk_size = self._cht.chunk_size

    def hash(self, token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """``uint64[ceil(n / chunk_size)]`` (raises ValueError for an empty or invalid prompt)."""
        return self._cht.hash_prompt(token_ids)


class _Ring:
    """A consistent-hash ring over a fixed set of replicas, ``RING_VNODES`` points each."""

    def __init__(self, replicas: Collection[str], vnodes: int = RING_VNODES) -> None:
        digest = xxhash.xxh3_64_intdigest
        points = sorted((digest(f"{r}#{i}".encode()), r) for r in replicas for i in range(vnodes))
        self.positions = [p for p, _ in points]
        self.owners = [r for _, r in points]

    def walk(self, h: int):
        """The replicas clockwise from position ``h``, each point in turn (repeats included)."""
        owners = self.owners
        n = len(owners)
        start = bisect.bisect_left(self.positions, h)
        for i in range(n):
            yield owners[(start + i) % n]


class ReplicaRouter(ABC):
    """Chooses a replica per request (see the module docstring)."""

    name: ClassVar[str]
    #: Whether :meth:`choose` reads the request's hashes (the caller may skip hashing otherwise).
    uses_hashes: ClassVar[bool] = False

    def __init__(self) -> None:
        self._ring: _Ring | None = None
        self._ring_members: frozenset[str] = frozenset()

    @abstractmethod
    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = ()) -> str:
        """The replica for a request with prefix ``hashes`` (:meth:`PrefixHasher.hash`; ``None``
        for a request without a prompt), among the keys of ``loads`` (replica -> requests it is
        serving now), avoiding ``avoid`` unless no other replica is left.

        Raises:
            ValueError: ``loads`` is empty.
        """

    def routed(self, hashes: np.ndarray | None, replica: str) -> None:  # noqa: B027 - optional hook
        """The request went to ``replica`` (whatever :meth:`choose` said)."""

    def forget(self, replica: str) -> None:  # noqa: B027 - optional hook
        """``replica`` is gone, and its prefix cache with it."""

    def state(self) -> dict[str, Any]:
        """Counters for reports and ``/metrics``."""
        return {}

    # -- shared helpers -------------------------------------------------------------------------
    def _ring_for(self, replicas: Collection[str]) -> _Ring:
        members = frozenset(replicas)
        if self._ring is None or members != self._ring_members:
            self._ring = _Ring(members)
            self._ring_members = members
        return self._ring

    @staticmethod
    def _allowed(loads: Mapping[str, int], avoid: Collection[str]) -> Collection[str]:
        """The candidates without ``avoid`` (all of them when that leaves none)."""
        if not loads:
            raise ValueError("no replica to route to")
        if avoid:
            usable = {r for r in loads if r not in avoid}
            if usable:
                return usable
        return loads.keys()


class RoundRobinRouter(ReplicaRouter):
    """The candidates in turn (sorted by name, so the order survives a replica joining or leaving)."""

    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = ()) -> str:
        usable = sorted(self._allowed(loads, avoid))
        replica = usable[self._next % len(usable)]
        self._next += 1
        return replica


class PowerOfTwoRouter(ReplicaRouter):
    """Two distinct candidates at random, the one serving fewer requests (the first drawn on a tie):
    Ray Serve's ``PowerOfTwoChoicesRequestRouter``."""

    name = "pow2"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = ()) -> str:
        usable = list(self._allowed(loads, avoid))
        if len(usable) == 1:
            return usable[0]
        a, b = self._rng.sample(usable, 2)
        return b if loads[b] < loads[a] else a


class PrefixHashRouter(ReplicaRouter):
    """Consistent hashing of the prompt's first ``key_chunks`` chunks, without a load bound."""

    name = "prefix-hash"
    uses_hashes = True

    def __init__(self, key_chunks: int = 1) -> None:
        super().__init__()
        if key_chunks < 1:
            raise ValueError(f"key_chunks must be >= 1, got {key_chunks}")
        self.key_chunks = key_chunks

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = ()) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        ring = self._ring_for(loads)
        h = int(hashes[min(self.key_chunks, len(hashes)) - 1])
        return next(r for r in ring.walk(h) if r in ok)


class PrefixAffinityRouter(ReplicaRouter):
    """Ours: longest known prefix, bounded by load (see the module docstring).

    Args:
        load_factor: ``c`` of consistent hashing with bounded loads: no replica is sent a request
            that would take it above ``ceil(c * (total + 1) / n)`` requests in flight (> 1).
        slack: the bound is at least ``floor((total + 1) / n) + slack`` (at low load ``c``'s
            bound is 1 or 2 requests, which would scatter a document's questions).
        max_keys: chunk keys remembered at most (those routed least recently forgotten first).
        new_prefix: where a prefix no replica holds goes: ``"ring"`` (default), the first replica
            under the bound clockwise from its first chunk's hash (documents spread evenly by hash,
            and prompts that share a first chunk meet); ``"least"``: the least loaded replica (in the
            simulator it lets a replica that serves short requests gather documents: 1.2-1.5x the
            mean requests per replica against 1.2 with the ring, for a few percent of throughput).
    """

    name = "prefix"
    uses_hashes = True

    def __init__(self, load_factor: float = 1.25, slack: int = 2, max_keys: int = MAX_TABLE_KEYS,
                 new_prefix: str = "ring") -> None:
        super().__init__()
        if not load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1, got {load_factor}")
        if slack < 0 or max_keys < 2:
            raise ValueError("slack must be >= 0 and max_keys >= 2")
        if new_prefix not in ("ring", "least"):
            raise ValueError(f"new_prefix must be 'ring' or 'least', got {new_prefix!r}")
        self.new_prefix = new_prefix
        self.load_factor = float(load_factor)
        self.slack = int(slack)
        self.max_keys = int(max_keys)
        # The table of chunk key -> replica last sent it, as two generations: keys are written to the
        # young one; when it holds half of max_keys it becomes the old one and the previous old one
        # is dropped. A key routed within the last generation survives (an approximate LRU at the
        # cost of plain dict writes: a routed prompt rewrites all of its keys, so its chain of keys
        # is whole in the young generation, as the longest-match search needs).
        self._young: dict[int, str] = {}
        self._old: dict[int, str] = {}
        self.counts = {"affinity": 0, "spilled": 0, "new": 0}

    def bound(self, total: int, n: int) -> int:
        """The most requests one of ``n`` replicas may hold after this one joins ``total``."""
        return max(math.ceil(self.load_factor * (total + 1) / n), (total + 1) // n + self.slack)

    def _get(self, h: int) -> str | None:
        # A chunk's hash is cumulative (it hashes every chunk before it), so it names its prefix,
        # level included, on its own: the CHT pairs it with the level, a router need not.
        replica = self._young.get(h)
        return self._old.get(h) if replica is None else replica

    def longest_match(self, hashes: np.ndarray) -> int:
        """The deepest level whose key the table holds, -1 for none (binary search: the keys of a
        routed prompt are all recorded, so the levels held form a prefix)."""
        young, old = self._young, self._old
        keys = hashes.tolist()
        if keys[0] not in young and keys[0] not in old:
            return -1
        lo, hi = 0, len(keys) - 1
        while lo < hi:  # invariant: level lo is held
            mid = (lo + hi + 1) // 2
            if keys[mid] in young or keys[mid] in old:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def owner(self, hashes: np.ndarray) -> tuple[int, str | None]:
        """``(deepest level known, the replica last sent it)``; ``(-1, None)`` for a new prefix."""
        level = self.longest_match(hashes)
        if level < 0:
            return -1, None
        return level, self._get(int(hashes[level]))

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = ()) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        cap = self.bound(sum(loads.values()), len(loads))
        level, owner = self.owner(hashes)
        if owner is not None and owner in ok and loads[owner] < cap:
            self.counts["affinity"] += 1
            return owner
        ring = self._ring_for(loads)
        if owner is None:
            self.counts["new"] += 1
            if self.new_prefix == "least":
                least = min(loads[r] for r in ok)
                return next(r for r in ring.walk(int(hashes[-1])) if r in ok and loads[r] == least)
            level = 0
        else:
            self.counts["spilled"] += 1
        for r in ring.walk(int(hashes[level])):
            if r in ok and loads[r] < cap:
                return r
        return min(ok, key=lambda r: (loads[r], r))  # every replica at the bound

    def routed(self, hashes: np.ndarray | None, replica: str) -> None:
        if hashes is None:
            return
        young = self._young
        young.update(dict.fromkeys(hashes.tolist(), replica))
        if len(young) >= self.max_keys // 2:
            self._old, self._young = young, {}

    def forget(self, replica: str) -> None:
        for table in (self._young, self._old):
            for key in [k for k, r in table.items() if r == replica]:
                del table[key]

    def state(self) -> dict[str, Any]:
        return {**self.counts, "table_keys": len(self._young) + len(self._old)}


#: Router names (``make_router``), the comparison routers first.
ROUTERS: dict[str, type[ReplicaRouter]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    PowerOfTwoRouter.name: PowerOfTwoRouter,
    PrefixHashRouter.name: PrefixHashRouter,
    PrefixAffinityRouter.name: PrefixAffinityRouter,
}


def make_router(name: str, **kwargs: Any) -> ReplicaRouter:
    """A router by name (:data:`ROUTERS`) with its keyword arguments.

    Raises:
        ValueError: unknown name.
    """
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}") from None
    return cls(**kwargs)
