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
  keys are chained) if that prefix covers at least ``min_match`` of the prompt (10%), as long as
  its load stays under the bound of consistent hashing with bounded loads (Mirrokni, Thorup,
  Zadimoghaddam, SODA 2018): ``ceil(load_factor * (total + 1) / n)`` (``load_factor`` 5), and never
  below the mean plus ``slack`` (2). Past the bound the request walks the hash ring from its
  deepest known key to the first replica under the bound (a hot prefix spills to the same second
  replica every time, which then holds it too); a new prefix goes to the least loaded replica
  (``new_prefix="least"``; ``"ring"``: walk the ring from its first chunk's key; ``"smallest"``:
  the replica sent the fewest prompt tokens). The defaults are the best of a tuning search on the
  cluster simulator beside the field's routers (``benchmarks.router_peers``; before it
  ``load_factor=1.25``, ``new_prefix="ring"``, no ``min_match``).

The field's routers, as peers to measure ours against (each class's docstring names the rule it
follows, its source and version, its default knobs and where this version approximates it):

* ``sglang-cache-aware`` (:class:`SGLangCacheAwareRouter`): SGLang router's ``cache_aware`` policy;
* ``ray-prefix-affinity`` (:class:`RayPrefixAffinityRouter`): Ray Serve LLM's
  ``PrefixCacheAffinityRouter``;
* ``lmetric`` (:class:`LMetricRouter`): LMetric (OSDI '26), new prefill tokens x batch size;
* ``dynamo-kv`` (:class:`DynamoKvRouter`): NVIDIA Dynamo's KV router cost.

The peers match prompts by text or by token block in their own trees; here they see what ours
sees, the chunked prefix hashes (512-token chunks by default), so a per-replica radix tree is
approximated by the set of chunk keys each replica was sent (:class:`PrefixHistory`: a match is a
whole number of chunks, at most the prompt's length). A router that needs a request's length or
its life (prefill done, finished) reads them from the optional arguments of :meth:`ReplicaRouter.choose`
and :meth:`ReplicaRouter.routed` (``tokens``, ``request_id``) and from :meth:`ReplicaRouter.prefilled`
and :meth:`ReplicaRouter.finished` (the simulator passes them all; the Ray Serve router of
``feather-serve``, which runs only ours, none of them).

Every router honours ``avoid`` (replicas that just failed this request) unless nothing else is left.
"""

from __future__ import annotations

import bisect
import math
import random
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE

__all__ = [
    "PEERS",
    "ROUTERS",
    "DynamoKvRouter",
    "LMetricRouter",
    "PowerOfTwoRouter",
    "PrefixAffinityRouter",
    "PrefixHashRouter",
    "PrefixHasher",
    "PrefixHistory",
    "RayPrefixAffinityRouter",
    "ReplicaRouter",
    "RequestLedger",
    "RoundRobinRouter",
    "SGLangCacheAwareRouter",
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


def _spans(n_keys: int, tokens: int | None, chunk_size: int) -> list[int]:
    """Tokens each chunk key of a prompt covers (the last chunk may be partial)."""
    if tokens is None:
        return [chunk_size] * n_keys
    return [max(1, min(chunk_size, tokens - k * chunk_size)) for k in range(n_keys)]


def _prompt_tokens(hashes: np.ndarray, tokens: int | None, chunk_size: int) -> int:
    """The prompt's length: ``tokens`` when known, else its chunks x ``chunk_size``."""
    return int(tokens) if tokens is not None else len(hashes) * chunk_size


class PrefixHistory:
    """Which prompt prefixes each replica was sent: the peers' approximate per-replica radix trees.

    SGLang's and Ray's routers keep a radix tree of the prompt text each worker was sent (Dynamo's
    approximate indexer, of the token blocks); here a replica's tree is the set of chunk keys it was
    sent (the cumulative chunk hashes: a key names its whole prefix), so a match is a whole number of
    chunks. A replica's size (the tree's characters there) is the tokens its keys cover. At most
    ``max_tokens`` per replica: past that the least recently sent keys go first, deepest first (a
    prompt's keys are touched from its last chunk to its first), as the trees evict LRU leaves.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, max_tokens: int = 1 << 26) -> None:
        if chunk_size < 1 or max_tokens < 1:
            raise ValueError("chunk_size and max_tokens must be >= 1")
        self.chunk_size = int(chunk_size)
        self.max_tokens = int(max_tokens)
        #: chunk key -> {replica: when it was last sent it (a counter)}
        self.holders: dict[int, dict[str, int]] = {}
        self._keys: dict[str, OrderedDict[int, int]] = {}  # replica -> key -> tokens, LRU first
        self.size: Counter[str] = Counter()  # replica -> tokens its keys cover
        self._clock = 0

    def insert(self, hashes: np.ndarray, replica: str, tokens: int | None = None) -> None:
        """``replica`` was sent the prompt of ``hashes`` (``tokens`` long)."""
        self._clock += 1
        stamp = self._clock
        keys = hashes.tolist()
        spans = _spans(len(keys), tokens, self.chunk_size)
        mine = self._keys.setdefault(replica, OrderedDict())
        holders = self.holders
        for key, span in zip(reversed(keys), reversed(spans), strict=True):
            if key in mine:
                mine.move_to_end(key)
            else:
                mine[key] = span
                self.size[replica] += span
            holders.setdefault(key, {})[replica] = stamp
        while self.size[replica] > self.max_tokens and mine:
            key, span = mine.popitem(last=False)
            self.size[replica] -= span
            who = holders.get(key)
            if who is not None:
                who.pop(replica, None)
                if not who:
                    del holders[key]

    def match(self, hashes: np.ndarray) -> dict[str, int]:
        """Replica -> leading chunks of ``hashes`` it was sent (replicas with none left out)."""
        keys = hashes.tolist()
        holders = self.holders
        first = holders.get(keys[0]) if keys else None
        if not first:
            return {}
        alive = set(first)
        depth: dict[str, int] = {}
        for level in range(1, len(keys)):
            here = holders.get(keys[level])
            still = alive.intersection(here) if here else set()
            for r in alive - still:
                depth[r] = level
            alive = still
            if not alive:
                break
        for r in alive:
            depth[r] = len(keys)
        return depth

    def stamp(self, key: int, replica: str) -> int:
        """When ``replica`` was last sent ``key`` (0: never)."""
        return self.holders.get(key, {}).get(replica, 0)

    def forget(self, replica: str) -> None:
        for key in self._keys.pop(replica, {}):
            who = self.holders.get(key)
            if who is not None:
                who.pop(replica, None)
                if not who:
                    del self.holders[key]
        self.size.pop(replica, None)


class RequestLedger:
    """What each replica has been sent and not yet done, in tokens, kept from the request's life.

    Per replica: ``pending`` prefill tokens (each request's new tokens, its prompt less the prefix the
    router expected the replica to hold, until :meth:`prefilled`) and ``kv`` tokens (the distinct chunk
    keys of its requests in flight, a shared document counted once, until :meth:`finished`): Dynamo's
    router's active prefill tokens and active blocks, kept the same way (its ``ActiveSequences``).
    """

    def __init__(self) -> None:
        self.pending: Counter[str] = Counter()
        self.kv: Counter[str] = Counter()
        self._active: dict[int, Counter[str]] = {}  # chunk key -> replica -> requests in flight holding it
        self._requests: dict[str, tuple[str, int, list[int], list[int], bool]] = {}

    def add(self, request_id: str, replica: str, new_tokens: int, keys: list[int], spans: list[int]) -> None:
        if request_id in self._requests:  # routed again (a retry): the first routing is void
            self.finished(request_id)
        self.pending[replica] += new_tokens
        active = self._active
        for key, span in zip(keys, spans, strict=True):
            who = active.get(key)
            if who is None:
                who = active[key] = Counter()
            if not who[replica]:
                self.kv[replica] += span
            who[replica] += 1
        self._requests[request_id] = (replica, new_tokens, keys, spans, False)

    def prefilled(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None or entry[4]:
            return
        replica, new_tokens, keys, spans, _ = entry
        self.pending[replica] -= new_tokens
        self._requests[request_id] = (replica, new_tokens, keys, spans, True)

    def finished(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, new_tokens, keys, spans, done = entry
        if not done:
            self.pending[replica] -= new_tokens
        active = self._active
        for key, span in zip(keys, spans, strict=True):
            who = active[key]
            who[replica] -= 1
            if not who[replica]:
                del who[replica]
                self.kv[replica] -= span
                if not who:
                    del active[key]

    def active_overlap(self, keys: list[int], spans: list[int]) -> Counter[str]:
        """Replica -> tokens of these keys its requests in flight already hold."""
        out: Counter[str] = Counter()
        active = self._active
        for key, span in zip(keys, spans, strict=True):
            who = active.get(key)
            if who:
                for r in who:
                    out[r] += span
        return out

    def load(self, replica: str) -> int:
        """Pending prefill tokens + distinct KV tokens in flight."""
        return self.pending[replica] + self.kv[replica]

    def forget(self, replica: str) -> None:
        for rid in [rid for rid, e in self._requests.items() if e[0] == replica]:
            self.finished(rid)
        self.pending.pop(replica, None)
        self.kv.pop(replica, None)


class ReplicaRouter(ABC):
    """Chooses a replica per request (see the module docstring)."""

    name: ClassVar[str]
    #: Whether :meth:`choose` reads the request's hashes (the caller may skip hashing otherwise).
    uses_hashes: ClassVar[bool] = False
    #: Whether the router reads the request's length (``tokens``) and its life: the caller that can
    #: passes ``tokens`` to :meth:`choose` and :meth:`routed`, a ``request_id`` to :meth:`routed`, and
    #: calls :meth:`prefilled` and :meth:`finished` (the simulator does; a router must still work,
    #: less well, without them).
    tracks_requests: bool = False

    def __init__(self) -> None:
        self._ring: _Ring | None = None
        self._ring_members: frozenset[str] = frozenset()

    @abstractmethod
    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        """The replica for a request with prefix ``hashes`` (:meth:`PrefixHasher.hash`; ``None``
        for a request without a prompt), among the keys of ``loads`` (replica -> requests it is
        serving now), avoiding ``avoid`` unless no other replica is left. ``tokens``: the prompt's
        length, where the caller knows it.

        Raises:
            ValueError: ``loads`` is empty.
        """

    def routed(self, hashes: np.ndarray | None, replica: str, *,  # noqa: B027 - optional hook
               tokens: int | None = None, request_id: str | None = None) -> None:
        """The request went to ``replica`` (whatever :meth:`choose` said); ``request_id`` names it in
        later :meth:`prefilled` / :meth:`finished` calls."""

    def prefilled(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request's prompt has been prefilled (its first token came back)."""

    def finished(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request finished: it holds no KV cache any more."""

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
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
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
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
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
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        ring = self._ring_for(loads)
        h = int(hashes[min(self.key_chunks, len(hashes)) - 1])
        return next(r for r in ring.walk(h) if r in ok)


class PrefixAffinityRouter(ReplicaRouter):
    """Ours: longest known prefix, bounded by load (see the module docstring).

    The defaults (``load_factor=5, slack=2, new_prefix="least", min_match=0.1``) won the tuning search
    of ``benchmarks.router_peers`` (16 simulated replicas, L-Eval, with SGLang's, Ray Serve's,
    LMetric's and Dynamo's rules tuned beside it) and beat the previous ones (``1.25, 2, "ring", 0``)
    on held-out seeds at 4, 16 and 64 replicas (``docs/results.md``). A load counted in tokens
    (pending prefill plus the distinct KV tokens in flight) was tried there too and dropped: a hot
    document's replica looked light (its document counted once, its questions cached) while its
    queue grew.

    Args:
        load_factor: ``c`` of consistent hashing with bounded loads: no replica is sent a request
            that would take it above ``ceil(c * (total + 1) / n)`` requests in flight (> 1).
        slack: the bound is at least ``floor((total + 1) / n) + slack`` (at low load ``c``'s
            bound is 1 or 2 requests, which would scatter a document's questions).
        max_keys: chunk keys remembered at most (those routed least recently forgotten first).
        new_prefix: where a prefix no replica holds goes: ``"least"`` (default): the least loaded
            replica (the first on the ring from the prompt's last key among equals); ``"ring"``: the
            first replica under the bound clockwise from its first chunk's hash (documents spread
            evenly by hash, and prompts that share a first chunk meet); ``"smallest"``: the replica
            under the bound that was sent the fewest prompt tokens (the tokens of each routed prompt
            past the deepest chunk key the replica already owned, so a key that changes owners
            counts again: about the smallest tree of SGLang's and Ray's routers), then the least
            loaded.
        min_match: a known prefix covering less than this fraction of the prompt is not followed:
            the request goes where a new prefix goes (SGLang's and Ray's match-rate threshold: a
            shared preamble of a few hundred tokens does not pull a new document onto its replica).
            Default 0.1; ``0``: any known prefix is followed.
        chunk_size: tokens per chunk of the hashes (the scheduler's chunk size; ``min_match`` and
            ``new_prefix="smallest"`` count tokens by it).
    """

    name = "prefix"
    uses_hashes = True

    def __init__(self, load_factor: float = 5.0, slack: int = 2, max_keys: int = MAX_TABLE_KEYS,
                 new_prefix: str = "least", min_match: float = 0.1,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__()
        if not load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1, got {load_factor}")
        if slack < 0 or max_keys < 2:
            raise ValueError("slack must be >= 0 and max_keys >= 2")
        if new_prefix not in ("ring", "least", "smallest"):
            raise ValueError(f"new_prefix must be 'ring', 'least' or 'smallest', got {new_prefix!r}")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        self.min_match = float(min_match)
        self.new_prefix = new_prefix
        self.load_factor = float(load_factor)
        self.slack = int(slack)
        self.max_keys = int(max_keys)
        self.chunk_size = int(chunk_size)
        # The table of chunk key -> replica last sent it, as two generations: keys are written to the
        # young one; when it holds half of max_keys it becomes the old one and the previous old one
        # is dropped. A key routed within the last generation survives (an approximate LRU at the
        # cost of plain dict writes: a routed prompt rewrites all of its keys, so its chain of keys
        # is whole in the young generation, as the longest-match search needs).
        self._young: dict[int, str] = {}
        self._old: dict[int, str] = {}
        #: replica -> prompt tokens it was sent (``new_prefix="smallest"``; see the class docstring)
        self.sent_tokens: Counter[str] = Counter()
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
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        cap = self.bound(sum(loads.values()), len(loads))
        level, owner = self.owner(hashes)
        if owner is not None and self.min_match > 0.0:
            n = _prompt_tokens(hashes, tokens, self.chunk_size)
            if min((level + 1) * self.chunk_size, n) < self.min_match * n:
                level, owner = -1, None  # too little of it known: a new prefix
        if owner is not None and owner in ok and loads[owner] < cap:
            self.counts["affinity"] += 1
            return owner
        ring = self._ring_for(loads)
        if owner is None:
            self.counts["new"] += 1
            if self.new_prefix == "least":
                least = min(loads[r] for r in ok)
                return next(r for r in ring.walk(int(hashes[-1])) if r in ok and loads[r] == least)
            if self.new_prefix == "smallest":
                sent = self.sent_tokens
                under = [r for r in ok if loads[r] < cap] or list(ok)
                return min(under, key=lambda r: (sent[r], loads[r], r))
            level = 0
        else:
            self.counts["spilled"] += 1
        for r in ring.walk(int(hashes[level])):
            if r in ok and loads[r] < cap:
                return r
        return min(ok, key=lambda r: (loads[r], r))  # every replica at the bound

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        if hashes is None:
            return
        keys = hashes.tolist()
        if self.new_prefix == "smallest":  # the keys past the deepest one the replica already owns
            get, chunk = self._get, self.chunk_size
            n, added = _prompt_tokens(hashes, tokens, chunk), 0
            for level in range(len(keys) - 1, -1, -1):
                if get(keys[level]) == replica:
                    break
                added += max(1, min(chunk, n - level * chunk))
            self.sent_tokens[replica] += added
        young = self._young
        young.update(dict.fromkeys(keys, replica))
        if len(young) >= self.max_keys // 2:
            self._old, self._young = young, {}

    def forget(self, replica: str) -> None:
        for table in (self._young, self._old):
            for key in [k for k, r in table.items() if r == replica]:
                del table[key]
        self.sent_tokens.pop(replica, None)

    def state(self) -> dict[str, Any]:
        return {**self.counts, "table_keys": len(self._young) + len(self._old)}


# ------------------------------------------------------------------------------------ the field's routers


class _PeerRouter(ReplicaRouter):
    """A peer that keeps what each replica was sent (:class:`PrefixHistory`) and, from the request's
    life, each replica's tokens in flight (:class:`RequestLedger`)."""

    uses_hashes = True
    tracks_requests = True

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, max_tree_tokens: int = 1 << 26) -> None:
        super().__init__()
        self.chunk_size = int(chunk_size)
        self.history = PrefixHistory(chunk_size, max_tree_tokens)
        self.ledger = RequestLedger()
        self.counts: Counter[str] = Counter()

    def _match(self, hashes: np.ndarray, tokens: int | None) -> tuple[int, dict[str, int]]:
        """``(prompt tokens, replica -> tokens of its prefix that replica was sent)``."""
        n = _prompt_tokens(hashes, tokens, self.chunk_size)
        chunk = self.chunk_size
        return n, {r: min(d * chunk, n) for r, d in self.history.match(hashes).items()}

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        if hashes is None or len(hashes) == 0:
            return
        if request_id is not None:
            n, held = self._match(hashes, tokens)
            keys = hashes.tolist()
            self.ledger.add(request_id, replica, n - held.get(replica, 0), keys,
                            _spans(len(keys), tokens, self.chunk_size))
        self.history.insert(hashes, replica, tokens)

    def prefilled(self, request_id: str) -> None:
        self.ledger.prefilled(request_id)

    def finished(self, request_id: str) -> None:
        self.ledger.finished(request_id)

    def forget(self, replica: str) -> None:
        self.history.forget(replica)
        self.ledger.forget(replica)

    def state(self) -> dict[str, Any]:
        return dict(self.counts)


class SGLangCacheAwareRouter(_PeerRouter):
    """SGLang router's ``cache_aware`` policy (``src/policies/cache_aware.rs`` of the model gateway that
    sglang-router 0.3 ships), with the defaults of sglang-router 0.3.x (``RouterArgs``, what ``python -m
    sglang_router.launch_router`` runs with): ``cache_threshold=0.3``, ``balance_abs_threshold=64``,
    ``balance_rel_threshold=1.5``, ``max_tree_size=2**26`` (eviction every 60 s). The Rust
    ``CacheAwareConfig::default()`` is 0.5 / 32 / 1.1 instead; the tuning grid of
    ``benchmarks.router_peers`` covers both.

    Per request: (1) if the load is imbalanced, ``max - min > balance_abs_threshold`` and
    ``max > balance_rel_threshold * min`` over every replica's requests in flight, the replica
    serving the fewest (shortest queue); (2) else the match rate, the longest prefix any replica's
    tree holds over the prompt's length: above ``cache_threshold`` (strictly, as the Rust code), the
    replica holding that match; (3) else (``miss="least"``, sglang-router 0.3) the replica serving the
    fewest requests, the first in the router's worker order among equals. The prompt then enters the
    chosen replica's tree, whichever branch chose it. ``miss="smallest"``: the replica with the
    smallest tree instead, the rule of sglang-router's first releases (the Rust source's comment still
    describes it), which ``benchmarks.router_peers`` measured until ``benchmarks.router_fidelity``
    replayed the real router (2026-12-04: with it, 0.3.2 sends every request of a sequence sent one
    at a time to one worker).

    Approximations: the tree of prompt text is :class:`PrefixHistory` (whole 512-token chunks;
    ``max_tree_size`` counts tokens, not characters, evicted at once rather than every 60 s: it
    never binds in the benchmark); of several replicas at the deepest match, the one most recently
    sent it (the real tree takes the tenant it cached at that node, else the first in its hash map:
    arbitrary); ties of the shortest queue, the least loaded and the smallest tree by name (the Rust
    code: the first in worker order; ``benchmarks.router_fidelity`` names the replicas in that order).
    """

    name = "sglang-cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 26, miss: str = "least",
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size, max_tree_size)
        if miss not in ("least", "smallest"):
            raise ValueError(f"miss must be 'least' or 'smallest', got {miss!r}")
        self.miss = miss
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be >= 0")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = int(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)

    def imbalanced(self, loads: Mapping[str, int]) -> bool:
        hi, lo = max(loads.values()), min(loads.values())
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0 or self.imbalanced(loads):
            self.counts["shortest_queue"] += 1
            return min(ok, key=lambda r: (loads[r], r))
        n, held = self._match(hashes, tokens)
        held = {r: m for r, m in held.items() if r in ok}
        best = max(held.values(), default=0)
        if n and best / n > self.cache_threshold:
            self.counts["cache_hit"] += 1
            level = min(len(hashes), -(-best // self.chunk_size)) - 1
            key = int(hashes[level])
            return max((r for r, m in held.items() if m == best),
                       key=lambda r: (self.history.stamp(key, r), r))
        if self.miss == "least":
            self.counts["least_loaded"] += 1
            return min(ok, key=lambda r: (loads[r], r))
        self.counts["smallest_tree"] += 1
        size = self.history.size
        return min(ok, key=lambda r: (size[r], r))


class RayPrefixAffinityRouter(_PeerRouter):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` (ray 2.60: ``ray.serve.llm.request_router``,
    ``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``), with its
    defaults: ``imbalanced_threshold=inf``, ``match_rate_threshold=0.1``, no eviction.

    Per request: (1) if the candidates' queue lengths differ by more than ``imbalanced_threshold``,
    power of two choices (two at random, the shorter queue: Ray Serve's default router); (2) else the
    match rate, the longest prefix a candidate's tree holds over the prompt's length: at least
    ``match_rate_threshold``, the replicas holding that match; below it (or no match), the replicas
    with the smallest trees; of those, the one with the shortest queue (how Ray picks within the rank
    ``choose_replicas`` returns; the first on a tie). The prompt enters the chosen replica's tree.
    Ray 2.60 has these two knobs and no further tiers of match rates.

    Approximations: the tree of prompt text is :class:`PrefixHistory` (whole chunks); Ray's
    ``max_ongoing_requests`` back-off (wait while every chosen replica's queue is full) is not
    modelled; ties in queue length go by name.
    """

    name = "ray-prefix-affinity"

    def __init__(self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1,
                 seed: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size)
        if imbalanced_threshold < 0 or not 0.0 <= match_rate_threshold <= 1.0:
            raise ValueError("imbalanced_threshold must be >= 0 and match_rate_threshold in [0, 1]")
        self.imbalanced_threshold = float(imbalanced_threshold)
        self.match_rate_threshold = float(match_rate_threshold)
        self._rng = random.Random(seed)

    def _pow2(self, ok: Collection[str], loads: Mapping[str, int]) -> str:
        usable = sorted(ok)
        if len(usable) == 1:
            return usable[0]
        a, b = self._rng.sample(usable, 2)
        return b if loads[b] < loads[a] else a

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        queue = [loads[r] for r in ok]
        if hashes is None or len(hashes) == 0 or max(queue) - min(queue) > self.imbalanced_threshold:
            self.counts["pow2"] += 1
            return self._pow2(ok, loads)
        n, held = self._match(hashes, tokens)
        held = {r: m for r, m in held.items() if r in ok}
        best = max(held.values(), default=0)
        if best and best / n >= self.match_rate_threshold:
            self.counts["match"] += 1
            chosen = [r for r, m in held.items() if m == best]
        else:
            self.counts["smallest_tree"] += 1
            size = self.history.size
            least = min(size[r] for r in ok)
            chosen = [r for r in ok if size[r] == least]
        return min(chosen, key=lambda r: (loads[r], r))


class LMetricRouter(_PeerRouter):
    """LMetric ("Simple is Better", Zhang et al., OSDI '26, arXiv 2603.15202): the replica with the
    smallest product of a KV-cache indicator and a load indicator, no knobs. Here the KV-cache
    indicator is the request's new prefill tokens on that replica (its prompt less the prefix the
    replica was sent, :class:`PrefixHistory`; at least 1, so that a fully matched prompt still
    weighs its load), the load indicator the replica's batch size, its requests in flight + 1 (so an
    idle replica's product is not 0). Ties: the less loaded, then by name.
    """

    name = "lmetric"

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size)

    def score(self, replica: str, n: int, held: Mapping[str, int], loads: Mapping[str, int]) -> int:
        return max(1, n - held.get(replica, 0)) * (loads[replica] + 1)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        n, held = self._match(hashes, tokens)
        return min(ok, key=lambda r: (self.score(r, n, held, loads), loads[r], r))


class DynamoKvRouter(_PeerRouter):
    """NVIDIA Dynamo's KV router (``lib/kv-router``: ``DefaultWorkerSelector``; docs "KV Router":
    ``logit = kv_overlap_score_weight x potential_prefill_blocks + potential_active_blocks``), lowest
    logit wins (``router_temperature=0``, the default: no softmax sampling; ties at random).
    Defaults: ``overlap_score_weight=1.0``, ``block_size=16``.

    For a replica: ``potential_prefill_blocks`` = (its prefill tokens routed and not yet prefilled +
    this prompt's tokens less the overlap it holds) / block size; ``potential_active_blocks`` = the
    distinct blocks of its requests in flight + this prompt's blocks not among them
    (:class:`RequestLedger`, as Dynamo's ``ActiveSequences``: added when routed, prefill tokens
    dropped at the first token, blocks at the finish).

    Approximations: the overlap comes from the routing history (:class:`PrefixHistory`, whole
    512-token chunks; Dynamo's ``--no-kv-events`` approximate indexer, whose 120 s TTL no benchmark
    run reaches), not from the engines' KV events (the default mode, which sees evictions); decode
    tokens are not added to the active blocks as they are generated (outputs here are short beside
    8K-token prompts). ``block_size`` scales both terms alike, so it does not change the choice.
    """

    name = "dynamo-kv"

    def __init__(self, overlap_score_weight: float = 1.0, block_size: int = 16, seed: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size)
        if overlap_score_weight < 0 or block_size < 1:
            raise ValueError("overlap_score_weight must be >= 0 and block_size >= 1")
        self.overlap_score_weight = float(overlap_score_weight)
        self.block_size = int(block_size)
        self._rng = random.Random(seed)

    def costs(self, hashes: np.ndarray, loads: Mapping[str, int], ok: Collection[str],
              tokens: int | None = None) -> dict[str, float]:
        """Replica -> its logit for this request (lower is better)."""
        n, held = self._match(hashes, tokens)
        keys = hashes.tolist()
        active_hit = self.ledger.active_overlap(keys, _spans(len(keys), tokens, self.chunk_size))
        ledger, w, bs = self.ledger, self.overlap_score_weight, self.block_size
        return {r: (w * (ledger.pending[r] + n - held.get(r, 0)) + ledger.kv[r] + n - active_hit[r]) / bs
                for r in ok}

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        costs = self.costs(hashes, loads, ok, tokens)
        best = min(costs.values())
        tied = sorted(r for r, c in costs.items() if c <= best + 1e-9)
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


#: The field's routers (:data:`ROUTERS` holds them too), in the order the benchmark reports them.
PEERS: tuple[str, ...] = (SGLangCacheAwareRouter.name, RayPrefixAffinityRouter.name, LMetricRouter.name,
                          DynamoKvRouter.name)


#: Router names (``make_router``), the comparison routers first.
ROUTERS: dict[str, type[ReplicaRouter]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    PowerOfTwoRouter.name: PowerOfTwoRouter,
    PrefixHashRouter.name: PrefixHashRouter,
    PrefixAffinityRouter.name: PrefixAffinityRouter,
    SGLangCacheAwareRouter.name: SGLangCacheAwareRouter,
    RayPrefixAffinityRouter.name: RayPrefixAffinityRouter,
    LMetricRouter.name: LMetricRouter,
    DynamoKvRouter.name: DynamoKvRouter,
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
