"""Variants of ours (``prefix``) on one cell of :mod:`benchmarks.router_peers`, without its tuning.

    python -m benchmarks.router_variants zipf:16:1.0 0,1,2 '{"base": {}, "hot": {"balance_abs": 8, ...}}'

A cell is ``KIND:REPLICAS:LOAD`` (``uniform``: L-Eval, ``zipf``: its Zipf variant, s = 1.1, ``mooncake``:
the Mooncake synthetic trace), built by :func:`benchmarks.router_peers.cell_runs` as the evaluation
builds it. Seeds below 10,000 are the evaluation's (its workload, those arrival draws); a seed ``s``
from 10,000 on draws a workload of its own (seed ``s + 100 x replicas``, as the tuning's are drawn)
with those arrivals, so variants can be chosen on seeds the evaluation never sees. Each variant (knobs
over ours' defaults, told the replica's KV tokens) prints its mean output tok/s, its ratio to the
first variant (the range per seed), mean E2E, prefix hit rate and max/mean requests per replica;
``--peers results/router_peers.json`` adds each peer at its tuned knobs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks import router_peers as rp
from feather_env.serving_metrics import parse_goodput


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cell", help="KIND:REPLICAS:LOAD, e.g. zipf:16:1.0")
    p.add_argument("seeds", help="comma-separated seeds")
    p.add_argument("variants", help="JSON object: label -> ours' knobs (the first is the baseline)")
    p.add_argument("--peers", default=None, metavar="JSON",
                   help="also each peer at the knobs it was tuned to there (a router_peers JSON, e.g. "
                        "results/router_peers.json), after the variants, each against the first variant")
    args = p.parse_args(argv)
    kind, n, load = args.cell.split(":")
    cell = rp.cell_runs(kind, int(n), [int(x) for x in args.seeds.split(",")])
    sim, runs = cell.sim, cell.timed(float(load))
    rows = [(label, rp.OURS, knobs) for label, knobs in json.loads(args.variants).items()]
    if args.peers:
        tuned = json.loads(Path(args.peers).read_text())["tuned"]
        rows += [(name, name, tuned[name]) for name in rp.PEERS]
    out = rp.run_rows(sim, runs, rows, parse_goodput(rp.DEFAULT_GOODPUT))
    base = out[rows[0][0]]
    for label, r in out.items():
        per = [a / b for a, b in zip(r["output_throughput_runs"], base["output_throughput_runs"],
                                     strict=True)]
        print(f"{args.cell} {label:10s} {r['output_throughput']:8.1f} tok/s "
              f"x{r['output_throughput'] / base['output_throughput']:.4f} ({min(per):.3f}-{max(per):.3f}) "
              f"E2E {r['mean_e2el_ms'] / 1000:.2f} s, hit {r['prefix_hit_rate']:.3f}, "
              f"max/mean {r['max_over_mean']:.2f}", flush=True)


if __name__ == "__main__":
    main()
