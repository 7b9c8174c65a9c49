"""The admission rule's ``tpot`` term: what it adds to ``slo`` on one engine and a fleet, and its window.

    python -m benchmarks.tpot_term [--windows 0.5,2,10] [--json results/tpot_term.json]

``slo+tpot`` (:mod:`scheduler_runtime.admission`) bounds the prefill admitted over the last
``TPOT_WINDOW_S`` seconds (default 2) so that the running decodes keep their TPOT SLO. This benchmark
serves, for each window in ``--windows`` (the module constant set for the run), ``slo`` (F = 1, told
nothing), ``slo+tpot``, and the tuned ``slo:F`` with and without the term, on the simulator:

* **one engine**: :mod:`benchmarks.admission_headroom`'s cells (``mooncake-synthetic`` at 4x and 6x,
  the EPYC AVX-512 profile, SLO TTFT <= 5 s and TPOT <= 50 ms), each load's best constant and tuned
  ``slo:F`` read from ``--headroom`` (its JSON), on its held-out windows;
* **a fleet**: :mod:`benchmarks.fleet_admission`'s speed fleet of 8 replicas on windows of the Mooncake
  trace at load 1.5, no rerouting, ours learned routing, held-out draws ``--fleet-seeds``; its tuned
  ``slo:F`` read from ``--fleet`` (that benchmark's JSON).

Every figure is SLO attainment over the requests submitted (a rejected request is a miss), with the
share of requests that missed their TPOT while meeting their TTFT.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import fleet_admission, measured
from benchmarks.admission_headroom import Server
from benchmarks.unequal_replicas import FleetDraws, fleet_mooncake_pool, fleets, timed_runs
from feather_env.cluster_sim import ReplicaSpec
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import serving_metrics
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from scheduler_runtime import admission
from scheduler_runtime.learned_router import LearnedRouter

FLEET_SLOS = {"ttft": 5000.0, "tpot": 50.0}


def rules(tuned: str) -> list[str]:
    """``slo``, ``slo+tpot``, the tuned ``slo:F`` and it with the term."""
    return ["slo", "slo+tpot", tuned, f"{tuned}+tpot"]


def single_engine(headroom: dict[str, Any], servers: dict[str, Server],
                  window: float) -> list[dict[str, Any]]:
    """Each load's held-out windows of ``admission_headroom`` (served by ``servers``, one per load), each
    rule on its best constant."""
    out = []
    for rate, load in headroom["loads"].items():
        server = servers[rate]
        base, tuned = load["best_constant"], load["slo_rule"].split("~", 1)[1]
        for seed in headroom["eval_seeds"]:
            for rule in rules(tuned):
                m = serving_metrics(server.serve(f"{base}~{rule}", seed), goodput=server.slos)
                out.append({"window_s": window, "cell": f"one engine, {float(rate):g}x", "seed": seed,
                            "rule": rule, "attainment": m["slo_attainment"],
                            "rejected": m["rejected"] / m["submitted"]})
    return out


@dataclass(frozen=True)
class FleetRuns:
    """The speed fleet of 8 replicas and its held-out Mooncake windows with arrivals at ``load``."""

    engine: EngineConfig
    specs: Sequence[ReplicaSpec]
    runs: Sequence[tuple[int, Workload]]
    load: float

    @classmethod
    def draw(cls, seeds: Sequence[int], load: float = 1.5) -> FleetRuns:
        engine = load_scenario("leval-kv-pressure").engine_config()
        pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
        draws = FleetDraws(engine, pool, 8, workload="mooncake",
                           moon=fleet_mooncake_pool("leval-kv-pressure", engine))
        specs = fleets(8, 0.0, 0.0)["speed"]
        runs = timed_runs([(seed, w, cap["req_s"]) for seed, w, cap in draws.held_out("speed", specs, seeds)],
                          load, True)
        return cls(engine, specs, runs, load)


def fleet(runs: FleetRuns, tuned: str, window: float) -> list[dict[str, Any]]:
    """``runs``' fleet, ours learned, each rule on every replica."""
    engine, specs, load = runs.engine, runs.specs, runs.load
    out = []
    for seed, timed in runs.runs:
        for rule in rules(tuned):
            r = fleet_admission.cluster(8, engine, specs, rule, FLEET_SLOS, False).run(
                timed, LearnedRouter(), goodput=FLEET_SLOS, scrape_s=0.0)
            tpot = sum(p["tpot_miss"] for p in r.per_replica)
            out.append({"window_s": window, "cell": f"speed fleet, Mooncake, load {load:g}", "seed": seed,
                        "rule": rule, "attainment": sum(r.met) / len(timed),
                        "rejected": r.metrics.get("rejected", 0) / len(timed),
                        "tpot_missed": tpot / len(timed)})
    return out


def render(res: dict[str, Any]) -> str:
    """Mean attainment (share rejected) per cell, rule and window."""
    rows: dict[tuple[str, str], dict[float, list[dict[str, Any]]]] = {}
    for r in res["runs"]:
        rows.setdefault((r["cell"], r["rule"].replace(res["tuned"].get(r["cell"], "\0"), "slo:F tuned")),
                        {}).setdefault(r["window_s"], []).append(r)
    windows = res["windows_s"]
    table = []
    for (cell, rule), by_window in rows.items():
        cols = []
        for w in windows:
            rs = by_window.get(w, [])
            cols.append(f"{100 * statistics.fmean(x['attainment'] for x in rs):.1f}% "
                        f"({100 * statistics.fmean(x['rejected'] for x in rs):.1f}%)" if rs else "-")
        table.append([cell, rule, *cols])
    tuned = ", ".join(f"{c}: `{t}`" for c, t in res["tuned"].items())
    return "\n".join([
        f"SLO attainment over the requests submitted (share rejected), mean over held-out windows, for each "
        f"`TPOT_WINDOW_S`; tuned F ({tuned}). {measured(res)}; `{res['command']}`: "
        f"{res['wall_s'] / 60:.1f} min.", "",
        format_table(["cell", "rule", *(f"window {w:g} s" for w in windows)], table)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", default="0.5,2,10", help="TPOT_WINDOW_S values, seconds")
    p.add_argument("--headroom", default="results/admission_headroom.json")
    p.add_argument("--fleet", default="results/fleet_admission_mooncake_speed_draws12_noreroute.json")
    p.add_argument("--fleet-seeds", default="20000,20001")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    with open(args.headroom) as f:
        headroom = json.load(f)
    with open(args.fleet) as f:
        fleet_tuned = json.load(f)["tuning"]["speed"][fleet_admission.OURS_LEARNED]["best"]["slo"]
    windows = [float(w) for w in args.windows.split(",")]
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    servers = {rate: Server(float(rate)) for rate in headroom["loads"]}
    fleet_runs = FleetRuns.draw(seeds)
    default = admission.TPOT_WINDOW_S
    runs: list[dict[str, Any]] = []
    try:
        for w in windows:
            admission.TPOT_WINDOW_S = w
            runs += single_engine(headroom, servers, w) + fleet(fleet_runs, fleet_tuned, w)
            print(f"[{time.perf_counter() - start:5.0f} s] window {w:g} s", file=sys.stderr, flush=True)
    finally:
        admission.TPOT_WINDOW_S = default
    tuned = {f"one engine, {float(r):g}x": ld["slo_rule"].split("~", 1)[1]
             for r, ld in headroom["loads"].items()}
    tuned["speed fleet, Mooncake, load 1.5"] = fleet_tuned
    command = "python -m benchmarks.tpot_term " + shlex.join(argv if argv is not None else sys.argv[1:])
    out = {"benchmark": "tpot_term", "machine": machine_info(), "windows_s": windows,
           "default_window_s": default, "tuned": tuned, "runs": runs, "wall_s": time.perf_counter() - start,
           "command": command}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
