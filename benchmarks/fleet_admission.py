"""Admission across an unequal fleet: each replica's admission rule under each router, at and past capacity.

    python -m benchmarks.fleet_admission --first-seed 20000 --seeds 8 \\
        --tuning-from results/unequal_replicas.json --json results/fleet_admission.json

The fleets, workloads, loads and routers are :mod:`benchmarks.unequal_replicas`' (its speed and KV fleets
of ``--replicas`` (8) simulated ``leval-kv-pressure`` replicas; load = offered rate over the fleet's
capacity; held-out draws from :data:`~benchmarks.router_peers.HELD_OUT_DRAWS` or the evaluation's one
document set below :data:`~benchmarks.router_peers.TUNE_SEED_BASE`). The routers: ours learned (told
nothing) and each peer of :data:`~benchmarks.unequal_replicas.PEERS`, tuned on the fleet where its tuning
(``--tuning-from``, made without admission) moved it off its defaults.

Every replica runs an admission rule (:mod:`scheduler_runtime.admission`; the cluster simulator's
``~RULE``, :mod:`feather_env.cluster_sim`): a request one replica sheds is routed again among the others,
as ``feather-serve --reroute-shed`` does, and is rejected only when every replica shed it; with
``--no-reroute`` the first rejection stands, as ``feather-serve`` serves by default (the runs of both are
in ``docs/results.md``, "Admission across a fleet"). The rules, each on every router:

* ``none``: admit everything (what every router is measured with in :mod:`benchmarks.unequal_replicas`);
* ``slo``: ours at its default factor (told nothing: each replica's pace learns its own speed);
* the best of each family on the tuning draws (:func:`tune_rules`, mean attainment over the tuning
  draws at every load, per router and fleet): ours ``slo:F`` (F in
  :data:`benchmarks.admission_headroom.FACTORS`) and vLLM's caps ``queued-tokens:N`` and ``queued-reqs:N``
  (:data:`~benchmarks.admission_headroom.TOKEN_CAPS`, :data:`~benchmarks.admission_headroom.REQ_CAPS`),
  ``vllm caps`` in the tables being the better of the two on the tuning draws;
* a **placebo** for ours: as many requests as ours learned with ``slo`` rejected on that draw, chosen at
  random (:data:`PLACEBO_SEEDS`, the median), removed from the workload and counted as not met, the rest
  served by ours learned with ``none``: what rejecting that many requests is worth without choosing them.

Reported per cell (fleet x load), means over the seeds: SLO attainment (requests meeting TTFT <= 5 s and
TPOT <= 50 ms over the requests **submitted**, rejected ones included: shedding does not inflate it),
output throughput and the share rejected; the headline gives ours learned with ``slo`` over the best peer
with ``none`` (the issue's comparison, the field's routers as deployed without a cap), over the best peer
with vLLM's caps tuned, over the best peer with ours' ``slo`` (the router's share alone), over ours with
``none`` (the admission's share) and over the placebo: medians over the seeds of the per-seed ratios, in
attainment (output tok/s).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import measured
from benchmarks.admission_headroom import FACTORS, REQ_CAPS, TOKEN_CAPS
from benchmarks.router_peers import HELD_OUT_DRAWS, TUNE_SEED_BASE
from benchmarks.unequal_replicas import (
    OURS_LEARNED,
    PEERS,
    FleetDraws,
    fleet_mooncake_pool,
    fleets,
    own_draws,
    router_factories,
    seed_ratios,
    timed_runs,
    tuned_label,
)
from feather_env.cluster_sim import ClusterSim, ReplicaSpec
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from scheduler_runtime.router import ReplicaRouter

BASE = "feather-heuristic"
#: Each tuned family's settings (the rule after ``~``).
FAMILIES: dict[str, tuple[str, ...]] = {
    "slo": tuple(f"slo:{f:g}" for f in FACTORS),
    "queued-tokens": tuple(f"queued-tokens:{n}" for n in TOKEN_CAPS),
    "queued-reqs": tuple(f"queued-reqs:{n}" for n in REQ_CAPS),
}
PLACEBO_SEEDS = (0, 1, 2)
FLEETS = ("speed", "kv")


def cluster(n: int, engine: EngineConfig, specs: Sequence[ReplicaSpec], rule: str,
            slo: dict[str, float], reroute: bool = True) -> ClusterSim:
    """The fleet with ``rule`` on every replica (``none``: admit everything); ``reroute``: a request one
    replica sheds goes to another (else the rejection stands)."""
    return ClusterSim(n, engine, profiles=specs, scheduler=BASE if rule == "none" else f"{BASE}~{rule}",
                      admission_slos=slo, reroute_shed=reroute)


def serve(sim: ClusterSim, timed: Workload, router: ReplicaRouter, slo: dict[str, float],
          submitted: int | None = None) -> dict[str, float]:
    """One run's figures: attainment over ``submitted`` (default: the workload's requests), output tok/s,
    the share rejected, mean and P99 TTFT of the served."""
    r = sim.run(timed, router, goodput=slo, scrape_s=0.0)
    m = r.metrics
    total = submitted if submitted is not None else len(timed)
    served = m["completed"] > 0  # else every request was rejected: nothing output
    return {"attainment": sum(r.met) / total, "output_throughput": m["output_throughput"] if served else 0.0,
            "rejected": (m.get("rejected", 0) + total - len(timed)) / total,
            "mean_ttft_ms": m["mean_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"]}


def tune_rules(n: int, engine: EngineConfig, specs: Sequence[ReplicaSpec],
               runs: Sequence[tuple[int, Workload]], factories: dict[str, Callable[[int], ReplicaRouter]],
               slo: dict[str, float], log: Callable[[str], None], reroute: bool = True
               ) -> dict[str, dict[str, Any]]:
    """Per router, each family's best setting on the tuning ``runs`` (mean attainment) and every mean."""
    out: dict[str, dict[str, Any]] = {}
    for name, factory in factories.items():
        t0 = time.perf_counter()
        means = {rule: statistics.fmean(serve(cluster(n, engine, specs, rule, slo, reroute), timed,
                                              factory(seed), slo)["attainment"] for seed, timed in runs)
                 for rules in FAMILIES.values() for rule in rules}
        best = {family: max(rules, key=lambda r: means[r]) for family, rules in FAMILIES.items()}
        caps = max((best["queued-tokens"], best["queued-reqs"]), key=lambda r: means[r])
        out[name] = {"best": best, "vllm_caps": caps, "means": means}
        log(f"  {name}: slo {best['slo']}, vLLM caps {caps} ({means[caps]:.3f}) "
            f"[{time.perf_counter() - t0:.0f} s]")
    return out


#: The rules measured at their defaults, told nothing (each with its placebo): ``slo`` alone, and with
#: its ``tpot`` term (:mod:`scheduler_runtime.admission`).
DEFAULT_RULES = ("slo", "slo+tpot")


def rules_of(name: str, tuning: dict[str, dict[str, Any]] | None) -> dict[str, str]:
    """The rules a router is measured with: label -> rule."""
    rules = {"none": "none", **{r: r for r in DEFAULT_RULES}}
    t = (tuning or {}).get(name)
    if t is not None:
        rules["slo tuned"] = t["best"]["slo"]
        rules["vllm caps"] = t["vllm_caps"]
    return rules


def placebo(sim: ClusterSim, timed: Workload, router: Callable[[], ReplicaRouter], rejected: int,
            slo: dict[str, float]) -> dict[str, float]:
    """``rejected`` requests drawn at random removed, the rest served (``sim`` admits everything): the
    median run of :data:`PLACEBO_SEEDS` by attainment, over every request submitted."""
    runs = []
    for s in PLACEBO_SEEDS:
        drop = set(random.Random(s).sample([r.request_id for r in timed], rejected))
        kept = Workload(timed.name, tuple(r for r in timed if r.request_id not in drop))
        runs.append(serve(sim, kept, router(), slo, submitted=len(timed)))
    return sorted(runs, key=lambda x: x["attainment"])[len(runs) // 2]


def run_cell(n: int, engine: EngineConfig, specs: Sequence[ReplicaSpec], runs: Sequence[tuple[int, Workload]],
             factories: dict[str, Callable[[int], ReplicaRouter]], tuning: dict[str, dict[str, Any]] | None,
             slo: dict[str, float], reroute: bool = True) -> dict[str, Any]:
    """Every router with each of its rules, and the placebo, on each run ``(seed, timed workload)``."""
    sims: dict[str, ClusterSim] = {}
    rows: dict[str, dict[str, list[dict[str, float]]]] = {}
    placebos: dict[str, list[dict[str, float]]] = {label: [] for label in DEFAULT_RULES}
    for seed, timed in runs:
        for name, factory in factories.items():
            for label, rule in rules_of(name, tuning).items():
                sim = sims.setdefault(rule, cluster(n, engine, specs, rule, slo, reroute))
                run = serve(sim, timed, factory(seed), slo)
                rows.setdefault(name, {}).setdefault(label, []).append({**run, "rule": rule})
        ours = lambda seed=seed: factories[OURS_LEARNED](seed)  # noqa: E731
        for label, runs_ in placebos.items():
            k = round(rows[OURS_LEARNED][label][-1]["rejected"] * len(timed))
            runs_.append(placebo(sims["none"], timed, ours, k, slo))
    routers = {name: {label: {**{key: statistics.fmean(r[key] for r in rs) for key in rs[0] if key != "rule"},
                              "rules": sorted({r["rule"] for r in rs}), "runs": rs}
                      for label, rs in by_rule.items()}
               for name, by_rule in rows.items()}
    means = {label: {**{k: statistics.fmean(p[k] for p in ps) for k in ps[0]}, "runs": ps}
             for label, ps in placebos.items()}
    return {"routers": routers, "placebo": means["slo"], "placebos": means}


def best_peer(routers: dict[str, Any], label: str) -> str | None:
    """The peer of the highest mean attainment with the rule ``label`` (``None``: none measured with it)."""
    rows = [name for name in routers if name != OURS_LEARNED and label in routers[name]]
    return max(rows, key=lambda name: routers[name][label]["attainment"]) if rows else None


def _ratio(ours: Sequence[dict[str, float]], other: Sequence[dict[str, float]]) -> str:
    a = statistics.median(seed_ratios(ours, other, "attainment"))
    t = statistics.median(seed_ratios(ours, other, "output_throughput"))
    return f"{a:.2f}x ({t:.2f}x)"


def headline(res: dict[str, Any]) -> list[list[Any]]:
    """Per cell, ours learned with ``slo`` (its default) and with its tuned ``slo:F``, against the
    comparisons of the module docstring (the best peer with the same rule: ``slo``, or its own tuned
    ``slo:F``)."""
    rows = []
    for c in res["cells"]:
        routers, placebos = c["routers"], placebos_of(c)
        ours = routers[OURS_LEARNED]
        for label in (*DEFAULT_RULES, "slo tuned"):
            if label not in ours:
                continue
            mine = ours[label]["runs"]
            cols = []
            for other in ("none", "vllm caps", label):
                peer = best_peer(routers, other)
                cols.append(f"{peer}: {_ratio(mine, routers[peer][other]['runs'])}" if peer else "-")
                if other == "none":
                    cols.append(ceiling(routers[peer][other]["runs"]) if peer else "-")
            rows.append([c["fleet"], f"{c['load']:g}", f"{label} ({', '.join(ours[label]['rules'])})",
                         f"{100 * ours[label]['attainment']:.1f}%", f"{ours[label]['output_throughput']:.0f}",
                         f"{100 * ours[label]['rejected']:.1f}%", *cols, _ratio(mine, ours["none"]["runs"]),
                         _ratio(mine, placebos[label]["runs"]) if label in placebos else "-"])
    return rows


def ceiling(runs: Sequence[dict[str, float]]) -> str:
    """The largest attainment ratio any rule could reach over ``runs`` (all requests good over theirs):
    the median over seeds of ``1 / attainment``."""
    inverse = [1.0 / r["attainment"] if r["attainment"] > 0 else math.inf for r in runs]
    return f"{statistics.median(inverse):.2f}x"


def cell_rows(c: dict[str, Any]) -> list[list[Any]]:
    """One row per router and rule: attainment, tok/s, rejected, P99 TTFT, the rule."""
    out = []
    for name, by_rule in c["routers"].items():
        for label, r in by_rule.items():
            out.append([name, label, ", ".join(r["rules"]), f"{100 * r['attainment']:.1f}%",
                        f"{r['output_throughput']:.0f}", f"{100 * r['rejected']:.1f}%",
                        f"{r['p99_ttft_ms'] / 1000:.1f}"])
    for label, p in placebos_of(c).items():
        out.append(["placebo (ours learned)", "random" if label == "slo" else f"random, as {label}", "-",
                    f"{100 * p['attainment']:.1f}%", f"{p['output_throughput']:.0f}",
                    f"{100 * p['rejected']:.1f}%", f"{p['p99_ttft_ms'] / 1000:.1f}"])
    return out


def placebos_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A cell's placebos by the default rule whose rejections they match (a run from before the ``tpot``
    term has ``slo``'s alone)."""
    return c.get("placebos", {"slo": c["placebo"]})


def render(res: dict[str, Any]) -> str:
    """The headline and one table per cell, in markdown."""
    seeds = res["seeds"]
    slo = res["slo"]
    reading = (f"{len(seeds)} held-out draws, seeds {seeds[0]:,}-{seeds[-1]:,}" if own_draws(seeds)
               else f"the evaluation's document set, arrival seeds {seeds}")
    shed = "is tried on the others" if res.get("reroute_shed", True) else "is rejected at once"
    names = {"leval": "L-Eval", "zipf": "L-Eval's Zipf-popularity variant",
             "mooncake": "windows of the Mooncake trace"}
    workload = names.get(res["workload"], res["workload"])
    out = [f"{res['replicas']} simulated `{res['scenario_engine']}` replicas per fleet, {workload}, "
           f"{reading}; SLO TTFT <= {slo['ttft'] / 1000:g} s and TPOT <= {slo['tpot']:g} ms; attainment over "
           f"the requests submitted; a request one replica sheds {shed}. {measured(res)}; "
           f"`{res['command']}`: {res['wall_s'] / 60:.1f} min wall on one core.", "",
           "Headline: ours learned with `slo` on every replica (its default, told nothing) and with its "
           "`slo:F` tuned, its attainment, output tok/s and share rejected; over the best peer with no "
           "admission, with vLLM's caps tuned, and with the same rule as ours (`slo`, or its own tuned "
           "`slo:F`); over ours learned with no admission, and (the default) over the placebo: attainment "
           "(output tok/s), median over seeds of the per-seed ratio; the ceiling is the ratio any rule would "
           "reach over the best peer with no admission by meeting the SLO for every request.", "",
           format_table(["fleet", "load", "ours' rule", "attain.", "tok/s", "rejected", "/ best peer, none",
                         "ceiling over it", "/ best peer, vLLM caps tuned", "/ best peer, same rule",
                         "/ ours, none", "/ placebo"],
                        headline(res))]
    for c in res["cells"]:
        out += ["", f"{c['fleet']} fleet, load {c['load']:g} ({c['rate_req_s']:.2f} req/s):", "",
                format_table(["router", "rule", "setting", "attain.", "tok/s", "rejected", "P99 TTFT s"],
                             cell_rows(c))]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--docs-per-replica", type=int, default=16)
    p.add_argument("--loads", default=None, help="loads over the fleet's capacity (default 0.8,1.0,1.5)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help=f"below {TUNE_SEED_BASE:,}: the evaluation's document set; from {HELD_OUT_DRAWS:,}: "
                        "held-out draws")
    p.add_argument("--fleets", default=",".join(FLEETS))
    p.add_argument("--workload", choices=("leval", "zipf", "mooncake"), default="leval",
                   help="mooncake: windows of the trace at its own timestamps scaled to the load "
                        "(benchmarks.unequal_replicas --workload mooncake's)")
    p.add_argument("--slo", default="ttft:5000 tpot:50", help="SLOs in ms, vLLM's --goodput pairs")
    p.add_argument("--scenario", default="leval-kv-pressure")
    p.add_argument("--tune-seeds", type=int, default=3, help="tuning draws for the rules (0: no tuning)")
    p.add_argument("--tuning-from", default=None,
                   help="a benchmarks.unequal_replicas JSON: its peers' tuning on each fleet")
    p.add_argument("--no-reroute", action="store_true",
                   help="a request one replica sheds is rejected at once (default: tried on the others)")
    p.add_argument("--quick", action="store_true",
                   help="4 replicas, 4 documents each, one tuning draw and one seed, load 3 (unless --loads)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.docs_per_replica, args.seeds, args.tune_seeds = 4, 4, 1, 1
        args.loads = args.loads or "3"
    args.loads = args.loads or "0.8,1.0,1.5"
    unknown = sorted(set(f for f in args.fleets.split(",") if f) - set(FLEETS))
    if unknown:
        p.error(f"unknown fleets {unknown}; choose from {list(FLEETS)}")
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    slo = {k: float(v) for k, v in (x.split(":") for x in args.slo.split())}
    engine = load_scenario(args.scenario).engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    n, seeds = args.replicas, list(range(args.first_seed, args.first_seed + args.seeds))
    try:
        own = own_draws(seeds)
    except ValueError as exc:
        p.error(str(exc))
    peer_tuning: dict[str, Any] = {}
    if args.tuning_from:
        with open(args.tuning_from) as f:
            peer_tuning = json.load(f).get("tuning") or {}
    loads = [float(x) for x in args.loads.split(",")]
    moon = fleet_mooncake_pool(args.scenario, engine) if args.workload == "mooncake" else None
    draws = FleetDraws(engine, pool, n, args.docs_per_replica, workload=args.workload, moon=moon)
    specs_by_fleet = fleets(n, 0.0, 0.0)
    cells, tuning = [], {}
    for fleet in [f for f in args.fleets.split(",") if f]:
        specs, trace = specs_by_fleet[fleet], draws.trace(fleet)
        every = router_factories(specs, engine, slo, peer_tuning.get(fleet))
        factories = {OURS_LEARNED: every[OURS_LEARNED],
                     **{p: every[tuned_label(p) if tuned_label(p) in every else p] for p in PEERS}}
        if args.tune_seeds > 0:
            runs = [run for seed, w, c in draws.tuning(fleet, specs, args.tune_seeds)
                    for load in loads for run in timed_runs([(seed, w, c["req_s"])], load, trace)]
            log(f"{fleet}: tuning the rules on {len(runs)} runs")
            tuning[fleet] = tune_rules(n, engine, specs, runs, factories, slo, log, not args.no_reroute)
        evaluated = draws.held_out(fleet, specs, seeds)
        caps = [c["req_s"] for _, _, c in evaluated]
        for load in loads:
            t0 = time.perf_counter()
            runs = timed_runs([(seed, w, c["req_s"]) for seed, w, c in evaluated], load, trace)
            cell = run_cell(n, engine, specs, runs, factories, tuning.get(fleet), slo, not args.no_reroute)
            cells.append({"fleet": fleet, "load": load,
                          "requests": round(statistics.fmean(len(w) for _, w in runs)),
                          "rate_req_s": load * statistics.fmean(caps), "capacity_per_seed_req_s": caps,
                          **cell})
            log(f"{fleet} x load {load:g}: {time.perf_counter() - t0:.0f} s")
    out = {"benchmark": "fleet_admission", "machine": machine_info(), "scenario_engine": args.scenario,
           "replicas": n, "docs_per_replica": args.docs_per_replica, "workload": args.workload,
           "seeds": seeds, "held_out_draws": own, "slo": slo, "quick": args.quick,
           "reroute_shed": not args.no_reroute,
           "tune_seeds": [TUNE_SEED_BASE + s for s in range(args.tune_seeds)],
           "peer_tuning_from": args.tuning_from,
           "routers": {OURS_LEARNED: "ours learned", **{p: p for p in PEERS}},
           "command": "python -m benchmarks.fleet_admission " + shlex.join(
               argv if argv is not None else sys.argv[1:]),
           "tuning": tuning, "cells": cells}
    out["wall_s"] = time.perf_counter() - start
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
