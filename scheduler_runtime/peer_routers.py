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

__all__ = ["PEERS", "DynamoKvRouter", "LMetricRouter", "LatencyModel", "LlmdPredictedLatencyRouter",
           "RayPrefixAffinityRouter", "SGLangCacheAwareRouter"]


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

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
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


class LatencyModel:
    """An online linear regression (recursive least squares with exponential forgetting ``forget`` per
    sample, ridge prior ``ridge``): llm-d's latency predictor's model, trained on every observation as
    it comes instead of an XGBoost model refitted now and then."""

    def __init__(self, features: int, forget: float = 0.998, ridge: float = 1.0) -> None:
        if not 0.0 < forget <= 1.0 or ridge <= 0:
            raise ValueError("forget must be in (0, 1] and ridge > 0")
        self.forget = float(forget)
        self.coef = np.zeros(features)
        self.cov = np.eye(features) / ridge
        self.samples = 0

    def add(self, x: np.ndarray, y: float) -> None:
        p, lam = self.cov, self.forget
        px = p @ x
        gain = px / (lam + x @ px)
        self.coef = self.coef + gain * (y - x @ self.coef)
        self.cov = (p - np.outer(gain, px)) / lam
        self.samples += 1

    def predict(self, x: np.ndarray) -> float:
        return max(0.0, float(x @ self.coef))


class LlmdPredictedLatencyRouter(_PeerRouter):
    """llm-d's predicted-latency scheduling (the inference scheduler's ``predicted-latency`` /
    ``latency-scorer`` plugins with the ``llm-d-latency-predictor`` sidecars; llm-d 0.3 to 0.7, docs
    "Latency Predictor" and guide "Predicted Latency-Based Scheduling"): the endpoint picker predicts
    each candidate pod's TTFT and TPOT for this request with models trained online from the pool's own
    requests, and picks by those predictions against the request's SLOs.

    The models' features, per pod at the request's dispatch (llm-d's ``PredictionRequest``): KV cache
    usage (``vllm:kv_cache_usage_perc``), input tokens, requests waiting and running (the scraped
    ``vllm:num_requests_waiting`` / ``_running``), the prefix cache score (the share of the prompt the
    pod's prefix index holds) and, for TPOT, tokens generated. TTFT samples come at the first token,
    TPOT samples at the finish. One model each for the whole pool (llm-d's predictor assumes every pod
    alike: "heterogeneous pools are not yet modeled"; ``per_pod=True`` trains one per pod instead).

    The rule (``latency-scorer`` with SLO headers; the SLOs are the benchmark's, ``ttft_slo_ms`` and
    ``tpot_slo_ms``): (1) the global affinity gate: with probability ``1 - epsilon_explore_sticky``
    (0.99), only pods whose prefix score is at least ``affinity_gate_tau_global`` (0.99), if any;
    (2) tiers: pods whose predicted TTFT and TPOT both meet the SLOs (positive headroom), else the rest;
    with both, the negative tier with probability ``epsilon_explore_neg`` (0.01); (3) in the positive
    tier, the per-tier affinity gate (``affinity_gate_tau`` 0.8, the same exploration), then
    ``headroom_selection_strategy="least"`` (bin-packing: the least headroom scores highest) on
    ``ttft_weight`` 0.8 x TTFT headroom + ``tpot_weight`` 0.2 x TPOT headroom, each normalised over the
    tier; in the negative tier, the idle pods (no running request) first, then the least weighted
    deficit (0.8 / 0.2); (4) ``selection_mode="linear"``: a pod drawn with probability proportional to
    its score. Without SLOs (``ttft_slo_ms=None``): the lowest blended predicted latency. Until the
    models have ``min_samples`` samples: the composite fallback, KV headroom + queue + prefix score
    (weights 1, 1, 1), the best.

    Approximations: the model is an online linear regression (:class:`LatencyModel`) over those features
    plus one interaction, input tokens x (1 - prefix score) (the uncached tokens, which a tree model
    finds by itself), where llm-d refits an XGBoost model on a window of samples; TPOT is one sample
    per request (its mean), where llm-d samples every ~200th token; metrics are those of the latest
    scrape (llm-d refreshes every 50 ms; the benchmark scrapes at every arrival); the prefix index is
    :class:`PrefixHistory` (whole chunks), as for the other peers.
    """

    name = "llm-d-predicted-latency"
    observes_service = True
    #: the TTFT model's features: 1, KV usage, input (K tokens), waiting, running, prefix score, uncached (K)
    TTFT_FEATURES = 7
    #: the TPOT model's: 1, KV usage, input (K tokens), waiting, running, tokens generated (K)
    TPOT_FEATURES = 6

    def __init__(self, ttft_slo_ms: float | None = 5000.0, tpot_slo_ms: float | None = 50.0,
                 ttft_weight: float = 0.8, tpot_weight: float = 0.2,
                 headroom_selection_strategy: str = "least",
                 affinity_gate_tau_global: float = 0.99, affinity_gate_tau: float = 0.8,
                 epsilon_explore_sticky: float = 0.01, epsilon_explore_neg: float = 0.01,
                 selection_mode: str = "linear", min_samples: int = 10, per_pod: bool = False,
                 forget: float = 0.998, seed: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size)
        if headroom_selection_strategy not in ("least", "most") or selection_mode not in ("linear", "max"):
            raise ValueError("headroom_selection_strategy must be least or most, "
                             "selection_mode linear or max")
        self.ttft_slo_ms, self.tpot_slo_ms = ttft_slo_ms, tpot_slo_ms
        self.ttft_weight, self.tpot_weight = float(ttft_weight), float(tpot_weight)
        self.strategy, self.selection_mode = headroom_selection_strategy, selection_mode
        self.tau_global, self.tau = float(affinity_gate_tau_global), float(affinity_gate_tau)
        self.eps_sticky, self.eps_neg = float(epsilon_explore_sticky), float(epsilon_explore_neg)
        self.min_samples, self.per_pod, self.forget_rate = int(min_samples), bool(per_pod), float(forget)
        self._rng = random.Random(seed)
        self._models: dict[str, tuple[LatencyModel, LatencyModel]] = {}
        self._metrics: dict[str, Mapping[str, Any]] = {}
        #: request id -> (pod, TTFT features, TPOT features, dispatch time, first token time)
        self._inflight: dict[str, list[Any]] = {}
        self._pending: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None

    def _model(self, pod: str) -> tuple[LatencyModel, LatencyModel]:
        key = pod if self.per_pod else ""
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = (LatencyModel(self.TTFT_FEATURES, self.forget_rate),
                                     LatencyModel(self.TPOT_FEATURES, self.forget_rate))
        return m

    def scraped(self, replica: str, metrics: Mapping[str, Any]) -> None:
        self._metrics[replica] = metrics

    def _state(self, pod: str) -> tuple[float, float, float]:
        m = self._metrics.get(pod, {})
        return (float(m.get("vllm:kv_cache_usage_perc", 0.0)), float(m.get("vllm:num_requests_waiting", 0)),
                float(m.get("vllm:num_requests_running", 0)))

    def prefix_score(self, held: int, n: int) -> float:
        """The share of an ``n``-token prompt a pod holds, ``held`` tokens of whole chunks: a prompt's
        last, partial chunk (a question after its document) is counted as held when every chunk before
        it is, as llm-d's 16-token blocks would find the document's tail."""
        if n <= 0:
            return 0.0
        whole = (n - 1) // self.chunk_size * self.chunk_size  # the tokens of every chunk but the last
        return 1.0 if whole and held >= whole else held / n

    def features(self, pod: str, n: int, prefix_score: float) -> tuple[np.ndarray, np.ndarray]:
        """The TTFT and TPOT models' features of a request of ``n`` tokens on ``pod``."""
        kv, waiting, running = self._state(pod)
        k = n / 1000.0
        ttft = np.array([1.0, kv, k, waiting, running, prefix_score, k * (1.0 - prefix_score)])
        tpot = np.array([1.0, kv, k, waiting, running, 0.0])
        return ttft, tpot

    def _linear(self, scores: dict[str, float]) -> str:
        pods = sorted(scores)
        if self.selection_mode == "max":
            return max(pods, key=lambda p: (scores[p], p))
        weights = [max(scores[p], 0.0) + 1e-6 for p in pods]
        return self._rng.choices(pods, weights)[0]

    def _gate(self, pods: list[str], score: Mapping[str, float], tau: float) -> list[str]:
        if self._rng.random() < self.eps_sticky:
            return pods
        sticky = [p for p in pods if score.get(p, 0.0) >= tau]
        return sticky or pods

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = sorted(self._allowed(loads, avoid))
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        n, held = self._match(hashes, tokens)
        score = {p: self.prefix_score(held.get(p, 0), n) for p in ok}
        feats = {p: self.features(p, n, score[p]) for p in ok}
        self._pending = ({p: f[0] for p, f in feats.items()}, {p: f[1] for p, f in feats.items()})
        models = {p: self._model(p) for p in ok}
        if any(m[0].samples < self.min_samples or m[1].samples < self.min_samples for m in models.values()):
            self.counts["composite"] += 1
            top_wait = max(self._state(p)[1] for p in ok) or 1.0
            return max(ok, key=lambda p: ((1.0 - self._state(p)[0]) + (1.0 - self._state(p)[1] / top_wait)
                                          + score[p], -loads[p], p))
        ttft = {p: models[p][0].predict(feats[p][0]) for p in ok}
        tpot = {p: models[p][1].predict(feats[p][1]) for p in ok}
        if self.ttft_slo_ms is None or self.tpot_slo_ms is None:
            self.counts["lowest_latency"] += 1
            return min(ok, key=lambda p: (self.ttft_weight * ttft[p] + self.tpot_weight * tpot[p], p))
        pods = self._gate(ok, score, self.tau_global)
        positive = [p for p in pods if ttft[p] <= self.ttft_slo_ms and tpot[p] <= self.tpot_slo_ms]
        negative = [p for p in pods if p not in positive]
        if positive and (not negative or self._rng.random() >= self.eps_neg):
            self.counts["positive"] += 1
            tier = self._gate(positive, score, self.tau)
            room = {p: (self.ttft_weight * _spread(tier, {q: self.ttft_slo_ms - ttft[q] for q in tier})[p]
                        + self.tpot_weight * _spread(tier, {q: self.tpot_slo_ms - tpot[q] for q in tier})[p])
                    for p in tier}
            total = self.ttft_weight + self.tpot_weight
            scores = {p: 1.0 - room[p] / total if self.strategy == "least" else room[p] / total for p in tier}
            return self._linear(scores)
        self.counts["negative"] += 1
        idle = [p for p in negative if self._state(p)[2] == 0]
        tier = idle or negative
        deficit = {p: (self.ttft_weight * _spread(tier, {q: ttft[q] - self.ttft_slo_ms for q in tier})[p]
                       + self.tpot_weight * _spread(tier, {q: tpot[q] - self.tpot_slo_ms for q in tier})[p])
                   for p in tier}
        total = self.ttft_weight + self.tpot_weight
        return self._linear({p: 1.0 - deficit[p] / total for p in tier})

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        pending, self._pending = self._pending, None
        if request_id is not None and hashes is not None and len(hashes):
            if pending is None or replica not in pending[0]:
                n, held = self._match(hashes, tokens)
                score = self.prefix_score(held.get(replica, 0), n)
                pending = tuple({replica: f} for f in self.features(replica, n, score))
            self._inflight[request_id] = [replica, pending[0][replica], pending[1][replica], self.clock(),
                                          None]
        super().routed(hashes, replica, tokens=tokens, request_id=request_id)

    def prefilled(self, request_id: str) -> None:
        super().prefilled(request_id)
        entry = self._inflight.get(request_id)
        if entry is None:
            return
        now = self.clock()
        entry[4] = now
        self._model(entry[0])[0].add(entry[1], (now - entry[3]) * 1000.0)

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
        super().finished(request_id)
        entry = self._inflight.pop(request_id, None)
        if entry is None or entry[4] is None or output_tokens is None or output_tokens < 2:
            return
        tpot_ms = (self.clock() - entry[4]) * 1000.0 / (output_tokens - 1)
        x = entry[2].copy()
        x[5] = output_tokens / 1000.0
        self._model(entry[0])[1].add(x, tpot_ms)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self._metrics.pop(replica, None)
        self._models.pop(replica, None)


def _spread(pods: Collection[str], values: Mapping[str, float]) -> dict[str, float]:
    """``values`` normalised to [0, 1] over ``pods`` (all 0.5 when they are equal)."""
    lo, hi = min(values[p] for p in pods), max(values[p] for p in pods)
    if hi - lo <= 1e-12:
        return dict.fromkeys(pods, 0.5)
    return {p: (values[p] - lo) / (hi - lo) for p in pods}


#: The field's routers (:data:`ROUTERS` holds them too), in the order the benchmark reports them.
PEERS: tuple[str, ...] = (SGLangCacheAwareRouter.name, RayPrefixAffinityRouter.name, LMetricRouter.name,
                          DynamoKvRouter.name)
