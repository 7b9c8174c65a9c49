"""Stand-in engine replicas: tiny OpenAI-compatible servers that answer at once, to measure front ends.

    python -m benchmarks.standin --port 9001 [--name a]

A stand-in answers ``POST /v1/completions`` and ``/v1/chat/completions`` with ``max_tokens`` (default
16) one-word tokens, whole or streamed as SSE chunks in vLLM's shape (``data: {...}``, the usage with
``stream_options.include_usage``, ``data: [DONE]``), and ``GET /health``, ``/v1/models``, ``/metrics``
(``vllm:request_success_total`` and ``vllm:prompt_tokens_total`` of what it served) and ``POST
/reset_prefix_cache``. It does no work, so what a front end in front of it costs is all there is to
measure (``benchmarks.frontend_overhead``), and the proxy's tests drive faults through it.

Faults, asked by the request body's ``"standin"`` object (a front end forwards bodies unchanged), each
naming stand-ins by their ``--name`` (default: the port): ``die_on`` (a list: exit at once, before
answering), ``hang_on`` (never answer), ``die_after`` (``{name: k}``: exit after ``k`` streamed chunks),
``delay_s`` (wait before answering), ``linger_s`` (hold a stream's end back after its ``[DONE]``).
``GET /standin/served`` lists the ``user`` field of every request it answered in full, so a test can check
that nothing is served twice. ``POST /standin/pace`` with ``{"factor": f}`` makes a paced stand-in ``f`` x
slower from then on (1: its own pace again), as a busy neighbour slows an engine.

Paced (``--prefill-ms-per-1k``, ``--decode-ms``, ``--kv-blocks``; :class:`StandIn`'s arguments), a
stand-in is an engine of a given speed and KV size, to feed a router that learns them: prefills are
served one at a time (``prefill_s_per_token`` x the prompt's tokens each, the others queueing), then
every further token of a request follows ``decode_s_per_token`` after the previous one; its ``/metrics``
is then vLLM's (:func:`vllm_metrics_text`: ``vllm:cache_config_info`` with ``num_gpu_blocks`` and
``block_size``, the queue, prefill and decode time histograms, the token counters), as
``scheduler_runtime.serving.vllm_metrics`` reads it.

Two ways to run them, one server class (:class:`StandIn`):

* as processes: :class:`StandIns` starts ``n`` of them on free ports (a context manager), and
  :func:`standin_command` is a replica command for :func:`scheduler_runtime.serving.replicas.replicas_for`
  (the front-end benchmarks and the proxy's tests);
* in this process: :class:`StandInWorkers` serves ``n`` of them from one event loop in a background
  thread and records what each received (:class:`Received`, the request's id read from a body field),
  optionally holding every request until it is released, so that a replay controls how many requests
  each worker has in flight (``benchmarks.router_fidelity``, ``tests/test_sglang_router.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from scheduler_runtime.serving.replicas import free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = "stand-in"


def standin_command(vllm_args: Sequence[str], port: int) -> list[str]:
    """A stand-in on ``port`` (``vllm_args`` ignored): the replica command of a proxy under test."""
    return [sys.executable, "-m", "benchmarks.standin", "--port", str(port)]


class StandIn:
    """The server (see the module docstring). ``before_answer``: awaited with each completion's body and
    the whole answer it is about to get (streamed or not), before anything is sent back (a recording and
    a gate: :class:`StandInWorkers`)."""

    def __init__(self, name: str, before_answer: Callable[[dict[str, Any], dict[str, Any]],
                                                          Awaitable[None]] | None = None, *,
                 prefill_s_per_token: float = 0.0, decode_s_per_token: float = 0.0,
                 kv_blocks: int | None = None, block_size: int = 16,
                 per_request_metrics: bool = False) -> None:
        self.name = name
        #: the usage chunk carries the request's wait before its prefill (vLLM's
        #: ``--enable-per-request-metrics``: ``metrics.queue_time_ms``)
        self.per_request_metrics = per_request_metrics
        self.served: list[Any] = []
        self.prompt_tokens = 0
        self._n = 0
        self._before_answer = before_answer
        self.prefill_s_per_token, self.decode_s_per_token = prefill_s_per_token, decode_s_per_token
        self.kv_blocks, self.block_size = kv_blocks, block_size
        self.paced = bool(prefill_s_per_token or decode_s_per_token or kv_blocks is not None)
        #: every paced sleep is multiplied by this (``POST /standin/pace {"factor": f}``: a slowdown)
        self.pace = 1.0
        #: vLLM's request-level sums of what it served (:func:`vllm_metrics_text`)
        self.sums: dict[str, float] = dict.fromkeys(("queue", "prefill", "decode", "generation"), 0.0)
        self._prefill_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/reset_prefix_cache", self.health)
        app.router.add_get("/standin/served", self.served_list)
        app.router.add_post("/standin/pace", self.set_pace)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": MODEL, "object": "model", "owned_by": "feather"}
        return web.json_response({"object": "list", "data": [model]})

    async def served_list(self, request: web.Request) -> web.Response:
        return web.json_response(self.served)

    async def set_pace(self, request: web.Request) -> web.Response:
        factor = float((await request.json()).get("factor", 1.0))
        if not factor > 0:
            return web.json_response({"error": "factor must be > 0"}, status=400)
        self.pace = factor
        return web.json_response({"pace": factor})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.paced:
            return web.Response(text=vllm_metrics_text(self), content_type="text/plain")
        labels = f'engine="0",model_name="{MODEL}"'
        text = ("# HELP vllm:request_success_total Count of successfully processed requests.\n"
                "# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{{labels},finished_reason="length"}} {len(self.served)}\n'
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
                "# TYPE vllm:prompt_tokens_total counter\n"
                f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens}\n")
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        control = body.get("standin") or {}
        if self.name in control.get("die_on", ()):
            os._exit(1)
        if self.name in control.get("hang_on", ()):
            await asyncio.sleep(3600)
        if control.get("delay_s"):
            await asyncio.sleep(float(control["delay_s"]))
        self._n += 1
        rid = f"cmpl-{self.name}-{self._n}"
        whole = answer(body, rid)
        if self._before_answer is not None:
            await self._before_answer(body, whole)
        if not body.get("stream"):
            if self.paced:
                first, _ = await self._prefill(body)
                await self._decode(body, first)
            self._served(body)
            return web.json_response(whole)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        first, queued = await self._prefill(body) if self.paced else (0.0, 0.0)
        die_after = (control.get("die_after") or {}).get(self.name)
        tokens = int(body.get("max_tokens") or 16)
        metrics = {"queue_time_ms": 1000.0 * queued} if self.per_request_metrics else None
        for i, event in enumerate(stream_events(body, rid, metrics)):
            if die_after is not None and i >= int(die_after):
                os._exit(1)
            if self.decode_s_per_token and 0 < i < tokens:
                await asyncio.sleep(self.decode_s_per_token * self.pace)
            await response.write(event.encode())
        if self.paced:
            self._decoded(body, first)
        if control.get("linger_s"):  # the stream's end held back after its [DONE]
            await asyncio.sleep(float(control["linger_s"]))
        await response.write_eof()
        self._served(body)
        return response

    async def _prefill(self, body: dict[str, Any]) -> tuple[float, float]:
        """Queue for the prefill (one at a time), serve it; returns when its first token is out, and the
        seconds it queued."""
        arrived = time.monotonic()
        async with self._prefill_lock:
            started = time.monotonic()
            await asyncio.sleep(self.prefill_s_per_token * _usage(body)["prompt_tokens"] * self.pace)
        first = time.monotonic()
        self.sums["queue"] += started - arrived
        self.sums["prefill"] += first - started
        return first, started - arrived

    async def _decode(self, body: dict[str, Any], first: float) -> None:
        for _ in range(int(body.get("max_tokens") or 16) - 1):
            await asyncio.sleep(self.decode_s_per_token * self.pace)
        self._decoded(body, first)

    def _decoded(self, body: dict[str, Any], first: float) -> None:
        self.sums["decode"] += time.monotonic() - first
        self.sums["generation"] += int(body.get("max_tokens") or 16)

    def _served(self, body: dict[str, Any]) -> None:
        self.served.append((body.get("standin") or {}).get("id", body.get("user")))
        self.prompt_tokens += _usage(body)["prompt_tokens"]


def vllm_metrics_text(standin: StandIn) -> str:
    """A paced stand-in's ``/metrics`` in vLLM 0.32's exposition (``vllm/v1/metrics/loggers.py``'s names
    and help; the histograms' buckets left out, their ``_sum`` and ``_count`` kept)."""
    labels = f'engine="0",model_name="{MODEL}"'
    n = float(len(standin.served))
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} 0.0"]
    for name, doc, value in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", standin.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", standin.sums["generation"]),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", 0.0)):
        lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                  f"{name}_total{{{labels}}} {float(value)}"]
    lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
              "# TYPE vllm:request_success_total counter",
              f'vllm:request_success_total{{{labels},finished_reason="length"}} {n}']
    for name, doc, total in (
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", standin.prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.",
             standin.sums["generation"]),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             standin.sums["queue"]),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             standin.sums["prefill"]),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
             standin.sums["decode"])):
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram",
                  f'{name}_bucket{{{labels},le="+Inf"}} {n}', f"{name}_count{{{labels}}} {n}",
                  f"{name}_sum{{{labels}}} {float(total)}"]
    if standin.kv_blocks is not None:
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  f'vllm:cache_config_info{{block_size="{standin.block_size}",cache_dtype="auto",engine="0",'
                  f'enable_prefix_caching="True",num_cpu_blocks="None",'
                  f'num_gpu_blocks="{standin.kv_blocks}"}} 1.0']
    return "\n".join(lines) + "\n"


def _usage(body: dict[str, Any]) -> dict[str, int]:
    prompt = body.get("prompt", "")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
    n = int(body.get("max_tokens") or 16)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def answer(body: dict[str, Any], rid: str) -> dict[str, Any]:
    """The whole answer to ``body``: ``max_tokens`` tokens ``"x "``, in vLLM's shape."""
    n = int(body.get("max_tokens") or 16)
    chat = "messages" in body
    message = {"message": {"role": "assistant", "content": "x " * n}} if chat else {"text": "x " * n}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, **message, "finish_reason": "length"}], "usage": _usage(body)}


def stream_events(body: dict[str, Any], rid: str, metrics: dict[str, float] | None = None) -> list[str]:
    """The streamed answer to ``body``: one SSE event per token, the usage if asked (with ``metrics``,
    vLLM's per-request metrics, where given), ``[DONE]``."""
    n = int(body.get("max_tokens") or 16)
    chat = "messages" in body
    kind = "chat.completion.chunk" if chat else "text_completion"
    delta = {"delta": {"content": "x "}} if chat else {"text": "x "}
    events = [json.dumps({"id": rid, "object": kind, "model": MODEL, "choices": [
        {"index": 0, **delta, "finish_reason": "length" if i == n - 1 else None}]}) for i in range(n)]
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"id": rid, "object": kind, "model": MODEL, "choices": [], "usage": _usage(body)}
        if metrics is not None:
            usage["metrics"] = metrics
        events.append(json.dumps(usage, separators=(",", ":")))
    return [f"data: {e}\n\n" for e in [*events, "[DONE]"]]


class StandIns:
    """``n`` stand-in processes on free ports of 127.0.0.1, started and waited for; killed on exit.
    ``args``: more of each one's command-line options (pacing, KV)."""

    def __init__(self, n: int, args: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> StandIns:
        self.procs = [subprocess.Popen([*standin_command((), p), *self.args], cwd=REPO) for p in self.ports]
        deadline = time.monotonic() + 60.0
        for url in self.urls:
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2.0):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        self.__exit__()
                        raise RuntimeError(f"stand-in {url} did not start") from None
                    time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@dataclass(frozen=True)
class Received:
    """One request a worker of :class:`StandInWorkers` received: the worker's index, the request's id
    (the body's ``id_field``, which the client sets), the body as it arrived and the answer it got."""

    worker: int
    request_id: str
    body: dict[str, Any]
    answer: dict[str, Any]


class _NoHttp2Probes(logging.Filter):
    """sglang-router opens each worker with an HTTP/2 preface (``PRI * HTTP/2.0``) before falling back
    to HTTP/1.1; aiohttp answers 400 and logs an error per connection: drop those records only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in record.getMessage() and not (
            record.exc_info and "PRI/Upgrade" in str(record.exc_info[1]))


class StandInWorkers:
    """``n`` stand-ins (:class:`StandIn`, named ``"0"``, ``"1"``, ...) on free loopback ports, served by
    one event loop in a background thread (a context manager). ``received`` lists what each got, in
    order of arrival; a request's id is its body's ``id_field``.

    ``hold``: a worker answers a request only once :meth:`release` is called with its id (so that a
    replay controls how many requests each worker has in flight); otherwise at once. ``paces``: each
    worker's pacing (:class:`StandIn`'s keyword arguments: speed and KV size), one per worker.
    :meth:`restart` replaces a worker by a fresh one on the same port (a restarted server).
    """

    def __init__(self, n: int, hold: bool = False, id_field: str = "feather_request_id",
                 paces: Sequence[dict[str, Any]] | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if paces is not None and len(paces) != n:
            raise ValueError(f"paces: {len(paces)} for {n} workers")
        self.paces = list(paces) if paces is not None else [{} for _ in range(n)]
        self.n = n
        self.hold = hold
        self.id_field = id_field
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.received: list[Received] = []
        self._arrived = threading.Condition()
        self._gates: dict[str, asyncio.Event] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stand-in-workers", daemon=True)
        self._runners: list[web.AppRunner] = []
        logging.getLogger("aiohttp.server").addFilter(_NoHttp2Probes())

    def _recorder(self, worker: int) -> Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]]:
        async def before_answer(body: dict[str, Any], whole: dict[str, Any]) -> None:
            rid = str(body.get(self.id_field, ""))
            gate = self._gates.setdefault(rid, asyncio.Event()) if self.hold else None
            with self._arrived:
                self.received.append(Received(worker, rid, body, whole))
                self._arrived.notify_all()
            if gate is not None:
                await gate.wait()
                del self._gates[rid]

        return before_answer

    async def _start(self) -> None:
        for i in range(self.n):
            self._runners.append(await self._serve(i))

    async def _serve(self, i: int) -> web.AppRunner:
        runner = web.AppRunner(StandIn(str(i), self._recorder(i), **self.paces[i]).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.ports[i]).start()
        return runner

    def restart(self, i: int) -> None:
        """Worker ``i`` stops and a fresh one (nothing served, counters at 0) serves on its port."""
        async def again() -> None:
            await self._runners[i].cleanup()
            self._runners[i] = await self._serve(i)

        asyncio.run_coroutine_threadsafe(again(), self._loop).result(timeout=30)

    async def _stop(self) -> None:
        for gate in self._gates.values():
            gate.set()
        for runner in self._runners:
            await runner.cleanup()

    def __enter__(self) -> StandInWorkers:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def worker_of(self, request_id: str, timeout: float = 0.0) -> int | None:
        """The worker that received ``request_id`` (the last one, if it came twice), waiting up to
        ``timeout`` seconds for it; ``None`` if none did."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for r in reversed(self.received):
                    if r.request_id == request_id:
                        return r.worker
                left = deadline - time.monotonic()
                if left <= 0 or not self._arrived.wait(left):
                    return None

    def release(self, request_id: str) -> None:
        """Let a held request be answered (``hold`` mode)."""
        async def open_gate() -> None:
            self._gates.setdefault(request_id, asyncio.Event()).set()

        asyncio.run_coroutine_threadsafe(open_gate(), self._loop).result(timeout=30)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.standin",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default=None, help="its name in fault requests (default: the port)")
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds before it listens")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=0.0,
                        help="paced: milliseconds of prefill per 1,000 prompt tokens (one prefill at a time)")
    parser.add_argument("--decode-ms", type=float, default=0.0, help="paced: milliseconds per further token")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="paced: the KV blocks its vLLM metrics publish (vllm:cache_config_info)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-per-request-metrics", action="store_true",
                        help="a stream's usage chunk carries metrics.queue_time_ms, as vLLM's does")
    args = parser.parse_args(argv)
    time.sleep(args.start_delay)  # an engine loading
    # sglang-router opens a worker with an HTTP/2 preface first, which aiohttp logs as an error
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    app = StandIn(args.name or str(args.port), prefill_s_per_token=args.prefill_ms_per_1k / 1e6,
                  decode_s_per_token=args.decode_ms / 1e3, kv_blocks=args.kv_blocks,
                  block_size=args.block_size, per_request_metrics=args.enable_per_request_metrics).app()
    try:
        import uvloop
    except ImportError:
        uvloop = None
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=uvloop.new_event_loop() if uvloop else None)


if __name__ == "__main__":
    main()
