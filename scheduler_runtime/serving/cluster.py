"""``feather-serve --replicas N --data-plane ray``: one OpenAI endpoint over N vLLM engines on Ray Serve.

The data plane for several machines (``--ray-address``); on one machine ``feather-serve --replicas N``
runs the lean proxy of :mod:`scheduler_runtime.serving.proxy` instead, with the same options, router, fault
contract and ``/metrics`` (:mod:`scheduler_runtime.serving.cluster_base`).

One Ray Serve application (``feather``) of two deployments:

* ``FeatherIngress`` (one replica, no CPU reserved) serves the HTTP API: ``/v1/completions`` and
  ``/v1/chat/completions`` (streaming too), ``/v1/models``, ``/health``, ``/metrics`` and, with
  ``VLLM_SERVER_DEV_MODE=1``, ``POST /reset_prefix_cache``. It renders each request with vLLM's own
  renderer (the chat template and the tokenizer run here, once), keys it by the chunked cumulative
  prefix hashes the scheduler's Chunked Hash Tree uses (:class:`~scheduler_runtime.router.PrefixHasher`)
  and hands the rendered token ids to an engine replica through a Ray Serve ``DeploymentHandle``.
* ``FeatherEngine`` (N replicas): vLLM's ``AsyncLLM`` built from the very arguments ``feather-serve``
  gives vLLM's API server (so every ``feather-serve`` option, ``--scheduler`` included, applies to
  every replica), with vLLM's OpenAI serving classes answering the pre-rendered request: the
  responses, streamed or not, are vLLM's. On a CPU machine replica ``k`` of a node (its Ray Serve
  ``local_rank``) is pinned to the ``k``-th entry of ``--replica-cores`` (default: one core each), its
  engine's OpenMP threads too (``VLLM_CPU_OMP_THREADS_BIND``).

The router (the engine deployment's ``RequestRouter``, which runs in the ingress process):

* ``--router prefix`` (default): :class:`~scheduler_runtime.serving.ray_router.PrefixRequestRouter`, a Ray
  Serve ``RequestRouter`` whose ``choose_replicas`` asks
  :class:`~scheduler_runtime.router.PrefixAffinityRouter` (the code the simulator runs) with the
  request's prefix hashes and the requests each replica is serving (counted from the router's own
  routed/completed callbacks); Ray then sends the request to that
  replica unless its queue is full (``--max-ongoing-requests``), else to the least loaded other one;
* ``--router prefix-learned``: :class:`~scheduler_runtime.serving.ray_router.LearnedRequestRouter`, the
  same around :class:`~scheduler_runtime.learned_router.LearnedRouter`, which learns each replica's speed
  and KV size: each engine replica publishes its parsed ``/metrics`` as its Ray routing stats
  (:meth:`EngineReplica.record_routing_stats`, every ``--scrape-period`` seconds, Ray's
  ``request_routing_stats_period_s``), and the ingress tells the router each request's first token and
  end with its output tokens, from the response it relays (as the proxy does);
* ``--router pow2``: Ray Serve's default router (power of two choices on queue lengths), untouched;
* ``--router ray-prefix-affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (its defaults), the
  field's router to measure ours against; it reads the prompt text from the call (:class:`TextBody`).

Faults. When an engine replica's process dies, Ray Serve starts a new one (a new vLLM engine: its
``__init__`` runs again on the freed core) and routes to it only once it is healthy; until then the
router no longer lists the dead replica. A request it held gets one retry on another replica if
nothing had been streamed to the client yet (the ingress waits for the first streamed chunk before
it answers, and the retry avoids the dead replica); otherwise a clear error: HTTP 503 with vLLM's
error body, or, mid-stream, an SSE ``error`` event and ``[DONE]``. Nothing is served twice: a retry
happens only when the first replica died, and its generation died with it. Response headers say
which replica answered (``x-feather-replica``) and after how many attempts (``x-feather-attempts``).

Admission (``--admission slo|deadline``, :mod:`scheduler_runtime.admission`): each engine replica holds
an :class:`~scheduler_runtime.serving.admission_http.AdmissionGate` of the settings ``feather-serve`` puts
in ``FEATHER_ADMISSION`` (forwarded to the deployments), and decides before its engine sees the request,
on the token ids the ingress rendered; a rejection comes back as the replica's whole answer with its
``x-feather-admission`` header, which the ingress answers (``--reroute-shed``: it tries a replica it has
not tried yet, with what is left of the request's TTFT SLO, ``slos``, answering the soonest-retry rejection
when every replica shed it). The
``deadline`` rule aborts a request whose first token has not come in time: an SSE error event, or an HTTP
504. Sheds count as ``feather_cluster_shed_total``, not as errors.

Metrics (``/metrics``): every engine replica's own exposition (vLLM's ``vllm:*`` series and Feather's
``feather_scheduler_*``), each sample with a ``replica`` label (the replica's Ray Serve rank), so a
client that sums a metric over its samples (``evaluate.py --endpoint``) gets the cluster's total; the
sums themselves under ``cluster:<name>``; and the ingress's own ``feather_cluster_*`` counters
(requests by replica and outcome, retries, errors, the prefix router's decisions).

Ray runs locally unless ``--ray-address`` names a running cluster: a local instance with
``num_cpus`` = replicas x ``--replica-cpus``, no dashboard, a 200 MB object store and every Ray
process on the loopback address (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine
mode). SIGTERM or SIGINT shuts the application and the local Ray instance down (engines included).
See ``docs/cluster.md``.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

try:
    from ray import serve
except ImportError as exc:  # the optional extra
    raise ImportError("feather-serve --replicas needs Ray Serve: pip install 'feather-toolkit[cluster]' "
                      f"(ray[serve]==2.60.*; never ray[llm], which replaces vLLM): {exc}") from exc

from scheduler_runtime.router import PrefixHasher
from scheduler_runtime.serving import cluster_base
from scheduler_runtime.serving.admission_http import (
    ADMISSION_HEADER,
    DEADLINE_STATUS,
    AdmissionGate,
    AdmissionSettings,
    DeadlineAborted,
    deadline_error,
    rejection_response,
    request_slos,
    sse_error,
)
from scheduler_runtime.serving.admission_http import ENV_VAR as ADMISSION_ENV
from scheduler_runtime.serving.cluster_base import (
    ROUTER_CHOICES,
    ClusterConfig,
    FrontEndStats,
    core_binding,
    error_body,
    estimates_exposition,
    replica_exposition,
    soonest_retry,
)
from scheduler_runtime.serving.ray_router import LearnedRequestRouter, PrefixRequestRouter
from scheduler_runtime.serving.vllm_metrics import parse_vllm_metrics
from scheduler_runtime.sse import (
    DONE_EVENT,
    UsageStrip,
    ends_stream,
    needs_usage,
    stream_output_tokens,
    stream_queue_seconds,
)

__all__ = ["APP_NAME", "ROUTER_CHOICES", "ClusterConfig", "EngineReplica", "FeatherIngress", "TextBody",
           "LearnedRequestRouter", "PrefixRequestRouter",
           "build_app", "run_cluster"]

APP_NAME = "feather"
ENGINE_DEPLOYMENT = "FeatherEngine"
INGRESS_DEPLOYMENT = "FeatherIngress"
#: Environment variables the deployments get from the command's environment (when set there).
FORWARDED_ENV = ("VLLM_SERVER_DEV_MODE", "TOKENIZERS_PARALLELISM", "VLLM_LOGGING_LEVEL", "HF_HUB_OFFLINE",
                 ADMISSION_ENV)
#: Exceptions of a request whose replica died (by name: ray is an optional dependency).
_REPLICA_LOST = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError",
                 "DeploymentUnavailableError")


# ------------------------------------------------------------------------------------ vLLM glue


def _vllm_namespace(vllm_args: Sequence[str]) -> Any:
    """vLLM's API-server argument namespace for ``vllm_args`` (its own parser and checks)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="feather-serve"))
    args = parser.parse_args(list(vllm_args))
    validate_parsed_serve_args(args)
    return args


#: The request the engine replica is answering, rendered by the ingress (read by the patched
#: ``render_*_request`` of vLLM's serving objects, within the request's own task).
_RENDERED: contextvars.ContextVar[Any] = contextvars.ContextVar("feather_rendered")


def _prerendered(serving: Any) -> None:
    """Make vLLM's serving object take the ingress's rendering instead of rendering again."""

    async def render(request: Any) -> Any:
        error = await serving._check_model(request)
        if error is not None:
            return error
        serving._preflight(getattr(request, "n", None) or 1)
        return _RENDERED.get()

    if hasattr(serving, "render_completion_request"):
        serving.render_completion_request = render
    if hasattr(serving, "render_chat_request"):
        serving.render_chat_request = render


def _prompt_ids(kind: str, rendered: Any) -> list[int] | None:
    """The first prompt's token ids of a request the ingress rendered (a chat's rendering is
    ``(conversation, inputs)``, a completion's its inputs; ``None``: none to read)."""
    inputs = rendered[1] if kind == "chat" and isinstance(rendered, (list, tuple)) and len(rendered) > 1 \
        else rendered
    first = inputs[0] if isinstance(inputs, (list, tuple)) and inputs else None
    ids = first.get("prompt_token_ids") if isinstance(first, dict) else None
    return list(ids) if ids else None


def _bind_cores(spec: str) -> None:
    cores, env = core_binding(spec)
    os.environ.update(env)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def _session_dir() -> str | None:
    """Ray's session folder on this node (``/tmp/ray/session_*``), where a replica's Prometheus files
    go (they stay there, beside the logs, when a replica is killed); ``None``: the system's temp folder."""
    import ray

    try:
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        path = os.path.join(context.get_temp_dir(), context.get_session_name())
    except Exception:  # noqa: BLE001 - a Ray without these: the default folder
        return None
    return path if os.path.isdir(path) else None


def _metrics_text(multiproc_dir: str, own_registry: bool) -> str:
    """This process's and its engine core's Prometheus exposition."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=multiproc_dir)
    text = generate_latest(registry).decode()
    if own_registry:  # prometheus_client was imported before the directory was set: in-process values
        text = generate_latest(REGISTRY).decode() + text
    return text


class EngineReplica:
    """One engine replica (the ``FeatherEngine`` deployment's class; see the module docstring)."""

    async def __init__(self, vllm_args: Sequence[str], replica_cores: Sequence[str] | None = None) -> None:
        context = serve.get_replica_context()
        self.rank = int(context.rank.rank)
        self.local_rank = int(context.rank.local_rank)
        self.replica_id = context.replica_id.unique_id
        self.cores = None
        self._stats_seq = 0
        if replica_cores:
            self.cores = replica_cores[self.local_rank % len(replica_cores)]
            _bind_cores(self.cores)
        # Feather's counters live in the engine-core process: share a Prometheus directory with it
        self._own_registry = "prometheus_client" in sys.modules
        self._prom_dir = tempfile.mkdtemp(prefix=f"feather-replica{self.rank}-prometheus-",
                                          dir=_session_dir())
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._prom_dir
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

        args = _vllm_namespace(vllm_args)
        self._engine_context = build_async_engine_client(args)
        self.engine = await self._engine_context.__aenter__()
        self.state = State()
        await init_app_state(self.engine, self.state, args, await self.engine.get_supported_tasks())
        for name in ("openai_serving_completion", "openai_serving_chat"):
            serving = getattr(self.state, name, None)
            if serving is not None:
                _prerendered(serving)
        # feather-serve --admission slo|deadline: this replica's rule (its counters in its Prometheus folder)
        settings = AdmissionSettings.from_env()
        self.admission = AdmissionGate(settings) if settings is not None else None

    def info(self) -> dict[str, Any]:
        """Who this replica is (its process, rank and cores)."""
        return {"replica_id": self.replica_id, "rank": self.rank, "local_rank": self.local_rank,
                "pid": os.getpid(), "cores": self.cores,
                "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}

    async def generate(self, kind: str, body: dict[str, Any], rendered: Any, route: Any = None,
                       avoid: Any = None, rid: str | None = None, tokens: int | None = None,
                       slos: dict[str, float] | None = None) -> AsyncIterator[Any]:
        """Serve one request; yields ``{"replica": ...}``, then ``{"status": S, "json": ...}`` (a whole
        answer; with ``"headers"`` when this replica's admission rule rejected it) or ``{"status":
        200, "stream": True}`` followed by vLLM's SSE strings. ``slos``: the request's own SLOs in
        milliseconds (its ``x-slo-*-ms`` headers, what is left of its TTFT after another replica shed
        it). ``route``, ``avoid``, ``rid`` and ``tokens`` are for the router (it reads the call's
        arguments)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        yield {"replica": self.replica_id, "rank": self.rank}
        stream = bool(body.get("stream"))
        gate, key = None, ""  # the gate of an admitted request
        ids = _prompt_ids(kind, rendered)
        if self.admission is not None and ids:
            key, decision = self.admission.admit([ids], slos or {})
            if not decision.admit:
                status, headers, payload = rejection_response(decision, self.admission.settings.status)
                yield {"status": status, "json": json.loads(payload),
                       "headers": {k.decode(): v.decode() for k, v in headers}}
                return
            gate = self.admission
            gate.begin(key, stream)
        result: Any = None
        try:
            if kind == "chat":
                request = ChatCompletionRequest.model_validate(body)
                create = self.state.openai_serving_chat.create_chat_completion
            else:
                request = CompletionRequest.model_validate(body)
                create = self.state.openai_serving_completion.create_completion
            token = _RENDERED.set(rendered)
            try:  # a task made now (the deadline rule's) copies the rendered request's context
                call = create(request, None)
                result = await (gate.run(key, call) if gate is not None else call)
            finally:
                _RENDERED.reset(token)
            if isinstance(result, ErrorResponse):
                if gate is not None:
                    gate.first_byte(key)
                yield {"status": result.error.code, "json": result.model_dump()}
            elif hasattr(result, "__aiter__"):
                first = None
                if gate is not None:  # the deadline rule may abort it until then
                    first = await gate.run(key, anext(result, None))
                    gate.first_byte(key)
                yield {"status": 200, "stream": True}
                if first is not None:
                    yield first
                async for chunk in result:
                    yield chunk
            else:
                if gate is not None:
                    gate.first_byte(key)
                yield {"status": 200, "json": result.model_dump()}
        except DeadlineAborted:
            if hasattr(result, "aclose"):  # vLLM aborts the request in its engine
                await result.aclose()
            if stream:
                yield {"status": 200, "stream": True}
                yield sse_error(deadline_error())
            else:
                yield {"status": DEADLINE_STATUS, "json": deadline_error()}
        finally:
            if gate is not None:
                gate.end(key)

    async def metrics(self) -> dict[str, Any]:
        """This replica's Prometheus exposition (vLLM's and Feather's series)."""
        return {"replica_id": self.replica_id, "rank": self.rank,
                "text": _metrics_text(self._prom_dir, self._own_registry)}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing stats of this replica (every ``request_routing_stats_period_s``): its
        ``/metrics`` as the learned router reads it (:func:`parse_vllm_metrics`), numbered."""
        self._stats_seq += 1
        return {"seq": self._stats_seq, "rank": self.rank,
                "metrics": parse_vllm_metrics(_metrics_text(self._prom_dir, self._own_registry)).metrics}

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine (its core process included) is alive."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        context = getattr(self, "_engine_context", None)
        if context is not None:
            self._engine_context = None
            await context.__aexit__(None, None, None)
        shutil.rmtree(getattr(self, "_prom_dir", ""), ignore_errors=True)


# ------------------------------------------------------------------------------------ the ingress


def _replica_lost(exc: BaseException) -> bool:
    return any(cls.__name__ in _REPLICA_LOST for cls in type(exc).__mro__)


#: The ingress's HTTP API (routes are :class:`FeatherIngress` methods).
app = FastAPI(title="feather-serve (Ray Serve)")


async def _json_body(raw: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await raw.json()
    except (ValueError, UnicodeDecodeError):
        return JSONResponse(error_body("the request body is not JSON", 400, "BadRequestError"),
                            status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body("the request body must be a JSON object", 400, "BadRequestError"),
                            status_code=400)
    return body


class TextBody(dict):
    """A request's JSON body with the ``prompt`` (completions) or ``messages`` (chat) attribute that
    Ray Serve LLM's ``PrefixCacheAffinityRouter`` reads from a call's arguments (``--router
    ray-prefix-affinity``); to everything else, the plain dict."""

    def __getattr__(self, name: str) -> Any:
        if name in ("prompt", "messages") and name in self:
            return self[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return TextBody, (dict(self),)


def _learned_routers() -> list[Any]:
    """The learning routers of this process (the ingress's; the real module's list, as this module
    travels by value). Defined before :class:`FeatherIngress`, which ``serve.ingress`` copies with the
    globals it finds then."""
    return [r for r in cluster_base.LIVE_ROUTERS if hasattr(r, "relayed")]


def _relayed(rid: str | None, **what: Any) -> None:
    """Tell the learning routers what the ingress saw of request ``rid`` (``None``: not learning)."""
    if rid is None:
        return
    for router in _learned_routers():
        router.relayed(rid, **what)


def _learned_estimates() -> dict[str, dict[str, Any]]:
    """What the learning routers learned, by Ray replica id (read from this thread: retried once if the
    router's own loop changed it meanwhile)."""
    out: dict[str, dict[str, Any]] = {}
    for router in _learned_routers():
        for _ in range(2):
            try:
                out.update(router.estimates())
                break
            except RuntimeError:  # a dict changed size while read
                continue
    return out


@serve.ingress(app)
class FeatherIngress:
    """The HTTP API (the ``FeatherIngress`` deployment's class; see the module docstring)."""

    async def __init__(self, engine: Any, vllm_args: Sequence[str], chunk_size: int, router: str,
                       replicas: int = 1, reads_wait: bool = False, reroute_shed: bool = False) -> None:
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state

        self.engine = engine
        self.router_name = router
        self.learns = router == "prefix-learned"  # tell the router what the responses show
        #: ... and each stream's reported wait before its first step (its usage chunk, asked for)
        self.reads_wait = self.learns and reads_wait
        self.hasher = PrefixHasher(chunk_size)
        args = _vllm_namespace(vllm_args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # rendering only, as vLLM's render server does
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(model_config=model_config,
                                 logging_config=engine_args.create_logging_config(),
                                 structured_outputs_config=engine_args.create_structured_outputs_config())
        self.state = State()
        await init_render_app_state(vllm_config, self.state, args)
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
        self.stats = FrontEndStats()
        self.replicas = replicas
        # feather-serve --admission slo|deadline: each engine replica's rule; its TTFT SLO bounds reroutes
        admission = AdmissionSettings.from_env()
        self.admits = admission is not None
        self.ttft_slo_ms = admission.slos.get("ttft") if admission is not None else None
        self.reroute_shed = reroute_shed  # else a replica's rejection is the answer

    # -- the API ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Any:
        return await self._answer("completion", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Any:
        return await self._answer("chat", raw)

    async def _answer(self, kind: str, raw: Request) -> Any:
        body = await _json_body(raw)
        if isinstance(body, Response):
            return body
        slos: dict[str, float] = {}
        if self.admits:  # a client's x-slo-*-ms headers tighten its SLOs (the replicas' rule reads them)
            try:
                slos = request_slos({k.lower(): v for k, v in raw.headers.items()})
            except ValueError as exc:
                self.stats.errors["bad_request"] += 1
                return JSONResponse(error_body(str(exc), 400, "BadRequestError"), status_code=400)
        return await self.serve_request(kind, body, slos)

    @app.get("/v1/models")
    async def models(self) -> Any:
        return (await self.state.openai_serving_models.show_available_models()).model_dump()

    @app.get("/health")
    async def health(self) -> Any:
        results = await self.replica_results("check_health")
        healthy = sum(1 for r in results if not isinstance(r, BaseException))
        return JSONResponse({"healthy_replicas": healthy, "replicas": len(results)},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(self) -> Any:
        return PlainTextResponse(await self.metrics_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self) -> Any:
        if not self.dev_mode:
            return JSONResponse(error_body("POST /reset_prefix_cache needs VLLM_SERVER_DEV_MODE=1", 404,
                                            "NotFoundError"), status_code=404)
        results = await self.replica_results("reset_prefix_cache")
        return Response(status_code=200 if results and all(r is True for r in results) else 503)

    @app.get("/replicas")
    async def replicas(self) -> Any:
        """Every engine replica's identity (rank, process, cores) and, with ``prefix-learned``, what the
        router learned of it (``estimates``): for operators and the fault test."""
        infos = [r for r in await self.replica_results("info") if isinstance(r, dict)]
        if self.learns:
            estimates = _learned_estimates()
            infos = [{**r, "estimates": estimates.get(r["replica_id"])} for r in infos]
        return infos

    # -- requests ---------------------------------------------------------------------------------
    async def serve_request(self, kind: str, body: dict[str, Any],
                            slos: dict[str, float] | None = None) -> Any:
        """Render, route and answer one ``/v1/completions`` (``kind="completion"``) or
        ``/v1/chat/completions`` (``"chat"``) request (see the module docstring for faults and sheds);
        ``slos``: its own SLOs in milliseconds (its ``x-slo-*-ms`` headers)."""
        arrived = time.monotonic()
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        renderer = self.state.online_renderer
        try:
            if kind == "chat":
                rendered = await renderer.render_chat(ChatCompletionRequest.model_validate(body))
                inputs = None if isinstance(rendered, ErrorResponse) else rendered[1]
            else:
                rendered = await renderer.render_completion(CompletionRequest.model_validate(body))
                inputs = None if isinstance(rendered, ErrorResponse) else rendered
        except ValueError as exc:  # pydantic's validation errors, vLLM's input errors
            self.stats.errors["bad_request"] += 1
            return JSONResponse(error_body(str(exc), 400, "BadRequestError"), status_code=400)
        if isinstance(rendered, ErrorResponse):
            self.stats.errors["bad_request"] += 1
            return JSONResponse(rendered.model_dump(), status_code=rendered.error.code)
        route = None
        first_input = inputs[0] if inputs else None
        learning: dict[str, Any] = {}
        if isinstance(first_input, dict) and first_input.get("prompt_token_ids"):
            route = self.hasher.hash(np.asarray(first_input["prompt_token_ids"], dtype=np.int64)).tolist()
            if self.learns:
                learning["tokens"] = len(first_input["prompt_token_ids"])
        if self.router_name == "ray-prefix-affinity":
            body = TextBody(body)
        strip_usage = self.reads_wait and needs_usage(body)
        if strip_usage:  # its usage chunk carries its wait; the client gets it only if it asked
            body = {**body, "stream_options": {"include_usage": True}}
        avoid: list[str] = []
        slos = dict(slos or {})
        ttft_ms = min([v for v in (self.ttft_slo_ms, slos.get("ttft")) if v is not None], default=None)
        shed: list[tuple[int, dict[str, str], Any]] = []  # the replicas' rejections
        attempt = lost = 0
        while True:
            attempt += 1
            if shed and ttft_ms is not None:  # another replica, with what is left of its TTFT SLO
                left = ttft_ms - 1000.0 * (time.monotonic() - arrived)
                if left <= 0:
                    return self._shed_answer(shed, attempt - 1)
                slos["ttft"] = left
            if self.learns:  # each attempt is a request of its own to the router
                learning["rid"] = uuid.uuid4().hex
            gen = self.engine.options(stream=True).generate.remote(
                kind, body, rendered, route=route, avoid=list(avoid), slos=dict(slos), **learning)
            header: dict[str, Any] | None = None
            try:
                header = await gen.__anext__()
                first = await gen.__anext__()
                # a stream is answered once its first chunk (its first token) exists: until then a
                # failure can still be retried, as the client has seen nothing
                first_chunk = await anext(gen, None) if first.get("stream") else None
            except Exception as exc:  # noqa: BLE001 - answered below
                gen.cancel()
                _relayed(learning.get("rid"), finished=True)
                is_lost = _replica_lost(exc)
                if is_lost and not lost:
                    lost += 1
                    self.stats.retries += 1
                    if header is not None:
                        avoid.append(header["replica"])
                    continue
                self.stats.errors["replica_lost" if is_lost else "replica_error"] += 1
                detail = str(exc).splitlines()[0] if str(exc) else ""
                message = (f"the engine replica serving this request failed before answering "
                           f"({type(exc).__name__}{', on the retry too' if lost else ''}): {detail}")
                return JSONResponse(error_body(message, 503, "ServiceUnavailableError"), status_code=503)
            if ADMISSION_HEADER in (first.get("headers") or {}):  # shed by its rule: try another replica
                _relayed(learning.get("rid"), finished=True)
                self.stats.counts[(str(header["rank"]), "shed")] += 1
                shed.append((first["status"], first["headers"], first["json"]))
                avoid.append(header["replica"])
                if len(set(avoid)) >= self.replicas or not self.reroute_shed:
                    return self._shed_answer(shed, attempt)
                continue
            if shed:
                self.stats.shed["rerouted"] += 1
            break
        rank = str(header["rank"])
        headers = {"x-feather-replica": f"{rank}/{header['replica']}", "x-feather-attempts": str(attempt)}
        rid = learning.get("rid")
        if not first.get("stream"):
            self.stats.counts[(rank, "ok" if first["status"] == 200 else "error_response")] += 1
            usage = (first["json"].get("usage") or {}) if first["status"] == 200 else {}
            tokens = usage.get("completion_tokens")
            _relayed(rid, finished=True,
                     output_tokens=int(tokens) // max(1, int(body.get("n") or 1)) if tokens else None)
            return JSONResponse(first["json"], status_code=first["status"], headers=headers)
        if first_chunk is not None:
            _relayed(rid, first_token=True)  # vLLM streams its first chunk with the first token
        return StreamingResponse(self._relay(gen, first_chunk, rank, rid, kind == "chat",
                                             int(body.get("n") or 1), strip_usage),
                                 media_type="text/event-stream", headers=headers)

    def _shed_answer(self, shed: Sequence[tuple[int, dict[str, str], Any]], attempts: int) -> JSONResponse:
        """Every replica tried shed the request: the rejection that lets it retry soonest."""
        status, headers, payload = soonest_retry(shed)
        self.stats.shed["rejected"] += 1
        return JSONResponse(payload, status_code=status,
                            headers={**headers, "x-feather-attempts": str(attempts)})

    async def _relay(self, gen: Any, first_chunk: str | None, rank: str, rid: str | None = None,
                     chat: bool = False, choices: int = 1, strip_usage: bool = False) -> AsyncIterator[str]:
        """The replica's SSE stream; a replica lost mid-stream ends it with an error event. With
        ``rid`` (``prefix-learned``), the router is told its end and output tokens (counted as the
        proxy counts them, :func:`stream_output_tokens`), and where it reads it, the wait the replica
        reported (:func:`stream_queue_seconds`); with ``strip_usage`` the usage chunk the ingress asked
        for is taken out (:class:`UsageStrip`)."""
        outcome = "ok"
        events, tail = 0, ["", ""]
        strip = UsageStrip() if strip_usage else None
        ended = False  # the client has the whole answer, its [DONE] included (as the proxy counts it)
        try:
            if first_chunk is not None:
                events += first_chunk.count("\n\n")
                tail = [tail[1], first_chunk]
                yield first_chunk if strip is None else strip.feed(first_chunk.encode()).decode()
            async for chunk in gen:
                if rid is not None and isinstance(chunk, str):
                    events += chunk.count("\n\n")
                    tail = [tail[1], chunk]
                if strip is not None and isinstance(chunk, str):
                    chunk = strip.feed(chunk.encode()).decode()
                    if not chunk:
                        continue
                ended = isinstance(chunk, str) and ends_stream(chunk)
                yield chunk
            if strip is not None and (rest := strip.flush()):
                yield rest.decode(errors="replace")
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (its response cancelled, or
            # this generator closed): so does the request, unless it was served
            if not ended:
                outcome = "client_gone"
                gen.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the stream: tokens were sent already
            outcome = "failed_mid_stream"
            reason = "replica_lost_mid_stream" if _replica_lost(exc) else "replica_error_mid_stream"
            self.stats.errors[reason] += 1
            message = (f"the engine replica {rank} serving this request failed mid-stream "
                       f"({type(exc).__name__}); not retried, as it had started answering")
            yield f"data: {json.dumps(error_body(message, 503, 'ServiceUnavailableError'))}\n\n"
            yield DONE_EVENT
        finally:
            self.stats.counts[(rank, outcome)] += 1
            if rid is not None:
                last = "".join(tail).encode()
                tokens = stream_output_tokens(events, last, chat, choices)
                waited = stream_queue_seconds(last) if self.reads_wait and outcome == "ok" else None
                _relayed(rid, finished=True, output_tokens=tokens if outcome == "ok" else None,
                         queued_s=waited)

    async def replica_results(self, method: str) -> list[Any]:
        """``method`` on every engine replica (exceptions in place of the failed ones)."""
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            return await self.engine.broadcast(method).results_async(return_exceptions=True)
        except DeploymentUnavailableError:
            return []

    async def metrics_text(self) -> str:
        """Every replica's exposition with its ``replica`` label, the sums, the ingress's counters."""
        results = await self.replica_results("metrics")
        answered = sorted((r for r in results if isinstance(r, dict)), key=lambda r: r["rank"])
        exposition = replica_exposition((str(r["rank"]), r["text"]) for r in answered)
        # this class travels by value (``serve.ingress`` wraps it): the routers are in the real module
        own = self.stats.exposition(self.router_name, len(results), len(answered),
                                    [router.stats() for router in cluster_base.LIVE_ROUTERS])
        learned = ""
        if self.learns:  # by rank, as every other series of a replica
            estimates = _learned_estimates()
            learned = estimates_exposition({str(r["rank"]): estimates[r["replica_id"]] for r in answered
                                            if r["replica_id"] in estimates})
        return "\n".join(p for p in (exposition, own, learned) if p) + "\n"


# ------------------------------------------------------------------------------------ deployment


def build_app(config: ClusterConfig, engine_cls: type = EngineReplica) -> Any:
    """The Ray Serve application for ``config`` (not started); ``engine_cls``: the engine deployment's
    class (:class:`EngineReplica`; a stand-in with its methods measures the rest of the data path)."""
    from ray.serve.config import RequestRouterConfig

    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    runtime_env = {"runtime_env": {"env_vars": env}} if env else {}
    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT, "num_replicas": config.replicas,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus,
                              **runtime_env},
        "health_check_period_s": 5.0, "health_check_timeout_s": 30.0, "graceful_shutdown_timeout_s": 10.0,
    }
    if config.router == "prefix":
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRequestRouter,
            request_router_kwargs=config.router_kwargs())
    elif config.router == "prefix-learned":
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=LearnedRequestRouter, request_router_kwargs=config.learned_router_kwargs(),
            request_routing_stats_period_s=config.scrape_period_s,
            request_routing_stats_timeout_s=max(5.0, 2 * config.scrape_period_s))
    elif config.router == "ray-prefix-affinity":
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter)
    engine = serve.deployment(engine_cls, **engine_options)
    ingress = serve.deployment(FeatherIngress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                               max_ongoing_requests=max(4096, config.max_ongoing_requests * config.replicas),
                               ray_actor_options={"num_cpus": 0, **runtime_env})
    cores = list(config.replica_cores) if config.replica_cores else None
    # the engine replicas' arguments: the common ones, with --enable-per-request-metrics where the
    # learned router reads each stream's wait (ClusterConfig.replica_vllm_args)
    return ingress.bind(engine.bind(list(config.replica_vllm_args(0)), cores), list(config.vllm_args),
                        config.chunk_size, config.router, config.replicas, config.reads_queue_time,
                        config.reroute_shed)


def _start_ray(config: ClusterConfig) -> None:
    """Connect to ``config.ray_address`` or start a local instance (loopback only: ``feather-serve``
    sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is imported)."""
    if config.ray_address is None:
        # an engine replica's vLLM engine-core process dies with it, even when it is killed
        os.environ.setdefault("RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper", "true")
    # a loaded machine starts the HTTP proxy slower than Ray's 5 s default readiness check
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    import ray

    if config.ray_address is not None:
        ray.init(address=config.ray_address, log_to_driver=False)
        return
    ray.init(num_cpus=max(1, int(round(config.replicas * config.replica_cpus))),
             num_gpus=int(round(config.replicas * config.replica_gpus)) or None,
             include_dashboard=False, object_store_memory=config.object_store_mb << 20, log_to_driver=False)


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _stop(*_: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # once: the shutdown itself is not interrupted
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop


def run_cluster(config: ClusterConfig) -> int:
    """Deploy ``config`` and serve until SIGTERM or SIGINT; returns the exit status.

    Everything this started (the application; the local Ray instance with its engines) is shut
    down before it returns, also when the deployment fails or the signal arrives during start-up.
    """
    started = time.monotonic()
    import ray

    status = 0
    try:
        _start_ray(config)
        # after ray.init, which installs handlers of its own (that abort on SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop)
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"feather-serve: {config.replicas} engine replicas behind the {config.router} router, serving "
              f"on http://{config.host}:{config.port} ({time.monotonic() - started:.0f} s to start)",
              flush=True)
        while True:
            time.sleep(3600)
    except _Stop:
        print("feather-serve: stopping (signal)", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, then everything is shut down
        print(f"feather-serve: error: the cluster failed: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        print(f"feather-serve: stopped ({time.monotonic() - started:.0f} s after start)", flush=True)
    return status
