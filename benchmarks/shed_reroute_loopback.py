"""Two real engine replicas past their capacity, each shedding by its admission rule: a shed request tried on
the other replica (``--reroute-shed``) or rejected at once (``--no-reroute-shed``).

    flock /tmp/feather-engine.lock python -m benchmarks.shed_reroute_loopback \\
        --json results/shed_reroute_loopback.json

``feather-serve --replicas 2`` (the proxy data plane, the prefix router, each replica on its own core,
:data:`benchmarks.cluster_loopback.SERVER_ARGS`: a 128 MiB KV cache, about 8 of the 4K-token documents)
with ``--admission RULE --slo SLO`` on each replica serves ``--documents`` L-Eval documents (``quality``
and ``tpo``, prompts cut at 4,096 tokens) x ``--questions`` questions, answers of 32 tokens, Poisson
arrivals at ``--rate`` requests/s in a shuffled order (open loop), driven by ``evaluate.py --endpoint``
(streamed; ``--reset-prefix-cache`` first) with the SLO as its ``--goodput``. The two modes alternate,
``--repeats`` rounds, a fresh cluster per run. Per run: attainment (requests that met the SLO over those
submitted: a rejected request counts as not met), requests served, rejected by the rule (an HTTP 503
carrying ``x-feather-admission``) and failed otherwise, the proxy's sheds (rerouted, rejected), output
tokens/s, TTFT P50/P99 of the served, the prefix-cache hit rate. Medians over the rounds per mode, and
the no-reroute mode over the reroute mode in attainment. The simulator's study of the same choice is
:mod:`benchmarks.fleet_admission` (``--no-reroute``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from benchmarks.cluster_loopback import SERVER_ARGS
from benchmarks.cluster_server import REPO, ClusterServer
from feather_env.evaluation.endpoint import parse_prometheus
from feather_env.reporting import format_table, machine_info, write_json

MODES = ("reroute", "no-reroute")


def run_mode(mode: str, args: argparse.Namespace, seed: int, out_dir: Path) -> dict[str, Any]:
    """One run: a fresh cluster in ``mode``, the workload, its figures and the proxy's shed counters."""
    label = f"{mode}-{seed}"
    flags = [*SERVER_ARGS, "--admission", args.admission, "--slo", args.slo,
             "--reroute-shed" if mode == "reroute" else "--no-reroute-shed"]
    workload = ["--workload", "leval", "--tasks", "quality,tpo", "--num-groups", str(args.documents),
                "--max-per-group", str(args.questions), "--max-prompt-tokens", "4096",
                "--max-output-tokens", "32", "--arrival", f"poisson:{args.rate:g}"]
    goodput = [f"{k}:{v}" for k, v in (x.split(":") for x in args.slo.split())]
    with ClusterServer(2, args.router, flags, log_path=out_dir / f"server-{label}.log") as server:
        command = [sys.executable, str(REPO / "evaluate.py"), *workload, "--seed", str(seed),
                   "--endpoint", server.url, "--reset-prefix-cache", "--goodput", *goodput,
                   "--label", label, "--out", str(out_dir / label), "--no-plots", "--no-progress",
                   "--request-timeout", "300"]
        t0 = time.monotonic()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - t0
        shed = {labels["outcome"]: value for name, labels, value in parse_prometheus(server.metrics())
                if name == "feather_cluster_shed_total"}
        server.stop()
    results = out_dir / label / "results.json"
    if not results.exists():  # evaluate.py exits 1 when requests failed (rejections do): that still writes it
        raise RuntimeError(f"evaluate.py failed ({done.returncode}): {done.stderr[-2000:]}")
    run = json.loads(results.read_text())["runs"][label]
    errors = run.get("errors") or {}
    rejected = sum(1 for e in errors.values() if "HTTP 503" in e and "overloaded" in e)
    submitted = run["submitted"]
    good = round((run.get("request_goodput") or 0.0) * run["duration"])
    return {"mode": mode, "seed": seed, "submitted": submitted, "completed": run["completed"],
            "rejected": rejected, "failed_otherwise": run["failed"] - rejected, "good": good,
            "attainment": good / submitted, "output_throughput": run["output_throughput"],
            "p50_ttft_ms": run.get("median_ttft_ms"), "p99_ttft_ms": run.get("p99_ttft_ms"),
            "prefix_hit_rate": run.get("prefix_hit_rate"), "proxy_shed": shed, "evaluate_wall_s": wall}


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, the medians over its rounds; the no-reroute mode over the reroute mode in attainment (the
    median of the per-round ratios, rounds paired in order) and in output throughput."""
    by = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    keys = ("attainment", "output_throughput", "rejected", "completed", "failed_otherwise")
    out: dict[str, Any] = {m: {k: statistics.median(r[k] for r in rs) for k in keys}
                           for m, rs in by.items() if rs}
    pairs = list(zip(by["no-reroute"], by["reroute"], strict=False))
    if pairs:
        out["no_reroute_over_reroute_attainment"] = statistics.median(
            a["attainment"] / b["attainment"] if b["attainment"] else float("inf") for a, b in pairs)
        out["no_reroute_over_reroute_output_throughput"] = statistics.median(
            a["output_throughput"] / b["output_throughput"] for a, b in pairs)
    return out


def render(res: dict[str, Any]) -> str:
    """The runs and the summary, in markdown."""
    rows = [[r["mode"], r["seed"], f"{100 * r['attainment']:.1f}%", f"{r['completed']}/{r['submitted']}",
             r["rejected"], r["failed_otherwise"],
             ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["proxy_shed"].items())) or "-",
             f"{r['output_throughput']:.1f}", f"{(r['p50_ttft_ms'] or 0) / 1000:.2f}",
             f"{(r['p99_ttft_ms'] or 0) / 1000:.2f}", f"{100 * (r['prefix_hit_rate'] or 0):.0f}%"]
            for r in res["runs"]]
    s = res["summary"]
    lines = [f"`feather-serve --replicas 2 --router {res['router']} --admission {res['admission']} --slo "
             f"\"{res['slo']}\"`, one core per replica; {res['documents']} L-Eval documents x "
             f"{res['questions']} questions, Poisson at {res['rate']:g} req/s, `evaluate.py --endpoint` "
             f"({measured(res)}; `{res['command']}`):", "",
             format_table(["mode", "seed", "attainment", "served", "rejected", "failed otherwise",
                           "proxy sheds", "output tok/s", "TTFT P50 s", "TTFT P99 s", "prefix hit"], rows)]
    if "no_reroute_over_reroute_attainment" in s:
        lines += ["", f"Medians: attainment {100 * s['reroute']['attainment']:.1f}% rerouted, "
                  f"{100 * s['no-reroute']['attainment']:.1f}% not; no reroute over reroute "
                  f"{s['no_reroute_over_reroute_attainment']:.2f}x in attainment, "
                  f"{s['no_reroute_over_reroute_output_throughput']:.2f}x in output tok/s."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals, requests/s")
    p.add_argument("--documents", type=int, default=30)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--admission", default="slo", metavar="RULE")
    p.add_argument("--slo", default="ttft:2000 tpot:100", help="the replicas' SLOs and the goodput's")
    p.add_argument("--router", default="prefix")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="round k draws its workload with seed + k")
    p.add_argument("--out", default="runs/shed-reroute-loopback")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = []
    for k in range(args.repeats):
        order = MODES if k % 2 == 0 else MODES[::-1]  # alternate which mode goes first
        for mode in order:
            runs.append(run_mode(mode, args, args.seed + k, out_dir))
            print(f"[{time.perf_counter() - start:5.0f} s] {mode} round {k}: "
                  f"attainment {runs[-1]['attainment']:.3f}", file=sys.stderr, flush=True)
    res = {"benchmark": "shed_reroute_loopback", "machine": machine_info(),
           "command": "python -m benchmarks.shed_reroute_loopback " + shlex.join(
               argv if argv is not None else sys.argv[1:]),
           "rate": args.rate, "documents": args.documents, "questions": args.questions,
           "admission": args.admission, "slo": args.slo, "router": args.router, "server_args": SERVER_ARGS,
           "runs": runs, "summary": summary(runs), "wall_s": time.perf_counter() - start}
    print(render(res))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
