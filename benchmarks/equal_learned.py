"""Ours learned on equal replicas: `prefix-learned` beside today's default on router_peers' grid.

    python -m benchmarks.equal_learned --json results/equal_learned.json

Issue 50's equal-replica check: learning each replica's speed and KV must cost nothing where the
replicas are alike. The cells and seeds are :mod:`benchmarks.router_peers`' evaluation
(:func:`~benchmarks.router_peers.cell_runs`): L-Eval at 4, 16 and 64 replicas (loads 0.8, 1 and 1.5; 0.8
and 1 at 64, with 8 documents per replica there), its Zipf variant at 16 and the Mooncake synthetic
trace at 4 and 16 replicas, arrival seeds 0-2, each load a multiple of the workload's saturation rate
measured with router_peers' fixed reference router. Those seeds share one L-Eval document set per
replica count and vary the arrivals only; ``--first-seed 20000 --seeds N`` (:data:`HELD_OUT_DRAWS`)
runs the grid on N held-out draws instead, each its own documents and arrivals (and Mooncake window),
drawn as router_peers draws its tuning workloads. Two routers on each run:

* ``prefix`` (today's default): :class:`~scheduler_runtime.router.PrefixAffinityRouter` at its
  defaults (the knobs router_peers tuned), told each replica's KV for its cache model, as router_peers
  runs it;
* ``prefix-learned``: :class:`~scheduler_runtime.learned_router.LearnedRouter` at its defaults, told
  nothing (it reads each replica's ``vllm:cache_config_info`` and learns the speeds from what it serves;
  its cache model on, by the engine's clock, since 2026-12-07);
* with ``--peers-from JSON`` (a run of :mod:`benchmarks.router_peers`), the field's routers at the knobs
  that run tuned (``tuned``), on the same runs: the issue's "no cell where a tuned peer beats ours by
  more than 2%", read side by side.

Per cell: each router's mean attainment (requests that met the SLO over those submitted; the issue's
TTFT <= 5 s and TPOT <= 50 ms, ``--slo``, and a tighter pair, ``--slo2``) and output tok/s, and ours
learned over today's default: the median of the per-seed ratios with their range
(:func:`benchmarks.unequal_replicas.run_cell`). The target: >= 0.98x in attainment in every cell. With the
peers, per cell the best of them and ours learned over it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import knob_values, measured
from benchmarks.router_peers import (
    DOCS_PER_REPLICA,
    DOCS_PER_REPLICA_LARGE,
    HELD_OUT_DRAWS,
    LARGE_REPLICAS,
    MOONCAKE_WINDOW_S,
    OURS,
    PEERS,
    TARGET_REPLICAS,
    TUNE_SEED_BASE,
    ZIPF_S,
    cell_runs,
    kv_tokens,
    make,
)
from benchmarks.unequal_replicas import OURS_LEARNED, run_cell, seed_ratios
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.serving_metrics import parse_goodput
from feather_env.workloads import WorkloadConfig, load_workload
from scheduler_runtime.learned_router import LearnedRouter

TARGET = 0.98
#: (kind, replicas, loads): router_peers' evaluation grid.
GRID = (("uniform", 4, (0.8, 1.0, 1.5)), ("uniform", 16, (0.8, 1.0, 1.5)), ("uniform", 64, (0.8, 1.0)),
        ("zipf", TARGET_REPLICAS, (0.8, 1.0, 1.5)), ("mooncake", 4, (0.8, 1.0, 1.5)),
        ("mooncake", 16, (0.8, 1.0, 1.5)))


def evaluate(grid: Sequence[tuple[str, int, Sequence[float]]], seeds: Sequence[int], slo: dict[str, float],
             slo2: dict[str, float], learned: dict[str, Any] | None = None,
             log: Any = print, peers: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each cell of ``grid`` with both routers: its rows of :func:`benchmarks.unequal_replicas.run_cell`.
    ``learned``: knobs of ours learned other than its defaults; ``peers``: peer -> its knobs, each run too
    (labelled ``peer (tuned)``)."""
    knobs = dict(learned or {})
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    cells = []
    for kind, n, loads in grid:
        runs = cell_runs(kind, n, seeds, pool=pool, docs_per_replica=DOCS_PER_REPLICA,
                         docs_per_replica_large=DOCS_PER_REPLICA_LARGE, large_replicas=LARGE_REPLICAS,
                         zipf_s=ZIPF_S, mooncake_window=MOONCAKE_WINDOW_S)
        kv = kv_tokens(runs.sim)
        factories = {OURS: lambda seed, kv=kv: make(OURS, {}, seed, kv),
                     OURS_LEARNED: lambda seed: LearnedRouter(**knobs)}
        for name, k in (peers or {}).items():
            factories[peer_label(name)] = lambda seed, name=name, k=k: make(name, k, seed)
        for load in loads:
            t0 = time.perf_counter()
            timed = runs.timed(load)
            res = run_cell(runs.sim, timed, factories, slo, slo2=slo2)
            routers = res["routers"]
            cells.append({"kind": kind, "replicas": n, "load": load, "requests": len(timed[0][1]),
                          "routers": routers})
            r = routers[OURS]
            log(f"{kind} x {n} at {load:g}: learned / today {r['learned_over_this_attainment']:.3f} "
                f"attainment ({time.perf_counter() - t0:.0f} s)")
    return cells


def peer_label(name: str) -> str:
    """A peer's row: at the knobs a router_peers run tuned."""
    return f"{name} (tuned)"


def peer_rows(res: dict[str, Any]) -> tuple[list[list[Any]], int]:
    """Per cell, the peer of the highest mean attainment and ours learned over it (median per-seed ratio,
    range); and the cells where it beats ours learned by more than 2% (that ratio under 1 / 1.02)."""
    rows, behind = [], 0
    for c in res["cells"]:
        routers = c["routers"]
        names = [peer_label(p) for p in res.get("peers", {}) if peer_label(p) in routers]
        if not names:
            continue
        best = max(names, key=lambda r: routers[r]["attainment"])
        ratio = routers[best]["learned_over_this_attainment"]
        spread = _range(routers[OURS_LEARNED]["runs"], routers[best]["runs"], "attainment")
        behind += ratio < 1 / 1.02
        rows.append([c["kind"], c["replicas"], f"{c['load']:g}", best,
                     f"{100 * routers[best]['attainment']:.1f}%",
                     f"{100 * routers[OURS_LEARNED]['attainment']:.1f}%",
                     f"{ratio:.3f}x ({spread})"])
    return rows, behind


def _range(runs_a: Sequence[dict[str, float]], runs_b: Sequence[dict[str, float]], key: str) -> str:
    ratios = seed_ratios(runs_a, runs_b, key)
    return f"{min(ratios):.3f}-{max(ratios):.3f}"


def render(res: dict[str, Any]) -> str:
    """The cells in markdown, and how many meet the target."""
    rows, met = [], 0
    for c in res["cells"]:
        today, ours = c["routers"][OURS], c["routers"][OURS_LEARNED]
        ratio = today["learned_over_this_attainment"]
        met += ratio >= TARGET
        rows.append([c["kind"], c["replicas"], f"{c['load']:g}", f"{100 * today['attainment']:.1f}%",
                     f"{100 * ours['attainment']:.1f}%",
                     f"{ratio:.3f}x ({_range(ours['runs'], today['runs'], 'attainment')})",
                     f"{today['learned_over_this_attainment_slo2']:.3f}x",
                     f"{today['output_throughput']:.0f}", f"{ours['output_throughput']:.0f}",
                     f"{today['learned_over_this_output_throughput']:.3f}x"])
    slo, slo2 = res["slo"], res["slo2"]
    pair = " ".join(f"{k}:{v:g}" for k, v in slo2.items())
    knobs = "".join(f", {k}={v}" for k, v in res.get("learned", {}).items())
    head = (f"Ours learned (`prefix-learned`{knobs}, told nothing) beside today's default (`prefix`, "
            f"told each replica's KV) on `benchmarks.router_peers`' grid, {_seeds_text(res['seeds'])}; "
            f"SLO TTFT <= {slo['ttft'] / 1000:g} s and TPOT <= {slo['tpot']:g} ms; ratios are medians of "
            f"per-seed ratios (range) ({measured(res)}; `{res['command']}`: {res['wall_s'] / 60:.1f} min "
            "wall on one core):")
    return (head + "\n\n"
            + format_table(["workload", "replicas", "load", "today: attained", "learned: attained",
                            "learned / today", f"learned / today ({pair})", "today tok/s", "learned tok/s",
                            "learned / today tok/s"], rows)
            + f"\n\nCells where ours learned is >= {TARGET}x today's default in attainment: {met} of "
            f"{len(res['cells'])}." + _peers_text(res))


def _seeds_text(seeds: Sequence[int]) -> str:
    if seeds[0] < TUNE_SEED_BASE:
        return f"its one document set, arrival seeds {seeds[0]}-{seeds[-1]}"
    return f"{len(seeds)} draws of their own documents and arrivals, seeds {seeds[0]:,}-{seeds[-1]:,}"


def _peers_text(res: dict[str, Any]) -> str:
    rows, behind = peer_rows(res)
    if not rows:
        return ""
    return (f"\n\nThe peers at the knobs `{res['peers_from']}` tuned, on the same runs:\n\n"
            + format_table(["workload", "replicas", "load", "best peer", "its attainment",
                            "learned: attained", "learned / best peer"], rows)
            + f"\n\nCells where a peer beats ours learned by more than 2%: {behind} of {len(rows)}.")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds FIRST..FIRST+N-1 (router_peers': 3)")
    p.add_argument("--first-seed", type=int, default=0,
                   help=f"the first seed: below {TUNE_SEED_BASE:,}, the evaluation's one document set with "
                        f"those arrivals; {HELD_OUT_DRAWS:,} on, held-out draws (each its own documents)")
    p.add_argument("--slo", default="ttft:5000 tpot:50", help="SLOs in ms, vLLM's --goodput pairs")
    p.add_argument("--slo2", default="ttft:2000 tpot:30", help="a tighter pair, counted on the same runs")
    p.add_argument("--quick", action="store_true", help="L-Eval at 4 replicas, load 1, one seed")
    p.add_argument("--learned", action="append", default=[], metavar="KNOB=VALUE",
                   help="a knob of ours learned off its default (repeatable; a number, true/false or a "
                        "name)")
    p.add_argument("--peers-from", default=None, metavar="JSON",
                   help="a benchmarks.router_peers run: its tuned peers are run beside ours learned")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    grid = (("uniform", 4, (1.0,)),) if args.quick else GRID
    if args.first_seed < 0 or args.seeds < 1:
        p.error("--first-seed must be >= 0 and --seeds >= 1")
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))
    slo, slo2 = parse_goodput(args.slo), parse_goodput(args.slo2)
    try:
        learned = knob_values(args.learned)
        LearnedRouter(**learned)
    except (TypeError, ValueError) as exc:
        p.error(f"--learned: {exc}")
    peers: dict[str, dict[str, Any]] = {}
    if args.peers_from:
        try:
            tuned = json.loads(Path(args.peers_from).read_text())["tuned"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--peers-from {args.peers_from}: not a router_peers run ({exc})")
        peers = {name: dict(tuned.get(name, {})) for name in PEERS}
    cells = evaluate(grid, seeds, slo, slo2, learned, log=lambda m: print(m, file=sys.stderr, flush=True),
                     peers=peers)
    res = {"benchmark": "equal_learned", "machine": machine_info(), "learned": learned,
           "command": "python -m benchmarks.equal_learned " + shlex.join(argv if argv is not None
                                                                         else sys.argv[1:]),
           "seeds": seeds, "slo": slo, "slo2": slo2, "target": TARGET, "cells": cells,
           **({"peers_from": args.peers_from, "peers": peers} if peers else {}),
           "wall_s": time.perf_counter() - start}
    print(render(res))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
