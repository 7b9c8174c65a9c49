"""The field's replica routers, as peers to measure ours
(:class:`~scheduler_runtime.router.PrefixAffinityRouter`) against. The docstring of
:mod:`scheduler_runtime.router` says how they see a request; each class's docstring names the rule
it follows, its source and version, its default knobs and where this version approximates it.
:data:`~scheduler_runtime.router.ROUTERS` holds them beside ours.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.router_base import (
    PrefixHistory,
    ReplicaRouter,
    RequestLedger,
    chunk_spans,
    prompt_tokens,
)

__all__ = ["PEERS", "DynamoKvRouter", "LMetricRouter", "RayPrefixAffinityRouter", "SGLangCacheAwareRouter"]


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
        n = prompt_tokens(hashes, tokens, self.chunk_size)
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
                            chunk_spans(len(keys), tokens, self.chunk_size))
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
        active_hit = self.ledger.active_overlap(keys, chunk_spans(len(keys), tokens, self.chunk_size))
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
