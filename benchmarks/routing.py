"""Routing across engine replicas in the simulator, and what the router costs per request.

    python -m benchmarks.routing --json results/routing.json

Part 1, the cluster (:class:`feather_env.cluster_sim.ClusterSim`): N simulated vLLM replicas, each
with the Feather scheduler (``feather-heuristic``) and ``leval-kv-pressure``'s engine (0.25 GiB of
KV cache: a few 8K-token documents at a time, so a document a replica has not seen lately is
prefilled again), behind each router of :mod:`scheduler_runtime.router`: ``round-robin``, ``pow2``
(Ray Serve's default), ``prefix-hash`` (consistent hashing of the first chunk, no load bound) and
``prefix`` (ours). The workload: ``--docs-per-replica`` x N L-Eval documents (prompts cut at 8,192
tokens) with at most 8 questions each, in a random order; past the 244 distinct documents the data
has, copies with a different first chunk (:func:`~feather_env.cluster_sim.distinct_documents`).
Arrivals are Poisson at ``--load`` x the cluster's saturation rate (default 1.0), which is
measured: the request throughput of the cluster with our router when the whole workload arrives at
once (pow2 saturates far below it). Each cell is the mean over ``--seeds`` arrival draws; at 16
replicas a sweep of loads (``--sweep-loads``) shows how the ratios move with the load. Targets (16
replicas): ours >= 1.3x pow2's output throughput and >= 1.05x prefix-hash's, and the busiest replica
serves <= 1.25x the mean requests per replica.

Part 2, the router's own cost: per request, at 64 replicas and 10,000 distinct prefixes (8K-token
prompts, 512-token chunks, every replica holding a random load), the median over repeats of
``choose`` + ``routed`` (what the Ray Serve router runs per request) and, apart, of hashing the
prompt (done once, by the ingress).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.cluster_sim import ClusterResult, ClusterSim, distinct_documents
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.workloads import WorkloadConfig, load_workload
from scheduler_runtime.router import PrefixHasher, ReplicaRouter, make_router

#: The routers compared here (the field's routers, also in ``scheduler_runtime.router.ROUTERS``, are
#: ``benchmarks.router_peers``').
ROUTERS = ("round-robin", "pow2", "prefix-hash", "prefix")
TARGETS = {"vs_pow2": 1.3, "vs_prefix_hash": 1.05, "max_over_mean": 1.25}
TARGET_REPLICAS = 16
OURS = "prefix"


def _router(name: str, seed: int):
    return make_router(name, seed=seed) if name == "pow2" else make_router(name)


def saturation_rate(sim: ClusterSim, workload: Any) -> float:
    """The cluster's request throughput with our router when all of ``workload`` arrives at once."""
    return sim.run(workload.with_arrivals("burst"), make_router(OURS)).metrics["request_throughput"]


def cluster_cell(sim: ClusterSim, workload: Any, load: float, seeds: Sequence[int],
                 saturation: float | None = None) -> dict[str, Any]:
    """Every router on ``workload`` at ``load`` x the measured saturation, ``seeds`` arrival draws."""
    if saturation is None:
        saturation = saturation_rate(sim, workload)
    rate = load * saturation
    runs: dict[str, list[ClusterResult]] = {name: [] for name in ROUTERS}
    for seed in seeds:
        timed = workload.with_arrivals(f"poisson:{rate}", seed)
        for name in ROUTERS:
            runs[name].append(sim.run(timed, _router(name, seed)))
    routers = {}
    for name, results in runs.items():
        routers[name] = {
            "output_throughput": statistics.fmean(r.metrics["output_throughput"] for r in results),
            "prefix_hit_rate": statistics.fmean(r.metrics["prefix_hit_rate"] for r in results),
            "mean_e2el_ms": statistics.fmean(r.metrics["mean_e2el_ms"] for r in results),
            "p99_ttft_ms": statistics.fmean(r.metrics["p99_ttft_ms"] for r in results),
            "max_over_mean": statistics.fmean(r.max_over_mean for r in results),
            "max_over_mean_worst": max(r.max_over_mean for r in results),
            "runs": [r.to_dict() for r in results],
        }
    ours = routers[OURS]["output_throughput"]
    for name in ROUTERS:
        routers[name]["ours_over_this"] = ours / routers[name]["output_throughput"]
    return {"replicas": sim.num_replicas, "documents": workload.num_groups, "requests": len(workload),
            "saturation_req_s": saturation, "load": load, "rate_req_s": rate, "routers": routers}


def router_cost(replicas: int = 64, prefixes: int = 10_000, prompt_tokens: int = 8192, repeats: int = 5,
                seed: int = 0,
                routers: Mapping[str, Callable[[], ReplicaRouter]] | None = None,
                alternate: bool = False) -> dict[str, Any]:
    """Per-request cost of each router (µs), and of hashing one prompt (see the module docstring).
    ``routers``: name -> a new router, instead of :data:`ROUTERS` (each is passed the prompt's length,
    and a request id where it tracks requests). ``alternate``: every router is built and warmed first,
    then timed one pass at a time in turn, in the reverse order every other round (side by side, so that
    the machine's drift falls on all of them alike); else each router's passes one after another."""
    rng = np.random.default_rng(seed)
    hasher = PrefixHasher()
    docs = [rng.integers(3, 30_000, prompt_tokens - 32, dtype=np.int32) for _ in range(prefixes)]
    prompts = [np.concatenate([d, rng.integers(3, 30_000, 32, dtype=np.int32)]) for d in docs]
    t0 = time.perf_counter()
    hashes = [hasher.hash(p) for p in prompts]
    hash_us = (time.perf_counter() - t0) / prefixes * 1e6
    names = [f"replica-{i}" for i in range(replicas)]
    load_draws = rng.integers(0, 16, (64, replicas))
    loads_pool = [dict(zip(names, row.tolist(), strict=True)) for row in load_draws]
    order = rng.permutation(prefixes)
    out: dict[str, Any] = {"replicas": replicas, "prefixes": prefixes, "prompt_tokens": prompt_tokens,
                           "chunk_size": hasher.chunk_size, "hash_us": hash_us, "routers": {}}
    factories = routers or {name: (lambda name=name: _router(name, seed)) for name in ROUTERS}

    def warmed(factory: Callable[[], ReplicaRouter]) -> ReplicaRouter:
        router = factory()
        if router.observes_service:
            ticks = iter(range(1 << 62))
            router.clock = lambda ticks=ticks: next(ticks) * 0.01
        if routers is None:
            for i, h in enumerate(hashes):  # warm: every prefix known (the table at 10,000 prefixes)
                router.routed(h, router.choose(h, loads_pool[i % 64]))
        else:
            for i, h in enumerate(hashes):
                _route(router, h, loads_pool[i % 64], prompt_tokens, f"w{i}")
        return router

    def one_pass(router: ReplicaRouter, r: int) -> float:
        t0 = time.perf_counter()
        for j, i in enumerate(order):
            h = hashes[i]
            if routers is None:
                router.routed(h, router.choose(h, loads_pool[j & 63]))
            else:
                _route(router, h, loads_pool[j & 63], prompt_tokens, f"{r}-{j}")
        return (time.perf_counter() - t0) / prefixes * 1e6

    times: dict[str, list[float]] = {name: [] for name in factories}
    if alternate:
        built = {name: warmed(factory) for name, factory in factories.items()}
        for r in range(repeats):
            for name in (list(built) if r % 2 == 0 else list(reversed(built))):
                times[name].append(one_pass(built[name], r))
    else:
        for name, factory in factories.items():
            router = warmed(factory)
            times[name] = [one_pass(router, r) for r in range(repeats)]
    for name, runs in times.items():
        out["routers"][name] = {"us_per_request": statistics.median(runs), "runs_us": runs}
    out["alternating"] = alternate
    return out


def _route(router: ReplicaRouter, hashes: np.ndarray, loads: Mapping[str, int], tokens: int,
           rid: str) -> None:
    """One request's routing with its length: ``choose`` + ``routed``; where the router tracks requests,
    with its id, and its first token and finish at once (a router that observes the service is told
    the request's reported wait before its finish and two output tokens, its clock 10 ms later at each
    reading)."""
    replica = router.choose(hashes, loads, tokens=tokens)
    if not router.tracks_requests:
        router.routed(hashes, replica, tokens=tokens)
        return
    router.routed(hashes, replica, tokens=tokens, request_id=rid)
    router.prefilled(rid)
    if router.observes_service:
        router.scheduled(rid, 0.001)
        router.finished(rid, output_tokens=2)  # type: ignore[call-arg]
    else:
        router.finished(rid)


def _cell_rows(cell: dict[str, Any]) -> list[list[Any]]:
    return [[name, r["output_throughput"], f"{r['ours_over_this']:.2f}x",
             f"{100 * r['prefix_hit_rate']:.0f}%", r["mean_e2el_ms"] / 1000, r["p99_ttft_ms"] / 1000,
             f"{r['max_over_mean']:.2f} (worst {r['max_over_mean_worst']:.2f})"]
            for name, r in cell["routers"].items()]


def verdicts(res: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    """Each target at :data:`TARGET_REPLICAS` replicas: ``{name: (value, met)}``."""
    cell = next((c for c in res["cells"] if c["replicas"] == res["target_replicas"]), None)
    if cell is None:
        return {}
    routers = cell["routers"]
    values = {"vs_pow2": routers["pow2"]["ours_over_this"],
              "vs_prefix_hash": routers["prefix-hash"]["ours_over_this"],
              "max_over_mean": routers[OURS]["max_over_mean"]}
    targets = res["targets"]
    return {k: (v, v <= targets[k] if k == "max_over_mean" else v >= targets[k]) for k, v in values.items()}


def render(res: dict[str, Any]) -> str:
    """The figures in markdown: a table per cluster size, the load sweep, the targets, the router's cost."""
    out = [f"Simulated clusters of `{res['scenario_engine']}` engines (0.25 GiB of KV each), Feather's "
           f"heuristic in every replica; L-Eval, {res['docs_per_replica']} documents per replica with at "
           f"most {res['max_per_group']} questions each, prompts <= {res['max_prompt_tokens']} tokens (the "
           f"data has {res['distinct_documents_in_data']} distinct documents: past them, copies with another "
           f"first chunk); Poisson arrivals at {res['load']:g} x the measured saturation rate; means over "
           f"{res['seeds']} arrival seeds ({measured(res)}; `python -m benchmarks.routing --json "
           "results/routing.json`)."]
    headers = ["router", "output tok/s", "ours / this", "prefix hit", "mean E2E s", "p99 TTFT s",
               "max/mean requests per replica"]
    for cell in res["cells"]:
        out += ["", f"**{cell['replicas']} replicas**: {cell['documents']} documents ({cell['copies']} "
                f"copies), {cell['requests']} requests, {cell['rate_req_s']:.1f} req/s (saturation "
                f"{cell['saturation_req_s']:.1f} req/s)", "", format_table(headers, _cell_rows(cell))]
    sweep = res.get("load_sweep") or []
    if sweep:
        rows = [[f"{c['load']:g}", f"{c['rate_req_s']:.1f}",
                 *(c["routers"][name]["output_throughput"] for name in ROUTERS),
                 f"{c['routers']['pow2']['ours_over_this']:.2f}x",
                 f"{c['routers']['prefix-hash']['ours_over_this']:.2f}x",
                 f"{c['routers'][OURS]['max_over_mean']:.2f}"] for c in sweep]
        out += ["", f"{res['target_replicas']} replicas, output tok/s by offered load (x the saturation):",
                "", format_table(["load", "req/s", *ROUTERS, "ours / pow2", "ours / prefix-hash",
                                  "ours max/mean"], rows)]
    checks = verdicts(res)
    if checks:
        out += ["", f"Targets at {res['target_replicas']} replicas:", ""]
        for key, (value, ok) in checks.items():
            sign = "<=" if key == "max_over_mean" else ">="
            out.append(f"- {'met' if ok else 'NOT met'}: {key} {value:.2f} ({sign} {res['targets'][key]})")
    cost = res.get("router_cost")
    if cost:
        out += ["", f"Router cost per request at {cost['replicas']} replicas and {cost['prefixes']:,} "
                f"distinct prefixes ({cost['prompt_tokens']}-token prompts, {cost['chunk_size']}-token "
                f"chunks, random loads); hashing a prompt, once at the ingress: {cost['hash_us']:.1f} us.",
                "",
                format_table(["router", "us per request (choose + routed)"],
                             [[name, r["us_per_request"]] for name, r in cost["routers"].items()])]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="4,16,64", help="comma-separated cluster sizes")
    p.add_argument("--docs-per-replica", type=int, default=16)
    p.add_argument("--max-per-group", type=int, default=8, help="questions per document at most")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--load", type=float, default=1.0, help="arrival rate / measured saturation rate")
    p.add_argument("--sweep-loads", default="0.7,0.8,0.9,1.1,1.2",
                   help=f"further loads at {TARGET_REPLICAS} replicas ('' for none)")
    p.add_argument("--seeds", type=int, default=3, help="arrival draws per cell")
    p.add_argument("--scenario", default="leval-kv-pressure", help="whose engine each replica has")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--cost-prefixes", type=int, default=10_000)
    p.add_argument("--cost-replicas", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    engine = load_scenario(args.scenario).engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", data_dir=args.data_dir,
                                        max_prompt_tokens=args.max_prompt_tokens))
    cells, sweep = [], []
    for n in (int(x) for x in args.replicas.split(",")):
        workload = distinct_documents(pool, args.docs_per_replica * n, seed=n,
                                      max_per_group=args.max_per_group)
        sim = ClusterSim(n, engine)
        cell = cluster_cell(sim, workload, args.load, range(args.seeds))
        cell["copies"] = max(0, cell["documents"] - pool.num_groups)
        cells.append(cell)
        if n == TARGET_REPLICAS and args.sweep_loads:
            for load in sorted({float(x) for x in args.sweep_loads.split(",")} | {args.load}):
                sweep.append(cell if load == args.load else
                             cluster_cell(sim, workload, load, range(args.seeds), cell["saturation_req_s"]))
    cost = router_cost(args.cost_replicas, args.cost_prefixes)
    out = {"benchmark": "routing", "machine": machine_info(), "scenario_engine": args.scenario,
           "engine": engine.to_dict(), "load": args.load, "seeds": args.seeds,
           "docs_per_replica": args.docs_per_replica, "max_per_group": args.max_per_group,
           "max_prompt_tokens": args.max_prompt_tokens, "distinct_documents_in_data": pool.num_groups,
           "cells": cells, "load_sweep": sweep, "targets": TARGETS, "target_replicas": TARGET_REPLICAS,
           "router_cost": cost}
    out["verdicts"] = {k: v for k, (v, _) in verdicts(out).items()}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
