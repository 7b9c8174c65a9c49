"""How well ours learned reads each replica's prefix cache, against the simulated engine's own.

    python -m benchmarks.cache_model_reading --json results/cache_model_reading.json

:class:`~scheduler_runtime.learned_router.LearnedRouter` reads what each replica holds twice: its cache
model decides whether a known document stays with its owner (an LRU of 1 x the replica's KV of prompts,
entered at their first token, what the requests in flight hold counting as held), and its learned prefill
speeds divide each prefill's service time by its uncached tokens. This benchmark routes
:mod:`benchmarks.unequal_replicas`' fleets (L-Eval, 8 replicas, its evaluation's held-out seeds) with ours
learned as the eleventh session left it (``work_by="model"``, every evicted document moved) and asks the
simulated engines, which the router never sees:

* at each document the model declares evicted from its owner: whether the owner's engine still held at
  least half of the known prefix then (``cached_prefix_tokens``), the owner's and the destination's
  requests in flight;
* per request: the uncached tokens the work was counted with, by the model and by an LRU of 1 x KV of what
  the replica was sent (``work_by="sent"``, read beside it without routing), against the tokens the engine
  prefilled (its timeline's prompt less ``prefix_hit_tokens``), split by where the model's holding came
  from (the LRU, the requests in flight, or neither).

Prints a table per fleet and load and writes every figure to ``--json``. About 1 min per cell on one core.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.unequal_replicas import DEFAULT_SLO, FleetDraws, fleets, timed_runs
from feather_env.cluster_sim import ClusterSim
from feather_env.reporting import machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.workloads import WorkloadConfig, load_workload
from scheduler_runtime.learned_router import LearnedRouter
from scheduler_runtime.router_base import PrefixHistory

#: Where the model's holding of a request's prefix on its replica came from.
SOURCES = ("model", "in flight", "none")


def read_run(sim: ClusterSim, timed: Any) -> dict[str, Any]:
    """One run's evictions and per-request work, read against the engines (see the module docstring)."""
    router = LearnedRouter(work_by="model", move_room=None)
    sent = PrefixHistory(router.chunk_size, 1 << 40, holders=False)  # work_by="sent"'s LRU, read beside
    run = sim.serve(timed, router, goodput=DEFAULT_SLO, scrape_s=0.0)
    evictions: list[dict[str, float]] = []
    source: dict[str, str] = {}
    predicted: dict[str, tuple[float, float]] = {}
    while (a := run.next_arrival()) is not None:
        evicted = router.counts["evicted"]
        choice = router.choose(a.hashes, a.loads, tokens=a.tokens)
        ids = a.request.prompt_token_ids
        if router.counts["evicted"] != evicted and a.hashes is not None:
            level, owner = router.owner(a.hashes)
            if owner is not None:
                known = min((level + 1) * router.chunk_size, len(ids))
                held = run.by_name[owner].engine.cached_prefix_tokens(ids)
                evictions.append({"owner_held": float(held >= 0.5 * known), "owner_in_flight": a.loads[owner],
                                  "destination_in_flight": a.loads[choice]})
        if a.hashes is not None and router.cached is not None and router.in_flight is not None:
            m = router.cached.match(a.hashes).get(choice, 0)
            f = router.in_flight.match(a.hashes).get(choice, 0)
            source[a.request.request_id] = "in flight" if f > m else ("model" if m > 0 else "none")
            kv = router._replica(choice).kv_tokens
            if kv and sent.limits.get(choice) != kv:
                sent.set_limit(choice, kv)
            n = a.tokens
            by_sent = float(max(0, n - min(n, sent.depth(a.hashes, choice) * router.chunk_size)))
            predicted[a.request.request_id] = (router._uncached(a.hashes, n, (choice,))[choice], by_sent)
            sent.insert(a.hashes, choice, a.tokens)
        run.route(choice)
    run.finish()
    work: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SOURCES}
    for t in run.timelines():
        if t.request_id in predicted:
            model, by_sent = predicted[t.request_id]
            work[source[t.request_id]].append((model, by_sent, float(t.prompt_len - t.prefix_hit_tokens)))
    return {"evictions": evictions, "work": work}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per seed, the evictions and how many of them the owner's engine still held; per source, the mean
    uncached tokens predicted by the model and by what was sent, and the engine's."""
    out: dict[str, Any] = {"evictions_per_seed": [len(r["evictions"]) for r in runs],
                           "owner_held_per_seed": [int(sum(e["owner_held"] for e in r["evictions"]))
                                                   for r in runs],
                           "owner_in_flight": statistics.fmean(e["owner_in_flight"] for r in runs
                                                               for e in r["evictions"]),
                           "destination_in_flight": statistics.fmean(e["destination_in_flight"] for r in runs
                                                                     for e in r["evictions"])}
    rows = {}
    for s in (*SOURCES, "all"):
        xs = [x for r in runs for src, w in r["work"].items() if s in (src, "all") for x in w]
        rows[s] = {"requests": len(xs), "model": statistics.fmean(x[0] for x in xs) if xs else 0.0,
                   "sent": statistics.fmean(x[1] for x in xs) if xs else 0.0,
                   "engine": statistics.fmean(x[2] for x in xs) if xs else 0.0}
    out["uncached_tokens"] = rows
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleets", default="speed,kv")
    p.add_argument("--loads", default="1.0")
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    n = 8
    engine = load_scenario("leval-kv-pressure").engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    draws = FleetDraws(engine, pool, n)
    cells = []
    print("| fleet | load | evictions per seed | the owner still held half | owner / destination in flight "
          "| uncached per request: model / sent / engine | held by the LRU: model / engine "
          "| held in flight: model / engine |")
    print("|---|---|---|---|---|---|---|---|")
    for fleet in [f for f in args.fleets.split(",") if f]:
        specs = fleets(n, 40.0, 100.0)[fleet]
        sim = ClusterSim(n, engine, profiles=specs)
        drawn = draws.held_out(fleet, specs, range(args.seeds))
        for load in (float(x) for x in args.loads.split(",")):
            runs = [read_run(sim, timed) for _, timed in timed_runs([(s, w, c["req_s"]) for s, w, c in drawn],
                                                                    load)]
            cell = {"fleet": fleet, "load": load, **summarize(runs)}
            u, ev, held = cell["uncached_tokens"], cell["evictions_per_seed"], cell["owner_held_per_seed"]
            print(f"| {fleet} | {load:g} | {min(ev)}-{max(ev)} | {min(held)}-{max(held)} | "
                  f"{cell['owner_in_flight']:.1f} / {cell['destination_in_flight']:.1f} | "
                  f"{u['all']['model']:.0f} / {u['all']['sent']:.0f} / {u['all']['engine']:.0f} | "
                  f"{u['model']['model']:.0f} / {u['model']['engine']:.0f} | "
                  f"{u['in flight']['model']:.0f} / {u['in flight']['engine']:.0f} |", flush=True)
            cells.append(cell)
    out = {"benchmark": "cache_model_reading", "machine": machine_info(),
           "command": "python -m benchmarks.cache_model_reading " + shlex.join(
               argv if argv is not None else sys.argv[1:]),
           "seeds": list(range(args.seeds)), "cells": cells, "wall_s": time.perf_counter() - start}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
