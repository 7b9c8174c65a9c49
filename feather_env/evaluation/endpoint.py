"""Any running OpenAI-compatible completions server, driven with a workload and timed at the client.

:func:`evaluate_endpoint` sends every request of a workload to ``POST {url}/v1/completions`` at its
arrival time (seconds after the run starts; ``burst``: all at once), at most ``max_concurrency`` in
flight, and streams the answer. It works against ``feather-serve`` and against vLLM's own server
with no Feather in it; a server that ignores vLLM's extra request fields would generate its own
lengths, and every such request is then reported as failed.

Each request asks for exactly its ``output_len`` tokens with the standard fields of vLLM's
completions API: the prompt as token ids (so every question of a document shares the document
exactly), ``max_tokens == min_tokens == output_len``, ``ignore_eos``, ``temperature: 0``,
``stream`` with ``stream_options.include_usage``; with ``hints`` (default) also
``vllm_xargs: {"feather_output_len": N, "feather_source": TASK}``, which the Feather schedulers read
(the ``oracle-*`` names and the length predictor) and vLLM's own scheduler ignores.

Timing follows ``vllm bench serve``'s client (``vllm/benchmarks/lib/endpoint_request_func.py``): a
request's clock starts when it is sent (after waiting for a ``max_concurrency`` slot; that wait is
reported apart, ``mean_client_queue_ms``), TTFT ends at the first streamed chunk with a choice,
every later chunk adds one ITL gap, and E2E latency ends at the last such chunk; ``duration`` is
the run's wall time from its start to the last answer.

A request is completed when the server answered 200, streamed at least one chunk, ended it with a
``finish_reason`` and reported (``usage.completion_tokens``) exactly the tokens asked. Anything else
(an HTTP error, a dropped connection, a timeout, a short answer, no usage) is a failure: counted,
kept in the timelines, and its reason recorded in :attr:`Run.errors
<feather_env.evaluation.report.Run>`, never dropped.

With ``reset_prefix_cache`` the server's prefix cache is emptied before the run (``POST
/reset_prefix_cache``, which vLLM serves with ``VLLM_SERVER_DEV_MODE=1``), so that the run starts
cold as an in-process run does; otherwise it finds what earlier runs left cached.

The server's ``/metrics`` is read before and after the run; the differences give the prefix-cache hit
rate (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``), preemptions, requests served, the
server's queue time and, when the server runs a Feather scheduler, its ``feather_scheduler_*``
counters and name. A server without ``/metrics`` still evaluates (those figures are ``None``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from feather_env.evaluation.report import ENDPOINT, Run
from feather_env.records import RequestTimeline
from feather_env.workloads import Request, Workload
from scheduler_runtime.config import ConfigError
from scheduler_runtime.sse import SSE_DONE, sse_events

__all__ = ["EndpointConfig", "EndpointError", "ServerInfo", "evaluate_endpoint", "normalize_url",
           "parse_prometheus", "probe_server", "read_metrics", "reset_prefix_cache"]


class EndpointError(RuntimeError):
    """The server cannot be used: unreachable, not an OpenAI-compatible server, no such model."""


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send the workload (recorded in the results JSON).

    Attributes:
        url: the server, ``http://HOST:PORT`` (a trailing ``/v1`` or ``/v1/completions`` is accepted).
        model: the served model name; ``None``: the server's only model.
        max_concurrency: at most this many requests in flight (``None``: no limit).
        label: the run's name; ``None``: the server's Feather scheduler, or ``vllm``, ``@HOST:PORT``.
        hints: send the Feather hints in ``vllm_xargs`` (module docstring).
        reset_prefix_cache: empty the server's prefix cache before the run (module docstring).
        request_timeout_s: a request not answered in full within this time fails.
        connect_timeout_s: for connecting, and for the checks before the run.
    """

    url: str
    model: str | None = None
    max_concurrency: int | None = None
    label: str | None = None
    hints: bool = True
    reset_prefix_cache: bool = False
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        normalize_url(self.url)
        if self.max_concurrency is not None and (isinstance(self.max_concurrency, bool)
                                                 or self.max_concurrency < 1):
            raise ConfigError(f"max_concurrency must be an integer >= 1, got {self.max_concurrency!r}")
        for name in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def root(self) -> str:
        return normalize_url(self.url)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalize_url(url: str) -> str:
    """The server's root URL (``http://host:port[/prefix]``, without ``/v1...``).

    Raises:
        ConfigError: not an ``http(s)://host[:port]`` URL.
    """
    parsed = urllib.parse.urlsplit(url.strip()) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"endpoint URL {url!r} is not http://HOST:PORT (e.g. http://127.0.0.1:8000)")
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"endpoint URL {url!r} has an invalid port") from None
    if parsed.query or parsed.fragment:
        raise ConfigError(f"endpoint URL {url!r}: no query or fragment, only http://HOST:PORT[/PREFIX]")
    path = parsed.path.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return f"{parsed.scheme}://{parsed.netloc}{path}"


@dataclass(frozen=True)
class ServerInfo:
    """What the checks before a run found: the root URL, the served models, the chosen one."""

    root: str
    models: tuple[str, ...]
    model: str


#: Direct connections (no proxy from the environment), as the aiohttp client that sends the requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout: float, data: bytes | None = None) -> str:
    with _OPENER.open(url, data=data, timeout=timeout) as resp:
        return resp.read().decode()


def reset_prefix_cache(root: str, timeout: float = 30.0) -> None:
    """Empty the server's prefix cache (vLLM's ``POST /reset_prefix_cache``, a dev-mode endpoint).

    Raises:
        EndpointError: the server has no such endpoint, or refused.
    """
    try:
        _get(root + "/reset_prefix_cache", timeout, data=b"")
    except urllib.error.HTTPError as exc:
        hint = (" (vLLM serves it with VLLM_SERVER_DEV_MODE=1 in the server's environment)"
                if exc.code in (404, 405) else "")
        raise EndpointError(f"{root} cannot reset its prefix cache: HTTP {exc.code} for POST "
                            f"/reset_prefix_cache{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EndpointError(f"cannot reach {root} to reset its prefix cache: {exc}") from None


def probe_server(config: EndpointConfig) -> ServerInfo:
    """Check, before anything is sent, that the server answers as an OpenAI server and serves the model.

    Raises:
        EndpointError: unreachable (connection refused, no answer, unknown host), not an
            OpenAI-compatible server, or no such model (the message lists the served ones).
    """
    root = config.root
    url = root + "/v1/models"
    try:
        body = _get(url, config.connect_timeout_s)
    except urllib.error.HTTPError as exc:
        raise EndpointError(f"{root} answered HTTP {exc.code} for GET /v1/models: is it an "
                            "OpenAI-compatible server (feather-serve, vLLM)?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionRefusedError):
            why = "connection refused: is the server running, on this host and port?"
        elif isinstance(reason, TimeoutError) or "timed out" in str(reason):
            why = f"no answer within {config.connect_timeout_s:g} s"
        else:
            why = str(reason)
        raise EndpointError(f"cannot reach {root} ({why})") from None
    try:
        models = tuple(str(m["id"]) for m in json.loads(body)["data"])
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{url} did not answer with an OpenAI model list: is {root} an "
                            "OpenAI-compatible server?") from None
    if not models:
        raise EndpointError(f"{root} serves no model")
    if config.model is not None:
        if config.model not in models:
            raise EndpointError(f"{root} does not serve model {config.model!r}; it serves {list(models)}")
        return ServerInfo(root, models, config.model)
    if len(models) > 1:
        raise EndpointError(f"{root} serves several models {list(models)}: choose one with --model")
    return ServerInfo(root, models, models[0])


# ------------------------------------------------------------------------------------ /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: ``(name, labels, value)``."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, value))
    return samples


def read_metrics(root: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]] | None:
    """The server's ``/metrics`` samples, or ``None`` when it has none (or does not answer)."""
    try:
        return parse_prometheus(_get(root + "/metrics", timeout))
    except (urllib.error.URLError, OSError, UnicodeDecodeError):
        return None


def _total(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


#: Server counters whose growth during the run is reported (vLLM's names, their ``_total`` series).
_VLLM_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "request_success",
                  "prompt_tokens", "generation_tokens")
_FEATHER_PREFIX = "feather_scheduler_"


def _server_figures(before: list[Any] | None, after: list[Any] | None) -> dict[str, Any]:
    """What the server's counters say about the run (module docstring); ``None`` without /metrics."""
    out: dict[str, Any] = {"prefix_hit_rate": None, "preemptions": None, "server_scheduler": None,
                           "server": None}
    if before is None or after is None:
        return out
    server: dict[str, Any] = {}
    for key in _VLLM_COUNTERS:
        name = f"vllm:{key}_total"
        present = any(n == name for n, _, _ in after)
        server[key] = _total(after, name) - _total(before, name) if present else None
    count = _total(after, "vllm:request_queue_time_seconds_count") - _total(
        before, "vllm:request_queue_time_seconds_count")
    seconds = _total(after, "vllm:request_queue_time_seconds_sum") - _total(
        before, "vllm:request_queue_time_seconds_sum")
    server["mean_queue_ms"] = 1000 * seconds / count if count > 0 else None
    feather = sorted({n for n, _, _ in after if n.startswith(_FEATHER_PREFIX) and n.endswith("_total")})
    if feather:
        server["feather"] = {n[len(_FEATHER_PREFIX):]: _total(after, n) - _total(before, n) for n in feather}
        names = sorted({lab["scheduler"] for n, lab, _ in after if n.startswith(_FEATHER_PREFIX)
                        and "scheduler" in lab})
        out["server_scheduler"] = ",".join(names) or None
    queries, hits = server["prefix_cache_queries"], server["prefix_cache_hits"]
    if queries:
        out["prefix_hit_rate"] = hits / queries
    out["preemptions"] = None if server["num_preemptions"] is None else int(server["num_preemptions"])
    out["server"] = server
    return out


# ------------------------------------------------------------------------------------ the run


def _payload(request: Request, model: str, hints: bool) -> dict[str, Any]:
    n = int(request.output_len)
    body: dict[str, Any] = {
        "model": model, "prompt": [int(t) for t in request.prompt_token_ids], "max_tokens": n,
        "min_tokens": n, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if hints:
        xargs: dict[str, Any] = {"feather_output_len": n}
        if request.source:
            xargs["feather_source"] = request.source
        body["vllm_xargs"] = xargs
    return body


async def _send(session: Any, url: str, request: Request, config: EndpointConfig, model: str,
                t0: float, semaphore: asyncio.Semaphore | None, headers: Mapping[str, str]
                ) -> tuple[RequestTimeline, float, str | None]:
    """One request at its arrival time: its timeline, its client queue wait, and why it failed."""
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + float(request.arrival_time) - time.perf_counter()))
    due = time.perf_counter()
    if semaphore is not None:
        await semaphore.acquire()
    sent = time.perf_counter()
    t = RequestTimeline(request.request_id, request.prompt_len, request.output_len, sent - t0,
                        source=request.source)
    error = None
    finish_reason = None
    usage_tokens = None
    try:
        async with session.post(url, json=_payload(request, model, config.hints), headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                return t, sent - due, f"HTTP {resp.status}: {body}"
            async for chunk in sse_events(resp.content):
                if chunk is SSE_DONE:
                    break
                now = time.perf_counter() - t0
                if chunk.get("error"):  # vLLM streams an error object when generation fails
                    raise RuntimeError(chunk["error"])
                if chunk.get("choices"):
                    if math.isnan(t.last_output):
                        t.first_token = now
                    else:
                        t.itl.append(now - t.last_output)
                    t.last_output = now
                    finish_reason = chunk["choices"][0].get("finish_reason") or finish_reason
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
    except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
        return t, sent - due, f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if semaphore is not None:
            semaphore.release()
    t.finish = t.last_output
    if math.isnan(t.last_output):
        error = "the server streamed no output"
    elif finish_reason is None:
        error = "the stream ended without a finish_reason"
    elif usage_tokens is None:
        error = "the server reported no usage (stream_options.include_usage)"
    else:
        t.tokens = int(usage_tokens)
        t.finished_count = 1
        if t.tokens != t.output_len:
            error = f"{t.tokens} tokens generated, {t.output_len} asked (finish_reason {finish_reason!r})"
    return t, sent - due, error


async def _run_all(workload: Workload, config: EndpointConfig, model: str, bar: Any
                   ) -> tuple[list[tuple[RequestTimeline, float, str | None]], float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=config.connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):  # as vllm bench serve
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    url = config.root + "/v1/completions"
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def one(request: Request) -> tuple[RequestTimeline, float, str | None]:
            result = await _send(session, url, request, config, model, t0, semaphore, headers)
            if bar is not None:
                bar.update(1)
            return result

        order = sorted(workload, key=lambda r: r.arrival_time)  # stable: queue order on ties
        results = await asyncio.gather(*(one(r) for r in order))
        return list(results), time.perf_counter() - t0


def evaluate_endpoint(workload: Workload, config: EndpointConfig, *, progress: bool = True,
                      server: ServerInfo | None = None) -> Run:
    """Serve ``workload`` on the server of ``config`` (module docstring) and return the run.

    ``server``: what :func:`probe_server` found (it is called when not given).

    Raises:
        EndpointError: the server cannot be used (before any request is sent).
    """
    info = server or probe_server(config)
    if config.reset_prefix_cache:
        reset_prefix_cache(info.root)
    before = read_metrics(info.root, config.connect_timeout_s)
    figures = _server_figures(before, before)
    host = urllib.parse.urlsplit(info.root).netloc
    label = config.label or f"{figures['server_scheduler'] or 'vllm'}@{host}"
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(workload), desc=f"{label:>24s}", unit="req", leave=True, file=sys.stderr,
                   dynamic_ncols=True)
    try:
        results, duration = asyncio.run(_run_all(workload, config, info.model, bar))
    finally:
        if bar is not None:
            bar.close()
    after = read_metrics(info.root, config.connect_timeout_s)
    timelines = [t for t, _, _ in results]
    errors = {t.request_id: err for t, _, err in results if err is not None}
    waits = [w for _, w, _ in results]
    extra: dict[str, Any] = {"endpoint": info.root, "model": info.model,
                             "max_concurrency": config.max_concurrency,
                             "prefix_cache_reset": config.reset_prefix_cache,
                             **_server_figures(before, after)}
    if config.max_concurrency:
        extra["mean_client_queue_ms"] = 1000 * sum(waits) / len(waits)
        extra["max_client_queue_ms"] = 1000 * max(waits)
    return Run(label, ENDPOINT, timelines, duration=duration, extra=extra, errors=errors)
