"""What a front end costs on its own: CPU seconds per request and requests/s over stand-in replicas.

    taskset -c 0 python -m benchmarks.frontend_overhead --json results/frontend_overhead.json
    taskset -c 0 python -m benchmarks.frontend_overhead --front-ends proxy,proxy-learned --rounds 7 \
        --requests 2000 --json results/frontend_overhead_learned.json

Two stand-in replicas (:mod:`benchmarks.standin`: they answer at once, so the front end is all there
is to measure) behind each front end in turn:

* ``proxy``: ``feather-serve``'s proxy data plane
  (``python -m scheduler_runtime.serving.proxy --worker-urls``,
  the same :class:`~scheduler_runtime.serving.proxy.ReplicaProxy` that ``feather-serve --replicas N`` runs);
* ``proxy-learned``: the same with ``--router prefix-learned`` (ours learning each replica's speed and
  KV: it also reads each stand-in's ``/metrics``, vLLM's names, every second, and follows every
  stream's first token and finish);
* ``sglang-router``: ``sglang-router --policy cache_aware`` (the ``peers`` extra; skipped when
  ``sglang_router`` does not import);
* ``ray``: ``feather-serve``'s Ray Serve data plane (``--data-plane ray``): the ingress deployment
  (vLLM's renderer with the bundled model's tokenizer), the prefix ``RequestRouter`` and a
  ``DeploymentHandle`` to two stand-in engine deployments answering at once, a local Ray instance;
* ``direct``: no front end, each document's requests sent to one fixed stand-in (the floor).

The load is shaped as ``benchmarks.cluster_loopback``'s: 12 documents x questions, streamed
completions of 16 tokens (``stream_options.include_usage``; without it, ``--no-usage``: then
``prefix-learned``'s proxy asks each stream's usage chunk itself, for the wait the stand-in reports on
it, and strips it), 8 clients in a closed loop, the
documents' requests shuffled; the prompts are text (a document of 3,000 random words, ~17,000
characters, then a question of 30), as sglang-router 0.3.2 refuses a prompt of token ids (HTTP 422).
The front end's CPU seconds are its processes' user + system time over the measured requests (for
Ray: every process of the Ray instance but the two stand-in replicas'), from ``/proc``; requests/s
is the clients' rate with everything on one core (run it under ``taskset -c 0``: the clients, the
stand-ins and the front end share it, so the rate says how much of the core a front end leaves to
the rest). Affinity is the share of requests that reached their document's most frequent replica.
With ``--rounds N`` the front ends are measured N times, in the reverse order every other round, and
each one's median CPU per request is given with its median paired ratio to the first front end's in
the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import psutil

from benchmarks import measured
from benchmarks.standin import REPO, StandIns, answer, stream_events
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.serving.replicas import free_port

FRONT_ENDS = ("direct", "proxy", "proxy-learned", "sglang-router", "ray")
#: The stand-ins behind the proxies publish vLLM's metrics with a KV size (what prefix-learned reads).
#: They report each request's wait on its usage chunk, as vLLM's ``--enable-per-request-metrics`` does.
PROXY_STANDIN_ARGS = ("--kv-blocks", "4095", "--block-size", "128", "--enable-per-request-metrics")
DOCUMENTS, DOC_WORDS, QUESTION_WORDS, OUTPUT_TOKENS, CLIENTS = 12, 3000, 30, 16, 8
MODEL = "unknown"  # sglang-router keys its trees by the model a worker reports: none here (router_fidelity)


def workload(requests: int, seed: int = 0) -> list[tuple[int, str]]:
    """``(document, prompt)`` per request, documents in a shuffled order."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(5000)]

    def words(n: int) -> str:
        return " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), n))

    docs = [words(DOC_WORDS) for _ in range(DOCUMENTS)]
    order = rng.integers(0, DOCUMENTS, requests)
    return [(int(d), f"{docs[d]}\nQuestion: {words(QUESTION_WORDS)}?") for d in order]


async def drive(urls: Sequence[str], requests: list[tuple[int, str]], tag: str, usage: bool = True
                ) -> tuple[float, int, list[tuple[int, str]]]:
    """Send ``requests`` with :data:`CLIENTS` clients; ``urls``: one front end, or one URL per document
    slot (``direct``); ``usage``: the clients ask each stream's usage chunk. Returns (seconds, failures,
    (document, x-feather-replica) of each answer that names its replica)."""
    import aiohttp

    queue = list(enumerate(requests))
    failures = 0
    named: list[tuple[int, str]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        while queue:
            i, (doc, prompt) = queue.pop()
            body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                                    "stream": True, "standin": {"id": f"{tag}-{i}-d{doc}"}}
            if usage:
                body["stream_options"] = {"include_usage": True}
            url = urls[doc % len(urls)]
            async with session.post(url + "/v1/completions", json=body) as resp:
                text = await resp.text()
                if resp.status != 200 or not text.rstrip().endswith("data: [DONE]"):
                    failures += 1
                if "x-feather-replica" in resp.headers:
                    named.append((doc, resp.headers["x-feather-replica"].split("/")[0]))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return time.perf_counter() - t0, failures, named


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def tree(pid: int, exclude: Sequence[int] = ()) -> list[int]:
    """``pid`` and its descendants, less ``exclude``."""
    try:
        p = psutil.Process(pid)
        pids = [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []
    return [x for x in pids if x not in exclude]


def affinity(placed: Sequence[tuple[str, str]]) -> tuple[float, list[int]]:
    """The share of the ``(document, replica)`` placements on their document's most frequent replica,
    and the requests per replica."""
    per_doc: dict[str, Counter[str]] = {}
    for doc, replica in placed:
        per_doc.setdefault(doc, Counter())[replica] += 1
    share = sum(c.most_common(1)[0][1] for c in per_doc.values()) / len(placed) if placed else 0.0
    return share, [n for _, n in sorted(Counter(r for _, r in placed).items())]


def placements(standins: StandIns, tag: str) -> list[tuple[str, str]]:
    """``(document, stand-in)`` of each of ``tag``'s requests the stand-ins served."""
    out = []
    for k, url in enumerate(standins.urls):
        with urllib.request.urlopen(url + "/standin/served", timeout=10) as resp:
            out += [(x.rsplit("-", 1)[1], str(k)) for x in json.loads(resp.read())
                    if isinstance(x, str) and x.startswith(tag + "-")]
    return out


def wait_ready(url: str, timeout_s: float = 300.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until a streamed completion through ``url`` succeeds."""
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the front end exited with {proc.returncode}")
        try:
            request = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    with_group = proc.poll() is None
    if with_group:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def measure(front_end: str, requests: int, warmup: int, seed: int,
            usage: bool = True) -> dict[str, Any] | None:
    """One front end over two fresh stand-ins (``usage``: :func:`drive`'s)."""
    work = workload(requests + warmup, seed)
    with StandIns(2, PROXY_STANDIN_ARGS if front_end.startswith("proxy") else ()) as standins:
        proc: subprocess.Popen[bytes] | None = None
        exclude: list[int] = []
        try:
            if front_end == "direct":
                urls = standins.urls
            else:
                port = free_port()
                urls = [f"http://127.0.0.1:{port}"]
                if front_end.startswith("proxy"):
                    command = [sys.executable, "-m", "scheduler_runtime.serving.proxy", "--port", str(port),
                               "--router", "prefix-learned" if front_end == "proxy-learned" else "prefix",
                               "--worker-urls", *standins.urls]
                elif front_end == "sglang-router":
                    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--port", str(port), "--prometheus-port", str(free_port()),
                               "--prometheus-host", "127.0.0.1", "--policy", "cache_aware",
                               "--log-level", "warn", "--worker-startup-check-interval", "1",
                               "--worker-urls", *standins.urls]
                else:
                    command = [sys.executable, "-m", "benchmarks.frontend_overhead", "--serve-ray",
                               str(port)]
                proc = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                wait_ready(urls[0], proc=proc)
                if front_end == "ray":
                    with urllib.request.urlopen(urls[0] + "/replicas", timeout=30) as resp:
                        exclude = [r["pid"] for r in json.loads(resp.read())]
            asyncio.run(drive(urls, work[:warmup], "warm", usage))
            pids = tree(proc.pid, exclude) if proc is not None else []
            cpu0 = cpu_seconds(pids)
            seconds, failures, named = asyncio.run(drive(urls, work[warmup:], "run", usage))
            cpu = cpu_seconds(pids) - cpu0 if proc is not None else 0.0
            # Ray's stand-ins are its own deployment's: their placements come from the answers' headers
            share, counts = affinity([(str(d), r) for d, r in named] if front_end == "ray"
                                     else placements(standins, "run"))
        finally:
            if proc is not None:
                stop(proc)
    return {"front_end": front_end, "requests": requests, "failures": failures, "seconds": seconds,
            "requests_per_s": requests / seconds, "cpu_s": cpu, "cpu_ms_per_request": 1000 * cpu / requests,
            "processes_measured": len(pids), "affinity": share, "per_replica": counts}


# ------------------------------------------------------------------------------------ Ray stand-ins


class StandInEngine:
    """A Ray Serve engine deployment answering at once
    (:class:`scheduler_runtime.serving.cluster.EngineReplica`'s
    methods, :mod:`benchmarks.standin`'s answers)."""

    def __init__(self, vllm_args: Sequence[str], replica_cores: Sequence[str] | None = None) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.rank = int(context.rank.rank)
        self.replica_id = context.replica_id.unique_id
        self.n = 0

    def info(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "rank": self.rank, "pid": os.getpid()}

    async def generate(self, kind: str, body: dict[str, Any], rendered: Any, route: Any = None,
                       avoid: Any = None, rid: Any = None, tokens: Any = None) -> Any:
        yield {"replica": self.replica_id, "rank": self.rank}
        self.n += 1
        rid = f"cmpl-{self.rank}-{self.n}"
        if not body.get("stream"):
            yield {"status": 200, "json": answer(body, rid)}
            return
        yield {"status": 200, "stream": True}
        for event in stream_events(body, rid):
            yield event

    async def metrics(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "rank": self.rank, "text": ""}

    async def reset_prefix_cache(self) -> bool:
        return True

    async def check_health(self) -> None:
        return None


def serve_ray(port: int) -> None:
    """``--serve-ray PORT``: the Ray Serve data plane over two :class:`StandInEngine` replicas, until
    SIGTERM."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from ray import serve

    from scheduler_runtime.serving.cluster import APP_NAME, ClusterConfig, _start_ray, build_app
    from scheduler_runtime.serving.serve import vllm_arguments

    config = ClusterConfig(replicas=2, data_plane="ray", vllm_args=tuple(vllm_arguments([])[0]), port=port,
                           replica_cpus=0.5)
    _start_ray(config)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config, engine_cls=StandInEngine), name=APP_NAME, route_prefix="/", blocking=False)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    serve.shutdown()


# ------------------------------------------------------------------------------------ report


def summary(payload: dict[str, Any]) -> list[list[Any]]:
    """Per front end over the rounds: its median CPU ms per request, and the median over the rounds of
    its CPU per request over the first front end's in the same round (the paired ratio)."""
    runs = payload["runs"]
    first = runs[0]["front_end"] if runs else None
    base = {r.get("round", 0): r["cpu_ms_per_request"] for r in runs if r["front_end"] == first}
    rows = []
    for name in dict.fromkeys(r["front_end"] for r in runs):
        mine = [r for r in runs if r["front_end"] == name]
        ratios = [r["cpu_ms_per_request"] / base[r.get("round", 0)] for r in mine
                  if base.get(r.get("round", 0))]
        paired = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        rows.append([name, len(mine), statistics.median(r["cpu_ms_per_request"] for r in mine), paired])
    return rows


def render(payload: dict[str, Any]) -> str:
    rows = [[r.get("round", 0) + 1, r["front_end"], r["requests"], r["failures"], r["requests_per_s"],
             r["cpu_ms_per_request"], f"{100 * r['affinity']:.1f}%", "/".join(map(str, r["per_replica"]))]
            for r in payload["runs"]]
    skipped = "".join(f"\n\n{name}: not measured ({why})" for name, why in payload.get("skipped", {}).items())
    out = (f"Front ends over two stand-in replicas, {payload['clients']} clients, streamed completions of "
           f"{OUTPUT_TOKENS} tokens on prompts of {DOC_WORDS + QUESTION_WORDS} words ({measured(payload)}; "
           f"`{payload['command']}`):\n\n"
           + format_table(["round", "front end", "requests", "failed", "req/s", "CPU ms / request",
                           "affinity", "per replica"], rows) + skipped)
    if payload.get("rounds", 1) > 1 and payload["runs"]:
        out += (f"\n\nOver {payload['rounds']} rounds, the order reversed every other round (medians; the "
                f"paired ratio is to `{payload['runs'][0]['front_end']}` in the same round, with its "
                "range):\n\n"
                + format_table(["front end", "rounds", "CPU ms / request", "paired ratio"], summary(payload)))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontend_overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--front-ends", default=",".join(FRONT_ENDS), help=f"some of {','.join(FRONT_ENDS)}")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the front ends this many times, the order reversed every other round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-usage", action="store_true",
                        help="the clients do not ask each stream's usage chunk (prefix-learned's proxy then "
                             "asks it, to read the reported wait, and strips it)")
    parser.add_argument("--serve-ray", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_ray is not None:
        serve_ray(args.serve_ray)
        return
    chosen = [f.strip() for f in args.front_ends.split(",") if f.strip()]
    unknown = sorted(set(chosen) - set(FRONT_ENDS))
    if unknown:
        parser.error(f"--front-ends: unknown {unknown}; choose from {list(FRONT_ENDS)}")
    if args.requests < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--requests and --rounds must be >= 1 and --warmup >= 0")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = f"taskset -c {','.join(map(str, cpus))} " if len(cpus) < (os.cpu_count() or len(cpus)) else ""
    payload: dict[str, Any] = {"benchmark": "frontend_overhead",
                               "command": f"{pinned}python -m benchmarks.frontend_overhead "
                                          + shlex.join(argv if argv is not None else sys.argv[1:]),
                               "machine": machine_info(), "clients": CLIENTS, "affinity_cpus": cpus,
                               "rounds": args.rounds, "runs": [], "skipped": {}}
    if "sglang-router" in chosen:
        try:
            import sglang_router  # noqa: F401
        except ImportError as exc:
            payload["skipped"]["sglang-router"] = f"sglang_router does not import: {exc}"
            chosen.remove("sglang-router")
    for r in range(args.rounds):
        for front_end in (chosen if r % 2 == 0 else chosen[::-1]):
            print(f"round {r + 1}: {front_end} ...", flush=True)
            run = measure(front_end, args.requests, args.warmup, args.seed, not args.no_usage)
            if run is not None:
                payload["runs"].append({**run, "round": r})
    print(render(payload))
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
