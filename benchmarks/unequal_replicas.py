"""Routing on unequal replicas: ours told nothing, ours learning each replica's speed and KV, ours told the
truth, and the field's routers, on fleets of mixed speed, mixed KV and a replica that drifts.

    python -m benchmarks.unequal_replicas --json results/unequal_replicas.json

The cluster and the workload are :mod:`benchmarks.router_peers`'
(:func:`~benchmarks.router_peers.uniform_workload`): ``--replicas`` (8) simulated replicas of
``leval-kv-pressure``'s engine (0.25 GiB of KV), Feather's heuristic in each; L-Eval,
``--docs-per-replica`` (16) documents per replica with at most 8 questions each, Poisson arrivals
drawn with seeds 0, 1, 2. The fleets (:func:`fleets`,
:class:`~feather_env.cluster_sim.ReplicaSpec`):

* ``equal``: the control, every replica alike;
* ``speed``: every other replica 3x slower in prefill and 1.5x in decode (the calibrated step model's
  prefill part and the rest of each step scaled,
  :meth:`~feather_env.step_model.StepCostModel.prefill_seconds`);
* ``kv``: every other replica with a quarter of the KV (0.0625 GiB);
* ``drift``: replica 0 runs 3x slower (prefill and decode) from ``--drift-at`` to ``--drift-until``
  seconds of the clock, on ``--drift-blocks`` (3) of the other fleets' workloads one after the other
  (:func:`drift_workload`: each of its own documents, so that the run outlasts the recovery while a
  document's questions come as close together as in the other fleets).

Load is the offered rate over the fleet's capacity: the sum over its replicas of each one's own
saturation throughput, each kind's measured as :mod:`benchmarks.routing` measures a cluster's (a fleet
of that kind alone, the whole workload at once, the fixed reference router of
:data:`benchmarks.router_peers.REFERENCE`; request throughput over its replicas). The drift fleet's
capacity is its replicas' at their own speed, on its first block (while replica 0 is slow, the offered
load is higher: 1 / (1 - 2 / 3 / replicas) of it).

The routers (:data:`ROUTERS`): ``prefix`` (ours as today, told nothing: no cache model),
``prefix-learned`` (:class:`~scheduler_runtime.learned_router.LearnedRouter`, told nothing: it reads the
replicas' ``vllm:cache_config_info`` and learns speeds from what it serves), ``prefix-learned-place``
(the same, also placing a new prefix by predicted completion), ``prefix-informed`` (the learned router
told each replica's true slowdowns, drift included, and KV: the upper reference), and the peers at
their published defaults (not tuned here): SGLang's ``cache_aware``, Ray's prefix affinity, LMetric,
Dynamo's KV router and llm-d's predicted-latency scorer (given the SLOs below as its request's SLO;
its one model for the pool, as llm-d ships it, and ``llm-d-per-pod``, one model per pod, the variant
that could tell unequal pods apart).
Every router that observes the service is handed each replica's metrics at every arrival.

Reported per cell (fleet x load), means over the seeds: output throughput, SLO attainment (requests
with TTFT <= 5 s and TPOT <= 50 ms over the requests submitted: the issue's SLO; ``--slo``), mean and
P99 TTFT and E2E latency; and ours learned over each router, the median over the seeds of the per-seed
ratios, in output throughput and in attainment. For the drift fleet, how long after the slowdown and
after the recovery the learned prefill speed of replica 0 (over the median of the others') first comes
within 20% of the truth (1/3, then 1), and from when it stays there until the phase ends. Last, each
of :data:`COST_ROUTERS`' CPU per request at ``--cost-replicas`` (64) replicas (:func:`cost`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from benchmarks.router_peers import REFERENCE, make, uniform_workload
from benchmarks.routing import router_cost
from feather_env.cluster_sim import ClusterResult, ClusterSim, ReplicaSpec, distinct_documents
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from scheduler_runtime.learned_router import LearnedRouter
from scheduler_runtime.peer_routers import LlmdPredictedLatencyRouter
from scheduler_runtime.router import PrefixAffinityRouter, ReplicaRouter

OURS_LEARNED = "prefix-learned"
PEERS = ("sglang-cache-aware", "ray-prefix-affinity", "lmetric", "dynamo-kv", LlmdPredictedLatencyRouter.name)
LLMD_PER_POD = "llm-d-per-pod"
ROUTERS = ("prefix", OURS_LEARNED, "prefix-learned-place", "prefix-informed", *PEERS, LLMD_PER_POD)
FLEETS = ("equal", "speed", "kv", "drift")
DEFAULT_SLO = {"ttft": 5000.0, "tpot": 50.0}
#: How close a learned speed must come to the truth, and how often the drift's trace samples it.
WITHIN, TRACE_S = 0.2, 1.0


def fleets(n: int, drift_at: float, drift_until: float, factor: float = 3.0) -> dict[str, list[ReplicaSpec]]:
    """Each fleet's replicas (see the module docstring)."""
    slow = ReplicaSpec(prefill_slowdown=3.0, decode_slowdown=1.5)
    small = ReplicaSpec(kv_cache_gib=0.0625)
    return {"equal": [ReplicaSpec()] * n,
            "speed": [slow if i % 2 else ReplicaSpec() for i in range(n)],
            "kv": [small if i % 2 else ReplicaSpec() for i in range(n)],
            "drift": [ReplicaSpec(drift=((drift_at, factor), (drift_until, 1.0)))]
            + [ReplicaSpec()] * (n - 1)}


def drift_workload(pool: Workload, n: int, docs_per_replica: int, blocks: int, seed: int) -> Workload:
    """``blocks`` workloads of :func:`~benchmarks.router_peers.uniform_workload`'s size one after the
    other: ``blocks x n x docs_per_replica`` distinct documents (at most 8 questions each), split into
    consecutive blocks of ``n x docs_per_replica``, each block's questions in a random order."""
    docs = distinct_documents(pool, blocks * n * docs_per_replica, seed=seed, max_per_group=8)
    groups = list(docs.groups().values())
    size = n * docs_per_replica
    rng = np.random.default_rng(seed)
    out = []
    for b in range(blocks):
        block = [r for g in groups[b * size:(b + 1) * size] for r in g]
        out += [block[i] for i in rng.permutation(len(block))]
    return Workload(f"{docs.name}/blocks{blocks}", tuple(out))


def capacity(engine: EngineConfig, specs: Sequence[ReplicaSpec], workload: Workload) -> dict[str, Any]:
    """The fleet's capacity (requests/s): each kind's saturation per replica (a fleet of that kind alone,
    ``workload`` at once, the reference router), summed over the replicas. A drift is left out."""
    n = len(specs)
    per_kind: dict[ReplicaSpec, float] = {}
    for spec in specs:
        own = ReplicaSpec(spec.prefill_slowdown, spec.decode_slowdown, spec.kv_cache_gib, spec.max_num_seqs,
                          spec.max_num_batched_tokens)
        if own not in per_kind:
            sim = ClusterSim(n, engine, profiles=[own] * n)
            sat = sim.run(workload.with_arrivals("burst"), PrefixAffinityRouter(**REFERENCE))
            per_kind[own] = sat.metrics["request_throughput"] / n
        per_kind[spec] = per_kind[own]
    return {"req_s": sum(per_kind[s] for s in specs),
            "per_replica_req_s": [per_kind[s] for s in specs]}


def router_factories(specs: Sequence[ReplicaSpec], engine: EngineConfig,
                     slo: dict[str, float]) -> dict[str, Callable[[int], ReplicaRouter]]:
    """Each router of :data:`ROUTERS` for a fleet, by arrival seed."""
    engines = [s.engine(engine) for s in specs]
    kv = {str(i): e.num_kv_blocks * e.block_size for i, e in enumerate(engines)}

    def told(replica: str, now: float) -> tuple[float, float]:
        return specs[int(replica)].slowdowns_at(now)

    out: dict[str, Callable[[int], ReplicaRouter]] = {
        "prefix": lambda seed: PrefixAffinityRouter(),
        OURS_LEARNED: lambda seed: LearnedRouter(),
        "prefix-learned-place": lambda seed: LearnedRouter(place_new=True),
        "prefix-informed": lambda seed: LearnedRouter(told=told, told_kv_tokens=kv),
        LlmdPredictedLatencyRouter.name: lambda seed: LlmdPredictedLatencyRouter(
            ttft_slo_ms=slo.get("ttft"), tpot_slo_ms=slo.get("tpot"), seed=seed),
        LLMD_PER_POD: lambda seed: LlmdPredictedLatencyRouter(
            ttft_slo_ms=slo.get("ttft"), tpot_slo_ms=slo.get("tpot"), seed=seed, per_pod=True),
    }
    for name in PEERS:
        out.setdefault(name, lambda seed, name=name: make(name, {}, seed))
    return out


class _Traced(LearnedRouter):
    """The learned router, its estimates sampled every :data:`TRACE_S` seconds of the clock."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace: list[tuple[float, dict[str, float | None]]] = []

    def choose(self, hashes: Any, loads: Any, avoid: Any = (), *, tokens: int | None = None) -> str:
        now = self.clock()
        if not self.trace or now - self.trace[-1][0] >= TRACE_S:
            self.trace.append((now, {r: e["prefill_tok_s"] for r, e in self.estimates().items()}))
        return super().choose(hashes, loads, avoid, tokens=tokens)


def convergence(trace: Sequence[tuple[float, dict[str, float | None]]], replica: str,
                phases: Sequence[tuple[float, float, float]]) -> list[dict[str, Any]]:
    """For each phase ``(start, end, slowdown)``: seconds from its start until ``replica``'s learned prefill
    speed over the median of the others' first comes within :data:`WITHIN` of ``1 / slowdown``
    (``first_s``), and from when it stays within until the phase ends (``settled_s``); ``None``: never."""
    out = []
    for start, end, slowdown in phases:
        samples = []
        for t, speeds in trace:
            if not start <= t < end:
                continue
            mine = speeds.get(replica)
            others = [v for r, v in speeds.items() if r != replica and v]
            if mine and others:
                samples.append((t, mine / statistics.median(others)))
        truth = 1.0 / slowdown
        ok = [abs(ratio / truth - 1.0) <= WITHIN for _, ratio in samples]
        first = next((t - start for (t, _), good in zip(samples, ok, strict=True) if good), None)
        settled = None
        for i in range(len(samples) - 1, -1, -1):
            if not ok[i]:
                break
            settled = samples[i][0] - start
        out.append({"start_s": start, "end_s": end, "slowdown": slowdown, "first_s": first,
                    "settled_s": settled, "samples": len(samples),
                    "last_ratio": samples[-1][1] if samples else None})
    return out


def _attainment(result: ClusterResult, submitted: int) -> float:
    m = result.metrics
    return (m.get("request_goodput") or 0.0) * m["duration"] / submitted


def run_cell(sim: ClusterSim, workload: Workload, rate: float, seeds: Sequence[int],
             factories: dict[str, Callable[[int], ReplicaRouter]], slo: dict[str, float],
             phases: Sequence[tuple[float, float, float]] = ()) -> dict[str, Any]:
    """Every router on ``workload`` at ``rate`` req/s, one Poisson draw per seed."""
    routers: dict[str, Any] = {}
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in factories}
    drift: list[list[dict[str, Any]]] = []
    estimates: list[dict[str, Any]] = []
    for seed in seeds:
        timed = workload.with_arrivals(f"poisson:{rate}", seed)
        for name, factory in factories.items():
            router = _Traced() if phases and name == OURS_LEARNED else factory(seed)
            r = sim.run(timed, router, goodput=slo, scrape_s=0.0)
            m = r.metrics
            per_seed[name].append({"output_throughput": m["output_throughput"],
                                   "attainment": _attainment(r, len(timed)),
                                   "mean_ttft_ms": m["mean_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"],
                                   "mean_e2el_ms": m["mean_e2el_ms"], "p99_e2el_ms": m["p99_e2el_ms"],
                                   "prefix_hit_rate": m["prefix_hit_rate"], "wall_s": r.wall_s})
            if isinstance(router, _Traced):
                drift.append(convergence(router.trace, "0", phases))
            if isinstance(router, LearnedRouter) and name == OURS_LEARNED:
                estimates.append(router.estimates())
    ours = per_seed[OURS_LEARNED]
    for name, runs in per_seed.items():
        row: dict[str, Any] = {k: statistics.fmean(x[k] for x in runs) for k in runs[0]}
        for key in ("output_throughput", "attainment"):
            ratios = [a[key] / b[key] if b[key] else math.inf for a, b in zip(ours, runs, strict=True)]
            row[f"learned_over_this_{key}"] = statistics.median(ratios)
        row["runs"] = runs
        routers[name] = row
    return {"routers": routers, "drift": drift, "learned_estimates_at_end": estimates[:1]}


#: The routers whose cost per request is measured (``--cost-replicas``).
COST_ROUTERS = ("prefix", OURS_LEARNED, "sglang-cache-aware", "lmetric", LlmdPredictedLatencyRouter.name)


def cost(replicas: int, prefixes: int, repeats: int) -> dict[str, Any]:
    """Each of :data:`COST_ROUTERS`' CPU per request (``choose`` + ``routed``, and the first token and
    finish for those that track requests) at ``replicas`` replicas
    (:func:`benchmarks.routing.router_cost`)."""
    engine = load_scenario("leval-kv-pressure").engine_config()
    factories = router_factories([ReplicaSpec()] * replicas, engine, DEFAULT_SLO)
    return router_cost(replicas, prefixes, repeats=repeats,
                       routers={name: (lambda name=name: factories[name](0)) for name in COST_ROUTERS})


def render(res: dict[str, Any]) -> str:
    """The figures in markdown: one table per cell, a summary of ours learned over each router, the
    drift's convergence."""
    slo = res["slo"]
    out = [f"{res['replicas']} simulated `{res['scenario_engine']}` replicas per fleet, L-Eval "
           f"({res['docs_per_replica']} documents per replica; drift: {res['drift_blocks']} such blocks), "
           f"arrival seeds {res['seeds']}; SLO TTFT <= {slo['ttft'] / 1000:g} s and TPOT <= {slo['tpot']:g} "
           "ms; "
           f"peers at their defaults. {measured(res)}; `{res['command']}`: {res['wall_s'] / 60:.1f} min wall "
           "on one core."]
    ratio_headers = ["fleet", "load", "learned tok/s", "learned attain."] + [f"/ {r}" for r in ROUTERS
                                                                            if r != OURS_LEARNED]
    summary = []
    for c in res["cells"]:
        routers = c["routers"]
        ours = routers[OURS_LEARNED]
        summary.append([c["fleet"], f"{c['load']:g}", ours["output_throughput"],
                        f"{100 * ours['attainment']:.1f}%"]
                       + [f"{routers[r]['learned_over_this_output_throughput']:.3f}x "
                          f"({routers[r]['learned_over_this_attainment']:.2f}x)"
                          for r in ROUTERS if r != OURS_LEARNED])
    out += ["", "Ours learned over each router: output tok/s (attainment), median over seeds of the per-seed "
            "ratio:", "", format_table(ratio_headers, summary)]
    grid = [[name] + [f"{100 * r['attainment']:.1f}% / {r['output_throughput']:.0f}"
                      for r in (c["routers"][name] for c in res["cells"])] for name in ROUTERS]
    out += ["", "Attainment / output tok/s, every router and cell (means over seeds):", "",
            format_table(["router"] + [f"{c['fleet']} {c['load']:g}" for c in res["cells"]], grid)]
    headers = ["router", "output tok/s", "attainment", "mean TTFT s", "P99 TTFT s", "mean E2E s", "P99 E2E s",
               "prefix hit"]
    for c in res["cells"]:
        rows = [[name, r["output_throughput"], f"{100 * r['attainment']:.1f}%", r["mean_ttft_ms"] / 1000,
                 r["p99_ttft_ms"] / 1000, r["mean_e2el_ms"] / 1000, r["p99_e2el_ms"] / 1000,
                 f"{100 * r['prefix_hit_rate']:.0f}%"] for name, r in c["routers"].items()]
        out += ["", f"**{c['fleet']}, load {c['load']:g}**: {c['requests']} requests, "
                f"{c['rate_req_s']:.2f} req/s (capacity {c['capacity_req_s']:.2f} req/s)", "",
                format_table(headers, rows)]
    drift_rows = []
    for c in res["cells"]:
        for seed, phases in zip(res["seeds"], c.get("drift") or [], strict=False):
            for p in phases:
                phase = f"{p['start_s']:g}-{p['end_s']:g} s, x{p['slowdown']:g}"
                drift_rows.append([f"{c['load']:g}", seed, phase,
                                   "never" if p["first_s"] is None else f"{p['first_s']:.0f} s",
                                   "never" if p["settled_s"] is None else f"{p['settled_s']:.0f} s",
                                   "-" if p["last_ratio"] is None else f"{p['last_ratio']:.2f}"])
    if drift_rows:
        out += ["", f"Drift: replica 0's learned prefill speed over the others' median, against the truth "
                f"(1 / slowdown): seconds from the change until it is first within {100 * WITHIN:.0f}%, and "
                "from when it stays within until the phase ends:", "",
                format_table(["load", "seed", "phase", "first within", "stays within from", "ratio at end"],
                             drift_rows)]
    c = res.get("router_cost")
    if c:
        passes = len(next(iter(c["routers"].values()))["runs_us"])
        out += ["", f"Router CPU per request at {c['replicas']} replicas, {c['prefixes']:,} distinct "
                f"{c['prompt_tokens']}-token prompts, random loads (median of {passes} passes; "
                "`benchmarks.routing.router_cost`; a router that tracks requests is told each request's "
                "first token and finish too):", "",
                format_table(["router", "us per request"],
                             [[k, v["us_per_request"]] for k, v in c["routers"].items()])]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--docs-per-replica", type=int, default=16)
    p.add_argument("--drift-blocks", type=int, default=3, help="the drift's workload: this many blocks")
    p.add_argument("--drift-at", type=float, default=40.0, help="seconds: replica 0 slows down")
    p.add_argument("--drift-until", type=float, default=100.0, help="seconds: it recovers")
    p.add_argument("--loads", default="0.8,1.0")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--fleets", default=",".join(FLEETS))
    p.add_argument("--slo", default="ttft:5000 tpot:50", help="SLOs in ms, vLLM's --goodput pairs")
    p.add_argument("--scenario", default="leval-kv-pressure")
    p.add_argument("--quick", action="store_true",
                   help="4 replicas, 4 documents each (drift: 3 blocks, slow from 6 s to 14 s), load 1, "
                        "one seed (a smoke test)")
    p.add_argument("--cost-replicas", type=int, default=64, help="0: no cost measurement")
    p.add_argument("--cost-prefixes", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.docs_per_replica = 4, 4
        args.loads, args.seeds, args.drift_at, args.drift_until = "1.0", 1, 6.0, 14.0
        args.cost_replicas, args.cost_prefixes = 8, 50
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    slo = {k: float(v) for k, v in (x.split(":") for x in args.slo.split())}
    engine = load_scenario(args.scenario).engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    n, seeds = args.replicas, list(range(args.seeds))
    specs_by_fleet = fleets(n, args.drift_at, args.drift_until)
    cells = []
    for fleet in args.fleets.split(","):
        specs = specs_by_fleet[fleet]
        workload = uniform_workload(pool, n, args.docs_per_replica, seed=n)
        cap = capacity(engine, specs, workload)
        if fleet == "drift":
            workload = drift_workload(pool, n, args.docs_per_replica, args.drift_blocks, seed=n)
            first = workload.requests[:len(workload) // args.drift_blocks]
            cap = capacity(engine, specs, Workload("first block", first))
        sim = ClusterSim(n, engine, profiles=specs)
        phases = ([(0.0, args.drift_at, 1.0), (args.drift_at, args.drift_until, 3.0),
                   (args.drift_until, math.inf, 1.0)] if fleet == "drift" else [])
        factories = router_factories(specs, engine, slo)
        for load in (float(x) for x in args.loads.split(",")):
            t0 = time.perf_counter()
            rate = load * cap["req_s"]
            cell = run_cell(sim, workload, rate, seeds, factories, slo, phases)
            cells.append({"fleet": fleet, "load": load, "requests": len(workload), "rate_req_s": rate,
                          "capacity_req_s": cap["req_s"],
                          "capacity_per_replica_req_s": cap["per_replica_req_s"], **cell})
            log(f"{fleet} x load {load:g}: {time.perf_counter() - t0:.0f} s")
    out = {"benchmark": "unequal_replicas", "machine": machine_info(), "scenario_engine": args.scenario,
           "engine": engine.to_dict(), "replicas": n, "docs_per_replica": args.docs_per_replica,
           "drift_blocks": args.drift_blocks, "drift_at_s": args.drift_at,
           "drift_until_s": args.drift_until, "seeds": seeds, "slo": slo, "quick": args.quick,
           "fleets": {f: [dataclasses.asdict(s) for s in specs_by_fleet[f]] for f in FLEETS},
           "command": "python -m benchmarks.unequal_replicas " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "cells": cells}
    if args.cost_replicas:
        t0 = time.perf_counter()
        out["router_cost"] = cost(args.cost_replicas, args.cost_prefixes, 1 if args.quick else 3)
        log(f"router cost at {args.cost_replicas} replicas: {time.perf_counter() - t0:.0f} s")
    out["wall_s"] = time.perf_counter() - start
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
