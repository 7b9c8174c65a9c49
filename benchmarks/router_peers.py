"""The field's routers beside ours on the cluster simulator, each at its defaults and tuned the same way.

    python -m benchmarks.router_peers --json results/router_peers.json

The routers (:mod:`scheduler_runtime.router`): ours (``prefix``), SGLang router's ``cache_aware``
policy (``sglang-cache-aware``), Ray Serve LLM's ``PrefixCacheAffinityRouter``
(``ray-prefix-affinity``), LMetric (``lmetric``, no knobs) and NVIDIA Dynamo's KV router
(``dynamo-kv``); each class's docstring says which published rule it follows, its default knobs and
where it approximates it (the peers' radix trees are sets of 512-token chunk keys).

The cluster and the workload are :mod:`benchmarks.routing`'s: N simulated replicas of
``leval-kv-pressure``'s engine (0.25 GiB of KV: a few 8K-token documents each), Feather's
heuristic in every replica; 16 L-Eval documents per replica with at most 8 questions each, in a
random order (past the data's 244 documents, copies with another first chunk); Poisson arrivals
at ``load`` x the cluster's saturation rate, measured once per workload with a fixed reference
router (:data:`REFERENCE`: ours as shipped before the first study, ``load_factor=1.25, slack=2``, the
ring), so that the offered load does not move with the router under test. Ours is told each
replica's KV tokens (its cache model's ``kv_tokens``).

1. **Tuning** (:func:`tune`): a small grid per router (:func:`grids`), scored by the mean output
   throughput at 16 replicas and loads 0.8 and 1.0 (the targets') over ``--tune-seeds`` (6)
   workloads whose documents and arrivals are drawn with seeds disjoint from the evaluation's (with
   3, the search's noise, about 1.5% per setting, was as large as what it decides between), beside
   ``--tune-zipf`` (6: the Zipf variants of every one of those; with 3, the sharing of a hot
   document's holders, worth 1.5-3% on Zipf held out, did not register) Zipf-popularity workloads and
   ``--tune-mooncake`` (3) Mooncake windows of tuning seeds too (every router scored on all three).
   Ours is searched in five stages: every ``load_factor`` x
   ``slack`` x ``new_prefix`` (no match-rate threshold, no cache model), then the best four again
   with ``min_match`` 0.1 and 0.3, then the best three so far with the cache model (``cache_factor``
   1 to 2), then the best two so far with the imbalance bound on a hot prefix
   (:data:`OURS_STAGE_FOUR`), then the best four so far with a prefix's holders shared
   (:data:`OURS_STAGE_FIVE`).
2. **Evaluation** (:func:`cell`): every router at its defaults and at its tuned knobs, at
   ``--loads`` (0.8, 1.0, and 1.5, past every router's capacity) on the evaluation seeds (the
   arrival draws 0, 1, 2 of :mod:`benchmarks.routing`'s workload): output throughput, mean and P99
   TTFT and E2E latency, goodput (vLLM's definition: completed requests per second that met every
   SLO of ``--goodput``), the prefix-cache hit rate, and ours (tuned) over each. At 16 replicas
   (the targets), 4 and 64 (``--docs-per-replica-large`` documents per replica and ``--loads-large``
   there, to keep the run short), and a Zipf variant at 16 replicas
   (:func:`~feather_env.cluster_sim.zipf_documents`: the same number of requests over the same
   documents, document popularity Zipf ``--zipf-s``), and the Mooncake synthetic trace at 4 and 16
   replicas (:func:`mooncake_windows`: a window of ``--mooncake-window`` x replicas seconds of the
   trace per seed, its own timestamps scaled to the load, :func:`at_rate`; the peers at the knobs
   tuned on L-Eval). Beside each cell, :func:`throughput_bound`: the output throughput no router can
   beat on those arrivals.

Targets (16 replicas, loads 0.8 and 1.0, output throughput): ours (tuned) >= 1.05x the tuned SGLang
and Ray routers and >= 1.0x the tuned LMetric and Dynamo routers.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.cluster_sim import ClusterResult, ClusterSim, distinct_documents, zipf_documents
from feather_env.evaluation.bound import arrival_order, prefix_work
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import parse_goodput
from feather_env.workloads import Request, Workload, WorkloadConfig, load_workload
from scheduler_runtime.router import (
    PEERS,
    ROUTERS,
    PrefixAffinityRouter,
    ReplicaRouter,
    make_router,
)

OURS = "prefix"
#: The reference router that measures each workload's saturation rate: ours as shipped before the
#: first study of the field's routers (fixed, so that a load means the same rate from run to run; every
#: knob ours' defaults could change is stated, the imbalance bound off).
REFERENCE: dict[str, Any] = {"load_factor": 1.25, "slack": 2, "new_prefix": "ring", "min_match": 0.0,
                             "cache_factor": 0.0, "balance_abs": math.inf, "spread": False}
#: Ours as shipped before this study (the first study's tuned setting, no cache model): ours' default row.
OURS_BEFORE: dict[str, Any] = {"load_factor": 5.0, "slack": 2, "new_prefix": "least", "min_match": 0.1,
                               "cache_factor": 0.0, "balance_abs": math.inf, "spread": False}
ROUTER_ORDER = (OURS, *PEERS)
#: Routers that draw random numbers (seeded with the arrival seed).
SEEDED = {"pow2", "ray-prefix-affinity", "dynamo-kv"}
#: ours (tuned) over each tuned peer, at 16 replicas and every evaluated load.
TARGETS = {"sglang-cache-aware": 1.05, "ray-prefix-affinity": 1.05, "lmetric": 1.0, "dynamo-kv": 1.0}
TARGET_REPLICAS = 16
#: Seeds from here draw workloads of their own (the tuning's, and ``benchmarks.router_variants``'
#: held-out ones); the evaluation's are below.
TUNE_SEED_BASE = 10_000
#: Held-out draws (``--first-seed`` of ``benchmarks.equal_learned`` and ``benchmarks.unequal_replicas``)
#: start here: seeds that no tuning (from :data:`TUNE_SEED_BASE`, at most a few dozen) or study saw, each
#: drawing its own workload as a tuning seed does.
HELD_OUT_DRAWS = 20_000
#: L-Eval documents per replica, and from :data:`LARGE_REPLICAS` replicas on.
DOCS_PER_REPLICA, DOCS_PER_REPLICA_LARGE, LARGE_REPLICAS = 16, 8, 64
#: The Zipf variant's popularity exponent.
ZIPF_S = 1.1
#: Seconds of the Mooncake trace per replica in one window.
MOONCAKE_WINDOW_S = 40.0
DEFAULT_SCENARIO = "leval-kv-pressure"
#: Ours' second tuning stage: each of these on each of the first stage's best four settings.
OURS_STAGE_TWO = ({"min_match": 0.1}, {"min_match": 0.3})
#: Ours' third stage: the cache model (``cache_factor`` x the replica's KV tokens) on the best two so far.
OURS_STAGE_THREE = tuple({"cache_factor": f} for f in (1.0, 1.25, 1.5, 1.75, 2.0))
#: Ours' fourth stage: the imbalance bound on a hot prefix only (``balance_abs`` x ``hot_share``, a
#: prefix hot at 1 or 2 replicas' share of the last 64 matched requests: 4 or 8 at 16 replicas;
#: SGLang's ``balance_rel`` 1.5) on the best two so far.
OURS_STAGE_FOUR = tuple({"balance_abs": a, "balance_rel": 1.5, "hot_window": 64, "hot_share": m}
                        for a, m in itertools.product((4, 8, 16), (1, 2)))
#: Ours' fifth stage: the cache model's holders of a known prefix shared (``spread``, Ray's rule: of the
#: replicas holding the longest match, the least loaded) on the best four so far.
OURS_STAGE_FIVE = ({"spread": True},)
#: Ours' stages: the first's grid, then two (:data:`OURS_STAGE_TWO`) on its best four, then three on
#: the best three so far (of distinct scores), four on the best two, five on the best four.
DEFAULT_GOODPUT = "ttft:2000 e2el:10000"
#: The Mooncake synthetic trace's scenario (its engine: 1 GiB of KV; its blocks: 64 tokens per hash id).
MOONCAKE_SCENARIO = "mooncake-synthetic"


def make(name: str, knobs: dict[str, Any], seed: int, kv_tokens: int | None = None) -> ReplicaRouter:
    """Router ``name`` with ``knobs`` (its random draws seeded with ``seed`` where it makes any;
    ``"inf"`` is infinity, as the JSON holds it). Ours is told each replica's KV tokens (``kv_tokens``),
    which its cache model needs."""
    knobs = {k: math.inf if v == "inf" else v for k, v in knobs.items()}
    extra = {"seed": seed} if name in SEEDED else {}
    if name == OURS and kv_tokens is not None:
        extra["kv_tokens"] = kv_tokens
    return make_router(name, **knobs, **extra)


def _jsonable(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in knobs.items()}


def defaults(name: str) -> dict[str, Any]:
    """The knobs of a router's default row: ours as shipped before the study, a peer's published ones
    (its class's defaults)."""
    if name == OURS:
        return _jsonable(OURS_BEFORE)
    params = inspect.signature(ROUTERS[name].__init__).parameters.values()
    return _jsonable({p.name: p.default for p in params if p.default is not inspect.Parameter.empty
                      and p.name not in ("seed", "chunk_size", "kv_tokens")})


def _is_default(name: str, knobs: dict[str, Any]) -> bool:
    return {**defaults(name), **_jsonable(knobs)} == defaults(name)


def _rank(name: str, row: dict[str, Any]) -> tuple[float, int]:
    """A tuning row's rank: its score, then (among equal scores: the same choices) how many knobs it
    shares with the defaults."""
    base = defaults(name)
    return row["output_throughput"], sum(base.get(k) == v for k, v in _jsonable(row["knobs"]).items())


def _top(name: str, scored: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ``k`` best tuning rows of distinct scores (settings that route alike score alike: one of them,
    the closest to the defaults, stands for all)."""
    out: list[dict[str, Any]] = []
    for row in sorted(scored, key=lambda r: _rank(name, r), reverse=True):
        if all(row["output_throughput"] != o["output_throughput"] for o in out):
            out.append(row)
    return out[:k]


def grids() -> dict[str, list[dict[str, Any]]]:
    """Each router's tuning grid (ours: stage one; stage two, :data:`OURS_STAGE_TWO`, on its best four)."""
    ours = [{"load_factor": c, "slack": s, "new_prefix": p, "min_match": 0.0, "cache_factor": 0.0,
             "balance_abs": math.inf, "spread": False}
            for c, s, p in itertools.product((1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0, 20.0), (0, 2), ("least",))]
    balance = ((64, 1.5), (32, 1.1), (8, 1.5), (4, 1.25))  # 0.3.x's RouterArgs, Rust's default, tighter
    sglang = [{"cache_threshold": t, "balance_abs_threshold": a, "balance_rel_threshold": r}
              for t, (a, r) in itertools.product((0.1, 0.3, 0.5, 0.7), balance)]
    ray = [{"imbalanced_threshold": i, "match_rate_threshold": m}
           for i, m in itertools.product((math.inf, 16, 8, 4), (0.1, 0.3, 0.5))]
    dynamo = [{"overlap_score_weight": w} for w in (0.5, 1.0, 2.0, 4.0, 8.0)]
    return {OURS: ours, "sglang-cache-aware": sglang, "ray-prefix-affinity": ray, "lmetric": [{}],
            "dynamo-kv": dynamo}


# ------------------------------------------------------------------------------------ workloads


def saturation_rate(sim: ClusterSim, workload: Workload) -> float:
    """Request throughput of the cluster with the reference router when all of ``workload`` arrives."""
    router = PrefixAffinityRouter(**REFERENCE)
    return sim.run(workload.with_arrivals("burst"), router).metrics["request_throughput"]


def kv_tokens(sim: ClusterSim) -> int:
    """Each replica's KV cache in tokens (what ours' cache model is told)."""
    return int(sim.engine.usable_kv_tokens)


def at_rate(workload: Workload, rate: float) -> Workload:
    """A timed trace with its own timestamps scaled to a mean of ``rate`` requests per second."""
    times = [r.arrival_time for r in workload]
    span = max(times) - min(times)
    scale = (len(workload) - 1) / span / rate if span > 0 else 1.0
    t0 = min(times)
    return Workload(f"{workload.name}@{rate:.3g}req/s",
                    tuple(r.with_arrival((r.arrival_time - t0) * scale) for r in workload), "trace")


def mooncake_pool(max_prompt_tokens: int | None = None) -> Workload:
    """The Mooncake synthetic trace as ``configs/scenarios/mooncake-synthetic.yaml`` reads it (64 token ids
    per hash id: lengths / 8); with ``max_prompt_tokens``, each prompt cut to its first so many tokens
    (the loader's ``overflow="truncate"``: a cut prompt keeps its leading blocks, so its shared prefix)."""
    overrides = None if max_prompt_tokens is None else {"workload": {"max_prompt_tokens": max_prompt_tokens}}
    return load_scenario(MOONCAKE_SCENARIO, overrides).pool


def mooncake_windows(window_s: float, seeds: Sequence[int], pool: Workload | None = None) -> list[Workload]:
    """Windows of ``window_s`` seconds of the Mooncake synthetic trace (one per seed, drawn as
    :meth:`Workload.window` draws them), of ``pool`` (default: :func:`mooncake_pool`, uncut)."""
    pool = mooncake_pool() if pool is None else pool
    return [pool.window(window_s, seed) for seed in seeds]


def uniform_workload(pool: Workload, replicas: int, docs_per_replica: int, seed: int) -> Workload:
    """:mod:`benchmarks.routing`'s workload (its evaluation draw is ``seed=replicas``)."""
    return distinct_documents(pool, docs_per_replica * replicas, seed=seed, max_per_group=8)


@dataclasses.dataclass
class CellRuns:
    """A cell's simulator and its workloads, one per seed (:func:`cell_runs`), each with its saturation
    rate; :meth:`timed` gives them arrivals at a load."""

    kind: str
    sim: ClusterSim
    seeds: list[int]
    workloads: list[Workload]
    saturations: list[float]

    def distinct(self) -> list[tuple[Workload, float]]:
        """Each distinct workload (the evaluation's seeds share one) with its saturation rate."""
        seen: dict[int, tuple[Workload, float]] = {}
        for w, sat in zip(self.workloads, self.saturations, strict=True):
            seen.setdefault(id(w), (w, sat))
        return list(seen.values())

    def timed(self, load: float) -> list[tuple[int, Workload]]:
        """``(seed, workload with arrivals)`` at ``load`` x its saturation rate: Poisson arrivals drawn
        with the seed (L-Eval, Zipf), or the trace's own timestamps scaled (:func:`at_rate`, Mooncake)."""
        runs = zip(self.seeds, self.workloads, self.saturations, strict=True)
        if self.kind == "mooncake":
            return [(seed, at_rate(w, load * sat)) for seed, w, sat in runs]
        return [(seed, w.with_arrivals(f"poisson:{load * sat}", seed)) for seed, w, sat in runs]


def cell_runs(kind: str, replicas: int, seeds: Sequence[int], *, pool: Workload | None = None,
              scenario: str = DEFAULT_SCENARIO, docs_per_replica: int = DOCS_PER_REPLICA,
              docs_per_replica_large: int = DOCS_PER_REPLICA_LARGE, large_replicas: int = LARGE_REPLICAS,
              zipf_s: float = ZIPF_S, mooncake_window: float = MOONCAKE_WINDOW_S,
              sim: ClusterSim | None = None) -> CellRuns:
    """The simulator of a cell (``kind``: ``"uniform"``, L-Eval; ``"zipf"``, its Zipf-popularity
    variant, ``zipf_s``; ``"mooncake"``, the Mooncake synthetic trace) of ``replicas`` and its workload
    per seed. A seed below :data:`TUNE_SEED_BASE` is the evaluation's: L-Eval's one workload (documents
    drawn with ``seed=replicas``; ``docs_per_replica``, ``docs_per_replica_large`` from
    ``large_replicas`` on), its arrivals drawn with the seed; from there on, the tuning's: a workload of
    its own (documents drawn with ``seed + 100 x replicas``). A Mooncake seed draws its window of
    ``mooncake_window`` x replicas seconds either way. ``pool``: the L-Eval pool (read if not given);
    ``sim``: the simulator to use (one of ``replicas`` of the right engine)."""
    if kind == "mooncake":
        sim = sim or ClusterSim(replicas, load_scenario(MOONCAKE_SCENARIO).engine_config())
        workloads = mooncake_windows(mooncake_window * replicas, seeds)
    elif kind in ("uniform", "zipf"):
        sim = sim or ClusterSim(replicas, load_scenario(scenario).engine_config())
        if pool is None:
            pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
        docs = docs_per_replica_large if replicas >= large_replicas else docs_per_replica
        drawn: dict[int, Workload] = {}

        def draw(seed: int) -> Workload:
            base = uniform_workload(pool, replicas, docs, seed=seed)
            if kind == "zipf":
                return zipf_documents(pool, base.num_groups, len(base), zipf_s, seed=seed)
            return base

        workloads = []
        for seed in seeds:
            ws = replicas if seed < TUNE_SEED_BASE else seed + 100 * replicas
            if ws not in drawn:
                drawn[ws] = draw(ws)
            workloads.append(drawn[ws])
    else:
        raise ValueError(f"unknown cell kind {kind!r}")
    if sim.num_replicas != replicas:
        raise ValueError(f"sim has {sim.num_replicas} replicas, not {replicas}")
    rates: dict[int, float] = {}  # one saturation run per distinct workload
    for w in workloads:
        if id(w) not in rates:
            rates[id(w)] = saturation_rate(sim, w)
    return CellRuns(kind, sim, list(seeds), workloads, [rates[id(w)] for w in workloads])


# ------------------------------------------------------------------------------------ the bound


def service_floor(engine_sim: ClusterSim, request: Request, cached: int) -> float:
    """The least end-to-end latency ``request`` can have when a prefix cache holds the first ``cached``
    tokens of its prompt: alone on an idle replica that served those tokens once before (with one
    output token; none if ``cached`` is 0), so only the rest of its prefill and its decode at batch
    size 1 remain."""
    at = 1000.0 if cached else 0.0
    real = Request(request.request_id, request.prompt_token_ids, request.prefix_group, request.output_len,
                   at, request.source, request.meta)
    warm = (Request(f"{request.request_id}@warm", request.prompt_token_ids[:cached], request.prefix_group,
                    1, 0.0, request.source, request.meta),) if cached else ()
    served = engine_sim.run(Workload("floor", (*warm, real)), make_router("round-robin"))
    return served.metrics["duration"] - at


def throughput_bound(engine_sim: ClusterSim, timed: Workload, floors: dict[tuple[str, int], float],
                     horizon_s: float = 60.0) -> float:
    """Output tok/s no router can beat on ``timed`` (its arrivals as given): every request finishes no
    earlier than its arrival plus its :func:`service_floor` with the prefix that earlier arrivals could
    have left in a cache (:func:`~feather_env.evaluation.bound.prefix_work`: whole KV blocks an earlier
    prompt shares with it, so a document's first question is prefilled whole), so the run lasts at
    least the latest of those (the requests of the last ``horizon_s`` seconds are checked: a floor is a
    few seconds here). It takes a prompt's prefill in parts to cost no less than
    in one go, as the engine's step costs do. ``floors``: (request id, cached tokens) -> floor, filled
    as computed."""
    start = min(r.arrival_time for r in timed)
    last = max(r.arrival_time for r in timed)
    reusable = {r.request_id: cached for r, (_, cached) in
                zip(arrival_order(timed), prefix_work(timed, engine_sim.engine.block_size), strict=True)}
    end = last
    for r in timed:
        if r.arrival_time >= last - horizon_s:
            key = (r.request_id, reusable[r.request_id])
            if key not in floors:
                floors[key] = service_floor(engine_sim, r, key[1])
            end = max(end, r.arrival_time + floors[key])
    return sum(r.output_len for r in timed) / (end - start)


# ------------------------------------------------------------------------------------ measuring


def _summary(results: Sequence[ClusterResult]) -> dict[str, Any]:
    def mean(key: str) -> float:
        return statistics.fmean(float(r.metrics[key]) for r in results)

    good = [r.metrics["request_goodput"] * r.metrics["duration"] / max(1, r.metrics["completed"])
            for r in results if r.metrics.get("request_goodput") is not None]
    return {"output_throughput": mean("output_throughput"), "request_goodput": mean("request_goodput"),
            "good_fraction": statistics.fmean(good) if good else None,
            "mean_ttft_ms": mean("mean_ttft_ms"), "p99_ttft_ms": mean("p99_ttft_ms"),
            "mean_e2el_ms": mean("mean_e2el_ms"), "p99_e2el_ms": mean("p99_e2el_ms"),
            "prefix_hit_rate": mean("prefix_hit_rate"),
            "max_over_mean": statistics.fmean(r.max_over_mean for r in results),
            "output_throughput_runs": [r.metrics["output_throughput"] for r in results],
            "wall_s": sum(r.wall_s for r in results)}


def run_rows(sim: ClusterSim, timed: Sequence[tuple[int, Workload]], rows: Sequence[tuple[str, str, dict]],
             goodput: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each row ``(label, router, knobs)`` on each ``(seed, workload with arrivals)``: label -> summary."""
    out = {}
    kv = kv_tokens(sim)
    for label, name, knobs in rows:
        results = [sim.run(w, make(name, knobs, seed, kv), goodput=goodput) for seed, w in timed]
        out[label] = {"router": name, "knobs": _jsonable(knobs), **_summary(results)}
    return out


def tune(sim: ClusterSim, pool: Workload, args: argparse.Namespace, goodput: dict[str, float],
         log: Callable[[str], None], mooncake_sim: ClusterSim | None = None) -> dict[str, Any]:
    """Each router's grid on the tuning workloads: ``{router: {"best": knobs, "grid": [...]}}``. The
    L-Eval workloads on ``sim``, ``--tune-zipf`` of their Zipf-popularity variants (``--zipf-s``, the
    first of those workloads' documents and seeds) on it and, with ``mooncake_sim``, ``--tune-mooncake``
    windows of the Mooncake trace (seeds of their own) on it; the score is the mean output tok/s over
    every run of all three."""
    n = sim.num_replicas
    own = [TUNE_SEED_BASE + s for s in range(args.tune_seeds)]
    kinds = [("leval", "uniform", sim, own)]
    if args.tune_zipf > 0 and args.zipf_s > 0:  # the first workloads' Zipf variants, the same seeds
        kinds.append(("zipf", "zipf", sim, own[:args.tune_zipf]))
    if mooncake_sim is not None and args.tune_mooncake > 0:
        kinds.append(("mooncake", "mooncake", mooncake_sim,
                      [TUNE_SEED_BASE + s for s in range(args.tune_mooncake)]))
    groups = []
    for what, kind, on, seeds in kinds:
        runs = cell_runs(kind, n, seeds, pool=pool, docs_per_replica=args.docs_per_replica,
                         docs_per_replica_large=args.docs_per_replica_large,
                         large_replicas=args.large_replicas, zipf_s=args.zipf_s,
                         mooncake_window=args.mooncake_window, sim=on)
        groups.append((what, on, [r for load in args.tune_loads for r in runs.timed(load)]))
    weights = {what: len(r) for what, _, r in groups}

    def score(name: str, grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        labelled = [(str(i), name, k) for i, k in enumerate(grid)]
        parts = {what: run_rows(on, runs, labelled, goodput) for what, on, runs in groups}
        runs = sum(len(r) for _, _, r in groups)
        log(f"  tuned {name}: {len(grid)} settings x {runs} runs in {time.perf_counter() - t0:.0f} s")
        out = []
        for label, _, knobs in labelled:
            rows = {what: p[label] for what, p in parts.items()}

            def mean(key: str, rows: dict[str, dict[str, Any]] = rows) -> float:
                return sum(weights[w] * r[key] for w, r in rows.items()) / runs

            out.append({"knobs": _jsonable(knobs), "output_throughput": mean("output_throughput"),
                        "mean_e2el_ms": mean("mean_e2el_ms"), "request_goodput": mean("request_goodput"),
                        **{f"{w}_output_throughput": r["output_throughput"] for w, r in rows.items()}})
        return out

    out: dict[str, Any] = {}
    for name, grid in grids().items():
        scored = score(name, grid)
        if name == OURS:  # stage two: the best four with a match-rate threshold; three: a cache model
            top = _top(name, scored, 4)
            scored += score(name, [{**r["knobs"], **extra} for extra in OURS_STAGE_TWO for r in top])
            top = _top(name, scored, 3)
            scored += score(name, [{**r["knobs"], **extra} for extra in OURS_STAGE_THREE for r in top])
            top = _top(name, scored, 2)  # four: the imbalance bound on a hot prefix
            scored += score(name, [{**r["knobs"], **extra} for extra in OURS_STAGE_FOUR for r in top])
            top = _top(name, scored, 4)  # five: a prefix's holders shared
            scored += score(name, [{**r["knobs"], **extra} for extra in OURS_STAGE_FIVE for r in top])
        best = max(scored, key=lambda r: _rank(name, r))  # of equals: the closest to the defaults
        out[name] = {"best": best["knobs"], "score": best["output_throughput"], "grid": scored}
    return out


def cell(runs: CellRuns, loads: Sequence[float], tuned: dict[str, dict[str, Any]],
         goodput: dict[str, float]) -> list[dict[str, Any]]:
    """Every router at its defaults and tuned, at each of ``loads``, on a cell's runs
    (:func:`cell_runs`): one cell per load."""
    sim, seeds, kind = runs.sim, runs.seeds, runs.kind
    distinct = runs.distinct()
    saturation = statistics.fmean(sat for _, sat in distinct)
    documents = statistics.fmean(w.num_groups for w, _ in distinct)
    requests = statistics.fmean(len(w) for w, _ in distinct)
    rows = []
    for name in ROUTER_ORDER:
        rows.append((_default_label(name), name, defaults(name)))
        if not _is_default(name, tuned[name]):
            rows.append((f"{name} (tuned)", name, tuned[name]))
    cells = []
    floor_sim, floors = ClusterSim(1, sim.engine), {}
    for load in loads:
        rate = load * saturation
        timed = runs.timed(load)
        routers = run_rows(sim, timed, rows, goodput)
        bounds = [throughput_bound(floor_sim, w, floors) for _, w in timed]
        ours = routers[_label(OURS, tuned)]
        for r in routers.values():
            r["ours_over_this"] = ours["output_throughput"] / r["output_throughput"]
            paired = [a / b for a, b in zip(ours["output_throughput_runs"], r["output_throughput_runs"],
                                            strict=True)]
            r["ours_over_this_range"] = [min(paired), max(paired)]
            r["ours_over_this_goodput"] = (ours["request_goodput"] / r["request_goodput"]
                                          if r["request_goodput"] else math.inf)
        cells.append({"kind": kind, "replicas": sim.num_replicas, "documents": round(documents),
                      "requests": round(requests), "load": load, "saturation_req_s": saturation,
                      "rate_req_s": rate, "seeds": list(seeds), "routers": routers,
                      "bound_output_throughput": statistics.fmean(bounds), "bound_runs": bounds})
    return cells


def _default_label(name: str) -> str:
    return f"{name} (previous default)" if name == OURS else f"{name} (default)"


def _label(name: str, tuned: dict[str, dict[str, Any]]) -> str:
    """The row of ``name`` at its tuned knobs."""
    return _default_label(name) if _is_default(name, tuned[name]) else f"{name} (tuned)"


class _Lockstep(ReplicaRouter):
    """A peer that routes, with ours beside it told the same: how often ours would have chosen the same."""

    uses_hashes = True
    tracks_requests = True

    def __init__(self, peer: ReplicaRouter, ours: ReplicaRouter) -> None:
        super().__init__()
        self.peer, self.ours = peer, ours
        self.name = peer.name
        self.same = self.total = 0

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int], avoid: Collection[str] = (), *,
               tokens: int | None = None) -> str:
        choice = self.peer.choose(hashes, loads, avoid, tokens=tokens)
        self.same += self.ours.choose(hashes, loads, avoid, tokens=tokens) == choice
        self.total += 1
        return choice

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        for router in (self.peer, self.ours):
            router.routed(hashes, replica, tokens=tokens, request_id=request_id)

    def prefilled(self, request_id: str) -> None:
        self.peer.prefilled(request_id)
        self.ours.prefilled(request_id)

    def finished(self, request_id: str) -> None:
        self.peer.finished(request_id)
        self.ours.finished(request_id)


def agreement(runs: CellRuns, load: float, tuned: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each tuned peer routes the first run of a cell (:func:`cell_runs`) at ``load``; ours (tuned),
    told every routing, answers each request too: the fraction of requests on which it would have
    chosen the same replica."""
    sim = runs.sim
    seed, timed = runs.timed(load)[0]
    out = {}
    for name in PEERS:
        lockstep = _Lockstep(make(name, tuned[name], seed), make(OURS, tuned[OURS], seed, kv_tokens(sim)))
        sim.run(timed, lockstep)
        out[name] = lockstep.same / lockstep.total
    return out


def verdicts(res: dict[str, Any]) -> list[dict[str, Any]]:
    """ours (tuned) over each tuned peer at the target size, per load, against :data:`TARGETS`, and the
    bound over that peer (``bound``: the most any router could show over it there)."""
    out = []
    for c in res["cells"]:
        if c["kind"] != "uniform" or c["replicas"] != res["target_replicas"]:
            continue
        for peer, target in res["targets"].items():
            row = c["routers"][_label(peer, res["tuned"])]
            ratio = row["ours_over_this"]
            out.append({"load": c["load"], "peer": peer, "ratio": ratio, "target": target,
                        "met": ratio >= target,
                        "bound": c["bound_output_throughput"] / row["output_throughput"]})
    return out


# ------------------------------------------------------------------------------------ report


def _knobs(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items()) or "-"


def _cell_table(c: dict[str, Any]) -> str:
    headers = ["router", "output tok/s", "ours (tuned) / this (per seed)", "goodput req/s (good)",
               "mean TTFT s", "P99 TTFT s", "mean E2E s", "P99 E2E s", "prefix hit", "max/mean req"]
    rows = []
    for label, r in c["routers"].items():
        good = (f"{r['request_goodput']:.2f} ({100 * r['good_fraction']:.0f}%)"
                if r["good_fraction"] is not None else "-")
        lo, hi = r["ours_over_this_range"]
        ratio = f"{r['ours_over_this']:.3f}x" + ("" if lo == hi == 1 else f" ({lo:.2f}-{hi:.2f})")
        rows.append([label, r["output_throughput"], ratio, good,
                     r["mean_ttft_ms"] / 1000, r["p99_ttft_ms"] / 1000, r["mean_e2el_ms"] / 1000,
                     r["p99_e2el_ms"] / 1000, f"{100 * r['prefix_hit_rate']:.0f}%",
                     f"{r['max_over_mean']:.2f}"])
    return format_table(headers, rows)


_KIND_TEXT = {"uniform": "uniform documents", "zipf": "Zipf document popularity (s = {s:g})",
              "mooncake": "Mooncake synthetic trace"}


def _mooncake_text(res: dict[str, Any]) -> str:
    if not any(c["kind"] == "mooncake" for c in res["cells"]):
        return ""
    return ("Mooncake: the FAST'25 synthetic trace as `configs/scenarios/mooncake-synthetic.yaml` reads it "
            "(64 token ids per 512-token hash id, lengths / 8; its engine, 1 GiB of KV), one window of "
            f"{res['mooncake_window_s']:g} s x replicas of the trace per seed, its own timestamps scaled to "
            "the load x that window's saturation rate. ")


def _tune_mooncake_text(res: dict[str, Any]) -> str:
    z, k = res.get("tune_zipf") or 0, res.get("tune_mooncake") or 0
    out = f", on {z} of their Zipf-popularity variants (s = {res['zipf_s']:g})" if z else ""
    return out + (f", and on {k} windows of the Mooncake trace of other seeds, the same loads" if k else "")


def summary_table(res: dict[str, Any]) -> str:
    """One row per cell: ours (tuned) over each tuned peer, and the mean E2E of ours and the best peer."""
    tuned = res["tuned"]
    headers = ["cell", "ours tok/s", *[f"/ {p}" for p in PEERS], "bound / ours",
               "mean E2E s: ours, best peer"]
    rows = []
    for c in res["cells"]:
        routers = c["routers"]
        ours = routers[_label(OURS, tuned)]
        peers = [routers[_label(p, tuned)] for p in PEERS]
        best = min(peers, key=lambda r: r["mean_e2el_ms"])
        ratios = []
        for r in peers:
            good = ours["request_goodput"] / r["request_goodput"] if r["request_goodput"] else math.inf
            ratios.append(f"{r['ours_over_this']:.3f}x ({good:.2f}x)")
        kind = "Zipf" if c["kind"] == "zipf" else c["kind"].replace("uniform", "L-Eval")
        e2e = f"{ours['mean_e2el_ms'] / 1000:.2f}, {best['mean_e2el_ms'] / 1000:.2f} ({best['router']})"
        where = f"{c['replicas']} x, {kind}, load {c['load']:g}"
        bound = c.get("bound_output_throughput")
        bound = f"{bound / ours['output_throughput']:.3f}x" if bound else "-"
        rows.append([where, ours["output_throughput"], *ratios, bound, e2e])
    return format_table(headers, rows)


def render(res: dict[str, Any]) -> str:
    """The tuned knobs, a table per cell, and the targets, in markdown."""
    slo = ", ".join(f"{'TTFT' if k == 'ttft' else k.upper()} <= {v / 1000:g} s"
                    for k, v in res["goodput"].items()).replace("E2EL", "E2E")
    tune_loads = ", ".join(f"{x:g}" for x in res["tune_loads"])
    out = [f"Simulated clusters of `{res['scenario_engine']}` engines (0.25 GiB of KV each), Feather's "
           f"heuristic in every replica; L-Eval, {res['docs_per_replica']} documents per replica "
           f"({res['docs_per_replica_large']} from {res['large_replicas']} replicas on) with at most 8 "
           "questions each, prompts <= 8,192 tokens; Poisson arrivals at the load x the saturation rate "
           f"measured with a fixed reference router (`prefix`, `{_knobs(res.get('reference', REFERENCE))}`); "
           f"means over arrival seeds {res['seeds']}. {_mooncake_text(res)}Goodput: vLLM's definition, "
           f"requests per second meeting {slo}. Each router "
           f"tuned on {res['tune_seeds']} workloads of other seeds at {res['tune_replicas']} replicas, loads "
           f"{tune_loads}{_tune_mooncake_text(res)} (score: mean output tok/s over every run); "
           f"the peers' radix trees are sets of 512-token chunk "
           f"keys (`scheduler_runtime/router.py`). {measured(res)}; `{res['command']}`: "
           f"{res['cpu_s'] / 60:.0f} min of CPU on one core ({res['wall_s'] / 60:.0f} min wall).", "",
           format_table(["router", "defaults (ours: previous)", "tuned (grid size)", "tuning score, tok/s"],
                        [[name, _knobs(res.get("defaults", {}).get(name, defaults(name))),  # as measured
                          f"{_knobs(t['best'])} ({len(t['grid'])})", t["score"]]
                         for name, t in res["tuning"].items()])]
    same = res.get("agreement")
    if same:
        out += ["", f"Ours (tuned) beside each tuned peer in lockstep ({res['target_replicas']} replicas, "
                "load 1, seed 0; the peer routes, ours is told every routing and answers too): the same "
                "replica for "
                + ", ".join(f"{100 * v:.1f}% of the requests with {k}" for k, v in same.items()) + "."]
    out += ["", "Ours (tuned) over each peer (tuned), output tok/s (and goodput), per cell; the bound over "
            "ours (output tok/s no router can beat: every request finishes no earlier than its arrival plus "
            "its end-to-end latency alone on an idle replica whose cache holds what earlier arrivals' "
            "prompts share with it, `throughput_bound`); "
            "mean E2E of ours and of the best peer there:", "", summary_table(res)]
    for c in res["cells"]:
        what = _KIND_TEXT[c["kind"]].format(s=res["zipf_s"])
        docs = f"{c['documents']} documents, " if c["kind"] != "mooncake" else ""
        out += ["", f"**{c['replicas']} replicas, load {c['load']:g}, {what}**: {docs}"
                f"{c['requests']} requests, {c['rate_req_s']:.1f} req/s (saturation "
                f"{c['saturation_req_s']:.1f})", "", _cell_table(c)]
    checks = res.get("verdicts") or []
    if checks:
        out += ["", f"Targets at {res['target_replicas']} replicas (ours tuned over each peer tuned, output "
                "tok/s):", ""]
        out += [f"- load {v['load']:g}, {v['peer']}: {v['ratio']:.3f}x (>= {v['target']:g}x) "
                f"{'met' if v['met'] else 'NOT met'}"
                + (f"; no router could show more than {v['bound']:.3f}x (the bound)" if "bound" in v else "")
                for v in checks]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="4,16,64", help="cluster sizes evaluated")
    p.add_argument("--large-replicas", type=int, default=LARGE_REPLICAS,
                   help="from here: --docs-per-replica-large")
    p.add_argument("--docs-per-replica", type=int, default=DOCS_PER_REPLICA)
    p.add_argument("--docs-per-replica-large", type=int, default=DOCS_PER_REPLICA_LARGE)
    p.add_argument("--loads", default="0.8,1.0,1.5")
    p.add_argument("--loads-large", default="0.8,1.0", help="the loads from --large-replicas on")
    p.add_argument("--seeds", type=int, default=3, help="evaluation arrival seeds 0..N-1")
    p.add_argument("--tune-replicas", type=int, default=16)
    p.add_argument("--tune-seeds", type=int, default=6, help="tuning workloads (own seeds)")
    p.add_argument("--tune-loads", default="0.8,1.0")
    p.add_argument("--tune-zipf", type=int, default=6,
                   help="Zipf variants (--zipf-s) of the first tuning workloads in the score (0: none)")
    p.add_argument("--tune-mooncake", type=int, default=3,
                   help="Mooncake windows (own seeds) in the tuning score beside L-Eval's (0: none)")
    p.add_argument("--zipf-s", type=float, default=ZIPF_S, help="0: no Zipf variant")
    p.add_argument("--goodput", default=DEFAULT_GOODPUT, help="SLOs in ms, vLLM's --goodput pairs")
    p.add_argument("--mooncake-replicas", default="4,16",
                   help="cluster sizes on the Mooncake trace ('': none)")
    p.add_argument("--mooncake-window", type=float, default=MOONCAKE_WINDOW_S,
                   help="seconds of the Mooncake trace per replica (one window per seed)")
    p.add_argument("--scenario", default=DEFAULT_SCENARIO)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.tune_loads = [float(x) for x in args.tune_loads.split(",")]
    start, cpu_start = time.perf_counter(), time.process_time()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    goodput = parse_goodput(args.goodput)
    engine = load_scenario(args.scenario).engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", data_dir=args.data_dir, max_prompt_tokens=8192))
    loads = [float(x) for x in args.loads.split(",")]
    seeds = list(range(args.seeds))

    log(f"tuning at {args.tune_replicas} replicas, loads {args.tune_loads}, {args.tune_seeds} workloads")
    mooncake_engine = load_scenario(MOONCAKE_SCENARIO).engine_config()
    tuning = tune(ClusterSim(args.tune_replicas, engine), pool, args, goodput, log,
                  ClusterSim(args.tune_replicas, mooncake_engine))
    tuned = {name: t["best"] for name, t in tuning.items()}
    for name, t in tuning.items():
        log(f"  {name}: {_knobs(t['best'])} ({t['score']:.0f} tok/s)")

    cells = []

    def runs(kind: str, n: int) -> CellRuns:
        return cell_runs(kind, n, seeds, pool=pool, scenario=args.scenario,
                         docs_per_replica=args.docs_per_replica,
                         docs_per_replica_large=args.docs_per_replica_large,
                         large_replicas=args.large_replicas, zipf_s=args.zipf_s,
                         mooncake_window=args.mooncake_window)

    target: CellRuns | None = None
    for n in (int(x) for x in args.replicas.split(",")):
        large = n >= args.large_replicas
        docs = args.docs_per_replica_large if large else args.docs_per_replica
        at = [float(x) for x in args.loads_large.split(",")] if large else loads
        t0 = time.perf_counter()
        uniform = runs("uniform", n)
        target = uniform if n == TARGET_REPLICAS else target
        cells += cell(uniform, at, tuned, goodput)
        log(f"{n} replicas ({docs} documents each): {time.perf_counter() - t0:.0f} s for loads {at}")
    t0 = time.perf_counter()
    same = agreement(target or runs("uniform", TARGET_REPLICAS), 1.0, tuned)
    log(f"lockstep agreement: {time.perf_counter() - t0:.0f} s")
    if args.zipf_s > 0:
        t0 = time.perf_counter()
        cells += cell(runs("zipf", TARGET_REPLICAS), loads, tuned, goodput)
        log(f"{TARGET_REPLICAS} replicas, Zipf: {time.perf_counter() - t0:.0f} s")
    for n in (int(x) for x in args.mooncake_replicas.split(",") if x.strip()):
        t0 = time.perf_counter()
        cells += cell(runs("mooncake", n), loads, tuned, goodput)
        log(f"{n} replicas, Mooncake: {time.perf_counter() - t0:.0f} s")

    out = {"benchmark": "router_peers", "machine": machine_info(), "scenario_engine": args.scenario,
           "engine": engine.to_dict(), "command": "python -m benchmarks.router_peers " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "docs_per_replica": args.docs_per_replica, "docs_per_replica_large": args.docs_per_replica_large,
           "large_replicas": args.large_replicas, "loads": loads, "seeds": seeds, "goodput": goodput,
           "tune_replicas": args.tune_replicas, "tune_seeds": args.tune_seeds,
           "tune_zipf": args.tune_zipf if args.zipf_s > 0 else 0, "tune_mooncake": args.tune_mooncake,
           "tune_loads": args.tune_loads,
           "zipf_s": args.zipf_s, "mooncake_window_s": args.mooncake_window,
           "mooncake_engine": mooncake_engine.to_dict(), "reference": _jsonable(REFERENCE),
           "ours_before": _jsonable(OURS_BEFORE),
           "tuning": tuning, "tuned": tuned,
           "defaults": {name: defaults(name) for name in ROUTER_ORDER}, "cells": cells,
           "agreement": same, "targets": TARGETS, "target_replicas": TARGET_REPLICAS}
    out["verdicts"] = verdicts(out)
    out["wall_s"] = time.perf_counter() - start
    out["cpu_s"] = time.process_time() - cpu_start
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
