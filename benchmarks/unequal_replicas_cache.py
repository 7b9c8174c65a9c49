"""Ours learned's knobs on unequal replicas (its cache model, the LRU that counts its work, the KV guard),
on the tuning seeds or the held-out ones.

    python -m benchmarks.unequal_replicas_cache
    python -m benchmarks.unequal_replicas_cache --workload zipf --seeds 12 \
        --variant 'learned, work LRU 1 x KV' --variant prefix-informed --json results/work_lru_zipf.json

:mod:`benchmarks.unequal_replicas`' fleets (``--fleets``; default ``kv``, ``equal`` and ``speed``; 8
replicas, ``--replicas``) and workloads (``--workload``: L-Eval, its Zipf variant or the Mooncake trace,
drawn by :class:`~benchmarks.unequal_replicas.FleetDraws` as that benchmark draws them), on ``--seeds`` (3)
workloads of their own as that benchmark's tuning draws them (seeds from 10,000, documents drawn with
``seed + 100 x replicas``, each its own capacity), or with ``--held-out`` on its evaluation's seeds, at
loads 0.8 and 1. Each variant's mean attainment, and its attainment over ``learned, cache off`` (the
cache model off and the work counted as whole prompts, the default until the note's seventh session;
always run): the median of the per-seed ratios with a distribution-free 90% interval
(:func:`~feather_env.reporting.median_interval`). The first study's variants (the default set): ours as today
(``prefix``, no cache model), and :class:`~scheduler_runtime.learned_router.LearnedRouter` with ours'
cache model at 1.25 x each replica's published KV (the first version's default), with it off (then the
default), at 2, 3 and 5 x KV, at 1.25 x at least the fleet's median KV (``floor``: a small replica's
model as large as a median one's) or half of it, and keeping a document whose owner's model evicted it on
that owner while the owner is within 1 or 3 requests of the least loaded (``stay``). Further (the note's
sixth session; ``--variant``, repeatable): counting a prefill's work as its tokens uncached by an LRU of 1
(today's default) or 2 x the replica's KV of what it was sent (``work_cache_factor``), the KV guard
filling to 100% or 90% (on whole prompts, as that study ran), and ours informed (``prefix-informed``).
The eleventh session's: the cache model kept by the engine's clock (``cache_clock="prefilled"``: a prompt
enters its replica's LRU at its first token, and what the replica's requests in flight hold counts as
held) at 0.5, 0.75, 1 and 1.25 x KV, beside ``learned, queue time`` (the model off, the default before it)
and the model at 1.25 x KV entered at routing. The twelfth session's: the speeds' work counted by an LRU of
what was sent (``work_by="sent"``), and a document the model evicted moved only to a replica with at most
0-4 requests in flight (``move_room``; 2 with the work by what was sent is today's default), or always
(the eleventh session's rule); the variants before it pin ``work_by="model"`` and ``move_room=None``.
Prints per variant and cell the mean attainment, output tok/s and prefix hit rate; ``--json`` keeps
every run. About 6 min on one core for the default set at 3 seeds.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.router_peers import mooncake_pool
from benchmarks.unequal_replicas import (
    DEFAULT_SLO,
    INTERVAL,
    FleetDraws,
    _attainment,
    fleets,
    router_factories,
    seed_ratios,
    timed_runs,
)
from feather_env.cluster_sim import ClusterSim
from feather_env.reporting import machine_info, median_interval, write_json
from feather_env.scenarios import load_scenario
from feather_env.workloads import WorkloadConfig, load_workload
from scheduler_runtime.learned_router import LearnedRouter, ReplicaLearning
from scheduler_runtime.router import PrefixAffinityRouter, ReplicaRouter


class FloorLearned(LearnedRouter):
    """The cache model of each replica sized ``cache_factor x max(its KV, floor x the fleet's median KV)``."""

    def __init__(self, floor: float = 1.0, **kwargs: Any) -> None:
        self.floor = float(floor)
        super().__init__(**kwargs)

    def _set_kv(self, name: str, r: ReplicaLearning, kv_tokens: int) -> None:
        if r.kv_tokens == kv_tokens:
            return
        r.kv_tokens = kv_tokens
        kvs = [x.kv_tokens for x in self.replicas.values() if x.kv_tokens]
        median = statistics.median(kvs)
        if self.cached is not None:
            for replica, x in self.replicas.items():
                if x.kv_tokens:
                    size = self.cache_factor * max(x.kv_tokens, self.floor * median)
                    self.cached.set_limit(replica, max(1, round(size)))


class StayLearned(LearnedRouter):
    """A document its owner's cache model evicted stays on the owner while the owner is within ``margin``
    requests of the least loaded replica."""

    def __init__(self, margin: int = 1, **kwargs: Any) -> None:
        self.margin = int(margin)
        super().__init__(**kwargs)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        evicted = self.counts["evicted"]
        choice = super().choose(hashes, loads, avoid, tokens=tokens)
        if self.counts["evicted"] != evicted and hashes is not None:
            _, owner = self.owner(hashes)
            if (owner is not None and owner in loads and owner not in avoid
                    and loads[owner] <= min(loads.values()) + self.margin):
                return owner
        return choice


class RoomRule(LearnedRouter):
    """Today's default with another rule for whether a document the cache model evicted moves (to where a new
    prefix goes) or stays on its owner (the twelfth session's alternatives to ``move_room``). It moves when:
    ``"seconds"``, that replica's queue of uncached prefill tokens at its learned prefill speed is at most
    ``value`` seconds; ``"waiting"``, that replica published at most ``value`` requests waiting; ``"share"``,
    it has at most ``value`` x the fleet's mean requests in flight; ``"up"``, its KV is at least the owner's
    and its weight at most the owner's; ``"sooner"``, its predicted completion of the whole prompt is earlier
    than the owner's; ``"floor"``, as ``move_room`` but it also moves where the owner is past the imbalance
    bound of a hot prefix. Otherwise it stays while the owner is under the load bound (the learned router's
    ``_keep``, of which this overrides ``_moves`` only)."""

    def __init__(self, rule: str, value: float = 0.0, **kwargs: Any) -> None:
        self.rule, self.value = rule, float(value)
        self.waiting: dict[str, float] = {}
        super().__init__(**kwargs)

    def scraped(self, replica: str, metrics: Mapping[str, Any]) -> None:
        super().scraped(replica, metrics)
        self.waiting[replica] = float(metrics.get("vllm:num_requests_waiting", 0))

    def _moves(self, hashes: np.ndarray, requests: Mapping[str, int], choice: str, owner: str) -> bool:
        now, v = self.clock(), self.value
        if self.rule == "seconds":
            speed = self._speed(choice, "prefill", now)
            return speed is None or self._replica(choice).queued_tokens * speed <= v
        if self.rule == "waiting":
            return self.waiting.get(choice, 0.0) <= v
        if self.rule == "share":
            return requests[choice] <= v * sum(requests.values()) / len(requests)
        if self.rule == "up":
            kv_c, kv_o = self._replica(choice).kv_tokens, self._replica(owner).kv_tokens
            w = self.weights(requests.keys(), now)
            return (kv_c is None or kv_o is None or kv_c >= kv_o) and w[choice] <= w[owner]
        if self.rule == "sooner":
            n = self._length(hashes, None)
            c, o = self.predicted_completion(choice, n, now), self.predicted_completion(owner, n, now)
            return c is None or o is None or c <= o
        least = min(requests.values())  # "floor"
        return (super()._moves(hashes, requests, choice, owner)
                or requests[owner] > max(least + self.balance_abs, self.balance_rel * least))


#: How the cache model counted the speeds' work and moved documents before the twelfth session (2026-12-07):
#: by the model, a document it evicted always moved (every variant below that predates it pins this).
_ELEVENTH: dict[str, Any] = {"work_by": "model", "move_room": None}
#: The learned router as the studies before 2026-12-07 ran it: without the reported wait (``queue_time``,
#: off then by default), so that each variant stays what its figures measured.
_off = functools.partial(LearnedRouter, queue_time="off", cache_factor=0.0, cache_clock="routed", **_ELEVENTH)
#: The first study's cache model (1.25 x KV, entered at routing), as its variants ran it.
_ROUTED: dict[str, Any] = {"cache_factor": 1.25, "queue_time": "off", "cache_clock": "routed", **_ELEVENTH}
#: The eleventh session's default: the cache model by the engine's clock at 1 x KV.
_eleventh = functools.partial(LearnedRouter, **_ELEVENTH)
#: Today's default before the cache model by the engine's clock (2026-12-07): the model off.
_service = functools.partial(LearnedRouter, queue_time="service", cache_factor=0.0, cache_clock="routed",
                             **_ELEVENTH)
#: The twelfth session's variants' stem: today's cache model, its speeds' work by what was sent.
_SENT = "learned, queue time, cache 1 x KV by the engine's clock, work by what was sent"

VARIANTS: dict[str, Callable[[], ReplicaRouter]] = {
    "prefix (ours as today)": PrefixAffinityRouter,
    "learned, cache 1.25 x KV": lambda: _off(cache_factor=1.25),
    "learned, cache off": lambda: _off(cache_factor=0.0, work_cache_factor=0.0),
    "learned, cache 2 x KV": lambda: _off(cache_factor=2.0),
    "learned, cache 3 x KV": lambda: _off(cache_factor=3.0),
    "learned, cache 5 x KV": lambda: _off(cache_factor=5.0),
    "learned, floor median KV": lambda: FloorLearned(1.0, **_ROUTED),
    "learned, floor half median": lambda: FloorLearned(0.5, **_ROUTED),
    "learned, stay within 1": lambda: StayLearned(1, **_ROUTED),
    "learned, stay within 3": lambda: StayLearned(3, **_ROUTED),
    "learned, work LRU 1 x KV": lambda: _off(work_cache_factor=1.0),
    "learned, work LRU 2 x KV": lambda: _off(work_cache_factor=2.0),
    "learned, cache 1.25 x KV while homogeneous": lambda: _off(cache_factor=1.25, homogeneous_cache=True),
    "learned, fleet noise z 1.645": lambda: _off(fleet_z=1.645),
    "learned, fleet noise z 2.33": lambda: _off(fleet_z=2.33),
    "learned, queue time": _service,
    "learned, queue time, cache 1.25 x KV while homogeneous": lambda: _service(
        cache_factor=1.25, homogeneous_cache=True),
    "learned, cache 1.25 x KV while homogeneous, fleet noise z 1.645": lambda: _off(
        cache_factor=1.25, homogeneous_cache=True, fleet_z=1.645),
    "learned, queue time, cache 1.25 x KV while homogeneous, fleet noise z 1.645": lambda: _service(
        cache_factor=1.25, homogeneous_cache=True, fleet_z=1.645),
    "learned, queue time, cache 1.25 x KV": lambda: _service(cache_factor=1.25),
    "learned, queue time, cache 1.25 x KV by the engine's clock": lambda: _eleventh(cache_factor=1.25),
    "learned, queue time, cache 1 x KV by the engine's clock": _eleventh,  # the eleventh session's default
    "learned, queue time, cache 1 x KV by the engine's clock, work by what was sent": lambda: LearnedRouter(
        move_room=None),
    "learned, queue time, cache 1 x KV by the engine's clock, keep 0.25": lambda: _eleventh(cache_keep=0.25),
    "learned, queue time, cache 1 x KV by the engine's clock, keep 0.75": lambda: _eleventh(cache_keep=0.75),
    "learned, queue time, cache 0.75 x KV by the engine's clock": lambda: _eleventh(cache_factor=0.75),
    "learned, queue time, cache 0.5 x KV by the engine's clock": lambda: _eleventh(cache_factor=0.5),
    "learned, queue time, cache 1 x KV by the engine's clock, stay within 1": lambda: StayLearned(
        1, **_ELEVENTH),
    "learned, queue time, cache 1 x KV by the engine's clock, stay within 3": lambda: StayLearned(
        3, **_ELEVENTH),
    # the twelfth session's: the work by what was sent, and an evicted document moved only to a replica with
    # at most ``move_room`` requests in flight (2: today's default)
    **{f"learned, queue time, cache 1 x KV by the engine's clock, work by what was sent, move room {k}": (
        functools.partial(LearnedRouter, move_room=k)) for k in (0, 1, 2, 3, 4)},
    "learned, queue time, cache 1 x KV by the engine's clock, work by the model, move room 2": lambda: (
        LearnedRouter(work_by="model")),
    **{f"{_SENT}, move if {rule} {v:g}": functools.partial(RoomRule, rule, v) for rule, values in (
        ("seconds", (0.5, 1, 2, 4)), ("waiting", (0, 1, 2, 4)), ("share", (0.25, 0.5, 0.75)), ("up", (0,)),
        ("sooner", (0,)), ("floor", (0,))) for v in values},
    # the guard's study counted whole prompts (then the default)
    "learned, KV guard, fill 1": lambda: _off(kv_guard=True, kv_fill=1.0, work_cache_factor=0.0),
    "learned, KV guard, fill 0.9": lambda: _off(kv_guard=True, kv_fill=0.9, work_cache_factor=0.0),
}
#: Rows of :mod:`benchmarks.unequal_replicas` itself (:func:`~benchmarks.unequal_replicas.router_factories`).
ROWS = ("prefix-informed",)
#: The cache model's variants (the first study's set, the default).
CACHE_VARIANTS = tuple(list(VARIANTS)[:10])
REFERENCE = "learned, cache off"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("leval", "zipf", "mooncake"), default="leval")
    p.add_argument("--fleets", default="kv,equal,speed")
    p.add_argument("--loads", default="0.8,1.0")
    p.add_argument("--replicas", type=int, default=8, help="replicas per fleet (half of them the odd kind)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--held-out", action="store_true",
                   help="the benchmark's evaluation seeds (0, 1, ...), not its tuning seeds")
    p.add_argument("--variant", action="append", default=None,
                   help=f"repeatable (default: the cache model's set), of: {'; '.join([*VARIANTS, *ROWS])}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = list(dict.fromkeys(args.variant or CACHE_VARIANTS))
    if set(names) - set(VARIANTS) - set(ROWS):
        p.error(f"--variant: one of {[*VARIANTS, *ROWS]}")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    start = time.perf_counter()
    n = args.replicas
    engine = load_scenario("leval-kv-pressure").engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    moon = (mooncake_pool(load_scenario("leval-kv-pressure").workload.max_prompt_tokens)
            if args.workload == "mooncake" else None)
    draws = FleetDraws(engine, pool, n, workload=args.workload, moon=moon)
    specs_by_fleet = fleets(n, 40.0, 100.0)
    cells = []
    print(f"| fleet | load | router | attainment (mean) | / {REFERENCE} (median "
          f"[{100 * INTERVAL:g}% interval]) | tok/s | hit |")
    print("|---|---|---|---|---|---|---|")
    for fleet in args.fleets.split(","):
        specs = specs_by_fleet[fleet]
        sim = ClusterSim(n, engine, profiles=specs)
        drawn = (draws.held_out(fleet, specs, range(args.seeds)) if args.held_out
                 else draws.tuning(fleet, specs, args.seeds))
        rows = router_factories(specs, engine, DEFAULT_SLO)
        for load in (float(x) for x in args.loads.split(",")):
            runs = timed_runs([(seed, w, c["req_s"]) for seed, w, c in drawn], load, draws.trace(fleet))
            per: dict[str, list[dict[str, float]]] = {}
            for name in names:
                for seed, timed in runs:
                    router = rows[name](seed) if name in ROWS else VARIANTS[name]()
                    r = sim.run(timed, router, goodput=DEFAULT_SLO, scrape_s=0.0)
                    per.setdefault(name, []).append({"attainment": _attainment(r, len(timed)),
                                                     "output_throughput": r.metrics["output_throughput"],
                                                     "prefix_hit_rate": r.metrics["prefix_hit_rate"]})
            for name in names:
                ratios = seed_ratios(per[name], per[REFERENCE], "attainment")
                low, high, coverage = median_interval(ratios, INTERVAL)
                row = {k: statistics.fmean(x[k] for x in per[name]) for k in per[name][0]}
                shown = f" [{low:.3f}-{high:.3f}]" if coverage >= INTERVAL else ""
                print(f"| {fleet} | {load:g} | {name} | {100 * row['attainment']:.1f}% | "
                      f"{statistics.median(ratios):.3f}x{shown} | "
                      f"{row['output_throughput']:.0f} | {100 * row['prefix_hit_rate']:.0f}% |", flush=True)
                cells.append({"fleet": fleet, "load": load, "router": name, **row,
                              "over_reference_attainment": statistics.median(ratios),
                              "over_reference_interval": [low, high, coverage], "runs": per[name]})
    out = {"benchmark": "unequal_replicas_cache", "machine": machine_info(),
           "command": "python -m benchmarks.unequal_replicas_cache " + shlex.join(
               argv if argv is not None else sys.argv[1:]),
           "workload": args.workload, "replicas": n, "seeds": [seed for seed, _, _ in drawn],
           "held_out": args.held_out,
           "reference": REFERENCE, "cells": cells, "wall_s": time.perf_counter() - start}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
