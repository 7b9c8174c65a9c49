"""What every replica router shares (:mod:`scheduler_runtime.router`): a prompt's routing key
(:class:`PrefixHasher`), the hash ring, what each replica was sent (:class:`PrefixHistory`), the
requests in flight per replica (:class:`RequestLedger`) and the interface (:class:`ReplicaRouter`).

Ours and the simple routers (:mod:`scheduler_runtime.router`) and the field's
(:mod:`scheduler_runtime.peer_routers`) are built on these; :mod:`scheduler_runtime.router`
re-exports them all.
"""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE

__all__ = ["MAX_TABLE_KEYS", "RING_VNODES", "PrefixHasher", "PrefixHistory", "ReplicaRouter", "RequestLedger",
           "chunk_spans", "prompt_tokens"]


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


def chunk_spans(n_keys: int, tokens: int | None, chunk_size: int) -> list[int]:
    """Tokens each chunk key of a prompt covers (the last chunk may be partial)."""
    if tokens is None:
        return [chunk_size] * n_keys
    return [max(1, min(chunk_size, tokens - k * chunk_size)) for k in range(n_keys)]


def prompt_tokens(hashes: np.ndarray, tokens: int | None, chunk_size: int) -> int:
    """The prompt's length: ``tokens`` when known, else its chunks x ``chunk_size``."""
    return int(tokens) if tokens is not None else len(hashes) * chunk_size


def leading_depths(holders: Mapping[int, Collection[str]], keys: Sequence[int]) -> dict[str, int]:
    """Replica -> how many leading ``keys`` it holds, by ``holders`` (a chunk key -> the replicas holding
    it); replicas holding none left out."""
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


class PrefixHistory:
    """Which prompt prefixes each replica was sent: the peers' approximate per-replica radix trees.

    SGLang's and Ray's routers keep a radix tree of the prompt text each worker was sent (Dynamo's
    approximate indexer, of the token blocks); here a replica's tree is the set of chunk keys it was
    sent (the cumulative chunk hashes: a key names its whole prefix), so a match is a whole number of
    chunks. A replica's size (the tree's characters there) is the tokens its keys cover. At most
    ``max_tokens`` per replica: past that the least recently sent keys go first, deepest first (a
    prompt's keys are touched from its last chunk to its first), as the trees evict LRU leaves.
    With ``holders=False`` it keeps no map from a key to its replicas: :meth:`match` is then refused,
    and :meth:`depth` (one replica's match) and the sizes cost about half as much to keep.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, max_tokens: int = 1 << 26, *,
                 holders: bool = True) -> None:
        if chunk_size < 1 or max_tokens < 1:
            raise ValueError("chunk_size and max_tokens must be >= 1")
        self.chunk_size = int(chunk_size)
        self.max_tokens = int(max_tokens)
        self.tracks_holders = bool(holders)
        #: replica -> its own ``max_tokens`` where it differs (:meth:`set_limit`: replicas of unequal KV).
        self.limits: dict[str, int] = {}
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
        spans = chunk_spans(len(keys), tokens, self.chunk_size)
        mine = self._keys.setdefault(replica, OrderedDict())
        added = 0
        holders = self.holders if self.tracks_holders else None
        for key, span in zip(reversed(keys), reversed(spans), strict=True):
            if key in mine:
                mine.move_to_end(key)
            else:
                mine[key] = span
                added += span
            if holders is not None:
                holders.setdefault(key, {})[replica] = stamp
        self.size[replica] += added
        self._evict(replica)

    def set_limit(self, replica: str, max_tokens: int) -> None:
        """``replica`` holds at most ``max_tokens`` (its least recently sent keys go now if it holds more)."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.limits[replica] = int(max_tokens)
        self._evict(replica)

    def _evict(self, replica: str) -> None:
        mine = self._keys.get(replica)
        limit = self.limits.get(replica, self.max_tokens)
        holders = self.holders
        while mine and self.size[replica] > limit:
            key, span = mine.popitem(last=False)
            self.size[replica] -= span
            who = holders.get(key)
            if who is not None:
                who.pop(replica, None)
                if not who:
                    del holders[key]

    def match(self, hashes: np.ndarray) -> dict[str, int]:
        """Replica -> leading chunks of ``hashes`` it was sent (replicas with none left out)."""
        if not self.tracks_holders:
            raise RuntimeError("this PrefixHistory keeps no holders (holders=False): use depth()")
        return leading_depths(self.holders, hashes.tolist())

    def depth(self, hashes: np.ndarray, replica: str) -> int:
        """Leading chunks of ``hashes`` that ``replica`` was sent (``match(hashes).get(replica, 0)``)."""
        mine = self._keys.get(replica)
        if not mine:
            return 0
        n = 0
        for key in hashes.tolist():
            if key not in mine:
                break
            n += 1
        return n

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
        self.limits.pop(replica, None)


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

    def match(self, hashes: np.ndarray) -> dict[str, int]:
        """Replica -> leading chunks of ``hashes`` that its requests in flight hold (replicas with none
        left out): :meth:`PrefixHistory.match` for what is in flight now."""
        return leading_depths(self._active, hashes.tolist())

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
    #: Whether the router learns from the service it sees (a router that tracks requests): the caller
    #: that can sets its :attr:`clock` (the time of each call), passes ``output_tokens`` to
    #: :meth:`finished`, and hands it each replica's published metrics now and then (:meth:`scraped`).
    observes_service: ClassVar[bool] = False
    #: The clock such a router reads (seconds; the simulator sets its own).
    clock: Callable[[], float] = staticmethod(time.monotonic)

    @property
    def reads_queue_time(self) -> bool:
        """Whether it uses the waits the servers report (:meth:`scheduled`): a front end then asks each
        stream for them."""
        return False

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

    def scheduled(self, request_id: str, queued_s: float) -> None:  # noqa: B027 - optional hook
        """The request waited ``queued_s`` seconds at its replica between its arrival there and its
        first scheduled step: told before :meth:`finished`, after :meth:`prefilled` (where the server
        reports it). vLLM keeps it per request (``RequestStateStats.scheduled_ts - queued_ts``) and returns
        it with ``--enable-per-request-metrics`` as ``metrics.queue_time_ms`` of a stream's final usage
        chunk, which the proxy and the Ray ingress read (:func:`scheduler_runtime.sse.stream_queue_seconds`);
        the simulator reports it at the same point."""

    def prefilled(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request's prompt has been prefilled (its first token came back)."""

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:  # noqa: B027
        """The request finished: it holds no KV cache any more. ``output_tokens``: the tokens it
        generated, where the caller knows them (a router that :attr:`observes_service` reads it)."""

    def forget(self, replica: str) -> None:  # noqa: B027 - optional hook
        """``replica`` is gone, and its prefix cache with it."""

    def scraped(self, replica: str, metrics: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """``replica``'s ``/metrics`` as just read, by vLLM's metric names (a router that
        :attr:`observes_service`): ``vllm:cache_config_info`` (a dict of its labels), gauges, and the
        sums and counts of its histograms."""

    def state(self) -> dict[str, Any]:
        """Counters for reports and ``/metrics``."""
        return {}

    def estimates(self) -> dict[str, dict[str, Any]]:
        """What the router has learned of each replica (empty for a router that learns nothing)."""
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
