"""Unequal replicas on loopback, real engines: ours learning each replica (told nothing) against
``sglang-router`` ``cache_aware``, at its defaults and tuned for load.

    flock /tmp/feather-engine.lock python -m benchmarks.unequal_loopback \\
        --json results/unequal_loopback.json
    python -m benchmarks.unequal_loopback --standin --repeats 1     # the whole benchmark on stand-ins

The setup (the unequal-replicas issue's): two plain ``feather-serve`` replicas, one core each
(:func:`benchmarks.frontend_loopback.plain_replicas`, :data:`~benchmarks.cluster_loopback.SERVER_ARGS`):

* replica 0 holds ``--kv-ratio`` (4) x the KV of replica 1: ``--small-kv-tokens`` (16,384 tokens, four
  of the workload's 4,096-token documents; ``--kv-cache-memory-bytes`` worked out from the model and the
  dtype this machine computes in, so the tokens are the same on every host) against 65,536;
* replica 1 shares its core with a noisy neighbour: a Python busy loop pinned to that core, which the
  kernel's fair scheduler gives half the core (the replica runs at about half speed).

The workload is :mod:`benchmarks.frontend_loopback`'s (12 L-Eval documents x 6 questions as text, answers
of at most 32 tokens, all at once, 8 in flight, its client; ``--documents`` for more, up to 30): 12
documents of up to 4,096 tokens, about 48,000 distinct prompt tokens, put the small replica under KV
pressure as soon as it is given more than four of them (sglang-router's cache-aware rule splits documents
by load, not by KV size).

Front ends, alternated, fresh replicas and front end per run (``--repeats``, default 3):

* ``feather-learned`` (ours): ``feather-serve --worker-urls U0 U1 --router prefix-learned`` (the proxy
  of ``feather-serve --replicas N`` over running servers), told nothing: it reads each replica's KV from
  its ``/metrics`` and learns its speeds from the requests it relays (``--kv-guard``: with its KV guard,
  a new document placed where it fits a replica's published KV);
* ``sglang-cache-aware``: ``sglang-router`` ``--policy cache_aware`` at its defaults;
* ``sglang-tuned``: the same tuned for load, ``--balance-abs-threshold 2 --balance-rel-threshold 1.1``.

Per run: requests completed with all their tokens, output tokens/s (all the answers' tokens over the
wall time), attainment (requests that completed within an SLO over those submitted) for each ``--slo``
pair, TTFT and TPOT percentiles (p50, p90, p99), the prefix-cache hit rate, the replicas' shares and, for
ours, what it learned of each replica by the end (``/replicas``' estimates: KV tokens, speeds) and the
waits it read (``feather_router_queue_reports_total``: every replica runs with vLLM's
``--enable-per-request-metrics``, for every front end alike). The
SLOs: the issue's ``ttft:5000 tpot:50`` and ``auto``, a pair set at the median TTFT and median TPOT of
every request of every run: on this tiny model on one CPU core a request takes about a second or two, so
the issue's pair is met by nearly every request that completes (it flags failures, not speed); the
medians put overall attainment near one half, where it moves with the front end that keeps latencies
down. Medians over the rounds per front end; ours over the better sglang-router (by median throughput)
in output throughput and in each attainment. Targets (issue): ours >= 1.15x in throughput, >= 1.0x
in attainment, every request completed under each.

``--standin``: the same benchmark over paced stand-in workers (:mod:`benchmarks.standin`; the small one
publishing a quarter of the KV and serving at half speed, with the same busy neighbour) and a small
synthetic text workload: seconds, for tests; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from benchmarks.admission_burst import percentile, tpot_s
from benchmarks.cluster_server import REPO, free_port, http_get
from benchmarks.frontend_loopback import (
    CONCURRENCY,
    chosen_front_ends,
    drive,
    hit_counts,
    plain_replicas,
    replica_cores,
    requests_for,
    wait_healthy,
)
from benchmarks.frontend_overhead import stop
from benchmarks.standin import MODEL as STANDIN_MODEL
from benchmarks.standin import standin_command
from feather_env.evaluation.endpoint import parse_prometheus
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.admission import parse_slos
from scheduler_runtime.hardware import compute_dtype, kv_bytes_per_token
from scheduler_runtime.serving.cluster_base import PER_REQUEST_METRICS
from scheduler_runtime.serving.replicas import die_with_parent
from scheduler_runtime.serving.serve import DEFAULT_MODEL

OURS = "feather-learned"
#: sglang-router's cache-aware rule, at its defaults and tuned for load (the issue's setting).
SGLANG = {"sglang-cache-aware": {},
          "sglang-tuned": {"balance_abs_threshold": 2, "balance_rel_threshold": 1.1}}
FRONT_ENDS = (OURS, *SGLANG)
ISSUE_SLO, AUTO = "ttft:5000 tpot:50", "auto"
BLOCK = 128  # feather-serve's --block-size
COMMAND = ("flock /tmp/feather-engine.lock python -m benchmarks.unequal_loopback "
           "--json results/unequal_loopback.json")
#: Stand-in mode: the big replica's pace (the small one's is twice as slow: its neighbour), its workload.
STANDIN_PACE = {"prefill_ms_per_1k": 20.0, "decode_ms": 2.0}
STANDIN_DOCS, STANDIN_QUESTIONS, STANDIN_TOKENS = 4, 3, 8


def kv_bytes(tokens: int) -> int:
    """``--kv-cache-memory-bytes`` for a replica of the bundled model holding ``tokens`` tokens (in blocks
    of :data:`BLOCK`, vLLM's null block added) in the dtype this machine computes in."""
    per_token = kv_bytes_per_token(DEFAULT_MODEL, compute_dtype("bfloat16"))
    return (-(-tokens // BLOCK) + 1) * BLOCK * per_token


@contextlib.contextmanager
def noisy_neighbour(core: str) -> Iterator[subprocess.Popen[bytes]]:
    """A Python busy loop pinned to ``core`` (half the core for whatever else runs there), until exit."""
    proc = subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"],
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def ours_over(urls: Sequence[str], log_path: Path, kv_guard: bool = False,
              router: str = "prefix-learned") -> Iterator[str]:
    """``feather-serve --worker-urls`` in front of ``urls`` (``--router prefix-learned``, told nothing, or
    ``router``; ``--kv-guard`` with ``kv_guard``);
    its URL once it reports a healthy replica and, learning, has read each replica's ``/metrics`` once
    (its first scrape, 1 s; at most 30 s), as a front end that has started."""
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler_runtime.serving.serve", "--port", str(port),
                                 "--router", router, *(["--kv-guard"] if kv_guard else []),
                                 "--worker-urls", *urls], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, time.monotonic() + 120, f"the proxy did not start (see {log_path})", 0.2)
            deadline = time.monotonic() + 30  # ready once it has read every replica's /metrics once
            while (router == "prefix-learned" and time.monotonic() < deadline
                   and not all((r.get("estimates") or {}).get("kv_tokens")
                               for r in json.loads(http_get(url + "/replicas")))):
                time.sleep(0.2)
            yield url
        finally:
            stop(proc)


def standin_requests(seed: int) -> list[tuple[str, int]]:
    """Stand-in mode's workload: :data:`STANDIN_DOCS` documents x :data:`STANDIN_QUESTIONS` questions as
    text, :data:`STANDIN_TOKENS` tokens each, in a shuffled order."""
    import random

    rng = random.Random(seed)
    docs = [" ".join(f"d{d}w{i}" for i in range(600)) for d in range(STANDIN_DOCS)]
    out = [(f"{doc} question {q}?", STANDIN_TOKENS) for doc in docs for q in range(STANDIN_QUESTIONS)]
    rng.shuffle(out)
    return out


def replica_setup(small_kv_tokens: int, kv_ratio: float, standin: bool) -> list[list[str]]:
    """Each replica's own arguments: ``feather-serve``'s KV size, or a stand-in's pace and KV blocks; and
    vLLM's per-request metrics (each stream's wait before its first step, which ours reads: the flag a
    user gives the servers behind ``--worker-urls``), the same for every front end."""
    sizes = [round(small_kv_tokens * kv_ratio), small_kv_tokens]
    if not standin:
        return [["--kv-cache-memory-bytes", str(kv_bytes(tokens)), PER_REQUEST_METRICS] for tokens in sizes]
    out = []
    for k, tokens in enumerate(sizes):
        slow = 2.0 if k == 1 else 1.0  # its neighbour's half of the core
        out.append(["--kv-blocks", str(-(-tokens // BLOCK)), "--block-size", str(BLOCK),
                    "--prefill-ms-per-1k", str(STANDIN_PACE["prefill_ms_per_1k"] * slow),
                    "--decode-ms", str(STANDIN_PACE["decode_ms"] * slow), PER_REQUEST_METRICS])
    return out


def run_once(front_end: str, requests: Sequence[tuple[str, int]], log_dir: Path,
             setup: Sequence[Sequence[str]], standin: bool, kv_guard: bool = False) -> dict[str, Any]:
    """One front end over two fresh unequal replicas, the small one's neighbour busy while it runs."""
    from benchmarks.router_fidelity import SGLangRouter

    log_dir.mkdir(parents=True, exist_ok=True)
    command = (lambda k, port: [*standin_command((), port), *setup[k]]) if standin else None
    own = [()] * len(setup) if standin else setup
    model = STANDIN_MODEL if standin else "unknown"
    with plain_replicas(log_dir, own, command) as urls, noisy_neighbour(replica_cores()[1]):
        front = (ours_over(urls, log_dir / "proxy.log", kv_guard) if front_end == OURS
                 else SGLangRouter(urls, SGLANG[front_end]))
        with front as entered:
            url = entered if isinstance(entered, str) else entered.url
            before = hit_counts([http_get(u + "/metrics") for u in urls])
            result = asyncio.run(drive(url, requests, model=model))
            after = hit_counts([http_get(u + "/metrics") for u in urls])
            shares = _shares(urls)
            # what ours learned of each replica by the end (its KV sizes and speeds), and the waits it read
            learned = ({str(r["rank"]): r["estimates"] for r in json.loads(http_get(url + "/replicas"))}
                       if front_end == OURS else None)
            reports = (sum(v for n, _, v in parse_prometheus(http_get(url + "/metrics"))
                           if n == "feather_router_queue_reports_total") if front_end == OURS else None)
    queries = after[1] - before[1]
    hit_rate = (after[0] - before[0]) / queries if queries else None
    return {"front_end": front_end, **result, "prefix_hit_rate": hit_rate, "replica_requests": shares,
            "learned": learned, "queue_reports": reports}


def _shares(urls: Sequence[str]) -> list[float]:
    """Requests each replica finished, from its ``vllm:request_success_total``."""
    return [sum(v for n, _, v in parse_prometheus(http_get(u + "/metrics"))
                if n == "vllm:request_success_total") for u in urls]


def slo_pairs(specs: Sequence[str], runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each ``--slo`` as ``{"ttft": ms, "tpot": ms}``; ``auto``: the medians over every completed request
    of ``runs`` (rounded up to the ms, so that a request at the median meets it)."""
    out = {}
    for spec in specs:
        if spec.strip() == AUTO:
            done = [r for run in runs for r in run["requests"] if r.get("completed")]
            ttfts = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
            tpots = [t for r in done if (t := tpot_s(r)) is not None]
            pair = {"ttft": math.ceil(1000 * statistics.median(ttfts)) if ttfts else math.inf,
                    "tpot": math.ceil(1000 * statistics.median(tpots)) if tpots else math.inf}
            out[f"auto (ttft:{pair['ttft']} tpot:{pair['tpot']})"] = pair
        else:
            out[spec.strip()] = parse_slos(spec)
    return out


def figures(run: Mapping[str, Any], slos: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """A run's attainment under each SLO pair and its TTFT and TPOT percentiles (ms)."""
    reqs = run["requests"]
    out: dict[str, Any] = {"attainment": {}}
    for name, pair in slos.items():
        good = 0
        for r in reqs:
            tpot = tpot_s(r)
            good += bool(r.get("completed") and r["ttft_s"] is not None
                         and 1000 * r["ttft_s"] <= pair.get("ttft", math.inf)
                         and (tpot is None or 1000 * tpot <= pair.get("tpot", math.inf)))
        out["attainment"][name] = good / len(reqs) if reqs else 0.0
    ttfts = [1000 * r["ttft_s"] for r in reqs if r.get("completed") and r["ttft_s"] is not None]
    tpots = [1000 * t for r in reqs if r.get("completed") and (t := tpot_s(r)) is not None]
    for q in (50, 90, 99):
        out[f"p{q}_ttft_ms"], out[f"p{q}_tpot_ms"] = percentile(ttfts, q), percentile(tpots, q)
    return out


def summarize(runs: Sequence[dict[str, Any]], slos: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Each run's figures; per front end the medians over its rounds; ours over the better sglang-router."""
    for run in runs:
        run.update(figures(run, slos))
    median: dict[str, dict[str, Any]] = {}
    for f in dict.fromkeys(r["front_end"] for r in runs):
        mine = [r for r in runs if r["front_end"] == f]
        median[f] = {"output_throughput": statistics.median(r["output_throughput"] for r in mine),
                     "completed": min(r["completed"] for r in mine), "submitted": mine[0]["submitted"],
                     "attainment": {s: statistics.median(r["attainment"][s] for r in mine) for s in slos},
                     **{k: statistics.median(r[k] for r in mine if r[k] is not None)
                        if any(r[k] is not None for r in mine) else None
                        for k in mine[0] if k.startswith("p") and k.endswith("_ms")}}
    out: dict[str, Any] = {"median": median}
    peers = [f for f in SGLANG if f in median]
    if OURS in median and peers:
        best = max(peers, key=lambda f: median[f]["output_throughput"])
        ours, theirs = median[OURS], median[best]
        out["versus"] = {"best_sglang": best,
                         "output_throughput": ours["output_throughput"] / theirs["output_throughput"],
                         "attainment": {s: ours["attainment"][s] / theirs["attainment"][s]
                                        if theirs["attainment"][s] else math.inf for s in slos}}
    return out


def render(res: Mapping[str, Any]) -> str:
    slos = list(res["slos"])
    rows = [[r["front_end"], f"{r['completed']}/{r['submitted']}", r["output_throughput"],
             *(f"{100 * r['attainment'][s]:.0f}%" for s in slos), r["p50_ttft_ms"], r["p99_ttft_ms"],
             r["p50_tpot_ms"], r["p99_tpot_ms"], "/".join(f"{x:.0f}" for x in r["replica_requests"])]
            for r in res["runs"]]
    lines = [f"Two unequal replicas on loopback (replica 1: 1/{res['kv_ratio']:g} of the KV, a busy "
             f"neighbour on its core), {CONCURRENCY} in flight ({measured(res)}; `{res['command']}`):", "",
             format_table(["front end", "completed", "output tok/s", *(f"attained {s}" for s in slos),
                           "p50 TTFT ms", "p99 TTFT ms", "p50 TPOT ms", "p99 TPOT ms", "per replica"], rows)]
    med = res["median"]
    lines += ["", "Medians over the rounds:", "",
              format_table(["front end", "completed (least)", "output tok/s",
                            *(f"attained {s}" for s in slos)],
                           [[f, f"{m['completed']}/{m['submitted']}", m["output_throughput"],
                             *(f"{100 * m['attainment'][s]:.0f}%" for s in slos)]
                            for f, m in med.items()])]
    if "versus" in res:
        v = res["versus"]
        lines += ["", f"- ours / {v['best_sglang']} (the better sglang-router by throughput), output "
                      f"throughput: {v['output_throughput']:.3f} (target >= 1.15)"]
        lines += [f"- ours / {v['best_sglang']}, attainment {s}: {ratio:.3f} (target >= 1.0)"
                  for s, ratio in v["attainment"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", default=",".join(FRONT_ENDS), help=f"of {','.join(FRONT_ENDS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--documents", type=int, default=12,
                   help="L-Eval documents of the workload (6 questions each; at most 30; default 12, "
                        "frontend_loopback's; --standin has its own)")
    p.add_argument("--small-kv-tokens", type=int, default=16384, help="replica 1's KV cache in tokens")
    p.add_argument("--kv-ratio", type=float, default=4.0, help="replica 0's KV over replica 1's")
    p.add_argument("--slo", action="append", default=None, metavar='"ttft:MS tpot:MS"|auto',
                   help=f"an SLO pair for attainment, repeatable (default: {ISSUE_SLO!r} and {AUTO!r})")
    p.add_argument("--standin", action="store_true", help="stand-in workers and a small workload (a test)")
    p.add_argument("--kv-guard", action="store_true",
                   help="ours with --kv-guard (a new document goes where it fits the replica's published KV)")
    p.add_argument("--out", default="runs/unequal-loopback")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    chosen = chosen_front_ends(p, args.front_ends, list(FRONT_ENDS), args.repeats)
    if args.small_kv_tokens < 1 or not args.kv_ratio >= 1 or not 1 <= args.documents <= 30:
        p.error("--small-kv-tokens >= 1, --kv-ratio >= 1, --documents from 1 to 30")
    specs = args.slo or [ISSUE_SLO, AUTO]
    for spec in specs:
        if spec.strip() != AUTO:
            try:
                parse_slos(spec)
            except ValueError as exc:
                p.error(f"--slo: {exc}")
    setup = replica_setup(args.small_kv_tokens, args.kv_ratio, args.standin)
    requests = standin_requests(args.seed) if args.standin else requests_for(args.seed, args.documents)
    runs = [run_once(f, requests, Path(args.out) / f"{f}-{i}", setup, args.standin, args.kv_guard)
            for i in range(args.repeats) for f in chosen]
    slos = slo_pairs(specs, runs)
    given = [(f"--{k.replace('_', '-')}", v) for k, v in vars(args).items()
             if k not in ("json", "out", "standin") and v != p.get_default(k)]
    command = COMMAND.replace(" --json", "".join(f" {flag}" if v is True else f" {flag} {shlex.quote(str(v))}"
                                                 for flag, v in given)
                              + (" --standin" if args.standin else "") + " --json")
    if args.json:  # the file this run wrote, not the default's
        command = command.replace("results/unequal_loopback.json", shlex.quote(args.json))
    out = {"benchmark": "unequal_loopback", "command": command, "machine": machine_info(), "seed": args.seed,
           "standin": args.standin, "kv_guard": args.kv_guard, "documents": args.documents,
           "small_kv_tokens": args.small_kv_tokens,
           "kv_ratio": args.kv_ratio,
           "replica_args": setup, "concurrency": CONCURRENCY, "slos": slos, "runs": runs,
           **summarize(runs, slos)}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
