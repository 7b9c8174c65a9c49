"""Which engine replica serves a request: prefix affinity bounded by load, and the routers it is compared to.

Engine-free (plain Python + numpy): the Ray Serve request router of ``feather-serve --replicas N``
(:mod:`scheduler_runtime.serving.cluster`) and the multi-replica simulator (:mod:`feather_env.cluster_sim`)
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
  Zadimoghaddam, SODA 2018): ``ceil(load_factor * (total + 1) / n)`` (``load_factor`` 20: a
  bound for outliers only), and never below the mean plus ``slack`` (2), and, where the caller
  gives each replica's KV size (``kv_tokens``), as long as a model of that replica's prefix cache (an
  LRU of ``cache_factor`` 1.25 x its KV tokens of what it was sent) still holds half of that prefix:
  a document the replica has evicted by now goes where a new one goes, as it is prefilled again
  wherever it goes. Past the bound the request walks the hash ring from its deepest known key to the
  first replica under the bound (a hot prefix spills to the same second replica every time, which
  then holds it too); a new prefix goes to the least loaded replica (``new_prefix="least"``;
  ``"ring"``: walk the ring from its first chunk's key; ``"smallest"``: the replica sent the fewest
  prompt tokens). The defaults are the best of a tuning search on the cluster simulator beside the
  field's routers (``benchmarks.router_peers``, L-Eval and the Mooncake trace; before the first
  ``load_factor=1.25``, ``new_prefix="ring"``, no ``min_match``; before the second
  ``load_factor=5``, no cache model).

The field's routers, as peers to measure ours against (each class's docstring names the rule it
follows, its source and version, its default knobs and where this version approximates it):

* ``sglang-cache-aware`` (:class:`SGLangCacheAwareRouter`): SGLang router's ``cache_aware`` policy;
* ``ray-prefix-affinity`` (:class:`RayPrefixAffinityRouter`): Ray Serve LLM's
  ``PrefixCacheAffinityRouter``;
* ``lmetric`` (:class:`LMetricRouter`): LMetric (OSDI '26), new prefill tokens x batch size;
* ``dynamo-kv`` (:class:`DynamoKvRouter`): NVIDIA Dynamo's KV router cost;
* ``llm-d-predicted-latency`` (:class:`LlmdPredictedLatencyRouter`): llm-d's predicted-latency scorer
  (TTFT and TPOT models trained online; it reads the clock and the replicas' metrics, and is not among
  :data:`PEERS`, which ``benchmarks.router_peers`` tunes).

Ours learning each replica's speed and KV size from what it serves is
:class:`~scheduler_runtime.learned_router.LearnedRouter` (``prefix-learned``), in its own module.

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

import math
import random
from collections import Counter, deque
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from scheduler_runtime.peer_routers import (
    PEERS,
    DynamoKvRouter,
    LlmdPredictedLatencyRouter,
    LMetricRouter,
    RayPrefixAffinityRouter,
    SGLangCacheAwareRouter,
)
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.router_base import (
    MAX_TABLE_KEYS,
    PrefixHasher,
    PrefixHistory,
    ReplicaRouter,
    RequestLedger,
    prompt_tokens,
)

__all__ = [
    "PEERS",
    "ROUTERS",
    "DynamoKvRouter",
    "LMetricRouter",
    "LlmdPredictedLatencyRouter",
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


#: Where ours sends a prefix no replica holds (``PrefixAffinityRouter(new_prefix=...)``).
NEW_PREFIX = ("least", "ring", "smallest", "least-smallest")


class PrefixAffinityRouter(ReplicaRouter):
    """Ours: longest known prefix, bounded by load (see the module docstring).

    The defaults (``load_factor=20, slack=2, new_prefix="least", min_match=0.1, cache_factor=1.25,
    cache_keep=0.5``, and the imbalance bound on a hot prefix ``balance_abs=8, balance_rel=1.5,
    hot_window=64, hot_share=1``, ``spread`` off) won the tuning search of ``benchmarks.router_peers`` (16
    simulated replicas, L-Eval, its Zipf-popularity variant and the Mooncake trace, with SGLang's, Ray
    Serve's, LMetric's and Dynamo's rules tuned beside it) and beat the previous ones (``5, 2, "least",
    0.1``, no cache model) on held-out seeds (``docs/results.md``). The third search (six Zipf tuning
    workloads, not three) moved the cache model from 1.5 to 1.25 x the KV and the hot bound from 16 / 8 to
    8 / 4: on the evaluation's seeds, +2.9% to +23% on Zipf (a document is hot once it takes a sixteenth
    of the matches, one replica's share at 16 replicas), +1.6% on L-Eval at 16 replicas and load 0.8, but
    -4.0% at 4 replicas and load 1 (where a replica's share is a quarter) and -3.7% at 16 and load 1.5.
    ``spread`` (Ray's rule among a hot document's holders) scored within 0.1% of it and was left off, as
    was ``new_prefix="least-smallest"`` (Ray's smallest tree as a tie-break: +4% at 64 replicas and load
    0.8, -5% at load 1, -6% on Zipf). The fourth search states the hot threshold as a share of the matches
    (``hot_share`` 1 or 2 replicas' share: 4 or 8 matches at 16 replicas, routing there as ``hot_min`` 4
    or 8 did), so that it scales with the cluster: over a fixed 4, at 4 replicas (seeds 10,000-10,002 and
    0-2) +1.1% / +2.1% / -0.6% at loads 0.8 / 1 / 1.5 on L-Eval, +2.0% on Zipf at load 1, Mooncake
    identical; at 64 replicas (10,000-10,002) identical at 0.8, -0.6% at 1. Tried there and dropped: a
    load counted in tokens (pending prefill plus the distinct KV tokens in flight: a hot document's
    replica looked light while its queue grew), a cost of new prefill tokens plus the tokens and requests
    in flight (LMetric's and Dynamo's terms on our table: better at 80% load, worse at 100%), and placing
    a new document by the new tokens in flight.
    A tighter request-count bound (``load_factor`` 3-5) spilled the Mooncake trace's hot long
    conversations, prefilling them again elsewhere.

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
            loaded; ``"least-smallest"``: the least loaded replica, of equals the one sent the fewest
            prompt tokens (then the first on the ring): at low load, when many replicas are idle, the
            documents spread by size as Ray's smallest tree spreads them, not by hash.
        min_match: a known prefix covering less than this fraction of the prompt is not followed:
            the request goes where a new prefix goes (SGLang's and Ray's match-rate threshold: a
            shared preamble of a few hundred tokens does not pull a new document onto its replica).
            Default 0.1; ``0``: any known prefix is followed.
        kv_tokens: each replica's KV cache in tokens, where the caller knows it (the simulator
            does; ``None``: unknown, and the cache model below is off).
        cache_factor: with ``kv_tokens``, a model of each replica's prefix cache: an LRU of
            ``cache_factor x kv_tokens`` tokens of the prompts it was sent (the chunks past what it
            already held, :class:`PrefixHistory`). A known prefix whose replica has, by this model,
            kept less than ``cache_keep`` of it (it was sent that many other tokens since) is followed
            no further: the request goes where a new prefix goes, to the least loaded replica, and the
            document with it (it was to be prefilled again anyway). ``0``: off. Default 1.25 (tuned).
        cache_keep: the share of the known prefix the model must still hold (default 0.5).
        balance_abs, balance_rel: an imbalance bound (SGLang's and Ray's thresholds, on the requests in
            flight): a replica serving more than ``max(least + balance_abs, balance_rel x least)``
            (``least``: the least loaded candidate's load) is not followed or spilled to; the request
            walks the ring as past the load bound. Default 8 and 1.5 (tuned, on a hot prefix only);
            ``balance_abs=inf``: off.
        hot_window, hot_share: with the imbalance bound, apply it only to a hot prefix: one whose
            deepest known key was the match of at least ``hot_share x hot_window / n`` (``n``
            replicas) of the last ``hot_window`` requests that matched a known prefix, ``hot_share`` x
            one replica's share whatever the cluster's size (a popular document's questions; a
            conversation's next turn, whose key is new each turn, is never hot). Default 64 and 1
            (tuned: 4 matches at 16 replicas, 16 at 4); ``hot_window`` 0: every prefix. Without
            ``hot_window`` the bound lost up to 30% on the Mooncake trace (``benchmarks.router_variants``).
        hot_min: if > 0, a fixed number of matches makes a prefix hot instead (``hot_share`` unused).
            Default 0.
        spread: with the cache model, a known prefix goes to the least loaded of the replicas the model
            says hold at least as much of it as the replica last sent it (that one among equals), not
            to that one alone (Ray's rule: of the replicas with the longest match, the shortest queue):
            a hot document spilled to a second replica is then shared by both. Default off.
        chunk_size: tokens per chunk of the hashes (the scheduler's chunk size; ``min_match`` and
            ``new_prefix="smallest"`` count tokens by it).
    """

    name = "prefix"
    uses_hashes = True

    def __init__(self, load_factor: float = 20.0, slack: int = 2, max_keys: int = MAX_TABLE_KEYS,
                 new_prefix: str = "least", min_match: float = 0.1, kv_tokens: int | None = None,
                 cache_factor: float = 1.25, cache_keep: float = 0.5,
                 balance_abs: float = 8.0, balance_rel: float = 1.5, hot_window: int = 64,
                 hot_share: float = 1.0, hot_min: int = 0, spread: bool = False,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__()
        if not load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1, got {load_factor}")
        if slack < 0 or max_keys < 2:
            raise ValueError("slack must be >= 0 and max_keys >= 2")
        if new_prefix not in NEW_PREFIX:
            raise ValueError(f"new_prefix must be one of {NEW_PREFIX}, got {new_prefix!r}")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1 or None, got {kv_tokens}")
        if cache_factor < 0 or not 0.0 <= cache_keep <= 1.0:
            raise ValueError(f"cache_factor must be >= 0 and cache_keep in [0, 1], got {cache_factor}, "
                             f"{cache_keep}")
        if (balance_abs < 0 or balance_rel < 1.0 or hot_window < 0 or hot_min < 0 or hot_share < 0
                or not (hot_min or hot_share)):
            raise ValueError("balance_abs must be >= 0, balance_rel >= 1, hot_window >= 0, and hot_min >= 0 "
                             "and hot_share >= 0, not both 0")
        self.spread = bool(spread)
        self.balance_abs = float(balance_abs)
        self.balance_rel = float(balance_rel)
        self.hot_window, self.hot_min = int(hot_window), int(hot_min)
        self.hot_share = float(hot_share)
        self._recent: deque[int] = deque()
        self._recent_count: Counter[int] = Counter()
        self.kv_tokens = kv_tokens
        self.cache_factor = float(cache_factor)
        self.cache_keep = float(cache_keep)
        #: The cache model (``kv_tokens`` and ``cache_factor``): what each replica still holds, LRU.
        self.cached: PrefixHistory | None = None
        if kv_tokens is not None and cache_factor > 0:
            self.cached = PrefixHistory(chunk_size, max(1, round(cache_factor * kv_tokens)))
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
        #: replica -> prompt tokens it was sent (``new_prefix="smallest"`` and ``"least-smallest"``; see
        #: the class docstring)
        self.sent_tokens: Counter[str] = Counter()
        self.counts = {"affinity": 0, "spilled": 0, "new": 0, "evicted": 0}

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

    def _hot(self, key: int, replicas: int) -> bool:
        """Count ``key`` as the match of one more request, over the last ``hot_window``; whether it is
        hot (matched at least ``hot_share x hot_window / replicas`` times there, or ``hot_min`` if
        set)."""
        self._recent.append(key)
        self._recent_count[key] += 1
        if len(self._recent) > self.hot_window:
            old = self._recent.popleft()
            self._recent_count[old] -= 1
            if not self._recent_count[old]:
                del self._recent_count[old]
        least = self.hot_min or max(1.0, self.hot_share * self.hot_window / replicas)
        return self._recent_count[key] >= least

    def routing_cache(self, loads: Mapping[str, float]) -> PrefixHistory | None:
        """The cache model :meth:`choose` routes by over ``loads``' replicas (``None``: none): ours', where
        it keeps one; a subclass may route without it where it does not trust it."""
        return self.cached

    def cache_holds(self, cached: PrefixHistory, hashes: np.ndarray) -> dict[str, int]:
        """Replica -> leading chunks of ``hashes`` that the cache model ``cached`` says it holds."""
        return cached.match(hashes)

    def caches_later(self, request_id: str | None) -> bool:
        """Whether the routed request ``request_id`` enters the cache model later than its routing (a
        subclass that hears the request's life may enter it when it is prefilled)."""
        return False

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        cap = self.bound(sum(loads.values()), len(loads))
        level, owner = self.owner(hashes)
        cached = self.routing_cache(loads)
        if owner is not None and (self.min_match > 0.0 or cached is not None):
            n = prompt_tokens(hashes, tokens, self.chunk_size)
            known = min((level + 1) * self.chunk_size, n)
            if known < self.min_match * n:
                level, owner = -1, None  # too little of it known: a new prefix
            elif cached is not None:
                held = self.cache_holds(cached, hashes)
                kept = min(held.get(owner, 0) * self.chunk_size, n)
                if kept < max(1.0, self.cache_keep * known):
                    self.counts["evicted"] += 1  # evicted there by now: prefilled again wherever it goes
                    level, owner = -1, None
                elif self.spread:  # Ray's rule: of the replicas holding as much, the least loaded
                    most = held[owner]
                    owner = min((r for r in ok if held.get(r, 0) >= most),
                                key=lambda r: (loads[r], r != owner, r), default=owner)
        floor = math.inf  # the imbalance bound: with hot_window, on a known prefix only if it is hot
        if self.balance_abs < math.inf and (self.hot_window == 0 or owner is None
                                            or self._hot(int(hashes[level]), len(loads))):
            least = min(loads[r] for r in ok)
            floor = max(least + self.balance_abs, self.balance_rel * least)

        def under(r: str) -> bool:
            return loads[r] < cap and loads[r] <= floor

        if owner is not None and owner in ok and under(owner):
            self.counts["affinity"] += 1
            return owner
        ring = self._ring_for(loads)
        if owner is None:
            self.counts["new"] += 1
            if self.new_prefix in ("least", "least-smallest"):
                least = min(loads[r] for r in ok)
                tied = {r for r in ok if loads[r] == least}
                if self.new_prefix == "least-smallest":  # of equals, the one sent the fewest tokens
                    fewest = min(self.sent_tokens[r] for r in tied)
                    tied = {r for r in tied if self.sent_tokens[r] == fewest}
                return next(r for r in ring.walk(int(hashes[-1])) if r in tied)
            if self.new_prefix == "smallest":
                sent = self.sent_tokens
                room = [r for r in ok if loads[r] < cap] or list(ok)
                return min(room, key=lambda r: (sent[r], loads[r], r))
            level = 0
        else:
            self.counts["spilled"] += 1
        for r in ring.walk(int(hashes[level])):
            if r in ok and under(r):
                return r
        return min(ok, key=lambda r: (loads[r], r))  # every replica at the bound

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        if hashes is None:
            return
        keys = hashes.tolist()
        if self.cached is not None and not self.caches_later(request_id):
            self.cached.insert(hashes, replica, tokens)
        if self.new_prefix in ("smallest", "least-smallest"):  # the keys past the deepest one it owns
            get, chunk = self._get, self.chunk_size
            n, added = prompt_tokens(hashes, tokens, chunk), 0
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
        if self.cached is not None:
            self.cached.forget(replica)

    def state(self) -> dict[str, Any]:
        return {**self.counts, "table_keys": len(self._young) + len(self._old)}


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
    LlmdPredictedLatencyRouter.name: LlmdPredictedLatencyRouter,
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
