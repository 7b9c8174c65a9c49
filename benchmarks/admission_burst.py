"""Bursts far past the engine's capacity against ``feather-serve --admission slo``: what each request gets.

    flock /tmp/feather-engine.lock python -m benchmarks.admission_burst --json results/admission_burst.json

``feather-serve --scheduler fcfs --admission slo --slo "ttft:2000 tpot:100"`` (the engine of
:data:`SERVER_ARGS`) receives ``--bursts`` (3) bursts of ``--burst-seconds`` (10) s at ``--rate`` (40)
requests/s, open loop (each request is sent at its scheduled time whatever the answers so far), with
``--quiet-seconds`` (20) of quiet after each. Every request is a streamed completion of a distinct
prompt of ``--prompt-tokens`` (3,600) random token ids, ``--max-tokens`` (16) tokens with
``ignore_eos``: 144,000 prompt tokens a second offered, about twenty times what one core prefills.
The engine: :data:`SERVER_ARGS` (a token budget of ``--max-num-batched-tokens``, 4,096, per step).
Configurations (``--replicas``, default ``1,2``):

* ``1``: the plain server, its engine threads on ``--cpu-cores`` (core 1,
  ``VLLM_CPU_OMP_THREADS_BIND``) and the rest of it (the API server and its admission middleware, the
  engine process's other threads) on ``--other-cores`` (core 0, with this client), as
  :class:`~feather_env.evaluation.server.LocalServer` pins a server in the other server benchmarks;
* ``2``: ``feather-serve --replicas 2`` (the proxy data plane), replica ``k`` on core ``k`` as the
  command pins them by default (its API server and engine alike), the proxy and this client unpinned
  and on core 0 respectively; a request one replica sheds is tried on the other before it is rejected.

Before the bursts, what the engines can prefill: each engine in turn (with ``--replicas 2``, each
replica's own server, behind the proxy's back) gets one warm-up request, then ``--probes`` (4) prompts
of the same length one at a time with ``max_tokens`` 1; its prefill tokens/s is the median of prompt
tokens / TTFT (client-side), and the configuration's is the sum over its engines.

Each request's outcome (:func:`classify`): ``completed`` (HTTP 200, a stream ending in ``[DONE]`` with
all its tokens), ``rejected`` (HTTP 503 with ``Retry-After`` and a body of type ``overloaded``),
``aborted`` (an SSE error event: the ``deadline`` rule), ``timeout`` (no answer within ``--timeout-s``,
120) and ``other`` (anything else: targets 0). Per configuration, beside the issue's targets:

* P50/P99 time to a 503 (client-side, from the send to the status line): <= 200 ms at P99;
* the fraction of the accepted requests (completed or aborted) whose TTFT met the SLO: >= 90%;
* accepted prompt tokens / (prefill tokens/s x (burst seconds + 2 s)), per burst and over all bursts:
  >= 70% (the engines stay busy on what they admit);
* ``/health`` polled every second throughout and once at the end: 200;
* the resident memory (RSS) of the server's processes before the bursts and after each (at the end
  of its quiet period): flat when the last after-burst reading is within 10% of the first.

Also recorded, without a target of the issue's: the accepted requests that met the TPOT SLO too (TPOT as
``vllm bench serve`` counts it: (latency - TTFT) / (tokens - 1)), which the ``slo`` rule does not
predict (it prices only the TTFT; every admitted prefill lengthens the steps of the requests already
decoding, to about a step of ``--max-num-batched-tokens`` tokens); per replica, its accepted requests
and their TTFT; how late the open loop sent (``max send lag``); and, from each burst's start to the
end of its quiet period, the share of the machine's CPU that processes other than this client and the
server used (``foreign``, the hypervisor's steal time included): on a shared machine, a burst run
under foreign load measures a slower engine than the admission rule's step-time profile describes.

A benchmark, not a test: about two and a half minutes of engine time per configuration, its start
included. The JSON holds every request as a CSV line (``requests``) and the first 20 that were neither
completed, rejected nor aborted in full (``others``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.sse import SSE_DONE, sse_events

#: The engine: a 512 MiB KV cache (~130k tokens), prompts up to 4,096 tokens, 64 sequences, a budget of
#: 4,096 tokens per step (the end-to-end admission test's ``SMALL_SERVER``).
SERVER_ARGS = ["--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "4096", "--max-num-seqs", "64",
               "--max-num-batched-tokens", "4096"]
MODEL = "tiny-llama"
OUTCOMES = ("completed", "rejected", "aborted", "timeout", "other")
#: The issue's targets.
TARGET_P99_503_MS = 200.0
TARGET_TTFT_MET = 0.90
TARGET_ADMITTED_WORK = 0.70
TARGET_RSS_DRIFT = 0.10
#: Seconds past a burst's end the engine is credited with (the ratio's denominator).
GRACE_S = 2.0


# ------------------------------------------------------------------------------------ bookkeeping


def classify(status: int | None, headers: Mapping[str, str], body: str, *, done: bool, error_event: bool,
             tokens: int, expected_tokens: int, timed_out: bool = False) -> str:
    """One request's outcome (module docstring) from what the client saw: the HTTP status (``None``:
    no answer), the response headers (lower-case names), the body of a non-200 answer, whether the
    stream ended with ``[DONE]``, whether it carried an SSE error event, the completion tokens its
    usage reported, and whether the client's timeout fired."""
    if timed_out:
        return "timeout"
    if status == 200:
        if error_event:
            return "aborted"
        return "completed" if done and tokens == expected_tokens else "other"
    if status == 503 and "retry-after" in headers:
        try:
            kind = json.loads(body)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            kind = None
        if kind == "overloaded":
            return "rejected"
    return "other"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (numpy's linear interpolation); ``None`` of nothing."""
    return float(np.percentile(values, q)) if len(values) else None


def tpot_s(r: Mapping[str, Any]) -> float | None:
    """A completed request's time per output token after the first, as ``vllm bench serve`` counts it:
    (latency - TTFT) / (output tokens - 1); ``None`` for fewer than two tokens or no TTFT."""
    if r.get("ttft_s") is None or r.get("e2e_s") is None or (r.get("tokens") or 0) < 2:
        return None
    return (r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1)


def summarize(results: Sequence[Mapping[str, Any]], *, bursts: int, burst_s: float, prefill_tps: float,
              ttft_slo_s: float, tpot_slo_s: float | None = None) -> dict[str, Any]:
    """The figures of one configuration from its requests (each a mapping with ``burst``, ``outcome``,
    ``prompt_tokens``, ``status_s`` (send to status line), ``ttft_s``, ``e2e_s`` and ``tokens``);
    ``prefill_tps``: what all its engines together prefill per second. ``slo_met``: the accepted requests
    that met the TTFT SLO and the TPOT SLO (:func:`tpot_s`; no target of the issue's)."""
    counts = Counter(r["outcome"] for r in results)
    to_503 = [1000.0 * r["status_s"] for r in results if r["outcome"] == "rejected"]
    accepted = [r for r in results if r["outcome"] in ("completed", "aborted")]
    met = [r for r in accepted if r["outcome"] == "completed" and r["ttft_s"] is not None
           and r["ttft_s"] <= ttft_slo_s]
    capacity = prefill_tps * (burst_s + GRACE_S)  # prompt tokens per burst
    per_burst = []
    for b in range(bursts):
        mine = [r for r in results if r["burst"] == b]
        tokens = sum(r["prompt_tokens"] for r in mine if r["outcome"] in ("completed", "aborted"))
        per_burst.append({"burst": b, "sent": len(mine),
                          "accepted": sum(r["outcome"] in ("completed", "aborted") for r in mine),
                          "accepted_prompt_tokens": tokens,
                          "admitted_work": tokens / capacity if capacity > 0 else None})
    total = sum(p["accepted_prompt_tokens"] for p in per_burst)
    ttfts = [r["ttft_s"] for r in accepted if r["ttft_s"] is not None]
    tpots = [t for r in accepted if r["outcome"] == "completed" and (t := tpot_s(r)) is not None]
    both = [r for r in met if tpot_slo_s is None or ((t := tpot_s(r)) is not None and t <= tpot_slo_s)]
    return {"sent": len(results), "counts": {k: counts.get(k, 0) for k in OUTCOMES},
            "p50_503_ms": percentile(to_503, 50), "p99_503_ms": percentile(to_503, 99),
            "max_503_ms": max(to_503) if to_503 else None,
            "accepted": len(accepted), "ttft_met": len(met),
            "ttft_met_frac": len(met) / len(accepted) if accepted else None,
            "p50_ttft_s": percentile(ttfts, 50), "p99_ttft_s": percentile(ttfts, 99),
            "p50_tpot_ms": None if not tpots else 1000.0 * np.percentile(tpots, 50),
            "p99_tpot_ms": None if not tpots else 1000.0 * np.percentile(tpots, 99),
            "slo_met": len(both), "slo_met_frac": len(both) / len(accepted) if accepted else None,
            "capacity_tokens_per_burst": capacity, "per_burst": per_burst,
            "admitted_work": total / (capacity * bursts) if capacity > 0 and bursts else None}


def by_replica(results: Sequence[Mapping[str, Any]], ttft_slo_s: float) -> dict[str, dict[str, Any]]:
    """Per replica that answered (``x-feather-replica``; ``-`` without the proxy): accepted requests, those
    that met the TTFT SLO, their median TTFT."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["outcome"] not in ("completed", "aborted"):
            continue
        key = str(r.get("replica") or "-").split("/")[0]
        mine = out.setdefault(key, {"accepted": 0, "ttft_met": 0, "ttfts": []})
        mine["accepted"] += 1
        if r["ttft_s"] is not None:
            mine["ttfts"].append(r["ttft_s"])
            mine["ttft_met"] += r["outcome"] == "completed" and r["ttft_s"] <= ttft_slo_s
    for mine in out.values():
        ttfts = mine.pop("ttfts")
        mine["p50_ttft_s"] = percentile(ttfts, 50)
    return out


def rss_flat(after: Sequence[float]) -> bool | None:
    """Memory flat: the last after-burst reading within :data:`TARGET_RSS_DRIFT` of the first."""
    if len(after) < 2:
        return None
    return abs(after[-1] - after[0]) <= TARGET_RSS_DRIFT * after[0]


def verdicts(s: Mapping[str, Any], *, healthy: bool, flat: bool | None) -> dict[str, bool | None]:
    """Each target met (True), missed (False) or not measurable (None)."""
    c = s["counts"]
    return {"nothing else": c["other"] == 0 and c["timeout"] == 0,
            "p99 time to 503": None if s["p99_503_ms"] is None else s["p99_503_ms"] <= TARGET_P99_503_MS,
            "ttft met": None if s["ttft_met_frac"] is None else s["ttft_met_frac"] >= TARGET_TTFT_MET,
            "admitted work": None if s["admitted_work"] is None
            else s["admitted_work"] >= TARGET_ADMITTED_WORK,
            "healthy": healthy, "memory flat": flat}


# ------------------------------------------------------------------------------------ the client


def prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` random token ids (the bundled model's vocabulary)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, tokens).tolist() for _ in range(count)]


def request_body(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def send_one(session: Any, url: str, body: bytes, *, prompt_tokens: int, max_tokens: int,
                   timeout_s: float) -> dict[str, Any]:
    """One streamed completion, timed from its send: the status line (``status_s``), the first token
    (``ttft_s``), the end (``e2e_s``), and its outcome (:func:`classify`)."""
    import aiohttp

    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "status": None, "status_s": None, "ttft_s": None,
                           "e2e_s": None, "tokens": 0, "reason": None, "retry_after": None, "replica": None}
    t0 = time.monotonic()
    headers: dict[str, str] = {}
    text, done, error_event, timed_out = "", False, False, False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"content-type": "application/json"}) as resp:
                out["status_s"] = time.monotonic() - t0
                out["status"] = resp.status
                headers = {k.lower(): v for k, v in resp.headers.items()}
                out["reason"] = headers.get("x-feather-admission")
                out["retry_after"] = headers.get("retry-after")
                out["replica"] = headers.get("x-feather-replica")
                if resp.status != 200:
                    text = await resp.text()
                else:
                    async for event in sse_events(resp.content):
                        if event is SSE_DONE:
                            done = True
                            break
                        if "error" in event:
                            error_event = True
                            text = json.dumps(event)
                            continue
                        if event.get("choices") and out["ttft_s"] is None:
                            out["ttft_s"] = time.monotonic() - t0
                        if event.get("usage"):
                            out["tokens"] = int(event["usage"].get("completion_tokens") or 0)
    except TimeoutError:
        timed_out = True
    except (aiohttp.ClientError, ValueError) as exc:
        text = f"{type(exc).__name__}: {exc}"
    out["e2e_s"] = time.monotonic() - t0
    out["outcome"] = classify(out["status"], headers, text, done=done, error_event=error_event,
                              tokens=out["tokens"], expected_tokens=max_tokens, timed_out=timed_out)
    if out["outcome"] == "other":
        out["detail"] = text[:300]
    return out


async def probe_prefill(session: Any, urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Each engine (``urls``: the server, or each replica's own server behind the proxy), one at a time:
    a warm-up request, then ``--probes`` prompts one at a time with ``max_tokens`` 1. Its prefill
    tokens/s is the median of prompt tokens / TTFT; ``prefill_tps`` is their sum."""
    ps = iter(prompts(len(urls) * (args.probes + 1), args.prompt_tokens, args.seed + 1_000_003))
    engines = []
    for url in urls:
        runs = []
        for k in range(args.probes + 1):
            p = next(ps)
            r = await send_one(session, url, request_body(p, 1), prompt_tokens=len(p), max_tokens=1,
                               timeout_s=args.timeout_s)
            if k == 0:
                continue  # the warm-up
            if r["outcome"] != "completed" or not r["ttft_s"]:
                raise RuntimeError(f"a prefill probe was not served: {r}")
            runs.append(r)
            await asyncio.sleep(0.5)
        rates = [r["prompt_tokens"] / r["ttft_s"] for r in runs]
        engines.append({"url": url, "ttft_s": [r["ttft_s"] for r in runs], "tokens_per_s": rates,
                        "prefill_tps": float(np.median(rates))})
    return {"engines": engines, "prefill_tps": sum(e["prefill_tps"] for e in engines)}


async def run_bursts(url: str, engine_urls: Sequence[str], args: argparse.Namespace, rss: Any,
                     cpu: Any) -> dict[str, Any]:
    """The probe, then the bursts (module docstring), ``/health`` polled every second throughout; ``rss()``
    and ``cpu()`` read the server's memory and the CPU seconds (:func:`cpu_seconds`) after each burst."""
    import aiohttp

    n = round(args.rate * args.burst_seconds)
    bodies = [[request_body(p, args.max_tokens) for p in prompts(n, args.prompt_tokens, args.seed + b)]
              for b in range(args.bursts)]
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no cap on connections
    no_limit = aiohttp.ClientTimeout(total=None)  # send_one applies --timeout-s
    async with aiohttp.ClientSession(connector=connector, timeout=no_limit) as session:
        probe = await probe_prefill(session, engine_urls, args)
        await asyncio.sleep(2.0)
        rss_before = await asyncio.to_thread(rss)
        cpu_last = await asyncio.to_thread(cpu)
        foreign = []
        health = {"polls": 0, "failures": 0}
        stop = asyncio.Event()

        async def poll_health() -> None:
            while not stop.is_set():
                health["polls"] += 1
                try:
                    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        health["failures"] += r.status != 200
                except (aiohttp.ClientError, TimeoutError):
                    health["failures"] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

        poller = asyncio.create_task(poll_health())
        results: list[dict[str, Any]] = []
        rss_after: list[dict[str, float]] = []
        send_lag = []

        async def one(b: int, k: int, body: bytes) -> None:
            r = await send_one(session, url, body, prompt_tokens=args.prompt_tokens,
                               max_tokens=args.max_tokens, timeout_s=args.timeout_s)
            results.append({"burst": b, "k": k, **r})

        for b in range(args.bursts):
            t0 = time.monotonic()
            tasks = []
            for k, body in enumerate(bodies[b]):
                due = t0 + k / args.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                send_lag.append(time.monotonic() - due)
                tasks.append(asyncio.create_task(one(b, k, body)))
            await asyncio.gather(*tasks)
            left = t0 + args.burst_seconds + args.quiet_seconds - time.monotonic()
            await asyncio.sleep(max(0.0, left))
            rss_after.append(await asyncio.to_thread(rss))
            cpu_now = await asyncio.to_thread(cpu)
            foreign.append(foreign_share(cpu_last, cpu_now))
            cpu_last = cpu_now
        stop.set()
        await poller
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                health_end = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            health_end = f"{type(exc).__name__}"
        metrics = ""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
                metrics = await r.text()
    results.sort(key=lambda r: (r["burst"], r["k"]))
    counters = [line for line in metrics.splitlines()
                if line.startswith(("feather_admission_", "feather_cluster_shed_total"))
                and 'replica="' not in line]
    return {"probe": probe, "results": results, "health": health, "health_end": health_end,
            "rss_mib_before": rss_before, "rss_mib_after": rss_after, "max_send_lag_s": max(send_lag),
            "foreign_cpu": foreign, "counters": counters}


# ------------------------------------------------------------------------------------ servers


def tree_rss_mib(pid: int) -> dict[str, float]:
    """Resident MiB of the process ``pid`` and its descendants (``total``) and their count (``processes``)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"total": 0.0, "processes": 0}
    out: dict[str, float] = {"total": 0.0, "processes": len(procs)}
    for p in procs:
        try:
            mib = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        out["total"] += mib
    return out


def server_args(args: argparse.Namespace) -> list[str]:
    """:data:`SERVER_ARGS` with ``--max-num-batched-tokens``'s value."""
    out = list(SERVER_ARGS)
    out[out.index("--max-num-batched-tokens") + 1] = str(args.max_num_batched_tokens)
    return out


def cpu_seconds(pid: int) -> dict[str, float]:
    """Now: the machine's busy and steal CPU seconds (``/proc/stat``), and those of this process and of
    the server's process tree (``mine``), with the wall clock."""
    import psutil

    busy = steal = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        ticks = os.sysconf("SC_CLK_TCK")
        busy = (sum(vals[:8]) - vals[3] - vals[4]) / ticks
        steal = vals[7] / ticks
    mine = sum(psutil.Process().cpu_times()[:2])
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            mine += sum(p.cpu_times()[:2])
    return {"t": time.monotonic(), "busy": busy, "steal": steal, "mine": mine}


def foreign_share(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Between two :func:`cpu_seconds`: the share of the machine's cores that other processes (``foreign``,
    steal included) and the hypervisor's other guests (``steal``) used."""
    capacity = (after["t"] - before["t"]) * (os.cpu_count() or 1)
    if capacity <= 0:
        return {"foreign": 0.0, "steal": 0.0}
    other = (after["busy"] - before["busy"]) - (after["mine"] - before["mine"])
    steal = max(0.0, after["steal"] - before["steal"])
    return {"foreign": max(0.0, other) / capacity, "steal": steal / capacity}


@contextlib.contextmanager
def server(replicas: int, args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, int, list[str]]]:
    """The configuration's server, up: ``(base URL, pid of the command, each engine's server URL)``."""
    admission = ["--admission", args.admission, "--slo", args.slo]
    if args.admission_profile:
        admission += ["--admission-profile", args.admission_profile]
    log_dir.mkdir(parents=True, exist_ok=True)
    if replicas == 1:
        from feather_env.engines.vllm_engine import EngineConfig
        from feather_env.evaluation.server import LocalServer

        engine = EngineConfig(kv_cache_gib=0.5, max_num_seqs=64, max_model_len=4096, cpu_cores=args.cpu_cores,
                              max_num_batched_tokens=args.max_num_batched_tokens)  # server_args()' engine
        with LocalServer(args.scheduler, engine, log_path=log_dir / "server.log",
                         other_cores=args.other_cores, extra_args=tuple(admission)) as s:
            assert s.proc is not None
            yield s.url, s.proc.pid, [s.url]
        return
    from benchmarks.cluster_server import ClusterServer

    reroute = {None: [], True: ["--reroute-shed"], False: ["--no-reroute-shed"]}[args.reroute_shed]
    with ClusterServer(replicas, "prefix", [*server_args(args), "--scheduler", args.scheduler, *admission,
                                            *reroute], log_path=log_dir / "server.log") as s:
        assert s.proc is not None
        yield s.url, s.proc.pid, [r["url"] for r in sorted(s.replica_info(), key=lambda r: r["rank"])]


def run_config(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    from scheduler_runtime.admission import parse_slos

    t_start = time.monotonic()
    with server(replicas, args, Path(args.out) / f"replicas-{replicas}") as (url, pid, engine_urls):
        started_s = time.monotonic() - t_start
        client_cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if args.client_cores and client_cores is not None:
            os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
        try:
            raw = asyncio.run(run_bursts(url, engine_urls, args, lambda: tree_rss_mib(pid),
                                         lambda: cpu_seconds(pid)))
        finally:
            if client_cores is not None:
                os.sched_setaffinity(0, client_cores)
    slos = parse_slos(args.slo)
    ttft_slo_s = slos["ttft"] / 1000.0
    tpot_slo_s = slos["tpot"] / 1000.0 if "tpot" in slos else None
    prefill_tps = raw["probe"]["prefill_tps"]
    summary = summarize(raw["results"], bursts=args.bursts, burst_s=args.burst_seconds,
                        prefill_tps=prefill_tps, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
    summary["by_replica"] = by_replica(raw["results"], ttft_slo_s)
    after = [r["total"] for r in raw["rss_mib_after"]]
    healthy = raw["health_end"] == 200 and raw["health"]["failures"] == 0
    flat = rss_flat(after)
    results = raw.pop("results")
    return {"replicas": replicas, "start_s": started_s, "wall_s": time.monotonic() - t_start, **raw,
            "summary": summary, "healthy": healthy, "memory_flat": flat,
            "verdicts": verdicts(summary, healthy=healthy, flat=flat),
            "others": [r for r in results if r["outcome"] in ("other", "timeout")][:20],
            "requests": requests_csv(results)}


#: The columns of :func:`requests_csv`.
REQUEST_COLUMNS = ("burst", "k", "outcome", "status", "status_s", "ttft_s", "e2e_s", "tokens", "reason",
                   "retry_after", "replica")


def parse_requests_csv(lines: Sequence[str], prompt_tokens: int) -> list[dict[str, Any]]:
    """:func:`requests_csv`'s lines back as request mappings (``prompt_tokens`` each): :func:`summarize`'s
    input."""
    header, *rows = lines
    columns = header.split(",")
    ints, floats = {"burst", "k", "status", "tokens"}, {"status_s", "ttft_s", "e2e_s"}
    out = []
    for row in rows:
        r: dict[str, Any] = {"prompt_tokens": prompt_tokens}
        for c, v in zip(columns, row.split(","), strict=True):
            r[c] = None if v == "" else int(v) if c in ints else float(v) if c in floats else v
        out.append(r)
    return out


def requests_csv(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every request as one CSV line of :data:`REQUEST_COLUMNS` (the header first; seconds to 0.1 ms,
    empty where not measured): the JSON stays small."""
    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.4f}" if isinstance(v, float) else str(v).replace(",", ";")

    return [",".join(REQUEST_COLUMNS), *(",".join(cell(r.get(c)) for c in REQUEST_COLUMNS) for r in results)]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _ok(v: bool | None) -> str:
    return "n/a" if v is None else ("met" if v else "MISSED")


def render(res: Mapping[str, Any]) -> str:
    """The printed table: one column per configuration, the targets beside."""
    runs = res["runs"]
    head = ["", *[f"--replicas {r['replicas']}" for r in runs], "target"]
    rows: list[list[Any]] = []

    def row(label: str, values: list[Any], target: str = "") -> None:
        rows.append([label, *values, target])

    row("prefill tokens/s per engine (median of probes)",
        [" + ".join(f"{e['prefill_tps']:,.0f}" for e in r["probe"]["engines"]) for r in runs])
    row("requests sent", [r["summary"]["sent"] for r in runs])
    for k in OUTCOMES:
        row(k, [r["summary"]["counts"][k] for r in runs], "0" if k in ("timeout", "other") else "")
    row("time to 503, P50 / P99 (ms)",
        [f"{_ms(r['summary']['p50_503_ms'])} / {_ms(r['summary']['p99_503_ms'])}" for r in runs],
        f"P99 <= {TARGET_P99_503_MS:.0f}")
    row("accepted that met TTFT", [f"{_pct(r['summary']['ttft_met_frac'])} ({r['summary']['ttft_met']}/"
                                   f"{r['summary']['accepted']})" for r in runs], f">= {TARGET_TTFT_MET:.0%}")
    row("... per replica: met / accepted (median TTFT s)",
        [", ".join(f"{k}: {v['ttft_met']}/{v['accepted']} ({v['p50_ttft_s'] or 0:.2f})"
                   for k, v in sorted(r["summary"]["by_replica"].items())) for r in runs])
    row("accepted that met TTFT and TPOT (no target)",
        [f"{_pct(r['summary'].get('slo_met_frac'))} ({r['summary'].get('slo_met')}/"
         f"{r['summary']['accepted']})" for r in runs])
    row("completed TPOT P50 / P99 (ms)",
        [f"{_ms(r['summary'].get('p50_tpot_ms'))} / {_ms(r['summary'].get('p99_tpot_ms'))}" for r in runs])
    row("accepted TTFT P50 / P99 (s)",
        [f"{r['summary']['p50_ttft_s'] or 0:.2f} / {r['summary']['p99_ttft_s'] or 0:.2f}" for r in runs])
    for b in range(res["bursts"]):
        row(f"accepted prompt tokens / prefillable, burst {b + 1}",
            [f"{_pct(r['summary']['per_burst'][b]['admitted_work'])} "
             f"({r['summary']['per_burst'][b]['accepted']} req)" for r in runs],
            f">= {TARGET_ADMITTED_WORK:.0%}")
    row("... over all bursts", [_pct(r["summary"]["admitted_work"]) for r in runs],
        f">= {TARGET_ADMITTED_WORK:.0%}")
    row("/health end (polls failed)", [f"{r['health_end']} ({r['health']['failures']}/{r['health']['polls']})"
                                       for r in runs], "200 (0)")
    row("server RSS MiB: before, after each burst",
        [", ".join(f"{x['total']:.0f}" for x in [r["rss_mib_before"], *r["rss_mib_after"]]) for r in runs],
        f"last within {TARGET_RSS_DRIFT:.0%} of first after")
    row("max send lag (s, open loop)", [f"{r['max_send_lag_s']:.3f}" for r in runs])
    row("other processes' CPU share, each burst",
        [", ".join(_pct(f["foreign"]) for f in r["foreign_cpu"]) for r in runs])
    lines = [f"{res['bursts']} bursts of {res['burst_seconds']:g} s at {res['rate']:g} req/s, "
             f"{res['prompt_tokens']:,}-token prompts, {res['max_tokens']} output tokens, streamed, "
             f"{res['quiet_seconds']:g} s quiet after each; `feather-serve --scheduler {res['scheduler']} "
             f"--admission {res['admission']} --slo \"{res['slo']}\""
             f"{' --reroute-shed' if res.get('reroute_shed') else ''}` ({measured(res)}; "
             f"`{res['command']}`):", "",
             format_table(head, rows), ""]
    for r in runs:
        v = r["verdicts"]
        lines.append(f"- `--replicas {r['replicas']}`: " + ", ".join(f"{k} {_ok(x)}" for k, x in v.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--rate", type=float, default=40.0, help="requests/s within a burst")
    p.add_argument("--burst-seconds", type=float, default=10.0)
    p.add_argument("--quiet-seconds", type=float, default=20.0)
    p.add_argument("--prompt-tokens", type=int, default=3600)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--probes", type=int, default=4, help="prefill probes (one at a time)")
    p.add_argument("--replicas", default="1,2", help="configurations: comma-separated replica counts")
    p.add_argument("--slo", default="ttft:2000 tpot:100")
    p.add_argument("--admission", default="slo", metavar="RULE")
    p.add_argument("--admission-profile", default=None, metavar="PATH",
                   help="feather-serve --admission-profile (default: feather-serve's)")
    p.add_argument("--scheduler", default="fcfs")
    p.add_argument("--reroute-shed", action=argparse.BooleanOptionalAction, default=None,
                   help="--replicas 2: feather-serve --reroute-shed (a request one replica sheds is tried on "
                        "the other) or --no-reroute-shed (its default: that rejection is the answer)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="the engine's token budget per step (the admission rule's too)")
    p.add_argument("--cpu-cores", default="1", help="--replicas 1: the engine threads' core(s)")
    p.add_argument("--other-cores", default="0", help="--replicas 1: the rest of the server's core(s)")
    p.add_argument("--client-cores", default="0", help="this client's core(s) while it drives ('': unpinned)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="the client's limit per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/admission-burst")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        configs = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        configs = []
    if not configs or min(configs) < 1:
        p.error("--replicas: comma-separated replica counts >= 1, e.g. 1,2")
    if args.bursts < 1 or args.rate <= 0 or args.burst_seconds <= 0 or args.quiet_seconds < 0 \
            or args.prompt_tokens < 1 or args.max_tokens < 1 or args.probes < 1 or args.timeout_s <= 0 \
            or args.max_num_batched_tokens < 1:
        p.error("--bursts, --rate, --burst-seconds, --prompt-tokens, --max-tokens, --probes, --timeout-s and "
                "--max-num-batched-tokens "
                "must be > 0 (--quiet-seconds >= 0)")
    from scheduler_runtime.admission import parse_slos

    try:
        if "ttft" not in parse_slos(args.slo):
            p.error("--slo needs a ttft SLO")
    except ValueError as exc:
        p.error(f"--slo: {exc}")
    t0 = time.monotonic()
    runs = []
    for n in configs:
        print(f"--replicas {n}: starting", flush=True)
        runs.append(run_config(n, args))
        print(f"--replicas {n}: done in {runs[-1]['wall_s']:.0f} s", flush=True)
    command = "python -m benchmarks.admission_burst " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                                     else argv))
    out = {"benchmark": "admission_burst", "command": command.strip(), "machine": machine_info(),
           "server_args": server_args(args), "bursts": args.bursts, "rate": args.rate,
           "burst_seconds": args.burst_seconds, "quiet_seconds": args.quiet_seconds,
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "slo": args.slo, "admission": args.admission, "admission_profile": args.admission_profile,
           "scheduler": args.scheduler, "timeout_s": args.timeout_s, "wall_s": time.monotonic() - t0,
           "reroute_shed": bool(args.reroute_shed),
           "targets": {"p99_503_ms": TARGET_P99_503_MS, "ttft_met": TARGET_TTFT_MET,
                       "admitted_work": TARGET_ADMITTED_WORK, "rss_drift": TARGET_RSS_DRIFT},
           "runs": runs}
    write_json(args.json, out)
    print(render(out))
    return out


if __name__ == "__main__":
    main()
