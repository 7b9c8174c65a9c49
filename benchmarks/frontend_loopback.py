"""Our front end against sglang-router on real engines: ``feather-serve --replicas 2`` vs
``sglang-router`` ``cache_aware`` in front of two plain ``feather-serve`` processes, each on its own core.

    flock /tmp/feather-engine.lock python -m benchmarks.frontend_loopback \
        --json results/frontend_loopback.json

The workload is :mod:`benchmarks.cluster_loopback`'s (12 L-Eval documents x 6 questions, prompts cut
at 4,096 tokens, answers of at most 32, all arriving at once in a shuffled order, 8 in flight), sent as
text (the token ids decoded with the bundled model's tokenizer): ``sglang-router`` 0.3.2 refuses a
prompt of token ids, so ``evaluate.py --endpoint`` (which sends ids) cannot drive it. Every front end
gets the very same requests, streamed, ``ignore_eos`` with ``min_tokens`` so that each answer has its
length. The requests name model ``unknown``, which every replica also serves
(``--served-model-name tiny-llama unknown``): sglang-router keys its trees by the model a worker
reports, and vLLM reports none (:mod:`benchmarks.router_fidelity`).

Front ends, alternated, fresh processes per run (``--repeats``, default 3):

* ``feather-proxy``: ``feather-serve --replicas 2 --router prefix`` (the proxy data plane; add
  ``--front-ends feather-ray`` for ``--data-plane ray``, ``feather-proxy-pow2`` for ``--router pow2``);
* ``ray-prefix-affinity``: ``feather-serve --replicas 2 --data-plane ray --router ray-prefix-affinity``,
  Ray Serve LLM's own ``PrefixCacheAffinityRouter`` in front of the same engines;
* ``sglang-cache-aware``: ``python -m sglang_router.launch_router --policy cache_aware`` (its defaults)
  in front of two ``feather-serve`` processes, replica ``k`` on the ``k``-th core of this command's
  affinity (``taskset``, and its OpenMP threads there too).

Per run: requests completed with all their tokens, output tokens/s (all the answers' tokens over the
wall time from the first request to the last answer), the prefix-cache hit rate (the replicas'
``vllm:prefix_cache_hits_total`` / ``queries_total`` over the run). Target (issue 35): ours completes
every request, its hit rate is no more than 2 points below sglang-router's, and its output throughput
is >= 0.95x sglang-router's (median runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from benchmarks.cluster_loopback import SERVER_ARGS, WORKLOAD_ARGS
from benchmarks.cluster_server import REPO, ClusterServer, free_port, http_get
from feather_env.evaluation.endpoint import parse_prometheus
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.workloads.build import WorkloadConfig, build_workload
from feather_env.workloads.tokenizer import load_tokenizer
from scheduler_runtime.serving.replica_args import without_flags
from scheduler_runtime.serving.replicas import die_with_parent
from scheduler_runtime.sse import SSE_DONE, sse_events

#: Our front ends: ``feather-serve --replicas 2`` with (data plane, router).
FEATHER_FRONT_ENDS = {"feather-proxy": ("proxy", "prefix"), "feather-ray": ("ray", "prefix"),
                      "ray-prefix-affinity": ("ray", "ray-prefix-affinity"),
                      "feather-proxy-pow2": ("proxy", "pow2")}
FRONT_ENDS = ("feather-proxy", "sglang-cache-aware", *(f for f in FEATHER_FRONT_ENDS if f != "feather-proxy"))
DEFAULT_FRONT_ENDS = "feather-proxy,sglang-cache-aware"
MODEL = "unknown"
SERVED = ["--served-model-name", "tiny-llama", MODEL]
CONCURRENCY = 8
COMMAND = ("flock /tmp/feather-engine.lock python -m benchmarks.frontend_loopback "
           "--json results/frontend_loopback.json")


def requests_for(seed: int, documents: int | None = None) -> list[tuple[str, int]]:
    """``(prompt text, output tokens)`` of :mod:`benchmarks.cluster_loopback`'s workload, in its order
    (``documents``: that many documents in place of its 12)."""
    args = dict(zip(WORKLOAD_ARGS[::2], WORKLOAD_ARGS[1::2], strict=True))
    workload = build_workload(WorkloadConfig(
        kind=args["--workload"], tasks=tuple(args["--tasks"].split(",")),
        num_groups=documents or int(args["--num-groups"]), max_per_group=int(args["--max-per-group"]),
        max_prompt_tokens=int(args["--max-prompt-tokens"]),
        max_output_tokens=int(args["--max-output-tokens"]), arrival=args["--arrival"], seed=seed))
    tokenizer = load_tokenizer()
    return [(tokenizer.decode([int(t) for t in r.prompt_token_ids]), int(r.output_len))
            for r in workload.requests]


def hit_counts(texts: Sequence[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries summed over the replicas' expositions."""
    hits = queries = 0.0
    for text in texts:
        for name, _, value in parse_prometheus(text):
            hits += value if name == "vllm:prefix_cache_hits_total" else 0.0
            queries += value if name == "vllm:prefix_cache_queries_total" else 0.0
    return hits, queries


async def drive(url: str, requests: Sequence[tuple[str, int]], model: str = MODEL,
                until_s: float | None = None) -> dict[str, Any]:
    """Every request, at most :data:`CONCURRENCY` in flight; completions and output tokens/s, and each
    request's ``sent_s`` (from the start), ``ttft_s`` (send to first token; ``None``: none came),
    ``e2e_s``, ``tokens`` and ``completed`` (every token it asked for), under ``requests``, in order.
    ``until_s``: instead, the requests again and again in their order, each of the :data:`CONCURRENCY`
    clients sending its next one until ``until_s`` seconds have passed (a closed loop of fixed length)."""
    import aiohttp

    done = tokens = 0
    each: dict[int, dict[str, Any]] = {}
    issued = 0
    t0 = time.monotonic()

    async def one(session: aiohttp.ClientSession, i: int, prompt: str, n: int) -> None:
        nonlocal done, tokens
        body = {"model": model, "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        sent, first, got = time.monotonic(), None, 0
        async with session.post(url + "/v1/completions", json=body) as resp:
            async for event in sse_events(resp.content):
                if event is SSE_DONE:
                    continue
                if first is None and event.get("choices"):
                    first = time.monotonic()
                usage = event.get("usage")
                got = usage["completion_tokens"] if usage else got
            ok = resp.status == 200 and got == n
        done += ok
        tokens += got
        each[i] = {"sent_s": sent - t0, "ttft_s": None if first is None else first - sent,
                   "e2e_s": time.monotonic() - sent, "tokens": got, "completed": ok}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued
        while (issued < len(requests)) if until_s is None else (time.monotonic() - t0 < until_s):
            i = issued
            issued += 1
            await one(session, i, *requests[i % len(requests)])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(client(session) for _ in range(min(CONCURRENCY, max(1, len(requests))))))
    wall = time.monotonic() - t0
    return {"completed": done, "submitted": len(each), "output_tokens": tokens, "wall_s": wall,
            "output_throughput": tokens / wall, "requests": [each[i] for i in sorted(each)]}


def chosen_front_ends(p: argparse.ArgumentParser, value: str, allowed: Sequence[str],
                      repeats: int) -> list[str]:
    """A loopback benchmark's comma-separated ``--front-ends``, some of ``allowed``; a usage error through
    ``p`` for none, an unknown one, or ``--repeats`` under 1."""
    chosen = [f.strip() for f in value.split(",") if f.strip()]
    if not chosen or set(chosen) - set(allowed) or repeats < 1:
        p.error(f"--front-ends: some of {list(allowed)}; --repeats >= 1")
    return chosen


def wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline: float, failure: str,
                 period_s: float = 1.0) -> None:
    """Until ``url``'s ``/health`` answers 200; ``RuntimeError(failure)`` if ``proc`` exits first or the
    ``deadline`` (``time.monotonic``) passes."""
    while True:
        with contextlib.suppress(OSError):
            http_get(url + "/health", timeout=5)
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(period_s)


def replica_cores(n: int = 2) -> list[str]:
    """Each of ``n`` replicas' core: replica ``k``'s is the ``k``-th of this command's affinity (round
    the list)."""
    cores = sorted(os.sched_getaffinity(0))
    return [str(cores[k % len(cores)]) for k in range(n)]


@contextlib.contextmanager
def plain_replicas(log_dir: Path, own_args: Sequence[Sequence[str]] = ((), ()),
                   command: Callable[[int, int], list[str]] | None = None) -> Iterator[list[str]]:
    """Plain ``feather-serve`` processes, one per entry of ``own_args`` (replica ``k`` with
    :data:`SERVER_ARGS` and ``own_args[k]`` in place of those it names), replica ``k`` pinned to the
    ``k``-th core of this command (:func:`replica_cores`); ``command(k, port)``: another server in place
    of ``feather-serve`` (a stand-in), pinned the same way."""
    procs, urls = [], []
    try:
        for k, (own, core) in enumerate(zip(own_args, replica_cores(len(own_args)), strict=True)):
            port = free_port()
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_SERVER_DEV_MODE": "1"}
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            log = (log_dir / f"replica{k}.log").open("wb")
            server = command(k, port) if command is not None else [
                sys.executable, "-m", "scheduler_runtime.serving.serve", "--port", str(port),
                *without_flags(SERVER_ARGS, own[::2]), *own, *SERVED]
            procs.append(subprocess.Popen(["taskset", "-c", core, *server], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 420
        for proc, url in zip(procs, urls, strict=True):
            wait_healthy(url, proc, deadline, f"feather-serve at {url} did not start (see {log_dir})")
        yield urls
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


def run_once(front_end: str, requests: Sequence[tuple[str, int]], log_dir: Path) -> dict[str, Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    if front_end == "sglang-cache-aware":
        from benchmarks.router_fidelity import SGLangRouter

        with plain_replicas(log_dir) as urls, SGLangRouter(urls) as router:
            before = hit_counts([http_get(u + "/metrics") for u in urls])
            result = asyncio.run(drive(router.url, requests))
            after = hit_counts([http_get(u + "/metrics") for u in urls])
    else:
        plane, router = FEATHER_FRONT_ENDS[front_end]
        with ClusterServer(2, router, [*SERVER_ARGS, *SERVED, "--data-plane", plane],
                           log_path=log_dir / "server.log") as server:
            before = hit_counts([server.metrics()])
            result = asyncio.run(drive(server.url, requests))
            after = hit_counts([server.metrics()])
    queries = after[1] - before[1]
    hit_rate = (after[0] - before[0]) / queries if queries else None
    return {"front_end": front_end, **result, "prefix_hit_rate": hit_rate}


def render(res: dict[str, Any]) -> str:
    rows = [[r["front_end"], f"{r['completed']}/{r['submitted']}", r["output_throughput"],
             f"{100 * (r['prefix_hit_rate'] or 0):.1f}%"] for r in res["runs"]]
    lines = [f"Two replicas on loopback, text prompts, {CONCURRENCY} in flight ({measured(res)}; "
             f"`{res['command']}`):", "",
             format_table(["front end", "completed", "output tok/s", "prefix hit"], rows)]
    med = res["median"]
    if "feather-proxy" in med and "sglang-cache-aware" in med:
        ours, theirs = med["feather-proxy"], med["sglang-cache-aware"]
        lines += ["", f"- ours / sglang-router output throughput (medians): "
                      f"{ours['output_throughput'] / theirs['output_throughput']:.3f} (target >= 0.95)",
                  f"- hit rate, ours minus sglang-router's: "
                  f"{100 * (ours['prefix_hit_rate'] - theirs['prefix_hit_rate']):+.1f} points (target >= -2)"]
    if "feather-proxy" in med and "ray-prefix-affinity" in med:
        ours, ray = med["feather-proxy"], med["ray-prefix-affinity"]
        lines += [f"- hit rate, ours minus Ray Serve's PrefixCacheAffinityRouter's: "
                  f"{100 * (ours['prefix_hit_rate'] - ray['prefix_hit_rate']):+.1f} points (target >= 0)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", default=DEFAULT_FRONT_ENDS,
                   help=f"of {','.join(FRONT_ENDS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/frontend-loopback")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    chosen = chosen_front_ends(p, args.front_ends, FRONT_ENDS, args.repeats)
    requests = requests_for(args.seed)
    runs = [run_once(f, requests, Path(args.out) / f"{f}-{i}") for i in range(args.repeats) for f in chosen]
    median = {}
    for f in chosen:
        mine = [r for r in runs if r["front_end"] == f]
        mid = sorted(mine, key=lambda r: r["output_throughput"])[len(mine) // 2]
        median[f] = {"output_throughput": statistics.median(r["output_throughput"] for r in mine),
                     "prefix_hit_rate": mid["prefix_hit_rate"] or 0.0}
    command = COMMAND + ("" if args.front_ends == DEFAULT_FRONT_ENDS else f" --front-ends {args.front_ends}")
    out = {"benchmark": "frontend_loopback", "command": command, "machine": machine_info(), "seed": args.seed,
           "server_args": [*SERVER_ARGS, *SERVED], "workload_args": WORKLOAD_ARGS, "concurrency": CONCURRENCY,
           "runs": runs, "median": median}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
