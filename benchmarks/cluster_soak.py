"""A soak of ``feather-serve --replicas 2``: ~80% load for 10 minutes, a replica killed every 3 minutes.

    flock /tmp/feather-engine.lock python -m benchmarks.cluster_soak --json results/cluster_soak.json

``feather-serve --replicas 2 --router prefix`` (the proxy data plane unless ``--data-plane ray``) is
first driven closed-loop for ``--probe-s`` (16 in flight) to find what it serves per second; then
streamed completions arrive as a Poisson process at ``--load`` (0.8) of that rate for ``--minutes``
(10), the requests of :mod:`benchmarks.cluster_faults` (12 documents of 1,500 tokens, a short
question each, 32 output tokens). Every ``--kill-every-s`` (180) the process of one replica gets
SIGKILL (rank 0, then 1, in turn). Reported:

* each request's outcome as the client sees it (:func:`benchmarks.cluster_faults.stream_one`):
  completed with all its tokens, after one retry, a clear error before any token (HTTP 503) or
  mid-stream (an SSE error event), anything else (the target: nothing else);
* none served twice: on each replica alive at the end, the completions vLLM counted equal the
  completions the client received from that incarnation;
* ``/health`` polled every second throughout: the polls that did not answer 200;
* the resident memory (RSS) of the front end (the command's process, or on Ray every Ray process)
  and of each replica's process group, at the start of the soak and at its end.

A benchmark, not a test: it needs the engines for over 10 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks import measured
from benchmarks.cluster_faults import DOC_TOKENS, DOCUMENTS, SERVER_ARGS, stream_one
from benchmarks.cluster_loopback import per_replica
from benchmarks.cluster_server import ClusterServer, http_get
from feather_env.reporting import format_table, machine_info, write_json

COMMAND = ("flock /tmp/feather-engine.lock python -m benchmarks.cluster_soak "
           "--json results/cluster_soak.json")
OK = ("completed", "retried")


def rss_mib(server: ClusterServer) -> dict[str, float]:
    """Resident MiB of the front end (the command's process; Ray's processes with it) and of each
    replica's process tree (``/replicas``' pids)."""
    assert server.proc is not None
    replicas = {str(r["rank"]): r["pid"] for r in server.replica_info()}
    out: dict[str, float] = {}
    inside: set[int] = set()
    for rank, pid in replicas.items():
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        inside |= {p.pid for p in procs}
        out[f"replica {rank}"] = sum(_rss(p) for p in procs) / 2**20
    front = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    out["front end"] = sum(_rss(p) for p in front if p.pid not in inside) / 2**20
    return out


def _rss(p: psutil.Process) -> int:
    try:
        return int(p.memory_info().rss)
    except psutil.Error:
        return 0


async def soak(server: ClusterServer, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(3, 8000, DOC_TOKENS).tolist() for _ in range(DOCUMENTS)]

    def prompt() -> list[int]:
        return docs[int(rng.integers(DOCUMENTS))] + rng.integers(3, 8000, 8).tolist()

    results: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        # capacity: closed loop, 16 in flight
        done = 0
        t0 = time.monotonic()

        async def closed() -> None:
            nonlocal done
            while time.monotonic() - t0 < args.probe_s:
                await stream_one(session, server.url, prompt())
                done += 1

        await asyncio.gather(*(closed() for _ in range(16)))
        capacity = done / (time.monotonic() - t0)
        rate = args.load * capacity
        health_failures, health_polls, kills = 0, 0, []
        rss_start = await asyncio.to_thread(rss_mib, server)
        stop = time.monotonic() + 60 * args.minutes

        async def health() -> None:
            nonlocal health_failures, health_polls
            while time.monotonic() < stop:
                health_polls += 1
                try:
                    limit = aiohttp.ClientTimeout(total=5)
                    async with session.get(server.url + "/health", timeout=limit) as r:
                        health_failures += r.status != 200
                except (aiohttp.ClientError, TimeoutError):
                    health_failures += 1
                await asyncio.sleep(1.0)

        async def killer() -> None:
            rank = 0
            while time.monotonic() + args.kill_every_s < stop:
                await asyncio.sleep(args.kill_every_s)
                victim = next(r for r in await asyncio.to_thread(server.replica_info) if r["rank"] == rank)
                os.kill(victim["pid"], signal.SIGKILL)
                kills.append({"at_s": time.monotonic() - (stop - 60 * args.minutes), **victim})
                rank = 1 - rank

        async def one() -> None:
            results.append(await stream_one(session, server.url, prompt()))

        side = [asyncio.create_task(health()), asyncio.create_task(killer())]
        tasks = []
        while time.monotonic() < stop:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        await asyncio.gather(*tasks)
        for task in side:
            task.cancel()
        await asyncio.to_thread(server.wait_healthy, 2, 600.0)
        rss_end = await asyncio.to_thread(rss_mib, server)
    return {"capacity_rps": capacity, "rate_rps": rate, "results": results, "kills": kills,
            "health_polls": health_polls, "health_failures": health_failures,
            "rss_mib_start": rss_start, "rss_mib_end": rss_end}


def render(res: dict[str, Any]) -> str:
    s = res["summary"]
    rows = [["requests", s["requests"]], ["completed with all their tokens", s["completed"]],
            ["... of them after one retry", s["retried"]],
            ["clear error before any token (HTTP 503)", s["error_before_answer"]],
            ["clear error mid-stream (SSE error event)", s["error_mid_stream"]],
            ["anything else", s["other"]],
            ["replicas killed", len(res["kills"])],
            ["/health polls not answered 200", f"{res['health_failures']} of {res['health_polls']}"],
            ["none served twice", "yes" if s["none_served_twice"] else "NO"]]
    memory = [[k, res["rss_mib_start"].get(k), res["rss_mib_end"].get(k)] for k in res["rss_mib_end"]]
    return "\n".join([
        f"`feather-serve --replicas 2 --router prefix {' '.join(res['extra_args'])}`, {res['minutes']} "
        f"minutes at {res['rate_rps']:.2f} req/s ({res['load']:.0%} of {res['capacity_rps']:.2f} measured), "
        f"a replica killed every {res['kill_every_s']:.0f} s ({measured(res)}; `{res['command']}`):", "",
        format_table(["", "count"], rows), "", "Resident memory (MiB):", "",
        format_table(["process", "start", "end"], memory)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every-s", type=float, default=180.0)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--probe-s", type=float, default=60.0)
    p.add_argument("--data-plane", choices=("proxy", "ray"), default="proxy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/cluster-soak")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not (0 < args.load <= 1.5 and args.minutes > 0 and args.kill_every_s > 0 and args.probe_s > 0):
        p.error("--load must be in (0, 1.5]; --minutes, --kill-every-s and --probe-s > 0")
    extra = ["--data-plane", args.data_plane]
    with ClusterServer(2, "prefix", [*SERVER_ARGS, *extra], log_path=Path(args.out) / "server.log") as server:
        res = asyncio.run(soak(server, args))
        text = http_get(server.url + "/metrics", timeout=30.0)
        replicas_after = server.replica_info()
        stopped = server.stop()
    results = res.pop("results")
    outcomes = Counter(r["outcome"] for r in results)
    counted = per_replica(text, "vllm:request_success_total")
    received = Counter(r["replica"] for r in results if r["outcome"] in OK)
    live = {str(r["rank"]): f"{r['rank']}/{r['replica_id']}" for r in replicas_after}
    ledger = {rank: {"vllm_counted": counted.get(rank, 0.0), "client_received": received.get(key, 0)}
              for rank, key in live.items()}
    summary = {"requests": len(results), "completed": outcomes["completed"] + outcomes["retried"],
               "retried": outcomes["retried"], "error_before_answer": outcomes["error_before_answer"],
               "error_mid_stream": outcomes["error_mid_stream"],
               "other": sum(v for k, v in outcomes.items()
                            if k not in (*OK, "error_before_answer", "error_mid_stream")),
               "none_served_twice": all(v["vllm_counted"] == v["client_received"] for v in ledger.values())}
    out = {"benchmark": "cluster_soak", "command": COMMAND, "machine": machine_info(),
           "server_args": SERVER_ARGS,
           "extra_args": extra, "minutes": args.minutes, "load": args.load, "kill_every_s": args.kill_every_s,
           **res, "summary": summary, "ledger": ledger, "replicas_after": replicas_after,
           "errors": [r for r in results if r["outcome"] not in OK][:50], "sigterm": stopped}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
