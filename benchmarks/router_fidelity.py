"""How faithfully the simulator's peers route: the real SGLang and Ray Serve routers against their
reimplementations in :mod:`scheduler_runtime.router`, on one replayed request sequence.

    python -m benchmarks.router_fidelity --json results/router_fidelity.json

Stand-in workers (:class:`benchmarks.standin.StandInWorkers`: :mod:`benchmarks.standin`'s
OpenAI-compatible servers, in this process, on loopback; they answer ``/v1/completions`` at once
with a tiny valid completion, ``/health`` with 200, ``/get_model_info`` and ``/get_server_info``
with 404, and record which worker received which request) sit behind the real router:

* **SGLang**: ``python -m sglang_router.launch_router --policy cache_aware --worker-urls ...`` (the
  ``peers`` extra's sglang-router), at its default thresholds and at non-default ones, in front of 2
  and 4 workers;
* **Ray Serve**: a deployment of stand-in replicas whose ``request_router_class`` is Ray Serve LLM's
  ``PrefixCacheAffinityRouter`` (:func:`replay_ray`), called through its handle.

The same sequence of requests is replayed through the simulator's ``sglang-cache-aware`` and
``ray-prefix-affinity`` routers with the same knobs and the same loads. Through sglang-router the
replay keeps ``--concurrency`` requests in flight (8): the stand-ins hold every request until the
replay releases one (drawn at random among those in flight, by id, so the draw does not depend on
the routing) and the next is sent only once a worker has the previous one, so each worker's requests
in flight at every decision are known exactly and are what the simulated router is given (its load
is the requests in flight, as sglang-router's). Sent one at a time instead, sglang-router 0.3.2
sends everything to one worker (a low match goes to the least loaded, all are equal, the first
wins), which tells little. Through Ray the requests go one at a time (its default
``imbalanced_threshold`` is infinite: loads only break ties).

**Mapping text to tokens.** The workloads are token ids (:mod:`feather_env.workloads`); the real routers
see each prompt as the text it decodes to (the bundled tokenizer, as ``feather_env.workloads.export``
writes prompts for vLLM's own benchmark tool), and match it character by character in their radix
trees. The simulator's router sees the request as the cluster simulator gives it: the token ids'
chunked prefix hashes (:class:`~scheduler_runtime.router.PrefixHasher`, 512-token chunks) and the prompt's
length in tokens.

**Two figures per replay.** *Lockstep* (the headline): before each request the simulator's router is
asked where it would send it, then told where the real router sent it (as ``benchmarks.router_peers``
compares ours with a peer), so both hold the same history at every decision and one disagreement does
not carry over; a decision the simulator makes among equals (a tie its rule breaks by name, the real
one by hash-map order) counts as identical only when it names the same worker, and the share of such
ties is reported beside. *Free-running*: the simulator routes the whole sequence on its own, compared
with the real assignment under the best relabelling of the workers (the workers are interchangeable;
the real routers break the first tie, every tree empty, at random).

Workloads: the L-Eval cluster workload (documents with at most 8 questions each, shuffled:
:func:`feather_env.cluster_sim.distinct_documents`, as ``benchmarks.routing`` and
``benchmarks.router_peers`` build it) and the first requests of the Mooncake synthetic trace (the
``mooncake-synthetic`` scenario's 64-token blocks; random token ids, so its text is the decoded noise).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import measured
from benchmarks.cluster_server import free_port
from benchmarks.standin import Received, StandInWorkers  # noqa: F401 - Received: re-exported
from feather_env.cluster_sim import distinct_documents
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from feather_env.workloads.tokenizer import BOS_ID, load_tokenizer
from scheduler_runtime.router import PrefixHasher, ReplicaRouter, make_router

#: The fidelity the simulator's ``sglang-cache-aware`` must reach (share of identical decisions).
TARGET = 0.90
#: sglang-router 0.3.2's defaults (``RouterArgs``), and the non-default setting replayed beside them.
SGLANG_DEFAULT: dict[str, Any] = {"cache_threshold": 0.3, "balance_abs_threshold": 64,
                                  "balance_rel_threshold": 1.5}
SGLANG_OTHER: dict[str, Any] = {"cache_threshold": 0.7, "balance_abs_threshold": 4,
                                "balance_rel_threshold": 1.25}
#: Ray 2.60's ``PrefixCacheAffinityRouter`` defaults (``initialize_state``).
RAY_DEFAULT: dict[str, Any] = {"imbalanced_threshold": float("inf"), "match_rate_threshold": 0.1}
MOONCAKE_TRACE = "traces/mooncake/synthetic_trace.jsonl"
ROUTER_START_TIMEOUT_S = 60.0
#: The body field that carries a request's id to the stand-in workers (an extra field: sglang-router
#: passes unknown fields on). Not OpenAI's ``user``: sglang-router routes a request that has one by
#: ``"user:" + user`` instead of its prompt.
ID_FIELD = "feather_request_id"
#: The model the replay's requests name. sglang-router keeps one cache-aware tree per model, keyed by
#: the model id each worker reports (``/get_model_info``, ``/get_server_info``); a worker that answers
#: neither is model ``unknown``, and a request naming another model finds no tree: sglang-router 0.3.2
#: then sends it to the first worker, every time, without prefix matching (measured here).
MODEL = "unknown"


# ------------------------------------------------------------------------------------ the real routers


def _knob_flags(knobs: Mapping[str, Any]) -> list[str]:
    return [x for k, v in knobs.items() for x in (f"--{k.replace('_', '-')}", str(v))]


class SGLangRouter:
    """``python -m sglang_router.launch_router --policy cache_aware`` in front of ``worker_urls`` on a
    free loopback port (a context manager; SIGTERM on exit). ``knobs``: ``cache_threshold``,
    ``balance_abs_threshold``, ``balance_rel_threshold``, ``max_tree_size``, ``eviction_interval_secs``
    (omitted ones: the router's defaults)."""

    def __init__(self, worker_urls: Sequence[str], knobs: Mapping[str, Any] | None = None,
                 policy: str = "cache_aware") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = len(worker_urls)
        self.command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                        "--port", str(self.port), "--prometheus-port", str(free_port()),
                        "--prometheus-host", "127.0.0.1", "--policy", policy, "--log-level", "warn",
                        "--worker-startup-check-interval", "1", "--worker-urls", *worker_urls,
                        *_knob_flags(knobs or {})]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SGLangRouter:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}:\n{out[-4000:]}")
            try:  # up once every worker is registered and healthy (they are added in the background)
                with urllib.request.urlopen(self.url + "/workers", timeout=2.0) as resp:
                    listed = json.loads(resp.read()).get("workers", [])
                if len(listed) == self.workers and all(w.get("is_healthy") for w in listed):
                    return self
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > ROUTER_START_TIMEOUT_S:
                self.__exit__()
                raise RuntimeError(f"sglang-router did not list {self.workers} healthy workers in "
                                   f"{ROUTER_START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


def post_json(url: str, body: Mapping[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """POST ``body`` as JSON, the answer's JSON."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def request_body(request_id: str, prompt: str) -> dict[str, Any]:
    """The ``/v1/completions`` body the replay sends: the prompt as text, one token, the id in
    :data:`ID_FIELD`."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, ID_FIELD: request_id}


def worker_order(router_url: str, urls: Sequence[str]) -> list[int]:
    """The stand-in workers (indexes into ``urls``) in the order sglang-router lists them (``GET
    /workers``): the order its ties go by (the first of the least loaded)."""
    with urllib.request.urlopen(router_url + "/workers", timeout=10) as resp:
        listed = [w["url"] for w in json.loads(resp.read())["workers"]]
    return [urls.index(u) for u in listed]


def replay_sglang(prompts: Sequence[tuple[str, str]], workers: int, knobs: Mapping[str, Any],
                  concurrency: int = 8, seed: int = 0) -> tuple[list[int], list[list[str]], list[int]]:
    """Each ``(request id, text)`` through the real sglang-router (cache_aware, ``knobs``) in front of
    ``workers`` stand-in workers that hold every request until released, at most ``concurrency`` in
    flight: before a request is sent with ``concurrency`` in flight, one of them (drawn with ``seed``)
    is released and its answer awaited; a request counts as routed once a worker has it, so the
    requests each worker holds at every decision are known exactly (the router's load is its requests
    in flight). Which request is released depends on the ids in flight only, not on where they went.
    Returns ``(the worker of each request, the requests in flight before each one, the workers in the
    router's order)``."""
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    in_flight_seen: list[list[str]] = []
    with (StandInWorkers(workers, hold=True, id_field=ID_FIELD) as stand_ins,
          SGLangRouter(stand_ins.urls, knobs) as router):
        order = worker_order(router.url, stand_ins.urls)
        inflight: dict[str, tuple[threading.Thread, int]] = {}
        errors: list[BaseException] = []

        def send(rid: str, text: str) -> None:
            try:
                post_json(router.url + "/v1/completions", request_body(rid, text), timeout=120)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors.append(exc)

        def finish(rid: str) -> None:
            thread, _ = inflight.pop(rid)
            stand_ins.release(rid)
            thread.join(timeout=60)
            time.sleep(0.002)  # the router's load counter drops as the answer passes: let it settle

        for rid, text in prompts:
            while len(inflight) >= concurrency:
                finish(sorted(inflight)[int(rng.integers(len(inflight)))])
            in_flight_seen.append(sorted(inflight))
            thread = threading.Thread(target=send, args=(rid, text), daemon=True)
            thread.start()
            worker = stand_ins.worker_of(rid, timeout=60)
            if worker is None or errors:
                raise RuntimeError(f"request {rid} reached no stand-in worker: {errors[:1]}")
            inflight[rid] = (thread, worker)
            chosen.append(worker)
        for rid in list(inflight):
            finish(rid)
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]!r}")
    return chosen, in_flight_seen, order


# ------------------------------------------------------------------------------------ Ray Serve


@dataclass(frozen=True)
class _RayCall:
    """What the Ray replay passes to a replica: Ray's prefix router reads the ``prompt`` attribute."""

    request_id: str
    prompt: str


def replay_ray(prompts: Sequence[tuple[str, str]], workers: int) -> list[int]:
    """Each ``(request id, text)`` through a Ray Serve deployment of ``workers`` stand-in replicas whose
    request router is Ray Serve LLM's ``PrefixCacheAffinityRouter`` (its defaults), one call at a time
    through the deployment's handle: the replica (by rank) each was routed to. Starts a local Ray
    (1 CPU, no dashboard) and shuts it down."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    @serve.deployment(num_replicas=workers, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter))
    class StandInReplica:
        def __init__(self) -> None:
            self.rank = serve.get_replica_context().rank

        def __call__(self, call: _RayCall) -> tuple[str, int]:
            return call.request_id, int(getattr(self.rank, "rank", self.rank))

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=100 * 1024 * 1024)
    try:
        handle = serve.run(StandInReplica.bind(), name="fidelity", route_prefix=None)
        out = []
        for rid, text in prompts:
            got, rank = handle.remote(_RayCall(rid, text)).result(timeout_s=60)
            assert got == rid
            out.append(rank)
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


# ------------------------------------------------------------------------------------ the simulator


@dataclass(frozen=True)
class Replay:
    """A request sequence as both sides see it: the real routers' text and the simulator's key."""

    name: str
    request_ids: list[str]
    texts: list[str]
    hashes: list[np.ndarray]
    tokens: list[int]

    def prompts(self, limit: int | None = None) -> list[tuple[str, str]]:
        return list(zip(self.request_ids, self.texts, strict=True))[:limit]


def as_replay(workload: Workload, name: str, limit: int) -> Replay:
    """The first ``limit`` requests of ``workload``: each prompt decoded to text (without ``<s>``, as
    ``feather_env.workloads.export`` writes it), its chunked prefix hashes and its length in tokens."""
    tok, hasher = load_tokenizer(), PrefixHasher()
    requests = list(workload)[:limit]
    texts = []
    for r in requests:
        ids = [int(t) for t in r.prompt_token_ids]
        texts.append(tok.decode(ids[1:] if ids and ids[0] == BOS_ID else ids, skip_special_tokens=True))
    return Replay(name, [r.request_id for r in requests], texts,
                  [hasher.hash(r.prompt_token_ids) for r in requests], [r.prompt_len for r in requests])


def leval_replay(requests: int, seed: int = 0, data_dir: str | None = None) -> Replay:
    """The L-Eval cluster workload (documents of at most 8 questions, shuffled), ``requests`` long."""
    pool = load_workload(WorkloadConfig(kind="leval", data_dir=data_dir, max_prompt_tokens=8192))
    documents = -(-requests // 5)  # ~6 questions per document on average: enough requests
    workload = distinct_documents(pool, documents, seed=seed, max_per_group=8)
    while len(workload) < requests:
        documents *= 2
        workload = distinct_documents(pool, documents, seed=seed, max_per_group=8)
    return as_replay(workload, f"L-Eval, {documents} documents (seed {seed})", requests)


def mooncake_replay(requests: int, data_dir: str | None = None) -> Replay:
    """The first ``requests`` of the Mooncake synthetic trace, 64-token blocks (``mooncake-synthetic``)."""
    cfg = WorkloadConfig(kind="custom", path=MOONCAKE_TRACE, format="mooncake", block_tokens=64,
                         max_prompt_tokens=None, data_dir=data_dir)
    return as_replay(load_workload(cfg), "Mooncake synthetic trace, 64-token blocks", requests)


@dataclass(frozen=True)
class RealRun:
    """A replay through a real router: the worker of each request, the requests in flight before each
    one (empty lists: one at a time), and the workers in the order the router breaks ties by."""

    chosen: list[int]
    in_flight: list[list[str]]
    order: list[int]

    def names(self) -> list[str]:
        """The simulator's name of each worker: names sort in the real router's tie order."""
        return [f"w{self.order.index(i)}" for i in range(len(self.order))]


def _loads(names: Sequence[str], in_flight: Sequence[str], where: Mapping[str, str]) -> dict[str, int]:
    loads = dict.fromkeys(names, 0)
    for rid in in_flight:
        loads[where[rid]] += 1
    return loads


def lockstep(replay: Replay, real: RealRun, router: ReplicaRouter) -> dict[str, Any]:
    """Each decision of the simulated ``router`` with the real history and loads (module docstring)."""
    names = real.names()
    where: dict[str, str] = {}
    same = 0
    disagreements: list[int] = []
    for i, chosen in enumerate(real.chosen):
        h, n, rid = replay.hashes[i], replay.tokens[i], replay.request_ids[i]
        predicted = router.choose(h, _loads(names, real.in_flight[i], where), tokens=n)
        if predicted == names[chosen]:
            same += 1
        else:
            disagreements.append(i)
        router.routed(h, names[chosen], tokens=n)
        where[rid] = names[chosen]
    return {"identical": same / len(real.chosen), "decisions": len(real.chosen),
            "disagreements": disagreements[:50]}


def free_running(replay: Replay, real: RealRun, router: ReplicaRouter) -> float:
    """The simulated ``router`` alone on the sequence (its loads: the same requests in flight, where it
    sent them): the share of identical decisions under the best relabelling of the workers."""
    names = real.names()
    where: dict[str, str] = {}
    sim = []
    for i in range(len(real.chosen)):
        h, n, rid = replay.hashes[i], replay.tokens[i], replay.request_ids[i]
        r = router.choose(h, _loads(names, real.in_flight[i], where), tokens=n)
        router.routed(h, r, tokens=n)
        where[rid] = r
        sim.append(names.index(r))
    workers = len(names)
    best = max(sum(perm[s] == t for s, t in zip(sim, real.chosen, strict=True))
               for perm in itertools.permutations(range(workers)))
    return best / len(real.chosen)


def compare(replay: Replay, real: RealRun, make: Callable[[], ReplicaRouter]) -> dict[str, Any]:
    """Lockstep and free-running agreement of a fresh simulated router (``make()``) with ``real``."""
    return {**lockstep(replay, real, make()), "free_running": free_running(replay, real, make()),
            "real_per_worker": np.bincount(np.asarray(real.chosen), minlength=len(real.order)).tolist()}


# ------------------------------------------------------------------------------------ main


def _knobs(knobs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items())


def render(res: Mapping[str, Any]) -> str:
    """The fidelity table in markdown."""
    rows = [[r["router"], r["knobs"], r["workload"], r["workers"], r["concurrency"], r["decisions"],
             f"{100 * r['identical']:.1f}%", f"{100 * r['free_running']:.1f}%",
             "/".join(str(x) for x in r["real_per_worker"]), f"{r['wall_s']:.0f}"]
            for r in res["rows"]]
    table = format_table(["real router", "knobs", "workload", "workers", "concurrency", "requests",
                          "identical (lockstep)",
                          "identical (free-running, relabelled)", "real per worker", "wall s"], rows)
    return (f"The real routers against the simulator's reimplementations on the same sequence, stand-in "
            f"workers (requests in flight: the concurrency column); target for SGLang's cache_aware: >= "
            f"{100 * res['target']:.0f}% identical. {measured(res)}; `{res['command']}`.\n\n{table}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600, help="requests per replay (>= 500 for the figure)")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--seed", type=int, default=0, help="the L-Eval workload's draw")
    p.add_argument("--workloads", default="leval,mooncake")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests in flight through sglang-router (1: one at a time)")
    p.add_argument("--routers", default="sglang,sglang-other,ray")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    replays = {"leval": lambda: leval_replay(args.requests, args.seed, args.data_dir),
               "mooncake": lambda: mooncake_replay(args.requests, args.data_dir)}
    rows = []
    for wname in args.workloads.split(","):
        replay = replays[wname]()
        log(f"{replay.name}: {len(replay.texts)} requests, mean {np.mean(replay.tokens):.0f} tokens, "
            f"{np.mean([len(t) for t in replay.texts]):.0f} characters")
        for workers in (int(x) for x in args.workers.split(",")):
            for rname in args.routers.split(","):
                t0 = time.perf_counter()
                if rname == "ray":
                    knobs, sim_name, concurrency = RAY_DEFAULT, "ray-prefix-affinity", 1
                    chosen = replay_ray(replay.prompts(), workers)
                    real = RealRun(chosen, [[] for _ in chosen], list(range(workers)))
                else:
                    knobs = SGLANG_DEFAULT if rname == "sglang" else SGLANG_OTHER
                    sim_name, concurrency = "sglang-cache-aware", args.concurrency
                    real = RealRun(*replay_sglang(replay.prompts(), workers, knobs, concurrency, args.seed))
                row = compare(replay, real, lambda n=sim_name, k=knobs: make_router(n, **k))
                row.update(router=rname, sim_router=sim_name, knobs=_knobs(knobs), workload=replay.name,
                           concurrency=concurrency,
                           workers=workers, wall_s=time.perf_counter() - t0)
                rows.append(row)
                log(f"  {rname} x {workers}: {100 * row['identical']:.1f}% identical "
                    f"(free-running {100 * row['free_running']:.1f}%)")
    out = {"benchmark": "router_fidelity", "machine": machine_info(), "target": TARGET, "rows": rows,
           "command": "python -m benchmarks.router_fidelity " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "wall_s": time.perf_counter() - start}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
