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
router (ours as shipped before this study: ``load_factor=1.25, slack=2``, the ring), so that the
offered load does not move with the router under test.

1. **Tuning** (:func:`tune`): a small grid per router (:func:`grids`), scored by the mean output
   throughput at 16 replicas and loads 1.0 and 1.5 over ``--tune-seeds`` workloads whose documents
   and arrivals are drawn with seeds disjoint from the evaluation's (at load 0.8 every good router
   serves what arrives, so throughput does not tell settings apart there). Ours is searched in two
   stages: every ``load_factor`` x ``slack`` x ``new_prefix`` (no match-rate threshold), then the
   best four again with ``min_match`` 0.1 and 0.3.
2. **Evaluation** (:func:`cell`): every router at its defaults and at its tuned knobs, at
   ``--loads`` (0.8, 1.0, and 1.5, past every router's capacity) on the evaluation seeds (the
   arrival draws 0, 1, 2 of :mod:`benchmarks.routing`'s workload): output throughput, mean and P99
   TTFT and E2E latency, goodput (vLLM's definition: completed requests per second that met every
   SLO of ``--goodput``), the prefix-cache hit rate, and ours (tuned) over each. At 16 replicas
   (the targets), 4 and 64 (``--docs-per-replica-large`` documents per replica and ``--loads-large``
   there, to keep the run short), and a Zipf variant at 16 replicas
   (:func:`~feather_env.cluster_sim.zipf_documents`: the same number of requests over the same
   documents, document popularity Zipf ``--zipf-s``).

Targets (16 replicas, loads 0.8 and 1.0, output throughput): ours (tuned) >= 1.05x the tuned SGLang
and Ray routers and >= 1.0x the tuned LMetric and Dynamo routers.
"""

from __future__ import annotations

import argparse
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
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import parse_goodput
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from scheduler_runtime.router import PEERS, ROUTERS, PrefixAffinityRouter, ReplicaRouter, make_router

OURS = "prefix"
#: Ours as shipped before this study: the default row of ours, and the reference router that
#: measures each workload's saturation rate.
OURS_BEFORE: dict[str, Any] = {"load_factor": 1.25, "slack": 2, "new_prefix": "ring", "min_match": 0.0}
ROUTER_ORDER = (OURS, *PEERS)
#: Routers that draw random numbers (seeded with the arrival seed).
SEEDED = {"pow2", "ray-prefix-affinity", "dynamo-kv"}
#: ours (tuned) over each tuned peer, at 16 replicas and every evaluated load.
TARGETS = {"sglang-cache-aware": 1.05, "ray-prefix-affinity": 1.05, "lmetric": 1.0, "dynamo-kv": 1.0}
TARGET_REPLICAS = 16
TUNE_SEED_BASE = 10_000
#: Ours' second tuning stage: each of these on each of the first stage's best four settings.
OURS_STAGE_TWO = ({"min_match": 0.1}, {"min_match": 0.3})
DEFAULT_GOODPUT = "ttft:2000 e2el:10000"


def make(name: str, knobs: dict[str, Any], seed: int) -> ReplicaRouter:
    """Router ``name`` with ``knobs`` (its random draws seeded with ``seed`` where it makes any;
    ``"inf"`` is infinity, as the JSON holds it)."""
    knobs = {k: math.inf if v == "inf" else v for k, v in knobs.items()}
    return make_router(name, **knobs, **({"seed": seed} if name in SEEDED else {}))


def _jsonable(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in knobs.items()}


def defaults(name: str) -> dict[str, Any]:
    """The knobs of a router's default row: ours as shipped before the study, a peer's published ones
    (its class's defaults)."""
    if name == OURS:
        return dict(OURS_BEFORE)
    params = inspect.signature(ROUTERS[name].__init__).parameters.values()
    return _jsonable({p.name: p.default for p in params
                      if p.default is not inspect.Parameter.empty and p.name not in ("seed", "chunk_size")})


def _is_default(name: str, knobs: dict[str, Any]) -> bool:
    return {**defaults(name), **_jsonable(knobs)} == defaults(name)


def _rank(name: str, row: dict[str, Any]) -> tuple[float, int]:
    """A tuning row's rank: its score, then (among equal scores: the same choices) how many knobs it
    shares with the defaults."""
    base = defaults(name)
    return row["output_throughput"], sum(base.get(k) == v for k, v in _jsonable(row["knobs"]).items())


def grids() -> dict[str, list[dict[str, Any]]]:
    """Each router's tuning grid (ours: stage one; stage two, :data:`OURS_STAGE_TWO`, on its best four)."""
    ours = [{"load_factor": c, "slack": s, "new_prefix": p, "min_match": 0.0}
            for c, s, p in itertools.product((1.1, 1.25, 1.5, 2.0, 3.0, 5.0), (0, 2),
                                             ("ring", "least", "smallest"))]
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
    router = PrefixAffinityRouter(**OURS_BEFORE)
    return sim.run(workload.with_arrivals("burst"), router).metrics["request_throughput"]


def uniform_workload(pool: Workload, replicas: int, docs_per_replica: int, seed: int) -> Workload:
    """:mod:`benchmarks.routing`'s workload (its evaluation draw is ``seed=replicas``)."""
    return distinct_documents(pool, docs_per_replica * replicas, seed=seed, max_per_group=8)


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
    for label, name, knobs in rows:
        results = [sim.run(w, make(name, knobs, seed), goodput=goodput) for seed, w in timed]
        out[label] = {"router": name, "knobs": _jsonable(knobs), **_summary(results)}
    return out


def tune(sim: ClusterSim, pool: Workload, args: argparse.Namespace, goodput: dict[str, float],
         log: Callable[[str], None]) -> dict[str, Any]:
    """Each router's grid on the tuning workloads: ``{router: {"best": knobs, "grid": [...]}}``."""
    n = sim.num_replicas
    timed = []
    for s in range(args.tune_seeds):
        workload = uniform_workload(pool, n, args.docs_per_replica, TUNE_SEED_BASE + 100 * n + s)
        saturation = saturation_rate(sim, workload)
        for load in args.tune_loads:
            seed = TUNE_SEED_BASE + s
            timed.append((seed, workload.with_arrivals(f"poisson:{load * saturation}", seed)))

    def score(name: str, grid: list[dict[str, Any]]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        rows = run_rows(sim, timed, [(str(i), name, k) for i, k in enumerate(grid)], goodput)
        log(f"  tuned {name}: {len(grid)} settings x {len(timed)} runs in {time.perf_counter() - t0:.0f} s")
        return [{"knobs": r["knobs"], "output_throughput": r["output_throughput"],
                 "mean_e2el_ms": r["mean_e2el_ms"], "request_goodput": r["request_goodput"]}
                for r in rows.values()]

    out: dict[str, Any] = {}
    for name, grid in grids().items():
        scored = score(name, grid)
        if name == OURS:  # stage two: the best four with a match-rate threshold
            top = sorted(scored, key=lambda r: _rank(name, r), reverse=True)[:4]
            scored += score(name, [{**r["knobs"], **extra} for extra in OURS_STAGE_TWO for r in top])
        best = max(scored, key=lambda r: _rank(name, r))  # of equals: the closest to the defaults
        out[name] = {"best": best["knobs"], "score": best["output_throughput"], "grid": scored}
    return out


def cell(sim: ClusterSim, workload: Workload, loads: Sequence[float], seeds: Sequence[int],
         tuned: dict[str, dict[str, Any]], goodput: dict[str, float], kind: str) -> list[dict[str, Any]]:
    """Every router at its defaults and tuned, at each of ``loads``: one cell per load."""
    saturation = saturation_rate(sim, workload)
    rows = []
    for name in ROUTER_ORDER:
        rows.append((_default_label(name), name, defaults(name)))
        if not _is_default(name, tuned[name]):
            rows.append((f"{name} (tuned)", name, tuned[name]))
    cells = []
    for load in loads:
        rate = load * saturation
        timed = [(seed, workload.with_arrivals(f"poisson:{rate}", seed)) for seed in seeds]
        routers = run_rows(sim, timed, rows, goodput)
        ours = routers[_label(OURS, tuned)]
        for r in routers.values():
            r["ours_over_this"] = ours["output_throughput"] / r["output_throughput"]
            paired = [a / b for a, b in zip(ours["output_throughput_runs"], r["output_throughput_runs"],
                                            strict=True)]
            r["ours_over_this_range"] = [min(paired), max(paired)]
            r["ours_over_this_goodput"] = (ours["request_goodput"] / r["request_goodput"]
                                          if r["request_goodput"] else math.inf)
        cells.append({"kind": kind, "replicas": sim.num_replicas, "documents": workload.num_groups,
                      "requests": len(workload), "load": load, "saturation_req_s": saturation,
                      "rate_req_s": rate, "seeds": list(seeds), "routers": routers})
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
        self.same += self.ours.choose(hashes, loads, avoid) == choice  # as the simulator asks ours
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


def agreement(sim: ClusterSim, workload: Workload, load: float, seed: int,
              tuned: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each tuned peer routes ``workload`` at ``load``; ours (tuned), told every routing, answers each
    request too: the fraction of requests on which it would have chosen the same replica."""
    timed = workload.with_arrivals(f"poisson:{load * saturation_rate(sim, workload)}", seed)
    out = {}
    for name in PEERS:
        lockstep = _Lockstep(make(name, tuned[name], seed), make(OURS, tuned[OURS], seed))
        sim.run(timed, lockstep)
        out[name] = lockstep.same / lockstep.total
    return out


def verdicts(res: dict[str, Any]) -> list[dict[str, Any]]:
    """ours (tuned) over each tuned peer at the target size, per load, against :data:`TARGETS`."""
    out = []
    for c in res["cells"]:
        if c["kind"] != "uniform" or c["replicas"] != res["target_replicas"]:
            continue
        for peer, target in res["targets"].items():
            ratio = c["routers"][_label(peer, res["tuned"])]["ours_over_this"]
            out.append({"load": c["load"], "peer": peer, "ratio": ratio, "target": target,
                        "met": ratio >= target})
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


def render(res: dict[str, Any]) -> str:
    """The tuned knobs, a table per cell, and the targets, in markdown."""
    slo = ", ".join(f"{'TTFT' if k == 'ttft' else k.upper()} <= {v / 1000:g} s"
                    for k, v in res["goodput"].items()).replace("E2EL", "E2E")
    tune_loads = ", ".join(f"{x:g}" for x in res["tune_loads"])
    out = [f"Simulated clusters of `{res['scenario_engine']}` engines (0.25 GiB of KV each), Feather's "
           f"heuristic in every replica; L-Eval, {res['docs_per_replica']} documents per replica "
           f"({res['docs_per_replica_large']} from {res['large_replicas']} replicas on) with at most 8 "
           "questions each, prompts <= 8,192 tokens; Poisson arrivals at the load x the saturation rate "
           f"measured with ours as shipped before (`{_knobs(OURS_BEFORE)}`); means over arrival seeds "
           f"{res['seeds']}. Goodput: vLLM's definition, requests per second meeting {slo}. Each router "
           f"tuned on {res['tune_seeds']} workloads of other seeds at {res['tune_replicas']} replicas, loads "
           f"{tune_loads} (score: mean output tok/s); the peers' radix trees are sets of 512-token chunk "
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
    for c in res["cells"]:
        what = ("Zipf document popularity (s = {:g})".format(res["zipf_s"]) if c["kind"] == "zipf"
                else "uniform documents")
        out += ["", f"**{c['replicas']} replicas, load {c['load']:g}, {what}**: {c['documents']} documents, "
                f"{c['requests']} requests, {c['rate_req_s']:.1f} req/s (saturation "
                f"{c['saturation_req_s']:.1f})", "", _cell_table(c)]
    checks = res.get("verdicts") or []
    if checks:
        out += ["", f"Targets at {res['target_replicas']} replicas (ours tuned over each peer tuned, output "
                "tok/s):", ""]
        out += [f"- load {v['load']:g}, {v['peer']}: {v['ratio']:.3f}x (>= {v['target']:g}x) "
                f"{'met' if v['met'] else 'NOT met'}" for v in checks]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="4,16,64", help="cluster sizes evaluated")
    p.add_argument("--large-replicas", type=int, default=64, help="from here: --docs-per-replica-large")
    p.add_argument("--docs-per-replica", type=int, default=16)
    p.add_argument("--docs-per-replica-large", type=int, default=8)
    p.add_argument("--loads", default="0.8,1.0,1.5")
    p.add_argument("--loads-large", default="0.8,1.0", help="the loads from --large-replicas on")
    p.add_argument("--seeds", type=int, default=3, help="evaluation arrival seeds 0..N-1")
    p.add_argument("--tune-replicas", type=int, default=16)
    p.add_argument("--tune-seeds", type=int, default=3, help="tuning workloads (own seeds)")
    p.add_argument("--tune-loads", default="1.0,1.5")
    p.add_argument("--zipf-s", type=float, default=1.1, help="0: no Zipf variant")
    p.add_argument("--goodput", default=DEFAULT_GOODPUT, help="SLOs in ms, vLLM's --goodput pairs")
    p.add_argument("--scenario", default="leval-kv-pressure")
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
    tuning = tune(ClusterSim(args.tune_replicas, engine), pool, args, goodput, log)
    tuned = {name: t["best"] for name, t in tuning.items()}
    for name, t in tuning.items():
        log(f"  {name}: {_knobs(t['best'])} ({t['score']:.0f} tok/s)")

    cells = []
    for n in (int(x) for x in args.replicas.split(",")):
        large = n >= args.large_replicas
        docs = args.docs_per_replica_large if large else args.docs_per_replica
        at = [float(x) for x in args.loads_large.split(",")] if large else loads
        t0 = time.perf_counter()
        cells += cell(ClusterSim(n, engine), uniform_workload(pool, n, docs, seed=n), at, seeds, tuned,
                      goodput, "uniform")
        log(f"{n} replicas ({docs} documents each): {time.perf_counter() - t0:.0f} s for loads {at}")
    t0 = time.perf_counter()
    n = TARGET_REPLICAS
    same = agreement(ClusterSim(n, engine), uniform_workload(pool, n, args.docs_per_replica, seed=n), 1.0,
                     seeds[0], tuned)
    log(f"lockstep agreement: {time.perf_counter() - t0:.0f} s")
    if args.zipf_s > 0:
        n = TARGET_REPLICAS
        base = uniform_workload(pool, n, args.docs_per_replica, seed=n)
        workload = zipf_documents(pool, base.num_groups, len(base), args.zipf_s, seed=n)
        t0 = time.perf_counter()
        cells += cell(ClusterSim(n, engine), workload, loads, seeds, tuned, goodput, "zipf")
        log(f"{n} replicas, Zipf: {time.perf_counter() - t0:.0f} s")

    out = {"benchmark": "router_peers", "machine": machine_info(), "scenario_engine": args.scenario,
           "engine": engine.to_dict(), "command": "python -m benchmarks.router_peers " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "docs_per_replica": args.docs_per_replica, "docs_per_replica_large": args.docs_per_replica_large,
           "large_replicas": args.large_replicas, "loads": loads, "seeds": seeds, "goodput": goodput,
           "tune_replicas": args.tune_replicas, "tune_seeds": args.tune_seeds, "tune_loads": args.tune_loads,
           "zipf_s": args.zipf_s, "ours_before": OURS_BEFORE, "tuning": tuning, "tuned": tuned,
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
