"""The paper's core experiment on the real vLLM engine: prefix-homogeneous vs heterogeneous decode.

N requests in G prefix groups are decoded (a) as one heterogeneous batch and (b) as
G homogeneous batches (one group each). Decode throughput is measured by
:class:`feather_env.backends.IsolatedBatchRunner` over decode-only engine steps, with each
group's prefix warmed first (an isolated decode loop, as in the paper). A sweep of
batch size x number of groups follows. Runs alternate inside one process and
report medians, since this machine is shared and noisy.

The order of the heterogeneous batch matters on CPU (see :func:`arrange`). The ratio
is measured on the round-robin order (``--order``); the first ``--extra-repeats``
repeats also run the same batch in a random arrival order and sorted by group, and
the JSON reports both (``heterogeneous_random_tok_s``/``ratio_random``,
``heterogeneous_sorted_tok_s``).

    python -m benchmarks.prefix_homogeneity --json results/prefix_homogeneity.json \
        --plot results/prefix_homogeneity.png
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from benchmarks.isolated import BatchResult, IsolatedBatchRunner
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.workloads.request import Request


def grouped_requests(
    groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
    *, seed: int, prefix_pool: Sequence[np.ndarray] | None = None, tag: str = "",
) -> list[Request]:
    """``groups`` x ``per_group`` requests: a shared random prefix per group + unique suffixes."""
    rng = np.random.default_rng(seed)
    pool = prefix_pool or [rng.integers(3, 8192, prefix_len, dtype=np.int32) for _ in range(groups)]
    if len(pool) < groups:
        raise ValueError(f"prefix pool has {len(pool)} prefixes, need {groups}")
    out = []
    for g in range(groups):
        for i in range(per_group):
            suffix = rng.integers(3, 8192, suffix_len, dtype=np.int32)
            out.append(Request(f"{tag}g{g}-{i}", np.concatenate([pool[g], suffix]), g, output_len))
    return out


ORDERS = ("round-robin", "random", "sorted")


def arrange(requests: Sequence[Request], order: str, seed: int = 0) -> list[Request]:
    """The batch in one of :data:`ORDERS`.

    Order matters on CPU: vLLM's CPU attention walks the batch request by request
    (each thread a contiguous slice), so what stays in the last-level cache is the
    KV of the last few requests' documents. ``round-robin`` puts a request of another
    group next to every request (g0, g1, ..., gG-1, g0, ...): every document read
    comes from DRAM, which is what a GPU sees when it runs the whole batch at once
    and what docs/design.md's CPU tables measured. ``random`` is a mixed arrival stream as
    FCFS admits it: a neighbour from the same group, or a document still in cache,
    is a matter of chance (and of how much cache the host's other tenants leave).
    ``sorted`` groups the requests by prefix, so each document is read once per step.
    """
    if order == "sorted":
        return sorted(requests, key=lambda r: r.prefix_group)
    if order == "random":
        perm = np.random.default_rng(seed).permutation(len(requests))
        return [requests[i] for i in perm]
    if order == "round-robin":
        by_group: dict[int, list[Request]] = {}
        for r in requests:
            by_group.setdefault(r.prefix_group, []).append(r)
        queues = [by_group[g] for g in sorted(by_group)]
        return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
    raise ValueError(f"unknown order {order!r}; expected one of {ORDERS}")


def aggregate(results: Sequence[BatchResult]) -> float:
    """Decode throughput of several batches run one after another (total tokens / total time)."""
    tokens = sum(r.decode_tokens for r in results)
    seconds = sum(r.decode_seconds for r in results)
    return tokens / seconds if seconds else 0.0


def run(args: argparse.Namespace) -> dict:
    engine = EngineConfig(
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=max(args.groups * args.per_group, max(args.sweep_batch, default=1)),
        max_model_len=args.prefix_len + args.suffix_len + args.output_len + 128,
        cpu_cores=args.cpu_cores,
    )
    t0 = time.perf_counter()
    backend = IsolatedBatchRunner(engine, warm_prefixes=True)
    backend.warmup()
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(args.seed)
    n_prefixes = max(args.groups, max(args.sweep_groups, default=1))
    pool = [rng.integers(3, 8192, args.prefix_len, dtype=np.int32) for _ in range(n_prefixes)]

    # -- default shape: one heterogeneous batch vs G homogeneous batches -------------------
    runs: dict[str, list[float]] = {"homogeneous": [], "heterogeneous": [], "ratio": []}
    extra = [o for o in ORDERS if o != args.order]
    for rep in range(args.repeats):
        reqs = grouped_requests(args.groups, args.per_group, args.prefix_len, args.suffix_len,
                                args.output_len, seed=args.seed + rep, prefix_pool=pool,
                                tag=f"r{rep}")
        kinds = ["het", "hom"] + (extra if rep < args.extra_repeats else [])
        if rep % 2:  # alternate the order of the runs between repeats
            kinds.reverse()
        tok_s: dict[str, float] = {}
        for kind in kinds:
            if kind == "hom":
                tok_s[kind] = aggregate([backend.run_batch_quiet([r for r in reqs if r.prefix_group == g])
                                         for g in range(args.groups)])
            else:
                order = args.order if kind == "het" else kind
                tok_s[kind] = aggregate([backend.run_batch_quiet(arrange(reqs, order, seed=rep))])
        hom, het = tok_s["hom"], tok_s["het"]
        runs["homogeneous"].append(hom)
        runs["heterogeneous"].append(het)
        runs["ratio"].append(hom / het)
        line = f"repeat {rep}: homogeneous {hom:,.0f} tok/s, heterogeneous ({args.order}) {het:,.0f} tok/s"
        for o in extra:  # every other order measured in this repeat, under its own keys
            if o in tok_s:
                key = o.replace("-", "_")
                runs.setdefault(f"heterogeneous_{key}", []).append(tok_s[o])
                if o != "sorted":
                    runs.setdefault(f"ratio_{key}", []).append(hom / tok_s[o])
                line += f", {o} {tok_s[o]:,.0f}"
        print(f"{line}; ratio {hom / het:.2f}")

    # -- sweep: batch size x groups in the batch --------------------------------------------
    sweep = []
    for batch in args.sweep_batch:
        for g in args.sweep_groups:
            if g > batch or batch % g:
                continue
            vals = []
            for rep in range(args.sweep_repeats):
                reqs = grouped_requests(g, batch // g, args.prefix_len, args.suffix_len,
                                        args.sweep_output_len, seed=1000 + rep,
                                        prefix_pool=pool, tag=f"s{batch}-{g}-{rep}")
                vals.append(backend.run_batch_quiet(arrange(reqs, args.order, seed=rep)).decode_tok_s)
            sweep.append({"batch_size": batch, "groups": g,
                          "decode_tok_s": statistics.median(vals), "runs": vals})
            print(f"sweep batch {batch:4d} groups {g:3d}: {statistics.median(vals):,.0f} tok/s")
    backend.close()

    other_orders: dict[str, float | None] = {}  # medians of the other orders, as run above
    for o in extra:
        key = o.replace("-", "_")
        other_orders[f"heterogeneous_{key}_tok_s"] = _median(runs.get(f"heterogeneous_{key}", []))
        if o != "sorted":
            other_orders[f"ratio_{key}"] = _median(runs.get(f"ratio_{key}", []))
    result = {
        "benchmark": "prefix_homogeneity",
        "machine": machine_info(),
        "engine": engine.to_dict(),
        "shape": {"groups": args.groups, "per_group": args.per_group,
                  "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                  "output_len": args.output_len, "repeats": args.repeats},
        "order": args.order,
        "homogeneous_tok_s": statistics.median(runs["homogeneous"]),
        "heterogeneous_tok_s": statistics.median(runs["heterogeneous"]),
        "ratio": statistics.median(runs["ratio"]),
        **other_orders,
        "runs": runs,
        "sweep": sweep,
        "wall_s": time.perf_counter() - t0,
    }
    return result


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: the headline ratio, its repeats, and the sweep."""
    s = res["shape"]
    out = [f"{s['groups']} groups x {s['per_group']} requests, {s['prefix_len']}-token prefixes, "
           f"{s['suffix_len']}-token suffixes, {s['output_len']} output tokens ({measured(res)}):", ""]
    n = s["groups"] * s["per_group"]
    order = res.get("order", "random")
    rows = [[f"{s['groups']} homogeneous batches of {s['per_group']}", res["homogeneous_tok_s"]],
            [f"1 heterogeneous batch of {n}, {order} order", res["heterogeneous_tok_s"]]]
    if res.get("heterogeneous_random_tok_s"):
        rows.append(["the same batch in a random arrival order", res["heterogeneous_random_tok_s"]])
    rows += [["the same batch sorted by prefix group", res.get("heterogeneous_sorted_tok_s") or "-"],
             [f"**homogeneous / heterogeneous ({order})**", f"**{res['ratio']:.2f}x**"]]
    if res.get("ratio_random"):
        rows.append(["homogeneous / heterogeneous (random arrival order)", f"{res['ratio_random']:.2f}x"])
    out.append(format_table(["schedule", "decode tok/s"], rows))
    runs = res.get("runs") or {}
    n_rep, n_extra = len(runs.get("ratio", [])), len(runs.get("heterogeneous_sorted", []))
    if n_rep > 1:
        extra = ("in every repeat" if n_extra >= n_rep else "in the first repeat" if n_extra == 1
                 else f"in the first {n_extra} repeats")
        out += ["", f"The ratio is the median of {n_rep} repeats: "
                + ", ".join(f"{r:.2f}" for r in runs["ratio"]) + f" (heterogeneous, {order} "
                + ", ".join(f"{v:,.0f}" for v in runs["heterogeneous"]) + " tok/s; homogeneous "
                + ", ".join(f"{v:,.0f}" for v in runs["homogeneous"])
                + f" tok/s). The other orders run {extra}."]
    if res.get("sweep"):
        groups = sorted({r["groups"] for r in res["sweep"]})
        batches = sorted({r["batch_size"] for r in res["sweep"]})
        cell = {(r["batch_size"], r["groups"]): r["decode_tok_s"] for r in res["sweep"]}
        out += ["", "Sweep, decode tok/s (rows: batch size; columns: prefix groups in the batch, "
                f"{order} order):", ""]
        out.append(format_table(["batch"] + [f"{g} groups" for g in groups],
                                [[b] + [cell.get((b, g), "-") for g in groups] for b in batches]))
        lo, hi = groups[0], groups[-1]
        equal = [f"{cell[(b, lo)] / cell[(b, hi)]:.2f}x at batch {b}" for b in batches
                 if (b, lo) in cell and (b, hi) in cell and cell[(b, hi)]]
        if lo != hi and equal:
            out += ["", f"At equal batch size, {lo} group vs {hi} groups: " + ", ".join(equal) + "."]
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for b in sorted({r["batch_size"] for r in res["sweep"]}):
        pts = sorted((r["groups"], r["decode_tok_s"]) for r in res["sweep"] if r["batch_size"] == b)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix groups in the batch")
    ax.set_ylabel("decode throughput (tok/s)")
    s = res["shape"]
    ax.set_title(f"Decode throughput vs prefix heterogeneity\n"
                 f"{s['prefix_len']}-token prefixes, tiny Llama on vLLM CPU, {res['machine']['date']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=12000)
    p.add_argument("--suffix-len", type=int, default=20)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="default-shape repeats (the ratio is their median)")
    p.add_argument("--order", choices=("round-robin", "random"), default="round-robin",
                   help="order of the heterogeneous batches (default shape and sweep)")
    p.add_argument("--extra-repeats", type=int, default=1,
                   help="repeats (the first ones) that also run the batch in the other orders")
    p.add_argument("--sweep-batch", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[32, 64, 128])
    p.add_argument("--sweep-groups", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[1, 2, 4, 8])
    p.add_argument("--sweep-output-len", type=int, default=32)
    p.add_argument("--sweep-repeats", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-cores", default="auto",
                   help="cores to pin the engine to (VLLM_CPU_OMP_THREADS_BIND); 'auto' for vLLM's default")
    p.add_argument("--quick", action="store_true",
                   help="small shape for a smoke run (4 groups x 16, 4000-token prefixes)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.cpu_cores == "auto":
        args.cpu_cores = None
    if args.quick:
        args.groups, args.per_group, args.prefix_len, args.output_len = 4, 16, 4000, 32
        args.sweep_batch, args.sweep_groups = [16], [1, 4]
    res = run(args)
    print()
    print(render(res))
    write_json(args.json, res)
    if args.plot and res["sweep"]:
        plot(res, args.plot)
    return res


if __name__ == "__main__":
    main()
