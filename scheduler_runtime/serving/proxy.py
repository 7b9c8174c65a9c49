"""The lean data plane of ``feather-serve --replicas N``: N plain replica processes behind one asyncio proxy.

``feather-serve --replicas N`` on one machine (``--data-plane proxy``, the default without
``--ray-address``) starts N plain ``feather-serve`` engine processes, each on its own port of
127.0.0.1 (replica ``k`` pinned to the ``k``-th entry of ``--replica-cores``, its vLLM OpenMP threads
too), and serves one OpenAI-compatible endpoint from this process, an aiohttp server on uvloop:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` are routed by the
  :class:`~scheduler_runtime.router.PrefixAffinityRouter` (``--router prefix``, the class and shipped
  knobs the simulator runs, told each replica's KV tokens from the engine arguments it starts them
  with, for its cache model) or :class:`~scheduler_runtime.router.PowerOfTwoRouter` (``--router pow2``)
  on the requests each replica is serving, counted from the proxy's own forwarding; the body goes to
  the replica unchanged and the replica's bytes come back unchanged (an SSE stream chunk by chunk), with
  ``x-feather-replica: RANK/ID`` and ``x-feather-attempts``. Nothing is tokenized here: the prefix
  keys are cumulative hashes of fixed-size chunks of what the request carries (:func:`request_keys`):
  the Chunked Hash Tree's keys of a prompt of token ids, or hashes of 2,048-byte chunks of a text
  prompt or of the chat messages (~512 tokens at 4 bytes a token), so a replica tokenizes each
  request once, as a plain ``feather-serve`` does.
* ``GET /health`` (200 while at least one replica is healthy, with the counts), ``GET /v1/models``
  (a healthy replica's), ``GET /metrics`` (every replica's exposition with a ``replica`` label, their
  sums and the proxy's counters: :mod:`scheduler_runtime.serving.cluster_base`), ``GET /replicas`` (each
  replica's rank, process, port, cores and state) and ``POST /reset_prefix_cache`` (every replica;
  vLLM's dev mode). Any other path goes to the least loaded healthy replica as it is.

The learned router (``--router prefix-learned``:
:class:`~scheduler_runtime.learned_router.LearnedRouter`, told nothing per replica) is fed what it
learns from: every ``scrape_period_s`` (1 s; a 2 s limit, one scrape in flight per replica) each healthy
replica's ``/metrics``, read by :func:`~scheduler_runtime.serving.vllm_metrics.parse_vllm_metrics` (its
KV from ``vllm:cache_config_info``, vLLM's histograms and counters) and handed to ``router.scraped``;
each request under an id of the proxy's own (``routed``), its first token (``prefilled``: a stream's
first chunk, which vLLM sends with the first token) and its finish (``finished``, with its output
tokens: the stream's last ``usage`` block, else its events counted). A replica that restarts is
forgotten (``router.forget``): one of the proxy's own processes when it dies, a server behind a URL when
its counters go back. ``GET /replicas`` shows each replica's ``estimates``, ``GET /metrics`` the
``feather_router_replica_{prefill_tok_s,decode_tok_s,kv_tokens,samples}`` gauges and the scrapes.
``--replica-weights`` tells it the replicas' relative speeds and ``--kv-tokens A,B,...`` their KV
instead. A stream is relayed unchanged (no ``include_usage`` is added).

Supervision. A replica is routed to only once its ``/health`` answers 200. When its process exits,
its process group (its vLLM engine core) is killed, the router forgets the prefixes it held, and it
is started again on the same cores and port (after 1 s, doubling up to 30 s while it keeps dying
within a minute of starting); a replica whose ``/health`` fails three times in a row is killed and
restarted the same way. A replica that dies before it ever became healthy at start-up ends the
command (exit 1): its arguments are wrong.

Faults, the contract of :mod:`scheduler_runtime.serving.cluster`: a request whose replica is lost (its
connection refused or broken) before anything reached the client is retried once on another replica
(``x-feather-attempts: 2``); a stream is answered only once the replica's first chunk is in, so until
then the client has seen nothing. Otherwise a clear error: HTTP 503 with vLLM's error body, or,
mid-stream, an SSE ``data: {"error": ...}`` event and ``data: [DONE]``. Nothing is served twice: a retry
follows only a lost connection, and a replica that loses its client (a dead proxy connection) aborts
the request. A replica's own answer (an HTTP 400, say) is the client's answer, not retried.

Admission (``feather-serve --replicas N --admission RULE``, each replica's rule:
:mod:`scheduler_runtime.serving.admission_http`). A request a replica's rule sheds (its answer carries
``x-feather-admission``) gets that replica's rejection. With ``--reroute-shed`` (``reroute_shed``) it goes
instead to another replica it has not tried, with ``x-slo-ttft-ms`` set to what is left of its TTFT SLO
(the client's header or the replicas' ``--slo ttft``, less the time spent since it arrived); only when
every healthy replica sheds it, or no time is left, is the client answered with a rejection: the one that
lets it retry soonest, in the replicas' 503/429 form. Sheds are not replica errors: they count as the
outcome ``shed`` of ``feather_cluster_requests_total`` and in
``feather_cluster_shed_total{outcome="rerouted"|"rejected"}``. vLLM's own caps (``queued-reqs``,
``queued-tokens``) answer with vLLM's 503, which the proxy relays as it is.

``python -m scheduler_runtime.serving.proxy --worker-urls URL [URL ...]`` fronts replicas that are already
running (health-checked, never restarted), as ``sglang-router --worker-urls`` does (their KV size is
unknown there unless ``--kv-tokens`` gives it: without it the prefix router's cache model is off); the
stand-in benchmark (``benchmarks.frontend_overhead``) measures it so. See ``docs/cluster.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np
import xxhash
from aiohttp import web

from scheduler_runtime.learned_router import QUEUE_TIME as LEARNED_QUEUE_TIME
from scheduler_runtime.learned_router import QUEUE_TIME_MODES, LearnedRouter
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.router import PowerOfTwoRouter, PrefixAffinityRouter, PrefixHasher, ReplicaRouter
from scheduler_runtime.serving.admission_http import (
    ADMISSION_HEADER,
    TTFT_HEADER,
    AdmissionSettings,
    request_slos,
    sse_error,
)
from scheduler_runtime.serving.cluster_base import (
    ROUTER_CHOICES,
    ClusterConfig,
    FrontEndStats,
    error_body,
    estimates_exposition,
    replica_exposition,
    soonest_retry,
)
from scheduler_runtime.serving.replicas import (
    MAX_RESTART_DELAY_S,
    RESTART_DELAY_S,
    STABLE_S,
    Replica,
    replicas_for,
)
from scheduler_runtime.serving.vllm_metrics import parse_vllm_metrics, restarted
from scheduler_runtime.sse import (
    UsageStrip,
    ask_usage,
    ends_stream,
    stream_output_tokens,
    stream_queue_seconds,
)

__all__ = ["CHARS_PER_TOKEN", "SCRAPE_PERIOD_S", "SCRAPE_TIMEOUT_S", "ReplicaProxy", "main",
           "parse_per_worker", "proxy_for", "request_keys", "run_proxy"]

#: Bytes of text counted as one token: a text prompt's routing chunk is ``chunk_size`` x this many bytes.
CHARS_PER_TOKEN = 4
#: Seconds between health probes of a healthy replica, and of one that is starting or suspect.
HEALTH_PERIOD_S, PROBE_PERIOD_S = 5.0, 0.5
#: A probe's time limit, and the consecutive failed probes of a replica that served after which it
#: is killed and restarted (it is out of routing from the first): about Ray Serve's 30 s.
PROBE_TIMEOUT_S, HEALTH_FAILURES = 10.0, 3
#: Seconds between scrapes of a replica's ``/metrics`` for a router that observes the service, and a
#: scrape's time limit (at most one in flight per replica).
SCRAPE_PERIOD_S, SCRAPE_TIMEOUT_S = 1.0, 2.0
#: Request headers not forwarded to a replica, and response headers not passed back (hop by hop).
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                  "proxy-connection", "te", "trailer", "date", "server"})


# ------------------------------------------------------------------------------------ routing keys


def _text_keys(data: bytes, chunk_bytes: int) -> np.ndarray:
    """Cumulative xxh3 hashes of ``data``'s ``chunk_bytes``-byte chunks (``H[k]`` names chunks 0..k)."""
    keys, h = [], 0
    for start in range(0, len(data), chunk_bytes):
        h = xxhash.xxh3_64_intdigest(data[start:start + chunk_bytes], seed=h)
        keys.append(h)
    return np.array(keys, dtype=np.uint64)


def _message_text(messages: Sequence[Any]) -> bytes:
    """The chat messages as one byte string whose prefixes are the conversation's prefixes."""
    parts = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ValueError("each chat message must be a JSON object")
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text, anything else as JSON
            content = "".join(p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                              else json.dumps(p, sort_keys=True) for p in content)
        parts.append(f"{m.get('role')}\x1f{'' if content is None else content}\x1e")
    return "".join(parts).encode()


def request_keys(body: Mapping[str, Any], chat: bool,
                 hasher: PrefixHasher) -> tuple[np.ndarray | None, int | None]:
    """A request's routing key and length, read from its JSON body without tokenizing.

    Returns ``(hashes, tokens)``: a prompt of token ids gets the Chunked Hash Tree's cumulative chunk
    hashes (``hasher``) and its length; a text prompt or chat messages get cumulative hashes of
    ``hasher.chunk_size x CHARS_PER_TOKEN``-byte chunks of its UTF-8 bytes and its length in bytes /
    ``CHARS_PER_TOKEN``, so that the router's ``min_match`` compares like with like. A batch
    (``prompt`` a list of prompts) is keyed by its first prompt. ``(None, None)`` when there is nothing
    to key (the replica answers that request's errors).
    """
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None, None
        try:
            data = _message_text(messages)
        except ValueError:
            return None, None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt:
            try:
                return hasher.hash(prompt), len(prompt)
            except (ValueError, TypeError, OverflowError):
                return None, None
        if not isinstance(prompt, str) or not prompt:
            return None, None
        data = prompt.encode()
    return _text_keys(data, hasher.chunk_size * CHARS_PER_TOKEN), -(-len(data) // CHARS_PER_TOKEN)


class _ReplicaLost(Exception):
    """The replica's connection was refused or broke before anything reached the client."""


# ------------------------------------------------------------------------------------ the proxy


class ReplicaProxy:
    """The endpoint over ``replicas`` (see the module docstring). :meth:`serve` runs it until stopped.

    Args:
        replicas: the replicas (processes to supervise, or running servers).
        router: ``"prefix"`` or ``"pow2"``, or a :class:`ReplicaRouter` instance.
        chunk_size: tokens per routing chunk (the scheduler's CHT chunk size).
        max_ongoing_requests: requests one replica is sent at most (the rest wait in the proxy).
        load_factor, slack: the prefix router's load bound (its shipped defaults).
        kv_tokens: each replica's KV cache in tokens, for the prefix router's model of each replica's
            prefix cache (:func:`run_proxy` works it out from the engine arguments the replicas are
            started with, :attr:`ClusterConfig.kv_tokens`). ``None``: unknown, as for servers someone
            else runs (``--worker-urls`` without ``--kv-tokens``), and the cache model is off.
            A sequence: one per replica, in order (``--kv-tokens A,B,...``: replicas of unequal KV). The
            learned router (``"prefix-learned"``) reads each replica's from its ``/metrics`` instead,
            unless told them here.
        ttft_slo_ms: the replicas' admission TTFT SLO (``--slo ttft:MS``), lowered by the time spent
            when a request shed by one replica goes to another (``None``: only a client's
            ``x-slo-ttft-ms`` is carried so).
        reroute_shed: a request one replica's admission rule shed goes to another (``--reroute-shed``;
            ``False``, the default: that rejection is the answer).
        replica_weights: the learned router told each replica's relative speed (one per replica, 2.0:
            twice as fast as 1.0), instead of learning it (``--replica-weights``).
        scrape_period_s, scrape_timeout_s: how often each replica's ``/metrics`` is read for a router
            that observes the service (``router.scraped``), and a scrape's time limit.
        kv_guard: the learned router places a new document where it fits the replica's published KV
            (``--kv-guard``; :class:`LearnedRouter`'s ``kv_guard``).
        queue_time: what the learned router makes of each stream's reported wait before its first step
            (:class:`LearnedRouter`'s ``queue_time``, ``--queue-time``; unless ``"off"`` the proxy reads it,
            and the replicas need ``--enable-per-request-metrics``).
    """

    def __init__(self, replicas: Sequence[Replica], router: str | ReplicaRouter = "prefix", *,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, max_ongoing_requests: int = 1024,
                 load_factor: float = 20.0, slack: int = 2, kv_tokens: int | Sequence[int] | None = None,
                 ttft_slo_ms: float | None = None, replica_weights: Sequence[float] | None = None,
                 scrape_period_s: float = SCRAPE_PERIOD_S,
                 scrape_timeout_s: float = SCRAPE_TIMEOUT_S, kv_guard: bool = False,
                 queue_time: str = LEARNED_QUEUE_TIME, reroute_shed: bool = False) -> None:
        if not replicas:
            raise ValueError("the proxy needs at least one replica")
        if max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests}")
        if not (scrape_period_s > 0 and scrape_timeout_s > 0):
            raise ValueError("scrape_period_s and scrape_timeout_s must be > 0")
        self.replicas = list(replicas)
        names = [r.name for r in self.replicas]
        per_kv = _per_replica(kv_tokens, names, "kv_tokens", integer=True)
        weights = _per_replica(replica_weights, names, "replica_weights")
        if isinstance(router, ReplicaRouter):
            self.router = router
        elif router == "prefix":
            self.router = PrefixAffinityRouter(load_factor=load_factor, slack=slack, chunk_size=chunk_size,
                                               kv_tokens=max(per_kv.values()) if per_kv else None)
            if per_kv and len(set(per_kv.values())) > 1 and self.router.cached is not None:
                for name, kv in per_kv.items():  # unequal KV: each replica's part of the cache model
                    self.router.cached.set_limit(name, max(1, round(self.router.cache_factor * kv)))
        elif router == "prefix-learned":
            told = None
            if weights:
                slowdowns = {name: 1.0 / w for name, w in weights.items()}
                told = lambda replica, now: (slowdowns.get(replica, 1.0),) * 2  # noqa: E731
            self.router = LearnedRouter(load_factor=load_factor, slack=slack, chunk_size=chunk_size,
                                        told_kv_tokens=per_kv, told=told, kv_guard=kv_guard,
                                        queue_time=queue_time)
        elif router == "pow2":
            self.router = PowerOfTwoRouter()
        else:
            raise ValueError(f"router must be one of {list(ROUTER_CHOICES)}, got {router!r}")
        if weights and not isinstance(self.router, LearnedRouter):
            raise ValueError("replica_weights are read by the learned router (prefix-learned) only")
        if kv_guard and not isinstance(self.router, LearnedRouter):
            raise ValueError("kv_guard is a knob of the learned router (prefix-learned) only")
        self.router_name = self.router.name
        #: the router is told each request's life (routed with the proxy's id, first token, finish)
        self.tracks = bool(self.router.tracks_requests)
        #: ... and learns from the service: output tokens at each finish, each replica's /metrics
        self.observes = bool(self.router.observes_service)
        #: ... and each stream's reported wait before its first step (its usage chunk, asked for)
        self.reads_wait = self.observes and self.router.reads_queue_time
        self._ids = itertools.count(1)
        self.scrape_period_s, self.scrape_timeout_s = float(scrape_period_s), float(scrape_timeout_s)
        #: scrapes by outcome (ok, error, restarted: a new server behind the same URL), lines skipped
        self.scrapes: Counter[str] = Counter()
        self.scrape_skipped_lines = 0
        self._scraping: dict[str, asyncio.Task[None]] = {}
        self._last_scrape: dict[str, dict[str, Any]] = {}
        self.hasher = PrefixHasher(chunk_size)
        self.max_ongoing = int(max_ongoing_requests)
        self.stats = FrontEndStats()
        self.ttft_slo_ms = ttft_slo_ms
        self.reroute_shed = bool(reroute_shed)
        self.decision_seconds = 0.0
        self.decisions = 0
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
        self.session: aiohttp.ClientSession | None = None
        self._freed = asyncio.Event()
        self._wake = asyncio.Event()
        self.failed_start: str | None = None

    # -- the application --------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application (its start-up opens the client session and starts supervising)."""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/replicas", self.replica_list)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application) -> Any:
        # keep-alive under the replicas' own (uvicorn's 5 s), so the proxy never reuses a connection
        # the replica has just closed
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0))
        tasks = [asyncio.create_task(self.supervise())]
        if self.observes:
            tasks.append(asyncio.create_task(self.scrape_loop()))
        yield
        for task in [*tasks, *self._scraping.values()]:
            task.cancel()
        for task in [*tasks, *self._scraping.values()]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.session.close()

    async def serve(self, host: str, port: int, stop: asyncio.Event,
                    on_ready: Callable[[], None] | None = None) -> int:
        """Serve on ``host:port`` until ``stop`` is set (or a replica fails at start); stop the replicas.

        ``on_ready`` is called once every replica is healthy. Returns the exit status (1: a replica
        failed to start)."""
        runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await runner.setup()  # the supervisor starts the replicas
        try:
            await web.TCPSite(runner, host, port).start()
            while not (stop.is_set() or self.failed_start):
                if on_ready is not None and all(r.healthy for r in self.replicas):
                    on_ready()
                    on_ready = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
        finally:
            await runner.cleanup()
            await asyncio.to_thread(self.stop_replicas)
        return 1 if self.failed_start else 0

    def stop_replicas(self, grace_s: float = 20.0) -> None:
        """SIGTERM every replica's process group, SIGKILL what is left after ``grace_s``."""
        own = [r for r in self.replicas if r.process is not None]
        for r in own:
            r.kill(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in own:
            assert r.process is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            r.kill(signal.SIGKILL)  # its engine core too, whatever the server did
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.process.wait(timeout=5.0)

    # -- supervision ------------------------------------------------------------------------------
    async def supervise(self) -> None:
        """Start, probe and restart the replicas (module docstring), forever."""
        while True:
            now = time.monotonic()
            await asyncio.gather(*(self._check(r, now) for r in self.replicas))
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PROBE_PERIOD_S)

    async def _check(self, r: Replica, now: float) -> None:
        if r.process is not None and r.process.poll() is not None:
            self._died(r, now)
            return
        if r.command is not None and r.process is None:
            if now >= r.next_start:
                r.restarts += r.started_at > 0
                try:
                    r.start()
                except (OSError, subprocess.SubprocessError) as exc:  # the process was never made
                    self._not_started(r, now, f"{type(exc).__name__}: {exc}")
            return
        if r.healthy and now - r.last_probe < HEALTH_PERIOD_S:
            return
        r.last_probe = now
        ok = await self._probe(r)
        if ok:
            r.failures = 0
            if not r.healthy:
                r.healthy = r.ever_healthy = True
                self._freed.set()
            if now - r.started_at > STABLE_S:
                r.restart_delay = RESTART_DELAY_S
            return
        if r.healthy or r.ever_healthy:
            r.failures += 1
            r.healthy = False
            if r.failures >= HEALTH_FAILURES and r.process is not None:
                print(f"feather-serve: replica {r.rank} failed {r.failures} health checks: restarting it",
                      file=sys.stderr, flush=True)
                r.kill()

    def _not_started(self, r: Replica, now: float, why: str) -> None:
        """A replica whose process could not be made: the server's error on its first start (as a
        replica that exits before it served), else tried again after the restart delay."""
        if r.restarts == 0:
            self.failed_start = f"replica {r.rank} could not start ({why})"
            print(f"feather-serve: error: {self.failed_start}", file=sys.stderr, flush=True)
            r.next_start = math.inf
            return
        print(f"feather-serve: replica {r.rank} could not start ({why}): trying again in "
              f"{r.restart_delay:.0f} s", file=sys.stderr, flush=True)
        r.next_start = now + r.restart_delay
        r.restart_delay = min(MAX_RESTART_DELAY_S, 2 * r.restart_delay)

    def _died(self, r: Replica, now: float) -> None:
        assert r.process is not None
        code = r.process.returncode
        r.kill()  # the engine core, if the server died alone
        r.healthy = False
        self.router.forget(r.name)  # its estimates and cache model too; its next scrape brings its KV back
        self._last_scrape.pop(r.name, None)
        if not r.ever_healthy and r.restarts == 0:
            self.failed_start = f"replica {r.rank} exited with status {code} before it served"
            print(f"feather-serve: error: {self.failed_start}", file=sys.stderr, flush=True)
            return
        print(f"feather-serve: replica {r.rank} exited with status {code}: restarting it in "
              f"{r.restart_delay:.0f} s", file=sys.stderr, flush=True)
        r.process = None
        r.next_start = now + r.restart_delay
        if now - r.started_at < STABLE_S:
            r.restart_delay = min(MAX_RESTART_DELAY_S, 2 * r.restart_delay)
        else:
            r.restart_delay = RESTART_DELAY_S

    async def _probe(self, r: Replica) -> bool:
        assert self.session is not None
        try:
            limit = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with self.session.get(r.url + "/health", timeout=limit) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def _lost(self, r: Replica) -> None:
        """A connection to ``r`` failed: out of routing until a probe (now) says otherwise."""
        r.healthy = False
        r.last_probe = 0.0
        self._wake.set()

    # -- what the replicas publish ------------------------------------------------------------------
    async def scrape_loop(self) -> None:
        """Every ``scrape_period_s``, read each healthy replica's ``/metrics`` (at most one scrape in
        flight per replica) for a router that observes the service, forever."""
        while True:
            for r in self.replicas:
                if r.healthy and r.name not in self._scraping:
                    task = asyncio.create_task(self._scrape(r))
                    self._scraping[r.name] = task
                    task.add_done_callback(lambda _, name=r.name: self._scraping.pop(name, None))
            await asyncio.sleep(self.scrape_period_s)

    async def _scrape(self, r: Replica) -> None:
        """One scrape of ``r``: parsed (:func:`parse_vllm_metrics`), a new server behind its URL
        forgotten (:func:`restarted`), handed to ``router.scraped``. Nothing raises from here: a failed
        scrape is counted."""
        assert self.session is not None
        incarnation = r.replica_id
        try:
            limit = aiohttp.ClientTimeout(total=self.scrape_timeout_s)
            async with self.session.get(r.url + "/metrics", timeout=limit) as resp:
                body = await resp.read()
                if resp.status != 200:
                    self.scrapes["error"] += 1
                    return
            scrape = parse_vllm_metrics(body.decode("utf-8", errors="replace"))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            self.scrapes["error"] += 1
            return
        self.scrape_skipped_lines += scrape.skipped
        if not scrape.metrics or r.replica_id != incarnation:  # nothing of vLLM's, or a new process since
            self.scrapes["error"] += 1
            return
        previous = self._last_scrape.get(r.name)
        self._last_scrape[r.name] = scrape.metrics
        if previous is not None and restarted(previous, scrape.metrics):
            self.scrapes["restarted"] += 1
            self.router.forget(r.name)
        try:
            self.router.scraped(r.name, scrape.metrics)
        except Exception:  # noqa: BLE001 - a router's fault must not stop the scrapes
            self.scrapes["error"] += 1
            return
        self.scrapes["ok"] += 1

    def estimates(self) -> dict[str, dict[str, Any]]:
        """What the router has learned of each replica (``router.estimates()``; empty for a router that
        learns nothing)."""
        return self.router.estimates()

    # -- routing ----------------------------------------------------------------------------------
    async def _pick(self, hashes: np.ndarray | None, tokens: int | None, avoid: list[str],
                    request_id: str | None = None) -> Replica | None:
        """The replica for a request, counted in flight (and told the router as ``request_id`` where it
        tracks requests); ``None`` when no replica is healthy."""
        while True:
            healthy = {r.name: r for r in self.replicas if r.healthy and r.name not in avoid}
            if not healthy:
                return None
            loads = {name: r.in_flight for name, r in healthy.items()}
            t0 = time.perf_counter()
            name = self.router.choose(hashes, loads, avoid, tokens=tokens)
            if loads[name] >= self.max_ongoing:  # full: the least loaded one with room, or wait
                name = min(loads, key=lambda k: (loads[k], k))
            self.decision_seconds += time.perf_counter() - t0
            self.decisions += 1
            if loads[name] < self.max_ongoing:
                replica = healthy[name]
                replica.in_flight += 1
                if request_id is not None:
                    self.router.routed(hashes, name, tokens=tokens, request_id=request_id)
                else:
                    self.router.routed(hashes, name, tokens=tokens)
                return replica
            self._freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), PROBE_PERIOD_S)

    def _done(self, r: Replica, request_id: str | None = None, output_tokens: int | None = None) -> None:
        """``r`` is done with a request: no longer in flight; the router told its finish (with its
        output tokens where it observes the service and they are known)."""
        r.in_flight -= 1
        self._freed.set()
        if request_id is not None:
            self.router.finished(request_id, output_tokens=output_tokens)

    # -- requests ---------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.route(request, chat=True)

    async def route(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Route, forward and relay one completion request (module docstring for faults)."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return self._error("the request body is not JSON", 400, "BadRequestError", "bad_request")
        if not isinstance(body, dict):
            return self._error("the request body must be a JSON object", 400, "BadRequestError",
                               "bad_request")
        hashes, tokens = request_keys(body, chat, self.hasher)
        n = body.get("n")
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        asked = ask_usage(raw, body) if self.reads_wait else None  # its usage chunk carries its wait
        return await self.forward(request, raw if asked is None else asked, hashes, tokens,
                                  stream=bool(body.get("stream")), chat=chat, choices=choices,
                                  strip_usage=asked is not None)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other path: to the least loaded healthy replica, as it is."""
        return await self.forward(request, await request.read(), None, None, stream=False)

    async def forward(self, request: web.Request, raw: bytes, hashes: np.ndarray | None, tokens: int | None,
                      stream: bool, chat: bool = False, choices: int = 1,
                      strip_usage: bool = False) -> web.StreamResponse:
        """Send ``raw`` to a replica (one retry if it is lost before answering; with ``reroute_shed``, another
        replica after one that sheds it, with what is left of its TTFT SLO) and relay its answer (module
        docstring).
        ``chat`` and ``choices`` (the body's ``n``) say how a stream's events count its output tokens;
        ``strip_usage``: the proxy asked for the stream's usage chunk, which the client does not get."""
        assert self.session is not None
        arrived = time.monotonic()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        ttft_ms = self._ttft_slo_ms(headers)
        avoid: list[str] = []
        lost = 0
        shed: list[tuple[int, Mapping[str, str], bytes]] = []  # the replicas' rejections
        for attempt in itertools.count(1):
            rid = str(next(self._ids)) if self.tracks else None  # each attempt is a request of its own
            replica = await self._pick(hashes, tokens, avoid, rid)
            if replica is None:
                if shed:
                    return self._shed_answer(shed, attempt - 1)
                if not lost:
                    return self._error("no engine replica is healthy to serve this request", 503,
                                       "ServiceUnavailableError", "no_replica")
                return self._error("the engine replica serving this request failed before answering, and no "
                                   "other replica is healthy", 503, "ServiceUnavailableError", "replica_lost")
            if shed and ttft_ms is not None:  # what is left of its TTFT SLO
                left = ttft_ms - 1000.0 * (time.monotonic() - arrived)
                if left <= 0:
                    self._done(replica, rid)
                    return self._shed_answer(shed, attempt - 1)
                for name in [k for k in headers if k.lower() == TTFT_HEADER]:
                    del headers[name]
                headers[TTFT_HEADER] = f"{left:.0f}"
            upstream: aiohttp.ClientResponse | None = None
            try:
                try:
                    upstream = await self.session.request(request.method, replica.url + request.path_qs,
                                                          data=raw, headers=headers)
                    if stream and upstream.status == 200:
                        first = await upstream.content.readany()
                    else:
                        first = await upstream.read()
                except (aiohttp.ClientError, OSError) as exc:
                    raise _ReplicaLost(f"{type(exc).__name__}: {exc}") from exc
            except _ReplicaLost as exc:
                if upstream is not None:
                    upstream.close()
                self._done(replica, rid)
                self._lost(replica)
                if not lost:
                    lost += 1
                    self.stats.retries += 1
                    avoid.append(replica.name)
                    continue
                return self._error(f"the engine replica serving this request failed before answering, on the "
                                   f"retry too ({exc})", 503, "ServiceUnavailableError", "replica_lost")
            except BaseException:  # the client went away while waiting
                if upstream is not None:
                    upstream.close()
                self._done(replica, rid)
                raise
            if ADMISSION_HEADER in upstream.headers:  # shed by the replica's admission rule: try another
                upstream.release()
                self._done(replica, rid)
                self.stats.counts[(replica.name, "shed")] += 1
                shed.append((upstream.status, upstream.headers, first))
                avoid.append(replica.name)
                if not self.reroute_shed:
                    return self._shed_answer(shed, attempt)
                continue
            if shed:
                self.stats.shed["rerouted"] += 1
            return await self._relay(request, replica, upstream, first, attempt, stream, rid, chat, choices,
                                     strip_usage)
        raise AssertionError("unreachable")

    def _ttft_slo_ms(self, headers: Mapping[str, str]) -> float | None:
        """The request's TTFT SLO: its ``x-slo-ttft-ms`` (when well formed) or the replicas' own."""
        slos = [self.ttft_slo_ms] if self.ttft_slo_ms is not None else []
        with contextlib.suppress(ValueError):  # a malformed header: the replica answers it (400)
            slos += [request_slos({k.lower(): v for k, v in headers.items()}).get("ttft", math.inf)]
        return min(slos, default=None)

    def _shed_answer(self, shed: Sequence[tuple[int, Mapping[str, str], bytes]],
                     attempts: int) -> web.Response:
        """Every replica tried shed the request: the rejection that lets it retry soonest (else the last)."""
        status, headers, body = soonest_retry(shed)
        self.stats.shed["rejected"] += 1
        out = {k: v for k, v in headers.items() if k.lower() not in _HOP}
        out["x-feather-attempts"] = str(attempts)
        return web.Response(body=body, status=status, headers=out)

    async def _relay(self, request: web.Request, replica: Replica, upstream: aiohttp.ClientResponse,
                     first: bytes, attempt: int, stream: bool, rid: str | None = None, chat: bool = False,
                     choices: int = 1, strip_usage: bool = False) -> web.StreamResponse:
        """The replica's answer to the client: whole, or streamed on from its first chunk. A router that
        tracks requests is told ``rid``'s first token at a stream's first chunk (vLLM sends its first
        bytes with the first token) and its finish at the end, with its output tokens
        (:func:`stream_output_tokens`) where it observes the service, and just before, the wait the
        replica reported (:func:`stream_queue_seconds`) where it reads that. With ``strip_usage`` the
        usage chunk the proxy asked for is taken out of the stream (:class:`UsageStrip`)."""
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        headers["x-feather-replica"] = f"{replica.rank}/{replica.replica_id}"
        headers["x-feather-attempts"] = str(attempt)
        rank, outcome = replica.name, "ok" if upstream.status < 400 else "error_response"
        if not (stream and upstream.status == 200):
            upstream.release()
            self._done(replica, rid)  # no first token seen apart: no speed sample, only its finish
            self.stats.counts[(rank, outcome)] += 1
            return web.Response(body=first, status=upstream.status, headers=headers)
        if rid is not None and first:
            self.router.prefilled(rid)
        tally = rid is not None and self.observes
        events, newline, tail = first.count(b"\n\n"), first.endswith(b"\n"), [first]
        response = web.StreamResponse(status=upstream.status, headers=headers)
        # clean: relayed to the end; served: the client got the whole answer (its [DONE] included), even if
        # it then left before the chunked stream's end, as SSE clients do (a stream that taught nothing else)
        clean = served = ended = False
        strip = UsageStrip() if strip_usage else None
        try:
            await response.prepare(request)
            chunk = first
            while chunk:
                out = chunk if strip is None else strip.feed(chunk)
                if out:
                    await response.write(out)
                    ended = ends_stream(out)
                try:
                    chunk = await upstream.content.readany()
                    if tally and chunk:  # SSE events end with a blank line (JSON holds no raw newline)
                        events += chunk.count(b"\n\n") + (newline and chunk[:1] == b"\n")
                        newline = chunk[-1:] == b"\n"
                        tail.append(chunk)
                        if len(tail) > 3:
                            del tail[0]
                except (aiohttp.ClientError, OSError) as exc:
                    outcome = "failed_mid_stream"
                    self.stats.errors["replica_lost_mid_stream"] += 1
                    self._lost(replica)
                    message = (f"the engine replica {rank} serving this request failed mid-stream "
                               f"({type(exc).__name__}); not retried, as it had started answering")
                    rest = strip.flush() if strip is not None else b""
                    await response.write(rest + sse_error(error_body(message, 503, "ServiceUnavailableError"))
                                         .encode())
                    break
            if strip is not None and (rest := strip.flush()):
                await response.write(rest)
            ended = ended or outcome == "ok"
            await response.write_eof()
            clean = served = outcome == "ok"
        except asyncio.CancelledError:  # the client went away: so does the request
            served = ended and outcome == "ok"
            outcome = outcome if served else "client_gone"
            raise
        except ConnectionError:  # the same, seen while writing to it
            served = ended and outcome == "ok"
            outcome = outcome if served else "client_gone"
        finally:
            if clean:
                upstream.release()
            else:
                upstream.close()  # the replica sees its client gone and aborts the request
            output = None
            if tally and served:
                last = b"".join(tail)
                output = stream_output_tokens(events, last, chat, choices)
                if self.reads_wait and (waited := stream_queue_seconds(last)) is not None:
                    self.router.scheduled(rid, waited)  # type: ignore[arg-type]
            self._done(replica, rid, output)
            self.stats.counts[(rank, outcome)] += 1
        return response

    def _error(self, message: str, status: int, err_type: str, reason: str) -> web.Response:
        self.stats.errors[reason] += 1
        return web.json_response(error_body(message, status, err_type), status=status)

    # -- the rest of the API ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        healthy = sum(r.healthy for r in self.replicas)
        return web.json_response({"healthy_replicas": healthy, "replicas": len(self.replicas)},
                                 status=200 if healthy else 503)

    async def replica_list(self, request: web.Request) -> web.Response:
        if not self.observes:
            return web.json_response([r.info() for r in self.replicas])
        estimates = self.estimates()
        return web.json_response([{**r.info(), "estimates": estimates.get(r.name)} for r in self.replicas])

    async def _each(self, method: str, path: str) -> list[tuple[Replica, int, bytes] | None]:
        """``method path`` on every healthy replica: ``(replica, status, body)``, ``None`` where it failed."""
        assert self.session is not None

        async def one(r: Replica) -> tuple[Replica, int, bytes] | None:
            try:
                async with self.session.request(method, r.url + path,
                                                timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
                    return r, resp.status, await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                return None

        return list(await asyncio.gather(*(one(r) for r in self.replicas if r.healthy)))

    async def metrics_text(self) -> str:
        """Every healthy replica's exposition with its ``replica`` label, the sums, the proxy's counters."""
        results = await self._each("GET", "/metrics")
        answered = sorted((x[0].name, x[2].decode()) for x in results if x is not None and x[1] == 200)
        stats = {**self.router.state(), "decision_seconds": self.decision_seconds,
                 "decisions": self.decisions}
        states = {"healthy": sum(r.healthy for r in self.replicas),
                  "restarts": sum(r.restarts for r in self.replicas)}
        own = self.stats.exposition(self.router_name, len(self.replicas), len(answered), [stats], states)
        parts = [replica_exposition(answered), own]
        if self.observes:
            parts.append(estimates_exposition(self.estimates(), self.scrapes, self.scrape_skipped_lines))
        return "\n".join(p for p in parts if p) + "\n"

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=(await self.metrics_text()).encode(),
                            headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return self._error("POST /reset_prefix_cache needs VLLM_SERVER_DEV_MODE=1", 404, "NotFoundError",
                               "bad_request")
        results = await self._each("POST", "/reset_prefix_cache")
        ok = bool(results) and all(x is not None and x[1] == 200 for x in results)
        return web.Response(status=200 if ok else 503)


# ------------------------------------------------------------------------------------ running it


def _per_replica(values: float | Sequence[float] | None, names: Sequence[str], what: str,
                 integer: bool = False) -> dict[str, Any] | None:
    """``values`` per replica name: one for all, or one per replica in order (``None``: not given)."""
    if values is None:
        return None
    given = [values] * len(names) if isinstance(values, (int, float)) else list(values)
    if len(given) != len(names):
        raise ValueError(f"{what}: {len(given)} values for {len(names)} replicas (give one, or one per "
                         "replica)")
    if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in given):
        raise ValueError(f"{what} must be > 0, got {given}")
    if integer and any(int(v) != v or v < 1 for v in given):
        raise ValueError(f"{what} must be whole numbers >= 1, got {given}")
    return {name: (int(v) if integer else float(v)) for name, v in zip(names, given, strict=True)}


def parse_per_worker(text: str | None, what: str, integer: bool = False) -> list[float] | None:
    """A command line's ``A,B,...`` (or one value for every worker): the numbers, checked (> 0).

    Raises:
        ValueError: naming ``what``."""
    if text is None:
        return None
    try:
        values = [int(x) if integer else float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{what}: expected {'whole numbers' if integer else 'numbers'} separated by "
                         f"commas, got {text!r}") from None
    if any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"{what} must be > 0, got {text!r}")
    return values


def _run(proxy: ReplicaProxy, host: str, port: int, on_ready: Callable[[], None] | None) -> int:
    """Serve ``proxy`` on uvloop (when installed) until SIGTERM or SIGINT."""
    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await proxy.serve(host, port, stop, on_ready)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def proxy_for(config: ClusterConfig, replicas: Sequence[Replica]) -> ReplicaProxy:
    """The proxy of ``config`` over ``replicas`` (not serving yet): its router, chunk size, queue bound,
    and the prefix router's knobs, each replica's KV tokens included (:meth:`ClusterConfig.router_kwargs`)."""
    # the learned router is told nothing: it reads each replica's KV from its /metrics
    knobs = config.learned_router_kwargs() if config.router == "prefix-learned" else config.router_kwargs()
    admission = AdmissionSettings.from_env()  # feather-serve --admission RULE set it for the replicas
    return ReplicaProxy(replicas, config.router, max_ongoing_requests=config.max_ongoing_requests,
                        ttft_slo_ms=admission.slos.get("ttft") if admission is not None else None,
                        replica_weights=config.replica_weights, scrape_period_s=config.scrape_period_s,
                        reroute_shed=config.reroute_shed, **knobs)


def run_proxy(config: ClusterConfig) -> int:
    """``feather-serve --replicas N`` with the proxy data plane: start, serve until SIGTERM or SIGINT,
    stop every replica; returns the exit status."""
    started = time.monotonic()
    try:
        replicas = replicas_for(config)
    except ValueError as exc:
        print(f"feather-serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    proxy = proxy_for(config, replicas)

    def ready() -> None:
        print(f"feather-serve: {config.replicas} engine replicas behind the {config.router} router (proxy), "
              f"serving on http://{config.host}:{config.port} ({time.monotonic() - started:.0f} s to start)",
              flush=True)

    try:
        status = _run(proxy, config.host, config.port, ready)
    except OSError as exc:  # the port is taken, say
        print(f"feather-serve: error: the proxy failed: {exc}", file=sys.stderr, flush=True)
        proxy.stop_replicas()
        status = 1
    print(f"feather-serve: stopped ({time.monotonic() - started:.0f} s after start)", flush=True)
    return status


def main(argv: Sequence[str] | None = None, prog: str = "python -m scheduler_runtime.serving.proxy") -> int:
    """``python -m scheduler_runtime.serving.proxy --worker-urls URL ...`` (or ``feather-serve --worker-urls
    URL ...``, ``prog`` naming it in errors): the proxy over running servers."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("--worker-urls", nargs="+", required=True, help="the replicas, http://HOST:PORT")
    parser.add_argument("--router", choices=ROUTER_CHOICES, default="prefix")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--max-ongoing-requests", type=int, default=1024)
    parser.add_argument("--kv-tokens", default=None, metavar="TOKENS[,TOKENS...]",
                        help="the workers' KV caches in tokens, one for all or one per worker, for the "
                             "prefix routers' cache model (default: unknown: prefix has its model off, "
                             "prefix-learned reads each worker's vllm:cache_config_info)")
    parser.add_argument("--replica-weights", default=None, metavar="W[,W...]",
                        help="prefix-learned: each worker's relative speed (2 = twice as fast as 1), one per "
                             "worker, instead of learning it")
    parser.add_argument("--scrape-period", type=float, default=SCRAPE_PERIOD_S,
                        help="seconds between reads of each worker's /metrics (prefix-learned)")
    parser.add_argument("--kv-guard", action="store_true",
                        help="prefix-learned: a new document goes where it fits the worker's published KV "
                             "(workers of unequal KV)")
    parser.add_argument("--queue-time", choices=QUEUE_TIME_MODES, default=LEARNED_QUEUE_TIME,
                        help="prefix-learned: what each stream's reported wait at its worker before its "
                             "first step does (service: the prefill speeds are measured from the "
                             "first step; off: not read). Unless off "
                             "the workers need --enable-per-request-metrics, and a stream is asked for its "
                             "usage chunk, which its client gets only if it asked (default: %(default)s)")
    parser.add_argument("--reroute-shed", action=argparse.BooleanOptionalAction, default=False,
                        help="a request one worker's admission rule sheds (its answer carries "
                             "x-feather-admission) is tried on another worker (default: no, that rejection "
                             "is the answer)")
    args = parser.parse_args(argv)
    for url in args.worker_urls:
        if not url.startswith(("http://", "https://")):
            parser.error(f"--worker-urls: {url!r} is not http://HOST:PORT")
    replicas = [Replica(rank=k, url=url.rstrip("/")) for k, url in enumerate(args.worker_urls)]
    try:
        kv = parse_per_worker(args.kv_tokens, "--kv-tokens", integer=True)
        weights = parse_per_worker(args.replica_weights, "--replica-weights")
        proxy = ReplicaProxy(replicas, args.router, chunk_size=args.chunk_size,
                             max_ongoing_requests=args.max_ongoing_requests,
                             kv_tokens=kv[0] if kv is not None and len(kv) == 1 else kv,
                             replica_weights=weights[0] if weights and len(weights) == 1 else weights,
                             scrape_period_s=args.scrape_period, kv_guard=args.kv_guard,
                             queue_time=args.queue_time, reroute_shed=args.reroute_shed)
    except ValueError as exc:
        message = str(exc)
        for name in ("kv_tokens", "replica_weights", "kv_guard"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        parser.error(message)
    return _run(proxy, args.host, args.port, lambda: print(f"proxy: serving on {args.port}", flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
