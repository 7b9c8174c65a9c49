"""Ours learned's cache model on unequal replicas: the variants tried on the tuning seeds.

    python -m benchmarks.unequal_replicas_cache

:mod:`benchmarks.unequal_replicas`' fleets ``kv``, ``equal`` and ``speed`` (8 replicas), each on
workloads of its own drawn as that benchmark's tuning draws them (seeds 10,000-10,002, documents drawn
with ``seed + 100 x replicas``; the fleet's capacity measured on the first, where that benchmark's
tuning measures it on each), at loads 0.8 and 1: ours as today
(``prefix``, no cache model), and :class:`~scheduler_runtime.learned_router.LearnedRouter` with ours'
cache model at 1.25 x each replica's published KV (the first version's default), with it off (today's
default), at 2, 3 and 5 x KV, at 1.25 x at least the fleet's median KV (``floor``: a small replica's
model as large as a median one's) or half of it, and keeping a document whose owner's model evicted it on
that owner while the owner is within 1 or 3 requests of the least loaded (``stay``). Prints per variant
and cell the mean attainment (each seed's), output tok/s and prefix hit rate. About 6 min on one core.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.router_peers import TUNE_SEED_BASE, uniform_workload
from benchmarks.unequal_replicas import DEFAULT_SLO, _attainment, capacity, fleets
from feather_env.cluster_sim import ClusterSim
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


VARIANTS: dict[str, Callable[[], ReplicaRouter]] = {
    "prefix (ours as today)": PrefixAffinityRouter,
    "learned, cache 1.25 x KV": lambda: LearnedRouter(cache_factor=1.25),
    "learned, cache off": lambda: LearnedRouter(cache_factor=0.0),
    "learned, cache 2 x KV": lambda: LearnedRouter(cache_factor=2.0),
    "learned, cache 3 x KV": lambda: LearnedRouter(cache_factor=3.0),
    "learned, cache 5 x KV": lambda: LearnedRouter(cache_factor=5.0),
    "learned, floor median KV": lambda: FloorLearned(1.0, cache_factor=1.25),
    "learned, floor half median": lambda: FloorLearned(0.5, cache_factor=1.25),
    "learned, stay within 1": lambda: StayLearned(1, cache_factor=1.25),
    "learned, stay within 3": lambda: StayLearned(3, cache_factor=1.25),
}


def main(argv: Sequence[str] | None = None) -> None:
    del argv
    n, seeds = 8, [TUNE_SEED_BASE + s for s in range(3)]
    engine = load_scenario("leval-kv-pressure").engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    specs_by_fleet = fleets(n, 40.0, 100.0)
    for fleet in ("kv", "equal", "speed"):
        specs = specs_by_fleet[fleet]
        sim = ClusterSim(n, engine, profiles=specs)
        workloads = {s: uniform_workload(pool, n, 16, seed=s + 100 * n) for s in seeds}
        cap = capacity(engine, specs, workloads[seeds[0]])["req_s"]
        for load in (0.8, 1.0):
            for name, factory in VARIANTS.items():
                att, tok, hit = [], [], []
                for s in seeds:
                    timed = workloads[s].with_arrivals(f"poisson:{load * cap}", s)
                    r = sim.run(timed, factory(), goodput=DEFAULT_SLO, scrape_s=0.0)
                    att.append(_attainment(r, len(timed)))
                    tok.append(r.metrics["output_throughput"])
                    hit.append(r.metrics["prefix_hit_rate"])
                print(f"| {fleet} | {load:g} | {name} | {100 * statistics.fmean(att):.1f}% "
                      f"({' / '.join(f'{100 * a:.0f}' for a in att)}) | {statistics.fmean(tok):.0f} | "
                      f"{100 * statistics.fmean(hit):.0f}% |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
