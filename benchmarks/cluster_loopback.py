"""Two engine replicas on loopback, behind the prefix router and behind Ray Serve's pow2: the prefix cache.

    flock /tmp/feather-engine.lock python -m benchmarks.cluster_loopback --json results/cluster_loopback.json

For each router, ``feather-serve --replicas 2 --router R`` (``--data-plane``: the proxy, the default,
or ``ray``; each replica pinned to its own core,
:data:`SERVER_ARGS`: a 128 MiB KV cache, about 8 of the 4K-token documents, so a replica that sees
every document evicts some) serves 12 L-Eval documents x 6 questions (``quality`` and ``tpo``, whose
documents have >= 8 questions; prompts cut at 4,096 tokens, answers at 32 tokens), all arriving at
once in a shuffled order, at most 8 in flight, driven by ``evaluate.py --endpoint`` unchanged
(streamed; ``--reset-prefix-cache`` first). Reported per router: requests completed with their
tokens, the prefix-cache hit rate the endpoint's ``/metrics`` gives summed over the replicas (what
``evaluate.py`` reports), output throughput, requests per replica (``vllm:request_success_total`` by
``replica``), and how the command stopped on SIGTERM (seconds, processes left over). Target: every
request completes under both routers, and the prefix router's hit rate is >= 10 points above pow2's.

``--router R`` serves ``R`` instead of ``prefix`` beside pow2, e.g. ``--data-plane ray --router
prefix-learned --json results/cluster_loopback_ray_learned.json``: the learned router in Ray Serve's
request router, behind real engines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from benchmarks.cluster_server import REPO, ClusterServer
from feather_env.evaluation.endpoint import parse_prometheus
from feather_env.reporting import format_table, machine_info, write_json

ROUTERS = ("prefix", "pow2")
SERVER_ARGS = ["--kv-cache-memory-bytes", str(128 << 20), "--max-model-len", "4608", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "8192"]
WORKLOAD_ARGS = ["--workload", "leval", "--tasks", "quality,tpo", "--num-groups", "12",
                 "--max-per-group", "6", "--max-prompt-tokens", "4096", "--max-output-tokens", "32",
                 "--arrival", "burst"]
CONCURRENCY = 8
TARGET_POINTS = 10.0
COMMAND = "flock /tmp/feather-engine.lock python -m benchmarks.cluster_loopback"


def per_replica(metrics_text: str, name: str) -> dict[str, float]:
    """``name``'s samples summed by their ``replica`` label."""
    out: dict[str, float] = {}
    for sample, labels, value in parse_prometheus(metrics_text):
        if sample == name and "replica" in labels:
            out[labels["replica"]] = out.get(labels["replica"], 0.0) + value
    return out


def run_router(router: str, seed: int, out_dir: Path, data_plane: str = "proxy") -> dict[str, Any]:
    """One router: start the cluster, ``evaluate.py --endpoint``, read ``/metrics``, SIGTERM."""
    label = f"2-replicas-{router}"
    with ClusterServer(2, router, [*SERVER_ARGS, "--data-plane", data_plane],
                       log_path=out_dir / f"server-{router}.log") as server:
        replicas = server.replica_info()
        before = per_replica(server.metrics(), "vllm:request_success_total")
        command = [sys.executable, str(REPO / "evaluate.py"), *WORKLOAD_ARGS, "--seed", str(seed),
                   "--endpoint", server.url, "--max-concurrency", str(CONCURRENCY), "--reset-prefix-cache",
                   "--label", label, "--out", str(out_dir / router), "--no-plots", "--no-progress"]
        t0 = time.monotonic()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        text = server.metrics()
        after = per_replica(text, "vllm:request_success_total")
        decisions = {labels["kind"]: value for name, labels, value in parse_prometheus(text)
                     if name == "feather_router_decisions_total"}
        start_s = server.start_s
        stop = server.stop()
    results = json.loads((out_dir / router / "results.json").read_text())
    run = results["runs"][label]
    served = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in sorted(after)}
    return {"router": router, "data_plane": data_plane, "evaluate_returncode": done.returncode,
            "evaluate_wall_s": wall,
            "evaluate_stdout_tail": done.stdout[-1500:], "completed": run["completed"],
            "failed": run["failed"],
            "submitted": run["submitted"], "prefix_hit_rate": run["prefix_hit_rate"],
            "output_throughput": run["output_throughput"], "mean_e2el_ms": run["mean_e2el_ms"],
            "requests_per_replica": served, "router_decisions": decisions, "replicas": replicas,
            "start_s": start_s, "sigterm": stop, "server": run.get("server")}


def render(res: dict[str, Any]) -> str:
    """The figures in markdown: one row per router, then the targets."""
    runs = res["runs"]
    rows = [[r["router"], f"{r['completed']}/{r['submitted']}", f"{100 * r['prefix_hit_rate']:.1f}%",
             r["output_throughput"], r["mean_e2el_ms"] / 1000,
             " / ".join(f"{v:.0f}" for v in r["requests_per_replica"].values()),
             f"{r['sigterm']['exit_s']:.1f} s, {len(r['sigterm']['left_over'])} of "
             f"{r['sigterm']['processes']} left"] for r in runs]
    points = res["hit_rate_points_over_pow2"]
    ours = runs[0]["router"]
    return "\n".join([
        f"`feather-serve --replicas 2 --data-plane {runs[0].get('data_plane', 'ray')}`, one core per "
        "replica, 12 L-Eval documents x 6 questions, shuffled, "
        f"{res['max_concurrency']} in flight, driven by `evaluate.py --endpoint` ({measured(res)}; "
        f"`{res['command']}`):", "",
        format_table(["router", "completed", "prefix hit (sum over replicas)", "output tok/s", "mean E2E s",
                      "requests per replica", "SIGTERM: exit, processes left"], rows), "",
        f"- {'met' if res['all_completed'] else 'NOT met'}: every request completed with its tokens under "
        "both routers",
        f"- {'met' if points >= res['target_points'] else 'NOT met'}: {ours} hit rate {points:+.1f} points "
        f"over pow2 (>= {res['target_points']:g})",
        f"- {'met' if res['sigterm_clean'] else 'NOT met'}: SIGTERM stopped every process the command "
        "started"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="which 12 documents, which questions, which order")
    p.add_argument("--out", default="runs/cluster-loopback", help="evaluate.py results and server logs")
    p.add_argument("--data-plane", choices=("proxy", "ray"), default="proxy",
                   help="feather-serve's data plane (docs/cluster.md)")
    p.add_argument("--router", default=ROUTERS[0], choices=("prefix", "prefix-learned"),
                   help="the router served beside pow2")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    runs = [run_router(router, args.seed, out_dir, args.data_plane) for router in (args.router, "pow2")]
    by = {r["router"]: r for r in runs}
    points = 100 * (by[args.router]["prefix_hit_rate"] - by["pow2"]["prefix_hit_rate"])
    all_done = all(r["failed"] == 0 and r["completed"] == r["submitted"] for r in runs)
    clean = all(not r["sigterm"]["left_over"] and r["sigterm"]["returncode"] == 0 for r in runs)
    command = " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)])
    out = {"benchmark": "cluster_loopback", "command": command, "machine": machine_info(), "seed": args.seed,
           "server_args": SERVER_ARGS, "workload_args": WORKLOAD_ARGS, "max_concurrency": CONCURRENCY,
           "runs": runs, "hit_rate_points_over_pow2": points, "all_completed": all_done,
           "sigterm_clean": clean, "target_points": TARGET_POINTS}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
